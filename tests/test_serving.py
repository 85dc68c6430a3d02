"""The Triton model repository served by a real tritonserver, through real tritonclient calls.

A request that must still be running when the test does something generates LONG tokens
ignoring end tokens: a client's next request or its leaving beats 2,000 engine steps anywhere."""
from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from clients.api import GenerationError, LLMClient
from kvforge.manifest import Manifest
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners import open_runner
from tests.conftest import SERVING_CONTEXT, SERVING_SLOTS

PROMPT = "def fibonacci(n):"
LONG = 2000


@pytest.fixture(scope="module")
def grpc(triton):
    return LLMClient(triton.grpc_url, "grpc")


@pytest.fixture(scope="module")
def http(triton):
    return LLMClient(triton.http_url, "http")


def metrics(triton) -> dict[str, float]:
    """kvforge's custom metrics as {name: value} (one `llm` model, so one series each)."""
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvforge_")}


def wait_for_metrics(triton, condition, what: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = metrics(triton)
        if condition(values):
            return values
        time.sleep(0.05)
    raise AssertionError(f"metrics never showed {what}: {values}")


def settled_metrics(triton) -> dict[str, float]:
    """Metrics once earlier requests are fully counted (the model publishes them every 0.1 s)."""
    reads = [metrics(triton)]
    for _ in range(50):
        time.sleep(0.2)
        reads = reads[-2:] + [metrics(triton)]
        if len(reads) == 3 and reads[0] == reads[1] == reads[2] and reads[2]["kvforge_running_sequences"] == 0:
            return reads[2]
    raise AssertionError(f"metrics never settled: {reads[-1]}")


def test_streaming_arrives_as_tokens_are_generated(triton, grpc):
    deltas = list(grpc.stream(PROMPT, max_tokens=200, ignore_eos=True))
    assert deltas[-1].final and not any(d.final for d in deltas[:-1])
    assert sum(len(d.token_ids) for d in deltas) == 200
    # the first response comes while the request still runs: leaving then cancels it, it never
    # finishes (how many tokens each response carries depends on how fast the client reads)
    before = settled_metrics(triton)
    for delta in grpc.stream(PROMPT, max_tokens=LONG, ignore_eos=True):
        assert delta.token_ids and not delta.final
        break
    after = wait_for_metrics(triton, lambda m: m["kvforge_cancelled_requests_total"]
                             == before["kvforge_cancelled_requests_total"] + 1, "the request cancelled")
    assert after["kvforge_finished_requests_total"] == before["kvforge_finished_requests_total"]
    assert after["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"] < LONG


def pytorch_greedy(engine_dir, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """The Hugging Face checkpoint itself, recomputing the whole sequence for every token."""
    from export.verify import hf_logits, reference_model

    model = reference_model(Manifest.load(engine_dir))
    tokens = list(prompt_ids)
    while len(tokens) - len(prompt_ids) < max_tokens:
        token = int(np.argmax(hf_logits(model, tokens)[-1]))
        if token in eos:
            break
        tokens.append(token)
    return tokens[len(prompt_ids):]


def test_greedy_through_triton_equals_in_process_and_pytorch(triton, exports, grpc, http):
    engine_dir = exports(max_seq_len=SERVING_CONTEXT)
    with LLMEngine(engine_dir) as engine:
        expected = engine.generate([PROMPT], SamplingParams(max_tokens=32))[0]
        seeded = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=5))[0]
        assert expected.token_ids == pytorch_greedy(engine_dir, engine.tokenizer.encode(PROMPT), 32,
                                                    set(engine.tokenizer.eos_token_ids))
    for client in (grpc, http):
        for stream in (True, False):
            got = client.generate(PROMPT, max_tokens=32, stream=stream)
            assert (got.text, got.token_ids) == (expected.text, expected.token_ids), (client.protocol, stream)
    assert grpc.generate(PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=5).token_ids == seeded.token_ids


