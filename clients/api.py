"""A small client for the `llm` model: gRPC stream_infer, HTTP generate and generate_stream.

Needs only tritonclient and numpy (HTTP generate uses the standard library: tritonclient has no
generate API). Every call yields text deltas with their arrival time, so TTFT and token rates
are measured where the user sees them:

    client = LLMClient("127.0.0.1:8001")
    for delta in client.stream("def f(x):", max_tokens=32):
        print(delta.text, end="", flush=True)
    completion = client.generate("def f(x):", max_tokens=32)  # text, token_ids, ttft, tokens_per_second

Leaving a gRPC stream early (break, or closing the generator) cancels the request on the server.
"""
from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

MODEL = "llm"
DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
# input name -> (Triton datatype, numpy dtype); the names of the TensorRT-LLM/vLLM backends
INPUTS = {"text_input": ("BYTES", np.object_), "max_tokens": ("INT32", np.int32),
          "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32),
          "seed": ("UINT64", np.uint64), "stop_words": ("BYTES", np.object_), "stream": ("BOOL", np.bool_),
          "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
          "frequency_penalty": ("FP32", np.float32), "min_tokens": ("INT32", np.int32),
          "bad_words": ("BYTES", np.object_), "end_id": ("INT32", np.int32),
          "exclude_input_in_output": ("BOOL", np.bool_)}
GRPC_OUTPUTS = ("text_output", "output_ids")  # what a stream reads; the server builds only these


class GenerationError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    time: float  # seconds from sending the request
    final: bool


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None  # seconds to the first token
    elapsed: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode rate after the first token (what a reader sees stream by)."""
        decode = self.elapsed - (self.ttft or 0.0)
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else 0.0

    def add(self, delta: Delta) -> None:
        if delta.token_ids and self.ttft is None:
            self.ttft = delta.time
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.elapsed = delta.time


def request_fields(prompt: str | bytes, max_tokens: int, stream: bool = True, **options) -> dict:
    """The request's inputs by name (INPUTS: temperature, top_k, top_p, seed, stop_words, ...);
    options left as None are not sent (the server's defaults)."""
    unknown = sorted(set(options) - set(INPUTS))
    if unknown:
        raise ValueError(f"unknown options {', '.join(unknown)}; the llm model takes {', '.join(INPUTS)}")
    fields = dict(text_input=prompt, max_tokens=max_tokens, stream=stream, **options)
    return {k: v for k, v in fields.items() if v is not None}


class LLMClient:
    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = MODEL, timeout: float = 300.0):
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout = url or DEFAULT_URLS[protocol], protocol, model, timeout

    def stream(self, prompt: str | bytes, max_tokens: int = 16, **options) -> Iterator[Delta]:
        fields = request_fields(prompt, max_tokens, stream=True, **options)
        return self._grpc(fields) if self.protocol == "grpc" else self._http(fields, "generate_stream")

    def generate(self, prompt: str | bytes, max_tokens: int = 16, stream: bool = True, **options) -> Completion:
        """The whole completion; stream=False asks the server for one response at the end."""
        fields = request_fields(prompt, max_tokens, stream=stream, **options)
        if self.protocol == "grpc":
            deltas = self._grpc(fields)
        else:
            deltas = self._http(fields, "generate_stream" if stream else "generate")
        completion = Completion()
        for delta in deltas:
            completion.add(delta)
        return completion

    # ------------------------------------------------------------------ gRPC

    def _grpc(self, fields: dict) -> Iterator[Delta]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = []
        for name, value in fields.items():
            datatype, dtype = INPUTS[name]
            data = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
            if datatype == "BYTES":
                data = np.vectorize(lambda v: v.encode("utf-8") if isinstance(v, str) else v, otypes=[object])(data)
            tensor = grpcclient.InferInput(name, list(data.shape), datatype)
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        finished = False
        try:
            client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
            started = time.perf_counter()
            # only the outputs read below: the server then builds and sends nothing else per token
            client.async_stream_infer(self.model, inputs, enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput(name) for name in GRPC_OUTPUTS])
            while not finished:
                try:
                    result, error, arrived = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise GenerationError(f"no response from {self.url} within {self.timeout:.0f} s") from None
                if error is not None:
                    finished = True
                    raise GenerationError(error.message() if isinstance(error, InferenceServerException) else str(error))
                finished = result.get_response().parameters["triton_final_response"].bool_param
                text, ids = (result.as_numpy(name) for name in GRPC_OUTPUTS)
                yield Delta(b"".join(text.reshape(-1)).decode("utf-8") if text is not None else "",
                            ids.reshape(-1).tolist() if ids is not None else [], arrived - started, finished)
        except InferenceServerException as e:
            try:  # a broken stream reports why through the callback, not the exception
                e = responses.get(timeout=1.0)[1] or e
            except queue.Empty:
                pass
            raise GenerationError(f"cannot reach {self.url}: {e.message()}") from None
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()

    # ------------------------------------------------------------------ HTTP

    def _http(self, fields: dict, endpoint: str) -> Iterator[Delta]:
        if isinstance(fields["text_input"], bytes):
            raise ValueError("HTTP generate carries JSON text; send raw bytes over gRPC")
        request = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/{endpoint}",
                                         data=json.dumps(fields).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                if endpoint == "generate":
                    yield self._http_delta(json.loads(response.read()), started, final=True)
                    return
                for line in response:  # server-sent events: one `data: {json}` line per response
                    if line.startswith(b"data:"):
                        yield self._http_delta(json.loads(line[5:]), started, final=False)
        except urllib.error.HTTPError as e:
            raise GenerationError(self._http_error(e.read())) from None
        except urllib.error.URLError as e:
            raise GenerationError(f"cannot reach {self.url}: {e.reason}") from None

    @staticmethod
    def _http_error(body: bytes) -> str:
        for line in body.splitlines():
            line = line[5:] if line.startswith(b"data:") else line
            try:
                return json.loads(line)["error"]
            except (ValueError, KeyError, TypeError):
                continue
        return body.decode(errors="replace") or "HTTP error without a message"

    @staticmethod
    def _http_delta(body: dict, started: float, final: bool) -> Delta:
        if "error" in body:
            raise GenerationError(body["error"])
        ids = body.get("output_ids", [])
        return Delta(body.get("text_output", ""), ids if isinstance(ids, list) else [ids],
                     time.perf_counter() - started, final)
