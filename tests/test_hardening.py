"""Fault suite: the launcher (front + supervised tritonserver) attacked the way a probe would.

Every wait is bounded and every request goes to loopback. Measured times are printed (run with
-s to see them); they are not asserted beyond hang bounds, as timings on shared cores vary. A
request that must outlive what a test does to it generates LONG tokens ignoring end tokens: a
deadline or a client's next request beats 2,000 engine steps on any machine.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from clients.api import GenerationError, LLMClient
from launcher.harness import TritonServer, dying_with_parent, free_ports
from launcher.tritonserver import STUB_NAME
from tests.conftest import ROOT, SERVING_CONTEXT
from tests.processes import descendants, is_llm_stub, process_start

PROMPT = "def fibonacci(n):"
SLOTS, MAX_WAITING = 4, 1
LONG = 2000  # tokens: a request that outlives what a test does to it (with ignore_eos)
HANG_BOUND = 60.0  # no wait in this file is longer; reaching it means something hangs
# the shared server's engine threads: not the default (every core), so the flag's effect shows
DECODE_THREADS = 1 if (os.cpu_count() or 1) > 1 else 2


def repository(exports, into: Path, max_waiting: int = MAX_WAITING) -> Path:
    from engines.repository import write_repository

    write_repository(exports(max_seq_len=SERVING_CONTEXT), into, slots=SLOTS)
    config = into / "llm" / "config.pbtxt"
    text, count = re.subn(r'(key: "max_waiting" value: \{ string_value: ")\d+', rf"\g<1>{max_waiting}",
                          config.read_text())
    assert count == 1, "the llm config has no max_waiting parameter"
    config.write_text(text)
    return into


def launch(repo: Path, *args: str, log_dir: Path | None = None, prefix: list[str] | None = None) -> TritonServer:
    http, grpc, metrics = free_ports(3)
    return TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, log_dir=log_dir,
                        extra_args=list(args), launcher_prefix=prefix).start()


@pytest.fixture(scope="module")
def repo(exports, tmp_path_factory):
    return repository(exports, tmp_path_factory.mktemp("hardening_repo"))


@pytest.fixture(scope="module")
def service(repo, tmp_path_factory):
    server = launch(repo, "--decode-threads", str(DECODE_THREADS), log_dir=tmp_path_factory.mktemp("hardening_logs"))
    yield server
    server.stop()


def request(server: TritonServer, path: str, body: bytes | None = None, headers: dict | None = None,
            method: str | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=body, headers=headers or {},
                                 method=method or ("POST" if body is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=HANG_BOUND) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def generate(server: TritonServer, **fields) -> tuple[int, http.client.HTTPMessage, bytes]:
    return request(server, "/v2/models/llm/generate", json.dumps({"text_input": PROMPT, "max_tokens": 4,
                                                                  **fields}).encode())


def serves(server: TritonServer) -> bool:
    status, _, body = generate(server)
    return status == 200 and len(json.loads(body)["output_ids"]) == 4


def wait_until(condition, what: str, timeout: float = HANG_BOUND, every: float = 0.02) -> float:
    """Seconds until condition() held; fails after timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(every)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def events(server: TritonServer) -> list[dict]:
    return [json.loads(line) for line in (server.log_dir / "kvforge.jsonl").read_text().splitlines()]


class Streams:
    """Long streams held open in threads (gRPC straight to Triton, HTTP through the front);
    each records how it ended and when. They start one after another, each once the one before
    has its first token: requests arriving together could overflow the waiting queue (it holds
    MAX_WAITING requests until the engine's next step admits them), free slots or not."""

    def __init__(self, server: TritonServer, grpc: int, http: int):
        self.results: list = []
        self.stop = threading.Event()  # set: the streams leave (cancel) at their next token
        self.threads = []
        for url, protocol in [(server.grpc_url, "grpc")] * grpc + [(server.http_url, "http")] * http:
            first = threading.Event()
            self.threads.append(threading.Thread(target=self.one, args=(url, protocol, first), daemon=True))
            self.threads[-1].start()
            assert first.wait(HANG_BOUND), "a stream got no first token"
        assert not self.results, f"a stream ended before the test began: {self.results}"

    def one(self, url: str, protocol: str, first: threading.Event) -> None:
        client = LLMClient(url, protocol, timeout=HANG_BOUND)
        try:
            for _ in client.stream(PROMPT, max_tokens=LONG, ignore_eos=True):
                first.set()
                if self.stop.is_set():
                    self.results.append(("left", time.monotonic()))
                    return
            self.results.append(("finished", time.monotonic()))
        except GenerationError as e:
            self.results.append((str(e), time.monotonic()))
        finally:
            first.set()

    def finished(self) -> bool:
        """Whether a stream ended on its own (its LONG tokens all out) rather than left."""
        return any(how == "finished" for how, _ in self.results)

    def join(self) -> list:
        for t in self.threads:
            t.join(HANG_BOUND)
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"
        return self.results