def test_http_generate_and_generate_stream_endpoints(triton):
    def post(endpoint: str, body: dict) -> bytes:
        request = urllib.request.Request(f"http://{triton.http_url}/v2/models/llm/{endpoint}",
                                         data=json.dumps(body).encode(), method="POST")
        return urllib.request.urlopen(request, timeout=30).read()

    one = json.loads(post("generate", {"text_input": PROMPT, "max_tokens": 200}))
    assert len(one["output_ids"]) == 200 and one["text_output"]
    events = [json.loads(line[5:]) for line in post("generate_stream", {"text_input": PROMPT, "max_tokens": 200,
                                                                        "stream": True}).splitlines()
              if line.startswith(b"data:")]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == one["text_output"]
    stop = one["text_output"][5:9]
    stopped = json.loads(post("generate", {"text_input": PROMPT, "max_tokens": 12, "stop_words": [stop]}))
    assert stopped["text_output"] == one["text_output"][:one["text_output"].index(stop)]


def test_concurrent_requests_run_in_the_same_steps(triton, grpc):
    """Nine requests run while a LONG one decodes (it is cancelled once they are done, so it
    decoded all along; on a host slow enough that its LONG tokens end first, it finishes): every
    step that gave one of them a decoded token ran two rows or more."""
    before = settled_metrics(triton)
    holder_started, leave = threading.Event(), threading.Event()

    def hold() -> None:
        for _ in grpc.stream(PROMPT, max_tokens=LONG, ignore_eos=True):
            holder_started.set()
            if leave.is_set():
                return  # leaving the stream cancels the request

    holder = threading.Thread(target=hold)
    holder.start()
    shorts, tokens = SERVING_SLOTS - 1, 64
    results: list = [None] * shorts
    try:
        assert holder_started.wait(60)
        start = threading.Barrier(shorts)

        def one(i: int) -> None:
            start.wait()
            results[i] = grpc.generate(f"{PROMPT} # {i}", max_tokens=tokens, ignore_eos=True)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(shorts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        leave.set()
        holder.join(120)
    assert all(r is not None and len(r.token_ids) == tokens for r in results)

    def ended(m: dict[str, float]) -> dict[str, float]:
        return {k: m[k] - before[k] for k in ("kvforge_finished_requests_total", "kvforge_cancelled_requests_total")}

    after = wait_for_metrics(triton, lambda m: sum(ended(m).values()) == shorts + 1
                             and m["kvforge_running_sequences"] == 0, "the ten requests ended")
    assert ended(after)["kvforge_finished_requests_total"] in (shorts, shorts + 1)  # the holder cancelled or done
    steps = after["kvforge_steps_total"] - before["kvforge_steps_total"]
    batched = after["kvforge_batched_steps_total"] - before["kvforge_batched_steps_total"]
    generated = after["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"]
    assert batched >= tokens - 1 and steps < generated, (steps, batched, generated)


def test_cancellation_frees_the_slots(triton, grpc, exports):
    before = settled_metrics(triton)

    def cancel_after_first_delta() -> None:
        for _ in grpc.stream(PROMPT, max_tokens=LONG, ignore_eos=True):
            break  # leaving the stream cancels the request on the server, LONG - 1 tokens early

    threads = [threading.Thread(target=cancel_after_first_delta) for _ in range(SERVING_SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    after = wait_for_metrics(triton, lambda m: m["kvforge_cancelled_requests_total"]
                             == before["kvforge_cancelled_requests_total"] + SERVING_SLOTS, "every request cancelled")
    assert after["kvforge_finished_requests_total"] == before["kvforge_finished_requests_total"]
    generated = after["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"]
    assert generated < SERVING_SLOTS * LONG
    assert after["kvforge_running_sequences"] == after["kvforge_waiting_sequences"] == 0
    # an idle engine keeps one row of the smallest capacity bucket, of its 1 GiB slot budget
    idle = 64 * Manifest.load(exports(max_seq_len=SERVING_CONTEXT)).kv_bytes_per_token / (1 << 30)
    assert after["kvforge_kv_cache_utilization"] == pytest.approx(idle)
    assert grpc.generate(PROMPT, max_tokens=4).token_ids


def test_custom_metrics_are_exported(triton, grpc):
    before = settled_metrics(triton)
    grpc.generate(PROMPT, max_tokens=4, ignore_eos=True)
    # the metrics thread publishes as soon as a request ended, off the responses' path
    values = wait_for_metrics(triton, lambda m: m["kvforge_finished_requests_total"]
                              > before["kvforge_finished_requests_total"], "the request finished")
    assert values["kvforge_finished_requests_total"] - before["kvforge_finished_requests_total"] == 1
    assert values["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"] == 4
    assert {"kvforge_kv_cache_utilization", "kvforge_kv_cache_bytes_held", "kvforge_running_sequences", "kvforge_waiting_sequences",
            "kvforge_generated_tokens_total", "kvforge_steps_total", "kvforge_batched_steps_total",
            "kvforge_finished_requests_total", "kvforge_cancelled_requests_total",
            "kvforge_expired_requests_total", "kvforge_cancel_poll_seconds_total",
            "kvforge_preempted_swap_total", "kvforge_preempted_recompute_total", "kvforge_loading_sequences",
            "kvforge_prefix_cache_queried_tokens_total", "kvforge_prefix_cache_hit_tokens_total",
            "kvforge_kv_host_pool_bytes", "kvforge_kv_host_pool_budget_bytes",
            "kvforge_kv_blocks_evicted_total", "kvforge_kv_tier_write_queue_blocks",
            "kvforge_kv_tier_write_dropped_blocks_total", "kvforge_kv_tier_loads_abandoned_total",
            "kvforge_kv_tier_loads_expired_total"} <= values.keys()
    # no tier below RAM, no timeouts, a 1 GiB slot budget these tests never outgrow
    assert values["kvforge_loading_sequences"] == values["kvforge_expired_requests_total"] == 0
    assert values["kvforge_preempted_swap_total"] == values["kvforge_preempted_recompute_total"] == 0
    assert values["kvforge_kv_tier_loads_expired_total"] == values["kvforge_kv_tier_write_dropped_blocks_total"] == 0


def raw_stream(triton, values: list[tuple[str, np.ndarray, str]]) -> str:
    """Send hand-made inputs over stream_infer; return the error message (or '' on success)."""
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    tensors = []
    for name, data, datatype in values:
        tensors.append(grpcclient.InferInput(name, list(data.shape), datatype))
        tensors[-1].set_data_from_numpy(data)
    done, errors = threading.Event(), []

    def callback(result, error):
        errors.append(error.message() if error else "")
        done.set()

    client.start_stream(callback)
    client.async_stream_infer("llm", tensors)
    assert done.wait(30), "no response"
    client.stop_stream()
    return errors[0]


@pytest.mark.parametrize("request_kwargs, message, over_http", [
    (dict(prompt=""), "the prompt is empty", True),
    (dict(prompt="word " * 2500), "the context holds 2048", True),
    (dict(prompt="x", max_tokens=0), "max_tokens must be at least 1", True),
    (dict(prompt="x", max_tokens=-3), "max_tokens must be at least 1", True),
    (dict(prompt="x", max_tokens=100000), "exceeds the context of 2048", True),
    (dict(prompt="x", temperature=-1.0), "temperature must be a finite number", True),
    (dict(prompt="x", temperature=float("nan")), "temperature must be a finite number", False),  # JSON has no NaN
    (dict(prompt="x", top_p=1.5), "top_p must be in (0, 1]", True),
    (dict(prompt="x", top_k=-1), "top_k must be an integer >= 0", True),
    (dict(prompt=b"caf\xe9 \xff"), "text_input is not valid UTF-8", False),  # JSON carries only valid text
    (dict(prompt="x", stop_words=[b"\xc3"]), "stop_words is not valid UTF-8", False),
    (dict(prompt="x", stop_words=[f"w{i}" for i in range(17)]), "at most 16 stop strings, got 17", True),
])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(grpc, http, request_kwargs, message, over_http):
    kwargs = {"max_tokens": 4, **request_kwargs}
    for client in (grpc, http) if over_http else (grpc,):
        with pytest.raises(GenerationError, match=re.escape(message)):
            client.generate(**kwargs, stream=False)
    assert len(grpc.generate(PROMPT, max_tokens=3).token_ids) == 3


def test_wrong_types_are_refused_by_triton_and_the_server_keeps_serving(triton, grpc):
    text = ("text_input", np.array([[b"x"]], dtype=np.object_), "BYTES")
    assert "expects 'INT32'" in raw_stream(triton, [text, ("max_tokens", np.array([[3.0]], np.float32), "FP32")])
    assert "expects 'BYTES'" in raw_stream(triton, [("text_input", np.array([[7]], np.int32), "INT32"),
                                                    ("max_tokens", np.array([[3]], np.int32), "INT32")])
    assert "max_tokens" in raw_stream(triton, [text])  # a required input missing
    assert "unexpected shape" in raw_stream(triton, [text, ("max_tokens", np.array([[3, 4]], np.int32), "INT32")])
    two_prompts = [("text_input", np.array([[b"x"], [b"y"]], np.object_), "BYTES"),
                   ("max_tokens", np.array([[3], [3]], np.int32), "INT32")]
    assert "one prompt per request" in raw_stream(triton, two_prompts)
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/llm/generate", method="POST",
                                     data=b'{"text_input": "x", "max_tokens": "many"}')
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 400  # the front checks the JSON; Triton itself would answer 500
    assert "max_tokens must be an integer" in json.loads(error.value.read())["error"]
    assert raw_stream(triton, [text, ("max_tokens", np.array([[3]], np.int32), "INT32")]) == ""
    assert len(grpc.generate(PROMPT, max_tokens=3).token_ids) == 3


def test_step_model_scores_with_dynamic_batching(exports, tmp_path):
    """Two requests scored in one execution, and each equal to the runner's logits alone. On a
    server of its own (the step model only) whose batcher waits for 2 requests: with the
    shipped 2 ms queue delay, whether two requests meet depends on how fast they arrive."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    repo = tmp_path / "repo"
    write_repository(exports(max_seq_len=SERVING_CONTEXT), repo, slots=SERVING_SLOTS)
    for model in repo.iterdir():
        if model.name != "step":
            shutil.rmtree(model)
    config = repo / "step" / "config.pbtxt"
    text, count = re.subn(r"dynamic_batching \{ max_queue_delay_microseconds: \d+ \}",
                          "dynamic_batching { max_queue_delay_microseconds: 60000000 preferred_batch_size: [ 2 ] }",
                          config.read_text())
    assert count == 1 and int(re.search(r"max_batch_size: (\d+)", text).group(1)) >= 2, text
    config.write_text(text)
    runner = open_runner(exports(max_seq_len=SERVING_CONTEXT))
    runner.allocate(1, 64)
    sequences = [np.array([5, 17, 99, 3], np.int64), np.array([42, 7], np.int64)]
    results: list = [None, None]
    http, grpc_port, metrics_port = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc_port, metrics_port=metrics_port) as server:
        def score(i: int) -> None:
            client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
            ids = httpclient.InferInput("input_ids", [1, len(sequences[i])], "INT64")
            ids.set_data_from_numpy(sequences[i][None])
            results[i] = client.infer("step", [ids]).as_numpy("logits")[0]

        threads = [threading.Thread(target=score, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("step")["model_stats"][0]
    for ids, logits in zip(sequences, results):
        expected = runner.step(ids[None], np.array([0]), np.array([len(ids)]))[0]
        np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert int(stats["inference_count"]) == 2 and int(stats["execution_count"]) == 1, stats
    assert [(int(b["batch_size"]), int(b["compute_infer"]["count"])) for b in stats["batch_stats"]] == [(2, 1)], stats


def test_step_model_refuses_ids_outside_the_vocabulary(triton):
    client = httpclient.InferenceServerClient(triton.http_url)
    bad = httpclient.InferInput("input_ids", [1, 2], "INT64")
    bad.set_data_from_numpy(np.array([[1, 10 ** 6]], np.int64))
    with pytest.raises(Exception, match="input_ids must be in"):
        client.infer("step", [bad])
