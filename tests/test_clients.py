"""Real clients against the real server: TensorRT-LLM-style inputs on `llm` and its aliases,
llama-index's NvidiaTriton, the vLLM backend's sample client logic, and each sampling input."""
from __future__ import annotations

import asyncio
import collections
import io
import json
import queue
import re
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import np_to_triton_dtype

from clients.generate import main as generate_cli
from clients.api import GenerationError, LLMClient
from kvforge.manifest import Manifest
from runtime.tokenizer import Tokenizer
from launcher.harness import free_ports
from tests.conftest import SERVING_CONTEXT

PROMPT = "def fibonacci(n):"
OUTPUTS = ("text_output", "output_ids", "num_input_tokens", "num_output_tokens", "sequence_length", "finish_reason",
           "cum_log_probs", "output_log_probs", "output_top_log_probs", "output_top_token_ids")


@pytest.fixture(scope="module")
def grpc(triton):
    return LLMClient(triton.grpc_url, "grpc")


@pytest.fixture(scope="module")
def tokenizer(exports):
    engine_dir = exports(max_seq_len=SERVING_CONTEXT)
    return Tokenizer(engine_dir, Manifest.load(engine_dir))


def test_a_server_that_is_not_there_is_a_clear_error_not_a_hang():
    url = f"127.0.0.1:{free_ports(1)[0]}"
    for protocol in ("grpc", "http"):
        with pytest.raises(GenerationError, match=f"^cannot reach {url}"):
            LLMClient(url, protocol, timeout=30).generate(PROMPT, max_tokens=3)


def test_a_request_past_its_deadline_is_a_clear_error_and_the_server_keeps_serving(triton):
    # 2,000 tokens ignoring end tokens: no machine streams them within the deadline
    with pytest.raises(GenerationError, match=r"^no final response from .* within 0.1 s"):
        LLMClient(triton.grpc_url, timeout=0.1).generate(PROMPT, max_tokens=2000, ignore_eos=True)
    assert len(LLMClient(triton.grpc_url).generate(PROMPT, max_tokens=4).token_ids) == 4


def test_the_command_line_client_reads_a_long_prompt_from_a_file_or_stdin(triton, tmp_path, capsys, monkeypatch):
    """A 100K-token prompt (~400 KB) is more than one command-line argument may hold: --prompt-file."""
    common = ["--url", triton.grpc_url, "--max-tokens", "4", "--temperature", "0"]
    answers = []
    for argv in ([PROMPT], ["--prompt-file", str(tmp_path / "prompt.txt")], ["--prompt-file", "-"]):
        (tmp_path / "prompt.txt").write_text(PROMPT)
        monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
        assert generate_cli(argv + common) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0].strip() and answers[0] == answers[1] == answers[2]
    for argv, message in (([], "one of the arguments prompt --prompt-file is required"),
                          ([PROMPT, "--prompt-file", "-"], "not allowed with argument"),
                          (["--prompt-file", str(tmp_path / "missing.txt")], "--prompt-file: .*missing.txt"),
                          ([PROMPT, "--timeout", "0"], "--timeout must be a positive number")):
        with pytest.raises(SystemExit):
            generate_cli(argv + common)
        assert re.search(message, capsys.readouterr().err), message


class RequestFailed(Exception):
    """The server answered the request with an error."""


def as_input(name: str, value) -> grpcclient.InferInput:
    data = value if isinstance(value, np.ndarray) else np.array([[value]])
    if data.dtype.kind in "US":
        data = np.vectorize(lambda v: v.encode(), otypes=[np.object_])(data)
    tensor = grpcclient.InferInput(name, list(data.shape), np_to_triton_dtype(data.dtype))
    tensor.set_data_from_numpy(data)
    return tensor