# ---------------------------------------------------------------- 1. control APIs closed

def test_control_apis_need_the_key_and_the_rest_stays_open(service):
    key = {"kvforge-key": service.control_key}
    model_py = b"import triton_python_backend_utils as pb\nclass TritonPythonModel:\n    pass\n"
    upload = json.dumps({"parameters": {
        "config": json.dumps({"backend": "python", "max_batch_size": 0,
                              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]}),
        "file:1/model.py": base64.b64encode(model_py).decode()}}).encode()
    anonymous = [("/v2/repository/models/llm/unload", b"{}"), ("/v2/repository/models/step/load", b"{}"),
                 ("/v2/repository/models/uploaded/load", upload), ("/v2/repository/index", b"{}"),
                 ("/v2/logging", None), ("/v2/trace/setting", None), ("/v2/systemsharedmemory/status", None)]
    for path, body in anonymous:
        status, _, text = request(service, path, body)
        assert status == 403 and b"restricted" in text, (path, status, text)
    for header in ({"kvforge-key": "wrong"}, {}):
        with pytest.raises(Exception, match="restricted|kvforge-key"):
            grpcclient.InferenceServerClient(service.grpc_url).unload_model("llm", headers=header)
    assert request(service, "/v2/models/uploaded/ready")[0] != 200  # the refused upload never loaded
    assert serves(service)
    # open to anyone: health, metadata, config, statistics, inference
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/llm", "/v2/models/llm/config",
                 "/v2/models/llm/ready", "/v2/models/llm/stats"):
        assert request(service, path)[0] == 200, path
    # the key holder can load (an upload too) and unload
    assert request(service, "/v2/repository/models/uploaded/load", upload, key)[0] == 200
    assert request(service, "/v2/models/uploaded/ready")[0] == 200
    assert request(service, "/v2/repository/models/uploaded/unload", b"{}", key)[0] == 200
    wait_until(lambda: request(service, "/v2/models/uploaded/ready")[0] != 200, "the upload unloaded")
    assert request(service, "/v2/repository/models/step/load", b"{}", key)[0] == 200
    assert serves(service)
    # that a reload or an unload is no death for the supervisor: the killed-stub test below
    # the key is never written to a log
    for log in service.log_dir.iterdir():
        assert service.control_key not in log.read_text(errors="replace"), log.name


def test_control_apis_stay_restricted_on_every_host(service):
    """The running tritonserver's own command line restricts the control APIs; the flags do not
    depend on the host (binding beyond loopback is not done in tests), and Triton's own HTTP
    stays private on loopback whatever HOST is: the front owns HOST."""
    from launcher.tritonserver import TritonProcess

    restricted = f"model-repository,logging,trace,shared-memory:kvforge-key={service.control_key}"
    running = Path(f"/proc/{service.tritonserver_pid()}/cmdline").read_bytes().decode().split("\0")
    for host in ("127.0.0.1", "0.0.0.0", "::"):
        command = TritonProcess(Path("repo"), host, 1, 2, 3, service.control_key, Path("log"), {}).command(Path("b"))
        for flag in (f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
                     "--http-address=127.0.0.1"):
            assert flag in command and flag in running, (host, flag)


# ---------------------------------------------------------------- 2. bodies bounded, server supervised

