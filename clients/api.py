"""A small client for the `llm` model: gRPC stream_infer, HTTP generate and generate_stream.

Needs only tritonclient, numpy and kvforge's wire contract (kvforge/llm_io.py; HTTP generate
uses the standard library: tritonclient has no generate API). Every call yields text deltas
with their arrival time (TimedDelta), so TTFT and token rates are measured where the user sees
them:

    client = LLMClient("127.0.0.1:8001")
    for delta in client.stream("def f(x):", max_tokens=32):
        print(delta.text, end="", flush=True)
    completion = client.generate("def f(x):", max_tokens=32)  # text, token_ids, ttft, tokens_per_second

Leaving a gRPC stream early (break, or closing the generator) cancels the request on the server.
One LLMClient holds one gRPC channel, which every thread's streams share (HTTP/2 multiplexes
them); each stream's responses are read in the thread that iterates it, over the stub of
tritonclient's GRPCInferenceService, rather than through tritonclient's callback stream API,
which opens a channel per client object and runs two more threads per stream: at 16 streams on
the server's 2 cores that cost about 0.1 ms more client CPU per token (README, Benchmarks).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from kvforge import llm_io
from kvforge.llm_io import Delta

MODEL = "llm"
DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
# the llm inputs a request may carry (datatypes: kvforge/llm_io.py)
OPTIONS = ("text_input", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_words", "stream",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "bad_words", "end_id",
          "ignore_eos", "exclude_input_in_output", "speculative", "guided_decoding_guide_type", "guided_decoding_guide",
          "return_log_probs", "logprobs", "min_p", "logit_bias_token_ids", "logit_bias", "allowed_token_ids",
          "stop_token_ids")
GRPC_OUTPUTS = ("text_output", "output_ids")  # what a stream reads; the server builds only these
LOG_PROB_OUTPUTS = ("output_log_probs",)  # with return_log_probs (or logprobs > 0)
TOP_LOG_PROB_OUTPUTS = ("output_top_log_probs", "output_top_token_ids")  # with logprobs > 0
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # what tritonclient's own channels allow (gRPC's default receive: 4 MiB)


class GenerationError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass(kw_only=True)
class TimedDelta(Delta):
    """One response as the client received it."""

    time: float  # seconds from sending the request
    final: bool


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None  # seconds to the first token
    elapsed: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # per token, when asked for (the raw model's)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, with logprobs=k

    @property
    def tokens_per_second(self) -> float:
        """Decode rate after the first token (what a reader sees stream by)."""
        decode = self.elapsed - (self.ttft or 0.0)
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else 0.0

    def add(self, delta: TimedDelta) -> None:
        if delta.token_ids and self.ttft is None:
            self.ttft = delta.time
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.top_logprobs += delta.top_logprobs or []
        self.elapsed = delta.time


def request_fields(prompt: str | bytes, max_tokens: int, stream: bool = True, **options) -> dict:
    """The request's inputs by name (OPTIONS: temperature, top_k, top_p, seed, stop_words, ...);
    options left as None are not sent (the server's defaults)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown options {', '.join(unknown)}; the llm model takes {', '.join(OPTIONS)}")
    fields = dict(text_input=prompt, max_tokens=max_tokens, stream=stream, **options)
    return {k: v for k, v in fields.items() if v is not None}


def grpc_request(model: str, fields: dict):
    """A ModelInferRequest for `fields` (request_fields), every input as raw contents as
    tritonclient sends them, asking for GRPC_OUTPUTS (and the log-prob outputs the fields ask
    for) and an empty final response."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model)
    for name, value in fields.items():
        spec = llm_io.INPUTS[name]
        data = np.array([value if isinstance(value, list) else [value]], dtype=spec.numpy_dtype)
        if spec.datatype == "BYTES":
            data = np.vectorize(lambda v: v.encode("utf-8") if isinstance(v, str) else v, otypes=[object])(data)
        request.inputs.add(name=name, datatype=spec.datatype, shape=data.shape)
        request.raw_input_contents.append(serialize_byte_tensor(data).item() if spec.datatype == "BYTES"
                                          else data.tobytes())
    top = (fields.get("logprobs") or 0) > 0
    log_probs = LOG_PROB_OUTPUTS if top or fields.get("return_log_probs") else ()
    for name in GRPC_OUTPUTS + log_probs + (TOP_LOG_PROB_OUTPUTS if top else ()):
        # only these: the server then builds and sends nothing else per token
        request.outputs.add(name=name)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class LLMClient:
    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = MODEL, timeout: float = 300.0):
        """timeout: seconds a gRPC request may take in all (its deadline); over HTTP, the longest
        wait for the server's next bytes."""
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout = url or DEFAULT_URLS[protocol], protocol, model, timeout
        self._stub, self._stub_lock = None, threading.Lock()

    def stream(self, prompt: str | bytes, max_tokens: int = 16, **options) -> Iterator[TimedDelta]:
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

    def _grpc_stub(self):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        with self._stub_lock:
            if self._stub is None:
                channel = grpc.insecure_channel(self.url, options=[
                    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)])
                self._stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return self._stub

    def _grpc(self, fields: dict) -> Iterator[TimedDelta]:
        import grpc
        from tritonclient.grpc import InferResult

        request = grpc_request(self.model, fields)
        started = time.perf_counter()
        # one request, then the client's half of the stream closes; Triton streams every response
        responses = self._grpc_stub().ModelStreamInfer(iter([request]), timeout=self.timeout)
        try:
            for response in responses:
                if response.error_message:
                    raise GenerationError(response.error_message)
                arrived = time.perf_counter()
                result = InferResult(response.infer_response)
                finished = response.infer_response.parameters["triton_final_response"].bool_param
                yield TimedDelta.from_result(result, time=arrived - started, final=finished)
                if finished:
                    return
            raise GenerationError(f"{self.url} closed the stream before the final response")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise GenerationError(f"no final response from {self.url} within {self.timeout:g} s") from None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise GenerationError(f"cannot reach {self.url}: {e.details()}") from None
            raise GenerationError(f"{self.url}: {e.code().name}: {e.details()}") from None
        finally:
            responses.cancel()  # a stream left early cancels its request on the server; after the end, a no-op

    # ------------------------------------------------------------------ HTTP

    def _http(self, fields: dict, endpoint: str) -> Iterator[TimedDelta]:
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
    def _http_delta(body: dict, started: float, final: bool) -> TimedDelta:
        if "error" in body:
            raise GenerationError(body["error"])
        return TimedDelta.from_json(body, time=time.perf_counter() - started, final=final)