def send(triton, model: str, inputs: dict, request_id: str = "", first=None, outputs=None) -> list:
    """One request over stream_infer; returns its responses ({output: numpy}) or raises its error.
    `first(response)` runs when the first response arrives (e.g. to send a stop signal);
    `outputs` names the outputs to ask for (default: none named, so all)."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, [as_input(k, v) for k, v in inputs.items()], request_id=request_id,
                                  enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(name) for name in outputs or ()] or None)
        got = []
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                raise RequestFailed(error.message())
            outputs = {name: result.as_numpy(name) for name in OUTPUTS if result.as_numpy(name) is not None}
            if outputs:
                got.append(outputs)
                if first is not None and len(got) == 1:
                    first(outputs)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def text_of(responses) -> str:
    return "".join(b"".join(r["text_output"].reshape(-1)).decode() for r in responses)


def ids_of(responses) -> list[int]:
    return [t for r in responses for t in r["output_ids"].reshape(-1).tolist()]


def error_of(triton, model: str, inputs: dict) -> str:
    try:
        send(triton, model, inputs)
    except RequestFailed as e:
        return str(e)
    raise AssertionError(f"{inputs} was accepted")


# ---------------------------------------------------------------------- llama-index


def test_llama_index_nvidia_triton_complete_and_stream_complete_with_defaults(triton, grpc):
    from llama_index.llms.nvidia_triton import NvidiaTriton

    greedy = grpc.generate(PROMPT, max_tokens=100).text  # its defaults: top_k 1, 100 tokens
    for model in ("ensemble", "llm"):  # "ensemble" is its default model name
        llm = NvidiaTriton(server_url=triton.grpc_url) if model == "ensemble" else \
            NvidiaTriton(server_url=triton.grpc_url, model_name=model)
        completed = llm.complete(PROMPT).text  # ends with its BOOL `stop` request, which must succeed
        streamed = "".join(part.delta for part in llm.stream_complete(PROMPT))
        # it reads max_tokens - 1 responses, then sends `stop`: one token per response fits that
        assert completed and greedy.startswith(completed) and len(completed) >= len(greedy) // 2, (model, completed)
        assert greedy.startswith(streamed) and len(streamed) >= len(greedy) // 2, (model, streamed)


def test_stop_signal_ends_the_live_request_with_that_id(triton, grpc):
    def stop(model, request_id):
        signal = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
                  "request_output_len": np.zeros((1, 1), np.uint32), "stop": np.array([[True]])}
        assert send(triton, model, signal, request_id) == []  # a success with no outputs

    for model in ("llm", "tensorrt_llm_bls"):
        request_id = f"long-{model}"
        # 2,000 tokens ignoring end tokens: the stop sent at the first response finds it running
        responses = send(triton, model, {"text_input": PROMPT, "max_tokens": np.array([[2000]], np.int32),
                                         "ignore_eos": np.array([[True]]), "stream": np.array([[True]])}, request_id,
                         first=lambda _: stop(model, request_id))
        assert responses[-1]["finish_reason"].reshape(-1)[0] == b"cancelled"  # a normal end, not an error
        assert len(ids_of(responses)) < 2000
    stop("llm", "no-such-request")  # nothing live with that id: still a success
    assert len(grpc.generate(PROMPT, max_tokens=3).token_ids) == 3


# ---------------------------------------------------------------------- vLLM backend


def test_vllm_backend_sample_client_logic(triton, grpc):
    """The request construction of the vLLM backend's samples/client.py, rewritten: text_input [1],
    stream [1], sampling_parameters [1] as JSON with string values (also sent as request
    parameters), exclude_input_in_output [1], over tritonclient.grpc.aio stream_infer."""
    prompts = ["def fibonacci(n):", "import os\n", "class Config:"]

    def request(prompt, request_id, sampling, stream, exclude):
        inputs = [grpcaio.InferInput("text_input", [1], "BYTES"), grpcaio.InferInput("stream", [1], "BOOL"),
                  grpcaio.InferInput("sampling_parameters", [1], "BYTES"),
                  grpcaio.InferInput("exclude_input_in_output", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
        inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        inputs[3].set_data_from_numpy(np.array([exclude], dtype=bool))
        return {"model_name": "vllm_model", "inputs": inputs, "request_id": request_id,
                "outputs": [grpcaio.InferRequestedOutput("text_output")], "parameters": sampling}

    async def run(sampling, stream, exclude) -> dict[str, str]:
        client = grpcaio.InferenceServerClient(url=triton.grpc_url)

        async def requests():
            for i, prompt in enumerate(prompts):
                yield request(prompt, str(i), sampling, stream, exclude)

        results = collections.defaultdict(str)
        async for result, error in client.stream_infer(inputs_iterator=requests()):
            assert error is None, error
            for text in result.as_numpy("text_output"):
                results[result.get_response().id] += text.decode()
        await client.close()
        return results

    sampled = asyncio.run(run({"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}, False, False))
    assert sorted(sampled) == ["0", "1", "2"]
    for i, prompt in enumerate(prompts):  # exclude_input_in_output false: the prompt comes first
        assert sampled[str(i)].startswith(prompt) and len(sampled[str(i)]) > len(prompt)
    greedy = asyncio.run(run({"temperature": "0", "max_tokens": "16"}, True, True))
    for i, prompt in enumerate(prompts):
        assert greedy[str(i)] == grpc.generate(prompt, max_tokens=16).text


def test_vllm_model_refuses_what_it_cannot_do(triton):
    def vllm(sampling, **inputs):
        return {"text_input": np.array([PROMPT]), "sampling_parameters": np.array([json.dumps(sampling)]),
                **{k: np.array([v]) for k, v in inputs.items()}}

    def refused(inputs) -> str:
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        errors: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: errors.put(error))
        client.async_stream_infer("vllm_model", [as_input(k, v) for k, v in inputs.items()])
        error = errors.get(timeout=60)
        client.stop_stream()
        return error.message() if error else ""

    assert "unknown sampling parameters best_of" in refused(vllm({"max_tokens": 4, "best_of": 2}))
    assert "exclude_input_in_output = False is not allowed" in refused(
        vllm({"max_tokens": 4}, stream=True, exclude_input_in_output=False))
    assert "max_tokens must be an integer" in refused(vllm({"max_tokens": "many"}))
    assert "num_return_sequences must be 1" in refused(vllm({"max_tokens": 4, "n": 2}))
    assert "unknown guided_decoding keys backend, whitespace_pattern" in refused(
        vllm({"max_tokens": 4, "guided_decoding": {"choice": ["a"], "backend": "xgrammar", "whitespace_pattern": " "}}))
    assert "guided_decoding needs exactly one of" in refused(
        vllm({"max_tokens": 4, "guided_decoding": {"choice": ["a"], "regex": "a"}}))
    choices = ["yes", "no", "maybe not"]
    for guide in ({"choice": choices}, {"regex": "yes|no|maybe not"}, {"grammar": 'start: "yes" | "no" | "maybe not"'}):
        got = send(triton, "vllm_model", vllm({"max_tokens": 16, "temperature": 1.0, "guided_decoding": guide}))
        assert text_of(got).removeprefix(PROMPT) in choices, guide


# ---------------------------------------------------------------------- sampling inputs


def generate(triton, model="llm", **inputs) -> list:
    values = {"text_input": PROMPT, "max_tokens": np.array([[24]], np.int32)}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            values[name] = value
        elif isinstance(value, list):
            values[name] = np.array([value])
        elif isinstance(value, bool):
            values[name] = np.array([[value]])
        elif isinstance(value, float):
            values[name] = np.array([[value]], np.float32)
        else:
            values[name] = np.array([[value]], np.int32)
    return send(triton, model, values)


def test_repetition_presence_and_frequency_penalties_remove_repeats(triton, tokenizer):
    greedy = ids_of(generate(triton))
    prompt_ids = set(tokenizer.encode(PROMPT))
    assert collections.Counter(greedy).most_common(1)[0][1] > 1  # the tiny random model repeats itself
    penalized = ids_of(generate(triton, repetition_penalty=1.5))
    assert len(set(penalized)) == len(penalized) and not set(penalized) & prompt_ids
    for option in ("presence_penalty", "frequency_penalty"):
        different = ids_of(generate(triton, **{option: 2.0}))
        assert max(collections.Counter(different).values()) < max(collections.Counter(greedy).values()), option


def test_min_tokens_delays_the_end_token(triton):
    greedy = ids_of(generate(triton))
    end = greedy[3]  # make a token the greedy text reaches early the end token
    first = greedy.index(end)
    ended = generate(triton, end_id=end)
    assert ids_of(ended) == greedy[:first] and ended[-1]["finish_reason"].reshape(-1)[0] == b"stop"
    delayed = ids_of(generate(triton, end_id=end, min_tokens=first + 6))
    assert len(delayed) >= first + 6 and end not in delayed[:first + 6]
    assert ids_of(generate(triton, end_id=end, min_length=first + 6)) == delayed  # TensorRT-LLM's older name


def test_ignore_eos_generates_past_the_end_token_and_stop_words_still_end(triton):
    greedy = generate(triton)
    ids, text = ids_of(greedy), text_of(greedy)
    end = ids[3]  # make a token the greedy text reaches early the end token, then ignore it
    ignoring = generate(triton, end_id=end, ignore_eos=True)
    assert ids_of(ignoring) == ids and ignoring[-1]["finish_reason"].reshape(-1)[0] == b"length"
    stop = text[len(text) // 2:][:4]  # after the ignored end token
    stopped = generate(triton, end_id=end, ignore_eos=True, stop_words=[stop])
    assert text_of(stopped) == text[:text.index(stop)]
    assert LLMClient(triton.grpc_url).generate(PROMPT, max_tokens=24, end_id=end, ignore_eos=True).token_ids == ids


def test_stop_words_cut_the_text_and_bad_words_never_appear(triton, tokenizer):
    full = generate(triton)
    text = text_of(full)
    stop = text[len(text) // 2:][:4]
    assert text_of(generate(triton, stop_words=[stop])) == text[:text.index(stop)]
    banned = next(t for t in ids_of(full) if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    without = ids_of(generate(triton, bad_words=[tokenizer.decode([banned])]))
    assert banned not in without and len(without) == 24


def test_log_probs_are_the_log_softmax_of_the_logits(triton, tokenizer):
    responses = generate(triton, return_log_probs=True, temperature=0.9, seed=np.array([[4]], np.uint64), top_k=50)
    ids = ids_of(responses)
    logprobs = np.concatenate([r["output_log_probs"].reshape(-1) for r in responses])
    prompt = tokenizer.encode(PROMPT)
    step = grpcclient.InferenceServerClient(triton.grpc_url)
    sequence = np.array([prompt + ids[:-1]], np.int64)
    tokens = grpcclient.InferInput("input_ids", list(sequence.shape), "INT64")
    tokens.set_data_from_numpy(sequence)
    logits = step.infer("step", [tokens]).as_numpy("logits")[0, len(prompt) - 1:].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    expected = (logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[np.arange(len(ids)), ids]
    np.testing.assert_allclose(logprobs, expected, atol=1e-4)
    assert abs(float(responses[-1]["cum_log_probs"].reshape(-1)[0]) - expected.sum()) < 1e-3


def test_top_log_probs_min_p_logit_bias_and_token_id_lists(triton):
    greedy = ids_of(generate(triton))
    responses = generate(triton, logprobs=3)  # > 0 implies return_log_probs
    assert ids_of(responses) == greedy
    assert responses[0]["output_top_token_ids"].shape == (1, 1, len(ids_of(responses[:1])), 3)
    top_ids = np.concatenate([r["output_top_token_ids"].reshape(-1, 3) for r in responses])
    top = np.concatenate([r["output_top_log_probs"].reshape(-1, 3) for r in responses])
    chosen = np.concatenate([r["output_log_probs"].reshape(-1) for r in responses])
    assert top_ids[:, 0].tolist() == greedy and np.array_equal(top[:, 0], chosen) and (np.diff(top) <= 0).all()
    favourite = next(t for t in range(100, 200) if t not in greedy)
    ids = lambda *values: np.array([values], np.int32)  # noqa: E731
    assert ids_of(generate(triton, logit_bias_token_ids=ids(favourite), logit_bias=np.array([[100]], np.float32))) \
        == [favourite] * 24
    allowed = {favourite, *greedy[:3]}
    assert set(ids_of(generate(triton, allowed_token_ids=ids(*allowed), temperature=1.0))) <= allowed
    assert ids_of(generate(triton, min_p=1.0, temperature=1.5)) == greedy
    stop = greedy[5]
    assert ids_of(generate(triton, stop_token_ids=ids(stop))) == greedy[:greedy.index(stop)]
    with pytest.raises(RequestFailed, match=r"logit_bias_token_ids \(1\) and logit_bias \(0\) must be as long"):
        generate(triton, logit_bias_token_ids=ids(favourite))
    response = urllib.request.urlopen(urllib.request.Request(
        f"http://{triton.http_url}/v2/models/llm/generate", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"text_input": PROMPT, "max_tokens": 4, "logprobs": 2, "min_p": 0.5,
                         "stop_token_ids": [favourite], "allowed_token_ids": greedy}).encode()), timeout=120)
    body = json.loads(response.read())
    assert body["output_ids"] == greedy[:4] and body["output_top_token_ids"][::2] == greedy[:4], body


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_python_client_returns_log_probs_and_sends_the_sampling_lists(triton, protocol):
    client = LLMClient(triton.grpc_url if protocol == "grpc" else triton.http_url, protocol)
    greedy = client.generate(PROMPT, max_tokens=6).token_ids
    scored = client.generate(PROMPT, max_tokens=6, logprobs=3)
    assert scored.token_ids == greedy and len(scored.logprobs) == len(scored.top_logprobs) == 6
    assert [top[0][0] for top in scored.top_logprobs] == greedy  # greedy: the raw model's most likely
    assert [top[0][1] for top in scored.top_logprobs] == pytest.approx(scored.logprobs)
    assert client.generate(PROMPT, max_tokens=6, return_log_probs=True).top_logprobs == []
    allowed = client.generate(PROMPT, max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=greedy[:2])
    assert set(allowed.token_ids) <= set(greedy[:2])


def test_echo_top_p_zero_and_token_counts(triton, grpc):
    greedy = grpc.generate(PROMPT, max_tokens=24).text
    assert text_of(generate(triton, exclude_input_in_output=False)) == PROMPT + greedy
    streamed = generate(triton, exclude_input_in_output=False, stream=True)
    assert text_of(streamed) == PROMPT + greedy
    assert text_of(generate(triton, top_p=0.0)) == greedy  # TensorRT-LLM reads top_p 0 as "off"
    for r in streamed:  # each response says how many tokens it carries
        assert r["num_output_tokens"].reshape(-1)[0] == r["output_ids"].size
    assert streamed[-1]["sequence_length"].reshape(-1)[0] == 24
    assert text_of(generate(triton, model="ensemble")) == PROMPT + greedy  # TensorRT-LLM's default: echo
    assert text_of(generate(triton, model="ensemble", stream=True)) == greedy


def test_a_request_gets_the_outputs_it_asked_for(triton):
    inputs = {"text_input": "def f(x):", "max_tokens": np.array([[4]], np.int32), "stream": np.array([[True]])}
    everything = send(triton, "llm", inputs)
    assert {"text_output", "output_ids", "num_output_tokens", "finish_reason"} <= everything[0].keys()
    asked = send(triton, "llm", inputs, outputs=["text_output", "num_output_tokens"])
    assert all(r.keys() == {"text_output", "num_output_tokens"} for r in asked)
    assert text_of(asked) == text_of(everything)  # greedy: the same answer, fewer tensors per token


@pytest.mark.parametrize("inputs, message", [
    (dict(beam_width=2), "beam_width must be 1: kvforge does not implement beam search"),
    (dict(length_penalty=0.5), "length_penalty must be 1"),
    (dict(num_return_sequences=2), "num_return_sequences must be 1"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    (dict(min_tokens=100), "min_tokens must be an integer in 0..max_tokens"),
    (dict(end_id=10 ** 6), "end_id names token 1000000, which is not in the vocabulary"),
    (dict(logprobs=21), "top_logprobs must be an integer in 0..20"),
    (dict(min_p=2.0), "min_p must be in [0, 1]"),
    (dict(seed=np.array([[1]], np.uint64), random_seed=np.array([[2]], np.uint64)), "seed and random_seed"),
])
def test_options_kvforge_cannot_honour_are_refused(triton, grpc, inputs, message):
    for model in ("llm", "ensemble"):
        assert message in error_of(triton, model, {"text_input": PROMPT, "max_tokens": np.array([[24]], np.int32),
                                                   **{k: v if isinstance(v, np.ndarray) else
                                                      np.array([[v]], np.float32 if isinstance(v, float) else np.int32)
                                                      for k, v in inputs.items()}})
    assert len(grpc.generate(PROMPT, max_tokens=3).token_ids) == 3


def test_http_fields_that_are_no_inputs_are_refused_by_name(triton):
    for model in ("llm", "tensorrt_llm_bls"):
        body = {"text_input": PROMPT, "max_tokens": 4, "random_sed": 1, "temperatur": 0.5}
        request = urllib.request.Request(f"http://{triton.http_url}/v2/models/{model}/generate",
                                         data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert "unknown request parameters random_sed, temperatur" in json.loads(error.value.read())["error"]


def test_cancelling_an_alias_request_cancels_the_llm_request(triton):
    from tests.test_serving import settled_metrics, wait_for_metrics

    before = settled_metrics(triton)
    for model in ("ensemble", "vllm_model"):
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        first, errors = threading.Event(), []

        def on_response(result, error):
            errors.append(error)
            first.set()

        client.start_stream(on_response)
        # 2,000 tokens, no end token before (vllm_model reads min_tokens, not ignore_eos): still
        # running when the client leaves at the first response
        inputs = {"text_input": np.array([[PROMPT]]), "max_tokens": np.array([[2000]], np.int32),
                  "ignore_eos": np.array([[True]]), "stream": np.array([[True]])} if model == "ensemble" else \
            {"text_input": np.array([PROMPT]), "stream": np.array([True]),
             "sampling_parameters": np.array([json.dumps({"max_tokens": 2000, "min_tokens": 2000})])}
        client.async_stream_infer(model, [as_input(k, v) for k, v in inputs.items()])
        assert first.wait(60) and errors[0] is None, (model, errors[0] and errors[0].message())
        client.stop_stream(cancel_requests=True)
        client.close()
    after = wait_for_metrics(triton, lambda m: m["kvforge_running_sequences"] == 0
                             and m["kvforge_cancelled_requests_total"] == before["kvforge_cancelled_requests_total"] + 2,
                             "both forwarded requests cancelled")
    assert after["kvforge_finished_requests_total"] == before["kvforge_finished_requests_total"]
    assert after["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"] < 2 * 2000


def test_token_id_prompts_with_pad_id_generate_as_the_text_does(triton, tokenizer):
    """TensorRT-LLM's form: input_ids + input_lengths (INT32) instead of text_input, pad_id
    accepted (kvforge never pads); the same greedy tokens as the text prompt."""
    ids = tokenizer.encode(PROMPT)
    expected = ids_of(generate(triton))
    for model in ("llm", "ensemble"):
        got = send(triton, model, {"input_ids": np.array([ids], np.int32),
                                   "input_lengths": np.array([[len(ids)]], np.int32),
                                   "max_tokens": np.array([[24]], np.int32), "pad_id": np.array([[0]], np.int32)})
        assert ids_of(got) == expected, model
    assert "pad_id" in error_of(triton, "llm", {"input_ids": np.array([ids], np.int32),
                                                "input_lengths": np.array([[len(ids)]], np.int32),
                                                "max_tokens": np.array([[4]], np.int32),
                                                "pad_id": np.array([[10 ** 6]], np.int32)})