def test_big_bodies_are_refused_before_triton_sees_them(service):
    pid = service.tritonserver_pid()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, text = request(service, "/v2/models/llm/generate", b"a" * (5 << 20), form)
    assert status == 413 and "the limit is" in json.loads(text)["error"]
    status, _, _ = request(service, "/v2/repository/index", b"a" * (5 << 20), form)
    assert status == 413
    # a chunked body declares no length: it is counted as it arrives
    connection = http.client.HTTPConnection(*service.http_url.split(":"), timeout=HANG_BOUND)
    connection.request("POST", "/v2/models/llm/generate", body=iter([b"a" * (64 << 10)] * 80),
                       headers={**form, "Transfer-Encoding": "chunked"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and "the limit is" in json.loads(response.read())["error"]
    connection.close()
    # a small form-encoded body is JSON to Triton (the front fixes curl -d's content type)
    status, _, _ = request(service, "/v2/models/llm/generate",
                           json.dumps({"text_input": PROMPT, "max_tokens": 3}).encode(), form)
    assert status == 200
    assert service.tritonserver_pid() == pid and serves(service)


@pytest.mark.parametrize("body, status, message", [
    (b'{"text_input": "x", "max_tokens": ', 400, "not valid JSON"),
    (b'[1, 2]', 400, "must be a JSON object"),
    (b'{"text_input": 7, "max_tokens": 3}', 400, "text_input must be a string"),
    (b'{"text_input": "x", "max_tokens": "many"}', 400, "max_tokens must be an integer"),
    (b'{"text_input": "x", "max_tokens": true}', 400, "max_tokens must be an integer"),
    (b'{"text_input": "x", "max_tokens": 3, "seed": -1}', 400, "seed must be an integer in 0..2**64-1"),
    (b'{"text_input": "x", "max_tokens": 3, "temperature": "hot"}', 400, "temperature must be a number"),
    (b'{"text_input": "x", "max_tokens": 3, "stop_words": [1]}', 400, "stop_words must be a string or a list"),
    (b'{"text_input": "x", "max_tokens": 3, "stop": "now"}', 400, "stop must be true or false"),
    (b'{"text_input": "x", "max_tokens": 3, "stream": "yes"}', 400, "stream must be true or false"),
    (b'\xff\xfe', 400, "not valid JSON"),
])
def test_client_mistakes_get_4xx_naming_the_field(service, body, status, message):
    for endpoint in ("generate", "generate_stream"):
        got, _, text = request(service, f"/v2/models/llm/{endpoint}", body)
        assert got == status and message in json.loads(text)["error"], (endpoint, got, text)
    assert serves(service)


def test_text_that_is_no_unicode_is_a_400_naming_the_field(service):
    # a lone surrogate escape is valid JSON but no Unicode text (Triton's own parser answers 500)
    for body, field in ((b'{"text_input": "\\ud800", "max_tokens": 4}', "text_input"),
                        (b'{"text_input": "x", "max_tokens": 4, "stop_words": ["a", "b\\udc00"]}', "stop_words.1")):
        for endpoint in ("generate", "generate_stream"):
            status, _, text = request(service, f"/v2/models/llm/{endpoint}", body)
            assert status == 400, (endpoint, status, text)
            assert json.loads(text)["error"].startswith(f"{field} is not valid Unicode text"), text
    assert serves(service)


# ---------------------------------------------------------------- 4, 5. step shape, short errors

def test_step_refuses_more_than_one_row(service):
    client = httpclient.InferenceServerClient(service.http_url)
    rows = httpclient.InferInput("input_ids", [2, 5], "INT64")
    rows.set_data_from_numpy(np.arange(10, dtype=np.int64).reshape(2, 5))
    with pytest.raises(Exception, match=re.escape("input_ids must have shape [1, n]")):
        client.infer("step", [rows])
    one = httpclient.InferInput("input_ids", [1, 5], "INT64")
    one.set_data_from_numpy(np.arange(5, dtype=np.int64)[None])
    assert client.infer("step", [one]).as_numpy("logits").shape[:2] == (1, 5)


def test_errors_quote_a_bounded_part_of_the_input(service):
    huge = "s" * 1_000_000
    for protocol, url in (("http", service.http_url), ("grpc", service.grpc_url)):
        with pytest.raises(GenerationError) as error:
            LLMClient(url, protocol).generate("x", max_tokens=3, stop_words=[huge], stream=False)
        message = str(error.value)
        assert "1000000 characters" in message and len(message) < 400, message[:500]
    status, _, text = generate(service, max_tokens="m" * 500_000)
    assert status == 400 and len(text) < 400 and b"500000 characters" in text


# ---------------------------------------------------------------- 7. queue full, 9. deadlines

def test_full_queue_is_503_over_http_and_unavailable_over_grpc(exports, tmp_path):
    # a queue of 0 places refuses every request as a full queue would: no race with slot holders
    server = launch(repository(exports, tmp_path / "repo", max_waiting=0), log_dir=tmp_path / "logs")
    try:
        for endpoint, stream in (("generate", False), ("generate_stream", True)):
            status, headers, text = request(server, f"/v2/models/llm/{endpoint}", json.dumps(
                {"text_input": PROMPT, "max_tokens": 3, "stream": stream}).encode())
            assert status == 503 and headers.get("Retry-After") == "1", (endpoint, status, text)
            assert json.loads(text)["error"].startswith("UNAVAILABLE: the waiting queue is full")
        with pytest.raises(GenerationError, match="^UNAVAILABLE: the waiting queue is full"):
            LLMClient(server.grpc_url).generate(PROMPT, max_tokens=3)
        assert server.ready()  # refusing for load is not being broken
    finally:
        server.stop()


def test_the_front_gives_each_error_kind_its_status():
    from frontend.proxy import retry_after, status_of
    from kvforge.errors import INTERNAL, INVALID, UNAVAILABLE, EngineError, QueueFullError, RequestError, wire_message

    # Triton answers a refusal for load with 400: the message's prefix says the kind
    for error, status in ((QueueFullError("the waiting queue is full"), 503),
                          (EngineError("the engine step failed"), 500),
                          (RequestError("max_tokens must be at least 1"), 400)):
        message = wire_message(error.kind, str(error))
        assert status_of(message, 400) == status == error.kind.http_status, message
    assert wire_message(INTERNAL, "the engine shut down") == "INTERNAL: the engine shut down"
    assert wire_message(INVALID, "the prompt is empty") == "the prompt is empty"
    assert status_of("Request for unknown model: 'x' is not found", 404) == 404  # Triton's own errors keep theirs
    assert retry_after(UNAVAILABLE.http_status) == {"Retry-After": "1"} and retry_after(500) == {}


def test_deadlines_end_requests_with_a_clear_error(exports):
    from runtime.llm_engine import LLMEngine, SamplingParams

    long = SamplingParams(max_tokens=LONG, ignore_eos=True)
    with LLMEngine(exports(max_seq_len=SERVING_CONTEXT), slots=1) as engine:
        outputs, ids = {}, {}

        def collect(out):  # on the engine thread
            if "queued" not in ids:  # the holder's first token: the queued request arrives now
                ids["queued"] = engine.submit(PROMPT, long, collect, queue_timeout=0.01)
            if out.finished:
                outputs[out.request_id] = out

        holder = engine.submit(PROMPT, long, collect)  # holds the only slot until cancelled
        wait_until(lambda: ids.get("queued") in outputs, "the queued request to end")
        assert engine.cancel(holder)
        running = engine.submit(PROMPT, long, collect, timeout=0.05)
        wait_until(lambda: holder in outputs and running in outputs, "the holder and the timed request to end")
    assert outputs[holder].finish_reason == "cancelled"  # it held the slot all along
    queued = outputs[ids["queued"]]
    assert queued.finish_reason == "timeout" and "queue timeout" in queued.error and queued.output_tokens == 0
    assert outputs[running].finish_reason == "timeout" and "request timeout" in outputs[running].error
    assert outputs[running].output_tokens < LONG


def test_request_timeout_through_the_server(repo, tmp_path):
    server = launch(repo, "--request-timeout", "0.05", log_dir=tmp_path)
    try:
        with pytest.raises(GenerationError, match="^UNAVAILABLE: .*past the server's request timeout"):
            LLMClient(server.grpc_url, timeout=HANG_BOUND).generate(PROMPT, max_tokens=LONG, ignore_eos=True)
        wait_until(lambda: any(e.get("source") == "engine" for e in events(server)), "the engine's log line")
        log = [e for e in events(server) if e.get("source") == "engine"]
        assert len(log) == 1 and log[0]["finish_reason"] == "timeout" and log[0]["output_tokens"] < LONG
        wait_until(lambda: metric(server, "kvforge_expired_requests_total") == 1, "the expiry counted")
    finally:
        server.stop()


@pytest.fixture
def draining(repo, tmp_path):
    """A server with a queue timeout and a long drain, for one test: the SIGTERM test ends it, so
    it is not shared (the tests run in any order)."""
    server = launch(repo, "--drain-seconds", "30", "--queue-timeout", "0.05", log_dir=tmp_path / "draining_logs")
    yield server
    server.stop()


def test_queue_timeout_through_the_server(draining):
    before = {name: metric(draining, name) for name in ("kvforge_expired_requests_total",
                                                       "kvforge_cancelled_requests_total")}
    streams = Streams(draining, grpc=SLOTS, http=0)  # every slot decoding a LONG request
    try:
        with pytest.raises(GenerationError, match="queue timeout"):
            LLMClient(draining.grpc_url, timeout=HANG_BOUND).generate(PROMPT, max_tokens=4)
    finally:
        streams.stop.set()
        results = streams.join()
    assert all(r == "left" for r, _ in results), results
    # the holders were cancelled when they left, not finished: they held every slot all along
    wait_until(lambda: metric(draining, "kvforge_cancelled_requests_total")
               == before["kvforge_cancelled_requests_total"] + SLOTS, "the holders cancelled")
    assert metric(draining, "kvforge_expired_requests_total") == before["kvforge_expired_requests_total"] + 1
    assert serves(draining)


# ---------------------------------------------------------------- 8. disconnects free the slot

def metric(server: TritonServer, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_http_disconnect_through_the_front_frees_the_slot(service):
    cancelled = metric(service, "kvforge_cancelled_requests_total")
    generated = metric(service, "kvforge_generated_tokens_total")
    connection = http.client.HTTPConnection(*service.http_url.split(":"), timeout=HANG_BOUND)
    connection.request("POST", "/v2/models/llm/generate_stream",
                       json.dumps({"text_input": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")
    connection.sock.shutdown(2)
    connection.close()
    wait_until(lambda: metric(service, "kvforge_cancelled_requests_total") > cancelled, "the cancellation")
    wait_until(lambda: metric(service, "kvforge_running_sequences") == 0, "the slot freed")
    assert metric(service, "kvforge_generated_tokens_total") > generated  # it was decoding when the client left


def test_a_request_cancelled_while_it_waits_for_a_slot_is_dropped_unserved(service):
    """A request with no output yet is asked whether its client left by the sender's timer
    (docs/deploying.md#cancellation), not only as its outputs go out: one waiting behind four LONG
    streams, left by its gRPC client, ends cancelled with no token while the streams still hold
    every slot."""
    from tests.test_clients import as_input

    cancelled = metric(service, "kvforge_cancelled_requests_total")
    streams = Streams(service, grpc=SLOTS, http=0)  # every slot decoding a LONG request
    try:
        client = grpcclient.InferenceServerClient(service.grpc_url)
        client.start_stream(lambda result, error: None)
        client.async_stream_infer("llm", [as_input("text_input", PROMPT), as_input("max_tokens", np.int32(4)),
                                          as_input("stream", True)], request_id="left-while-waiting")
        wait_until(lambda: metric(service, "kvforge_waiting_sequences") == 1, "the request waiting for a slot")
        client.stop_stream(cancel_requests=True)
        client.close()
        wait_until(lambda: (metric(service, "kvforge_cancelled_requests_total") == cancelled + 1
                            and metric(service, "kvforge_waiting_sequences") == 0) or streams.finished(),
                   "the waiting request dropped")
        if streams.finished():  # tiny-llama's LONG tokens take seconds: a slow enough host frees a slot
            pytest.skip("a LONG stream finished before the waiting request was dropped: the slots were not all held")
        assert metric(service, "kvforge_running_sequences") == SLOTS and not streams.results  # it never ran
    finally:
        streams.stop.set()
        results = streams.join()
    assert all(r == "left" for r, _ in results), results

    def logged():
        return [e for e in events(service) if e.get("request_id") == "left-while-waiting"]

    wait_until(logged, "its access-log line")
    (line,) = logged()
    assert line["finish_reason"] == "cancelled" and line["output_tokens"] == 0 and line["ttft_ms"] is None, line


def test_decode_threads_reach_the_engines_session(service):
    """--decode-threads (the launcher hands it to the llm model as $KVFORGE_THREADS) is what the
    served engine's ONNX Runtime session runs, not its default of every core."""
    wait_until(lambda: metric(service, "kvforge_engine_threads") > 0, "the engine's metrics published")
    assert metric(service, "kvforge_engine_threads") == DECODE_THREADS


# ---------------------------------------------------------------- 9. access log, histograms

def test_one_request_id_from_the_front_to_the_engine_and_no_prompt_in_the_log(service):
    secret_prompt = "def confidential_function_name_zq9():"
    histograms = ("kvforge_time_to_first_token_seconds", "kvforge_inter_token_seconds",
                  "kvforge_queue_wait_seconds", "kvforge_request_seconds")
    counts = {name: metric(service, f"{name}_count") for name in histograms}  # the module's earlier requests
    status, headers, _ = request(service, "/v2/models/llm/generate", json.dumps(
        {"text_input": secret_prompt, "max_tokens": 5}).encode(), {"X-Request-ID": "probe-42"})
    assert status == 200 and headers["X-Request-ID"] == "probe-42"
    wait_until(lambda: sum(e.get("request_id") == "probe-42" for e in events(service)) == 2, "both log lines")
    front, engine = sorted((e for e in events(service) if e.get("request_id") == "probe-42"),
                           key=lambda e: e["source"], reverse=True)
    assert front["source"] == "front" and front["status"] == 200 and front["total_ms"] > 0
    assert engine["source"] == "engine" and engine["output_tokens"] == 5 and engine["finish_reason"] == "length"
    assert engine["prompt_tokens"] > 0 and engine["ttft_ms"] > 0
    assert "confidential_function_name_zq9" not in (service.log_dir / "kvforge.jsonl").read_text()
    assert len(LLMClient(service.grpc_url).generate(PROMPT, max_tokens=100).token_ids) == 100  # a stream
    # the metrics thread publishes after the responses: wait for this module's two requests to show
    wait_until(lambda: metric(service, "kvforge_request_seconds_count") >= counts["kvforge_request_seconds"] + 2,
               "both requests in the histograms")
    text = urllib.request.urlopen(service.metrics_url, timeout=10).read().decode()
    for name in histograms:  # each request observed at least once (inter-token times: once per token)
        count = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}_count{{"))
        everything = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(f"{name}_bucket{{") and 'le="+Inf"' in line)
        assert count >= counts[name] + 2 and everything == count, (name, count, everything)


# ---------------------------------------------------------------- 3. dead stub healed; kill -9 of the server

def stub_pids(server: TritonServer) -> list[int]:
    pid = server.tritonserver_pid()
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in children if STUB_NAME.startswith(Path(f"/proc/{p}/comm").read_text().strip())]


def llm_stub(server: TritonServer) -> int:
    for pid in stub_pids(server):
        if is_llm_stub(pid):
            return pid
    raise AssertionError("no llm stub")


def not_ready_everywhere(server: TritonServer) -> bool:
    return all(request(server, path)[0] == 503 for path in ("/v2/health/ready", "/v2/models/llm/ready"))


def reload_and_unload(server: TritonServer) -> None:
    """What the key holder may do without the supervisor calling it a death: reload `step` (its
    stub is replaced) and load, then unload, a model (its stub goes)."""
    key = {"kvforge-key": server.control_key}
    upload = json.dumps({"parameters": {
        "config": json.dumps({"backend": "python", "max_batch_size": 0,
                              "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                              "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]}),
        "file:1/model.py": base64.b64encode(b"class TritonPythonModel:\n    pass\n").decode()}}).encode()
    assert request(server, "/v2/repository/models/step/load", b"{}", key)[0] == 200
    assert request(server, "/v2/repository/models/transient/load", upload, key)[0] == 200
    assert request(server, "/v2/repository/models/transient/unload", b"{}", key)[0] == 200
    wait_until(lambda: request(server, "/v2/models/transient/ready")[0] != 200, "the model unloaded")


@pytest.mark.parametrize("victim", ["llm stub", "tritonserver", "hung tritonserver"])
def test_a_killed_backend_or_server_is_restarted_and_streams_end(service, victim):
    """A stub killed, the server killed, or the server hung (SIGSTOP: alive, answering nothing):
    one restart each, for that reason, and every open stream ends with an error."""
    restarts = sum(e.get("event") == "restart" for e in events(service))
    if victim == "llm stub":  # just before: a stub replaced and a stub gone on purpose
        reload_and_unload(service)
        wait_until(lambda: not any(b"transient" in Path(f"/proc/{p}/cmdline").read_bytes() for p in stub_pids(service)),
                   "the unloaded model's stub gone")
    streams = Streams(service, grpc=SLOTS // 2, http=SLOTS - SLOTS // 2)
    killed, pid = time.monotonic(), llm_stub(service) if victim == "llm stub" else service.tritonserver_pid()
    os.kill(pid, signal.SIGSTOP if victim.startswith("hung") else signal.SIGKILL)
    try:
        broken = wait_until(lambda: not_ready_everywhere(service), "readiness false")
        results = streams.join()
    finally:
        if victim.startswith("hung") and process_start(pid) is not None:
            os.kill(pid, signal.SIGCONT)  # the supervisor should have killed it; a failing run leaves none stopped
    ended = max(t for _, t in results) - killed
    ready = wait_until(service.ready, "ready again", every=0.05) + broken
    print(f"\n{victim}: not ready after {broken:.2f} s, streams ended after {ended:.2f} s, "
          f"ready again after {ready:.2f} s")
    assert len(results) == SLOTS and all(r not in ("finished", "left") for r, _ in results), results
    assert serves(service)
    new = [e for e in events(service) if e.get("event") == "restart"][restarts:]
    # a killed stub: the supervisor sees it gone, unless tritonserver notices first and aborts
    # itself (seen on a loaded machine: exit code -6 within the stub's grace time); either way
    # there is exactly one restart
    reasons = {"llm stub": {"stub_died", "server_exited"}, "tritonserver": {"server_exited"},
               "hung tritonserver": {"server_hung"}}[victim]
    # Exactly one, whatever the machine's speed: the restarted server was ready (it served above),
    # and a second restart would take it exiting, losing a stub, or failing three 2 s liveness
    # probes in a row (launcher/supervisor.py), i.e. a real fault, not a slow step.
    assert len(new) == 1 and new[0]["reason"] in reasons, new
    if new[0]["reason"] == "stub_died":
        # the supervisor judged the replaced and the unloaded stub, missing longer, no later than
        # the killed one: it named only the killed one
        assert re.fullmatch(r"stub\(s\) \['llm_\d+_\d+'\] gone", new[0]["detail"]), new[0]


@pytest.mark.parametrize("death", ["tritonserver killed, left unreaped", "launcher's process group killed"])
def test_stubs_exit_once_their_server_is_gone(repo, tmp_path, death):
    """No stub outlives its server, however it dies: as a zombie nobody reaps (the stub's own
    check still sees the pid), or with the launcher that started it (the server then gets its
    PDEATHSIG and the stubs are re-parented)."""
    from launcher.tritonserver import TritonProcess, server_env

    if death.startswith("tritonserver"):
        server = TritonProcess(repo, "127.0.0.1", *free_ports(3), "k" * 24, tmp_path / "triton.log", server_env())
        server.start(HANG_BOUND)
        server_pid = server.process.pid
    else:
        server = launch(repo, log_dir=tmp_path)
        server_pid = server.tritonserver_pid()
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    stubs = {int(p): process_start(int(p)) for p in children
             if STUB_NAME.encode() in Path(f"/proc/{p}/cmdline").read_bytes()}
    try:
        assert len(stubs) == 5, stubs  # llm, step, ensemble, tensorrt_llm_bls, vllm_model
        if death.startswith("tritonserver"):
            os.kill(server_pid, signal.SIGKILL)  # not waited for: it stays a zombie until stop() below
        else:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(HANG_BOUND)
        gone = wait_until(lambda: all(process_start(pid) != started for pid, started in stubs.items()),
                          "every stub exited")
        print(f"\n{death}: the stubs were gone after {gone:.2f} s")
    finally:
        server.stop()
        for pid, started in stubs.items():  # what a failing run leaves behind
            if process_start(pid) == started:
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- 9. deadline, drain; full disk

def test_sigterm_drains_readiness_first_and_in_flight_requests_finish(draining):
    server = draining  # ends here
    try:
        client, tokens = LLMClient(server.http_url, "http", timeout=HANG_BOUND), []
        for delta in client.stream(PROMPT, max_tokens=LONG, ignore_eos=True):
            if not tokens:
                server.process.send_signal(signal.SIGTERM)
                wait_until(lambda: not server.ready(), "readiness false while draining")
                status, _, text = generate(server)
                assert status == 503 and "shutting down" in json.loads(text)["error"]
            tokens += delta.token_ids
        assert len(tokens) == LONG  # the in-flight request finished
        assert server.process.wait(HANG_BOUND) == 0
    finally:
        server.stop()


def test_a_drain_past_its_bound_is_cut_off_and_leaves_no_process(repo, tmp_path):
    """SIGTERM while a request cannot finish (the llm stub stopped after its first token, as a hung
    engine would be): the launcher drains it for --drain-seconds, then stops anyway (Triton's own
    exit timeout ends the model), the stream ends without its end, and no process of the server is left."""
    server, stub = launch(repo, "--drain-seconds", "1", log_dir=tmp_path), None
    try:
        processes, stub = descendants(server.process.pid), llm_stub(server)
        connection = http.client.HTTPConnection(*server.http_url.split(":"), timeout=HANG_BOUND)
        connection.request("POST", "/v2/models/llm/generate_stream",
                           json.dumps({"text_input": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}))
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")  # in flight
        os.kill(stub, signal.SIGSTOP)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(HANG_BOUND) == 0
        try:
            rest = response.read()  # what was sent before the cut
        except http.client.IncompleteRead as e:
            rest = e.partial
        received = [json.loads(line[5:]) for line in rest.splitlines() if line.startswith(b"data:")]
        assert not any(e.get("finish_reason") for e in received), received[-1:]  # its end never came
        wait_until(lambda: all(process_start(pid) != started for pid, started in processes.items()),
                   "every process of the server gone, the stopped stub included")
    finally:
        if stub is not None and process_start(stub) is not None:
            os.kill(stub, signal.SIGCONT)  # a failing run leaves none stopped
        server.stop()


def test_a_full_log_disk_does_not_stop_serving(repo, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    logs = tmp_path / "logs"
    logs.mkdir()
    # a private mount namespace: a 256 KiB tmpfs over the log dir, filled before the server starts
    prefix = ["unshare", "-rm", "sh", "-c",
              f"mount -t tmpfs -o size=256k tmpfs {logs} && head -c 240k /dev/zero > {logs}/filler; exec \"$@\"",
              "sh"]
    # the launcher's own output stays outside (readable if this fails); Triton's and kvforge's logs go in
    server = launch(repo, "--log-dir", str(logs), log_dir=tmp_path / "launcher", prefix=prefix)
    try:
        assert serves(server)
        assert len(LLMClient(server.grpc_url).generate(PROMPT, max_tokens=50).token_ids) == 50
        assert not list(logs.iterdir()), "the tmpfs was visible outside its namespace"
    finally:
        server.stop()


# ---------------------------------------------------------------- 10. settings refused; nothing outlives a test run

def launcher_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVFORGE_")}, **extra}


def refusal(*args: str, env: dict[str, str] | None = None) -> str:
    """The one line `python -m launcher ARGS` refuses with (exit code 2, no traceback)."""
    result = subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, text=True, cwd=ROOT,
                            env=env or launcher_env(), timeout=HANG_BOUND)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_the_launcher_refuses_bad_settings_in_one_line_before_starting_anything(repo, tmp_path):
    secret = "hunter2-redis-password"
    logs = tmp_path / "logs"
    http, grpc, metrics, openai = free_ports(4)
    ports = ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    common = ["--repo", str(repo), *ports, "--log-dir", str(logs)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", grpc))
        busy.listen()
        assert f"port {grpc} on 127.0.0.1 (--grpc-port) is in use" in refusal(*common)
    assert "would be open to anyone" in refusal(*common, "--host", "0.0.0.0", "--openai-port", str(openai))
    for args, env, source in (
            (["--kv-redis-url", f"http://:{secret}@127.0.0.1:6379/0"], None, "--kv-redis-url must start with redis://"),
            (["--kv-redis-url", f"redis://:{secret}@/0"], None, "--kv-redis-url names no host"),
            ([], launcher_env(KVFORGE_KV_REDIS_URL=f"redis://:{secret}@127.0.0.1:99999/0"), "$KVFORGE_KV_REDIS_URL")):
        line = refusal(*common, *args, env=env)
        assert source in line and secret not in line, line
    assert not logs.exists()  # refused before anything was made, the log dir included
    (tmp_path / "a-file").write_text("")
    line = refusal(*common[:-1], str(tmp_path / "a-file" / "logs"))
    assert "--log-dir" in line and "cannot be created" in line
    assert not list(tmp_path.rglob("triton.log")) and not list(tmp_path.rglob("kvforge.jsonl"))


def test_the_control_key_file_is_private_made_once_and_refused_when_others_can_read_it(repo, tmp_path, monkeypatch):
    """Without $KVFORGE_CONTROL_KEY the key comes from --control-key-file (docs/deploying.md): made
    on first use, mode 0600 in a 0700 folder, the same key after; a file others can read, or one
    that holds no key, is refused in one line before anything starts."""
    import stat

    from kvforge.env import CONTROL_KEY
    from launcher.keys import control_key

    monkeypatch.delenv(CONTROL_KEY, raising=False)
    key_file = tmp_path / "config" / "kvforge" / "control.key"
    key, source = control_key(key_file)
    assert source == str(key_file) and re.fullmatch(r"[A-Za-z0-9_-]{16,}", key)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert control_key(key_file) == (key, source)
    monkeypatch.setenv(CONTROL_KEY, "from-the-environment-0123")  # the environment wins over the file
    assert control_key(key_file) == ("from-the-environment-0123", f"${CONTROL_KEY}")
    common = ["--repo", str(repo), *sum((["--" + f, str(p)] for f, p in zip(
        ("http-port", "grpc-port", "metrics-port"), free_ports(3))), []), "--control-key-file", str(key_file)]
    key_file.chmod(0o644)
    assert f"the control key file {key_file} is readable by others; chmod 600 it" in refusal(*common)
    key_file.chmod(0o600)
    key_file.write_text("short\n")
    assert "must be 16+ characters" in refusal(*common)


def test_a_redis_url_missing_its_at_sign_is_refused_without_repeating_the_password(repo):
    line = refusal("--repo", str(repo), *sum((["--" + f, str(p)] for f, p in zip(
        ("http-port", "grpc-port", "metrics-port"), free_ports(3))), []),
        env=launcher_env(KVFORGE_KV_REDIS_URL="redis://:hunter2-redis-password127.0.0.1:6379/0"))
    assert "hunter2" not in line, line


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from launcher.harness import TritonServer, free_ports
    from launcher.redis_server import RedisServer

    redis = RedisServer(free_ports(1)[0]).start()
    print(redis.process.pid, flush=True)
    # the "launcher" is a sleeper that prints its pid: start() waits for a readiness that never comes
    sleeper = [sys.executable, "-c", "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"]
    TritonServer(Path(sys.argv[1]), http_port=free_ports(1)[0], log_dir=Path(sys.argv[2]), ready_timeout=600,
                 launcher_prefix=sleeper).start()
""")


def test_servers_a_killed_test_run_started_die_with_it(repo, tmp_path):
    """RedisServer and TritonServer (launcher/harness.py) children get SIGKILL when the process
    that started them dies, so a test run killed mid-way leaves neither a redis-server nor a
    launcher (whose tritonserver dies with it in turn) behind."""
    # the stand-in test run dies with this one too (its servers then die with it)
    child = subprocess.Popen(dying_with_parent([sys.executable, "-c", CHILD, str(repo), str(tmp_path)]), cwd=ROOT,
                             text=True, stdout=subprocess.PIPE)
    try:
        redis_pid = int(child.stdout.readline())
        wait_until(lambda: "pid " in (tmp_path / "launcher.log").read_text()
                   if (tmp_path / "launcher.log").exists() else False, "the stand-in launcher")
        launcher_pid = int((tmp_path / "launcher.log").read_text().split("pid ")[1].split()[0])
        started = {pid: process_start(pid) for pid in (redis_pid, launcher_pid)}
        assert all(started.values())
    finally:
        child.kill()
        child.wait(HANG_BOUND)
    wait_until(lambda: all(process_start(pid) != when for pid, when in started.items()), "both died with it")
