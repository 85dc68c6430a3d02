"""The KV-aware router (frontend/router/) in front of two real replicas (launchers), as a child
process, with each routing policy; a fake replica (a small HTTP server) where a failure must
happen on cue; and `make fleet`'s command run whole (its replicas on the fixed ports 8010.. and
the router on 8080, which must be free).

Which replica served a request is read from the router's /metrics (requests per replica), cached
tokens from the responses: nothing here depends on timing but generous polling bounds.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, SERVING_CONTEXT

WORDS = ("alpha beta gamma delta import return yield lambda class def self value items print range "
         "open close read write list dict tuple set frozen bytes string number error raise").split()
KEY = "router-test-control-key-0123456789"
WAIT = 60.0  # generous bound for anything polled


def text(seed: int, words: int = 400) -> str:
    """A prompt of its own: with 400 words, dozens of 16-token blocks."""
    rng = random.Random(seed)
    return f"{seed} " + " ".join(rng.choice(WORDS) for _ in range(words))


def until(condition, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def full_blocks(repo: Path, prompt: str) -> int:
    """The tokens of the prompt's full blocks but its last token's: what a repeat of it hits."""
    from engines.repository import engine_dir_of
    from kvforge.manifest import Manifest
    from runtime.tokenizer import Tokenizer

    engine = engine_dir_of(repo, "llm")
    return (len(Tokenizer(engine, Manifest.load(engine)).encode(prompt)) - 1) // 16 * 16


def namespace_of(repo: Path) -> str:
    from engines.repository import engine_dir_of
    from kvforge.manifest import Manifest, cache_namespace

    return cache_namespace(Manifest.load(engine_dir_of(repo, "llm"))).hex()


def replica_spec(server) -> str:
    host = server.host
    return f"http://{server.http_url},http://{host}:{server.openai_port},http://{host}:{server.metrics_port}"


def run_router(repo: Path, specs: list[str], port: int, log: Path, policy: str) -> subprocess.Popen:
    from launcher.harness import dying_with_parent

    command = [sys.executable, "-m", "frontend.router", "--repo", str(repo), "--port", str(port),
               "--policy", policy, *[a for spec in specs for a in ("--replica", spec)]]
    with open(log, "ab") as out:  # a killed test run takes the router with it
        return subprocess.Popen(dying_with_parent(command), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def router_over(repo: Path, specs: list[str], tmp: Path, policy: str = "kv"):
    """The router as a child process on a free port, serving once it answers /health."""
    from launcher.tritonserver import free_ports

    port = free_ports(1)[0]
    log = tmp / f"router-{port}.log"
    process = run_router(repo, specs, port, log, policy)
    url = f"http://127.0.0.1:{port}"

    def answers():
        assert process.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

    try:
        until(answers, "the router answers /health")
        yield url
    finally:
        process.terminate()
        process.wait(60)


@pytest.fixture(scope="module")
def repo(exports, tmp_path_factory):
    from engines.repository import write_repository

    repo = tmp_path_factory.mktemp("router_repository")
    write_repository(exports(max_seq_len=SERVING_CONTEXT), repo, slots=4)
    return repo


@pytest.fixture(scope="module")
def replicas(repo):
    from launcher.harness import TritonServer, free_ports

    ports = free_ports(8)  # in one call: all different
    servers = [TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai,
                            control_key=KEY)
               for http, grpc, metrics, openai in (ports[:4], ports[4:])]
    try:
        for server in servers:  # from this thread: a replica dies with the thread that started it
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(repo, replicas, tmp_path_factory):
    with router_over(repo, [replica_spec(s) for s in replicas], tmp_path_factory.mktemp("router")) as url:
        yield url


def metrics(url: str) -> dict[str, float]:
    """The router's samples: 'name{labels}' -> value."""
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def per_replica(samples: dict[str, float], name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for key, value in samples.items():
        found = re.fullmatch(rf'{name}\{{replica="(\d+)"[^}}]*\}}', key)
        if found:
            totals[found.group(1)] = totals.get(found.group(1), 0) + value
    return totals


def delta(before: dict, after: dict, name: str) -> dict[str, float]:
    b, a = per_replica(before, name), per_replica(after, name)
    return {r: a[r] - b.get(r, 0) for r in a if a[r] != b.get(r, 0)}


def idle(url: str) -> None:
    """Both replicas' load back to 0 as the router sees it (so only the prefix decides)."""
    until(lambda: all(v == 0 for v in per_replica(metrics(url), "kvforge_router_replica_load").values()),
          "every replica idle")


def generate(url: str, prompt: str, session: str | None = None, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/llm/generate", json={"text_input": prompt, "max_tokens": 2, **fields},
                      headers={"X-Session-ID": session} if session else {}, timeout=WAIT)


def served_by(url: str, send) -> str:
    """The replica that served send()'s one request (from the router's request counts)."""
    idle(url)
    before = metrics(url)
    response = send()
    assert response.status_code == 200, response.text
    (replica,) = delta(before, metrics(url), "kvforge_router_requests_total")
    return replica


def test_a_repeated_prompt_goes_back_to_the_replica_that_cached_it(repo, router):
    prompt = text(1)
    idle(router)
    first = generate(router, prompt)
    idle(router)
    before = metrics(router)
    second = generate(router, prompt)
    after = metrics(router)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    cached = second.json()["cached_tokens"]
    assert cached == full_blocks(repo, prompt) and first.json()["cached_tokens"] == 0
    served_by = delta(before, after, "kvforge_router_requests_total")
    assert len(served_by) == 1
    (replica,) = served_by
    assert delta(before, after, "kvforge_router_predicted_cached_tokens_total") == {replica: cached}
    assert delta(before, after, "kvforge_router_cached_tokens_total") == {replica: cached}

    # the OpenAI API: a chat, through the chat template, streamed with its usage
    chat = {"model": "llm", "messages": [{"role": "user", "content": text(2)}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    usages, prompt_tokens = [], []
    for _ in range(2):
        idle(router)
        with httpx.stream("POST", f"{router}/v1/chat/completions", json=chat, timeout=WAIT) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        usages.append(usage["prompt_tokens_details"]["cached_tokens"])
        prompt_tokens.append(usage["prompt_tokens"])
    assert usages == [0, (prompt_tokens[1] - 1) // 16 * 16] and prompt_tokens[0] == prompt_tokens[1]


def test_round_robin_takes_the_replicas_in_turn_whatever_they_cache(repo, replicas, tmp_path):
    prompt = text(11)
    with router_over(repo, [replica_spec(s) for s in replicas], tmp_path, policy="round-robin") as url:
        order = [served_by(url, lambda: generate(url, prompt)) for _ in range(4)]
    assert order in (["1", "2", "1", "2"], ["2", "1", "2", "1"]), order


def test_affinity_keeps_a_session_on_one_replica_and_falls_back_to_kv_without_one(repo, replicas, tmp_path):
    with router_over(repo, [replica_spec(s) for s in replicas], tmp_path, policy="affinity") as url:
        homes = {}
        for i in range(8):  # every request of a session on one replica, whatever its prompt
            session = f"session-{i}"
            served = {served_by(url, lambda: generate(url, text(20 + 2 * i + k, words=40), session)) for k in range(2)}
            assert len(served) == 1, (session, served)
            homes[session] = served.pop()
        assert set(homes.values()) == {"1", "2"}, homes  # the sessions' hashes cover both replicas
        # the OpenAI API's `user` names the session when the header does not
        chat = {"model": "llm", "messages": [{"role": "user", "content": text(40, words=40)}], "max_tokens": 2,
                "user": "session-0"}
        assert served_by(url, lambda: httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=WAIT)) == \
            homes["session-0"]
        # no session: the prefix decides (kv); a session homed elsewhere wins over the cached prefix
        cached_on = homes["session-0"]
        elsewhere = next(s for s, home in homes.items() if home != cached_on)
        prompt = text(41)
        assert served_by(url, lambda: generate(url, prompt, "session-0")) == cached_on
        assert served_by(url, lambda: generate(url, prompt)) == cached_on
        assert served_by(url, lambda: generate(url, prompt, elsewhere)) != cached_on


@pytest.mark.parametrize("flags, expected", [
    (["--policy", "random"], "error: --policy must be one of kv, round-robin, affinity, got 'random'"),
    (["--host", "0.0.0.0"], "error: the router on 0.0.0.0 would be open to anyone: set $KVFORGE_OPENAI_API_KEY "
                            "(clients send it as a bearer token) or bind 127.0.0.1"),
    (["--port", "{busy}"], "error: port {busy} on 127.0.0.1 (--port) is in use (another server?); choose another"),
])
def test_bad_router_settings_are_refused_at_start_with_one_line(repo, flags, expected):
    from kvforge import env

    with socket.socket() as busy:  # a port someone else listens on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        environment = {k: v for k, v in os.environ.items() if k != env.OPENAI_API_KEY}
        result = subprocess.run([sys.executable, "-m", "frontend.router", "--repo", str(repo),
                                 *[f.format(busy=port) for f in flags],
                                 "--replica", "http://127.0.0.1:1,http://127.0.0.1:1,http://127.0.0.1:1"],
                                cwd=ROOT, capture_output=True, text=True, timeout=WAIT, env=environment)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == expected.format(busy=port)


@pytest.mark.parametrize("flags, expected", [
    (["--spin-us", "99999"], "error: --spin-us must be in 0..10000, got 99999"),
    (["--prefill-budget", "0"], "error: --prefill-budget must be in 2..8192, got 0"),
    (["--http-port", "8000"], "error: --http-port is set per replica by the fleet"),
])
def test_the_fleet_checks_the_engine_flags_it_passes_to_every_replica(tmp_path, flags, expected):
    """`make fleet SPIN_US=...` (any of KV_FLAGS): a launcher flag reaches every replica, and a bad one is
    refused in one line before anything starts."""
    from launcher import __main__ as launcher_cli, fleet

    args = fleet.parse_args(["--replicas", "2", "--repo", str(tmp_path), "--spin-us", "0", "--scheduler", "alternate"])
    replica = launcher_cli.parse_args(fleet.launcher_flags(args, 2))
    assert (replica.spin_us, replica.scheduler) == (0, "alternate")
    result = subprocess.run([sys.executable, "-m", "launcher.fleet", "--replicas", "1", "--repo", str(tmp_path),
                             "--log-dir", str(tmp_path / "logs"), *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=WAIT)
    assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


FLEET_KV_HOST_BYTES = 100_000_001  # the RAM pools' total: 50,000,000 bytes each (the odd byte: split by floor)
FLEET_START = 300.0  # a bound for the fleet's replicas to start one after another, or for its stop


def listening(port: int) -> bool:
    """Whether anything accepts connections on 127.0.0.1:port (what a client sees, not a bind test)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def test_make_fleet_gives_each_replica_its_ports_and_share_and_stops_the_router_first(repo, tmp_path):
    """`make fleet REPLICAS=2` at run time (its command: launcher.fleet with the Makefile's flags, a
    total RAM pool and a disk tier to split): replica i serves on the default ports + 10*i with
    cores/2 ONNX Runtime threads, half the pool, its own logs and disk folder, behind the router on
    8080. SIGTERM stops the router first: it stops listening while both replicas still serve and
    lets its in-flight request finish; then the replicas stop, and no process of the fleet is left."""
    from frontend.router.__main__ import DEFAULT_PORT
    from frontend.router.replicas import metric
    from kvforge import env
    from kvforge.engine_config import variable
    from launcher.fleet import replica_ports
    from launcher.harness import dying_with_parent
    from tests.processes import descendants, is_llm_stub, process_start

    logs, disk, output = tmp_path / "logs", tmp_path / "disk", tmp_path / "fleet.log"
    environment = {k: v for k, v in os.environ.items() if k != variable("threads")}  # the fleet splits the cores
    environment[env.CONTROL_KEY] = KEY  # not the user's key file
    command = [sys.executable, "-m", "launcher.fleet", "--replicas", "2", "--repo", str(repo), "--host", "127.0.0.1",
               "--router-port", str(DEFAULT_PORT), "--policy", "kv", "--log-dir", str(logs), "--prefix-cache", "on",
               "--kv-host-bytes", str(FLEET_KV_HOST_BYTES), "--kv-disk-dir", str(disk)]
    with open(output, "wb") as out:  # a killed test run takes the fleet with it, and the fleet its replicas
        fleet = subprocess.Popen(dying_with_parent(command), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env=environment)
    router, stubs = f"http://127.0.0.1:{DEFAULT_PORT}", []

    def serving() -> bool:
        assert fleet.poll() is None, output.read_text()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{router}/health", timeout=2).json() == {"ready_replicas": [1, 2]}

    def replica_ready(i: int) -> bool:
        return httpx.get(f"http://127.0.0.1:{replica_ports(i)['http_port']}/v2/health/ready").status_code == 200

    def replica_metric(i: int, name: str) -> float:
        return metric(httpx.get(f"http://127.0.0.1:{replica_ports(i)['metrics_port']}/metrics").text, name)

    try:
        until(serving, "the router serving both replicas", FLEET_START)
        threads = max(1, (os.cpu_count() or 1) // 2)
        for i in (1, 2):
            ports = replica_ports(i)
            assert ports == dict(http_port=8000 + 10 * i, grpc_port=8001 + 10 * i, metrics_port=8002 + 10 * i,
                                 openai_port=9000 + 10 * i)
            assert replica_ready(i) and listening(ports["grpc_port"])
            assert httpx.get(f"http://127.0.0.1:{ports['openai_port']}/v1/models").json()["data"][0]["id"] == "llm"
            until(lambda: replica_metric(i, "kvforge_engine_threads") > 0, f"replica {i}'s metrics published")
            assert replica_metric(i, "kvforge_engine_threads") == threads
            assert replica_metric(i, "kvforge_kv_host_pool_budget_bytes") == FLEET_KV_HOST_BYTES // 2
            assert (logs / f"replica-{i}" / "triton.log").is_file() and (disk / f"replica-{i}").is_dir()
            assert f'replica="{i}",url="http://127.0.0.1:{ports["http_port"]}"' in httpx.get(f"{router}/metrics").text
        assert generate(router, text(60, words=20)).status_code == 200

        # the stop, with a request open on a replica that cannot answer it yet (both llm stubs
        # stopped, as hung engines would be)
        processes = descendants(fleet.pid)
        stubs = [pid for pid in processes if is_llm_stub(pid)]
        assert len(stubs) == 2, processes
        for pid in stubs:
            os.kill(pid, signal.SIGSTOP)
        held = {}
        sender = threading.Thread(target=lambda: held.update(response=generate(router, text(61, words=20))))
        sender.start()
        until(lambda: sum(per_replica(metrics(router), "kvforge_router_replica_load").values()) == 1,
              "the request open on a replica")
        fleet.send_signal(signal.SIGTERM)
        until(lambda: not listening(DEFAULT_PORT), "the router to stop listening")
        # The router now waits for its open request (its drain: up to 30 s), and the fleet stops
        # the replicas only after it: they serve (a draining replica's readiness is 503).
        assert replica_ready(1) and replica_ready(2)
        for pid in stubs:
            os.kill(pid, signal.SIGCONT)
        sender.join(WAIT)
        assert "response" in held, "the held request failed (its thread printed why)"
        assert held["response"].status_code == 200, held["response"].text  # it finished first
        assert len(held["response"].json()["output_ids"]) == 2
        assert fleet.wait(FLEET_START) == 0, output.read_text()[-3000:]  # a requested stop, as a launcher's
        until(lambda: all(process_start(pid) != started for pid, started in processes.items()),
              "every process of the fleet gone")
    finally:
        for pid in stubs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()


def test_prompts_without_a_shared_prefix_spread_over_both_replicas(router):
    """Equal load, nothing cached: each request goes to the replica routed to least so far (the
    lower number on a tie), so the counts even out whatever the module's earlier tests sent."""
    for seed in range(100, 106):
        totals = per_replica(metrics(router), "kvforge_router_requests_total")
        least = min(("1", "2"), key=lambda r: (totals.get(r, 0), r))
        assert served_by(router, lambda: generate(router, text(seed, words=40))) == least, (seed, totals)


def test_a_turns_answer_is_indexed_for_the_next_turn(router):
    """The next turn resends prompt + answer: the router predicts the answer's blocks cached too,
    as many as the replica reports (token ids, so no retokenization blurs the count)."""
    rng = random.Random(9)
    first = [rng.randrange(3, 200) for _ in range(100)]  # 6 full blocks and 4 tokens
    idle(router)
    answer = httpx.post(f"{router}/v2/models/llm/generate", timeout=WAIT,
                        json={"input_ids": first, "input_lengths": len(first), "request_output_len": 40})
    assert answer.status_code == 200, answer.text
    output = answer.json()["output_ids"]
    assert len(output) == 40
    following = first + output + [rng.randrange(3, 200) for _ in range(20)]
    idle(router)
    before = metrics(router)
    second = httpx.post(f"{router}/v2/models/llm/generate", timeout=WAIT,
                        json={"input_ids": following, "input_lengths": len(following), "request_output_len": 2})
    after = metrics(router)
    assert second.status_code == 200, second.text
    # the engine holds the KV of 100 + 39 tokens (the last answer token was never fed back): 8 blocks
    assert second.json()["cached_tokens"] == 8 * 16
    (replica,) = delta(before, after, "kvforge_router_requests_total")
    assert delta(before, after, "kvforge_router_predicted_cached_tokens_total") == {replica: 8 * 16}


def test_another_cache_salt_gets_no_predicted_hit(router):
    prompt = text(3)
    idle(router)
    assert generate(router, prompt).status_code == 200
    for salt, hit in (("tenant-b", False), ("tenant-b", True)):  # isolated from the unsalted run, then its own hit
        idle(router)
        before = metrics(router)
        response = generate(router, prompt, cache_salt=salt)
        after = metrics(router)
        assert response.status_code == 200
        predicted = sum(delta(before, after, "kvforge_router_predicted_cached_tokens_total").values())
        assert (predicted > 0) == hit and (response.json()["cached_tokens"] > 0) == hit, (salt, predicted)


def test_stop_goes_to_the_replica_serving_that_request(router):
    # Not pinned (a real replica's engine): the stop is sent the moment the first event arrives and
    # the stream has the whole context (~2000 tokens: seconds of decoding, more on a slower machine)
    # to go, against one HTTP round trip through the router.
    most = SERVING_CONTEXT - 64  # the 20-word prompt is well under 64 tokens
    body = {"text_input": text(4, words=20), "max_tokens": most, "ignore_eos": True, "stream": True}
    stop = {"input_ids": [0], "input_lengths": 0, "request_output_len": 0, "stop": True}
    idle(router)
    before_stream = metrics(router)
    with httpx.stream("POST", f"{router}/v2/models/llm/generate_stream", json=body,
                      headers={"X-Request-ID": "long-one"}, timeout=WAIT) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # it is live on its replica now
        before = metrics(router)
        # counted when the replica answered, before its first event reached us (the load gauge also
        # follows the replicas' polled metrics, so it is not read here)
        serving = set(delta(before_stream, before, "kvforge_router_requests_total"))
        answer = httpx.post(f"{router}/v2/models/llm/generate_stream", json=stop,
                            headers={"X-Request-ID": "long-one"}, timeout=WAIT)
        after = metrics(router)
        # the replica matched the stop by the request's X-Request-ID: the stream ends, short of its max_tokens
        events = [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]
    assert answer.status_code == 200
    stopped_on = set(delta(before, after, "kvforge_router_requests_total"))
    assert stopped_on == serving and len(serving) == 1
    assert events and events[-1]["finish_reason"] == "cancelled" and len(events) < most


def test_clear_prefix_cache_fans_out_to_every_replica(router):
    prompt = text(5)
    idle(router)
    assert generate(router, prompt).status_code == 200
    clear = {"text_input": "", "max_tokens": 1, "clear_prefix_cache": True}
    refused = httpx.post(f"{router}/v2/models/llm/generate", json={**clear, "control_key": "wrong"})
    assert refused.status_code == 400 and set(refused.json()["replicas"]) == {"1", "2"}
    cleared = httpx.post(f"{router}/v2/models/llm/generate", json={**clear, "control_key": KEY})
    assert cleared.status_code == 200, cleared.text
    answers = cleared.json()["replicas"]
    assert set(answers) == {"1", "2"} and all("cleared" in a["response"]["text_output"] for a in answers.values())
    assert set(per_replica(metrics(router), "kvforge_router_index_blocks").values()) == {0}
    idle(router)
    again = generate(router, prompt)
    assert again.status_code == 200 and again.json()["cached_tokens"] == 0


def test_control_and_metadata_apis_are_not_forwarded(router):
    for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/llm/unload"),
                         ("GET", "/v2/logging"), ("GET", "/v2/models/llm/config"), ("GET", "/v2/models/stats")):
        response = httpx.request(method, f"{router}{path}", headers={"kvforge-key": KEY})
        assert response.status_code == 404 and "not forwarded" in response.json()["error"], path


# ---------------------------------------------------------------------- a fake replica

class FakeReplica(ThreadingHTTPServer):
    """Answers the router's checks like a replica; its generate answers are set by `mode`:
    "refuse" (503), "drop" (closes the connection unanswered), "break" (one event, then gone)."""

    daemon_threads = True

    def __init__(self, namespace: str):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.namespace, self.mode, self.ready = namespace, "refuse", True
        self.polls = 0  # readiness questions answered: the router's polls, counted rather than timed
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def spec(self) -> str:
        url = f"http://127.0.0.1:{self.server_address[1]}"
        return f"{url},{url},{url}"


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        fake = self.server
        if self.path == "/v2/models/llm/config":
            self.answer(200, json.dumps({"parameters": {"cache_namespace": {"string_value": fake.namespace}}}).encode())
        elif self.path == "/v2/health/ready":
            fake.polls += 1
            self.answer(200 if fake.ready else 503, b"{}")
        elif self.path == "/metrics":
            self.answer(200, b"kvforge_kv_host_pool_budget_bytes 1000000\nkvforge_running_sequences 0\n"
                             b"kvforge_waiting_sequences 0\n", "text/plain")
        else:
            self.answer(200, b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = self.server.mode
        if mode == "refuse":
            self.answer(503, b'{"error": "UNAVAILABLE: the fake replica is full"}')
        elif mode == "drop":
            self.close_connection = True
            self.connection.close()
        else:  # "break": the first event, then the connection goes mid-body
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b'data: {"text_output": "x", "cached_tokens": 0}\n\n'
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
            self.close_connection = True
            self.connection.close()


@pytest.fixture
def fake(repo):
    server = FakeReplica(namespace_of(repo))
    yield server
    server.shutdown()
    server.server_close()


def test_a_request_failing_before_its_first_token_is_retried_on_another_replica(repo, replicas, fake, tmp_path):
    # the fake is replica 1: it wins every tie, so each request tries it first
    with router_over(repo, [fake.spec, replica_spec(replicas[0])], tmp_path) as url:
        for mode, path, body in (
                ("refuse", "/v2/models/llm/generate", {"text_input": text(6, words=20), "max_tokens": 2}),
                ("drop", "/v2/models/llm/generate", {"text_input": text(7, words=20), "max_tokens": 2}),
                ("refuse", "/v1/completions", {"model": "llm", "prompt": text(8, words=20), "max_tokens": 2})):
            fake.mode = mode
            # a dropped connection takes the fake out of the rotation until its next poll
            until(lambda: per_replica(metrics(url), "kvforge_router_replica_ready") == {"1": 1, "2": 1},
                  "the fake back in the rotation")
            idle(url)
            before = metrics(url)
            response = httpx.post(f"{url}{path}", json=body, timeout=WAIT)
            after = metrics(url)
            assert response.status_code == 200, (mode, path, response.text)
            assert after["kvforge_router_retries_total"] == before["kvforge_router_retries_total"] + 1, mode
            assert delta(before, after, "kvforge_router_failed_attempts_total") == {"1": 1}, mode
            assert delta(before, after, "kvforge_router_requests_total") == {"2": 1}, mode


def test_affinity_falls_back_when_the_sessions_replica_is_not_ready(repo, replicas, fake, tmp_path):
    from frontend.router.policies import session_home

    session = next(f"session-{i}" for i in range(100) if session_home(f"session-{i}", 2) == 0)  # the fake's
    with router_over(repo, [fake.spec, replica_spec(replicas[0])], tmp_path, policy="affinity") as url:
        idle(url)
        before = metrics(url)
        assert generate(url, text(50, words=20), session).status_code == 200  # the fake refused it first
        after = metrics(url)
        assert delta(before, after, "kvforge_router_failed_attempts_total") == {"1": 1}
        fake.ready = False
        until(lambda: per_replica(metrics(url), "kvforge_router_replica_ready") == {"1": 0, "2": 1},
              "the fake out of the rotation")
        before = metrics(url)
        assert generate(url, text(51, words=20), session).status_code == 200
        after = metrics(url)
        assert delta(before, after, "kvforge_router_failed_attempts_total") == {}
        assert delta(before, after, "kvforge_router_requests_total") == {"2": 1}


def test_a_replica_back_with_another_cache_namespace_stays_out_until_it_serves_ours(repo, replicas, fake, tmp_path):
    """A replica that leaves and comes back ready is verified again (docs/fleet.md: it may have been
    redeployed with another model): serving another cache namespace it stays out of the rotation,
    logged once however often it is polled, and rejoins once it serves the repository's again."""
    with router_over(repo, [fake.spec, replica_spec(replicas[0])], tmp_path) as url:
        (log,) = tmp_path.glob("router-*.log")
        fake.ready = False
        until(lambda: per_replica(metrics(url), "kvforge_router_replica_ready") == {"1": 0, "2": 1},
              "the fake out of the rotation")
        fake.namespace, fake.ready = "0" * 64, True  # back, as another model
        replica_1 = f"replica 1 ({fake.spec.split(',')[0]})"
        refusal = f"{replica_1} serves cache namespace 0000000000000000..."
        until(lambda: refusal in log.read_text(), "the refusal logged")
        polls = fake.polls
        until(lambda: fake.polls >= polls + 3, "three more polls of the refused replica")
        assert log.read_text().count(refusal) == 1, log.read_text()
        assert per_replica(metrics(url), "kvforge_router_replica_ready") == {"1": 0, "2": 1}
        before = metrics(url)
        assert generate(url, text(52, words=20)).status_code == 200  # the fake would refuse it: never asked
        assert delta(before, metrics(url), "kvforge_router_requests_total") == {"2": 1}

        fake.namespace = namespace_of(repo)  # redeployed with this repository's model again
        until(lambda: per_replica(metrics(url), "kvforge_router_replica_ready") == {"1": 1, "2": 1},
              "the fake back in the rotation")
        assert f"{replica_1} is ready: back in the rotation" in log.read_text()


def test_a_stream_broken_after_its_first_token_ends_with_an_error_event(repo, fake, tmp_path):
    fake.mode = "break"
    with router_over(repo, [fake.spec], tmp_path) as url:
        with httpx.stream("POST", f"{url}/v2/models/llm/generate_stream",
                          json={"text_input": "x", "max_tokens": 8}, timeout=WAIT) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[0]["text_output"] == "x"
        assert "ended the stream early" in events[-1]["error"]
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": "llm", "prompt": "x", "stream": True},
                          timeout=WAIT) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "ended the stream early" in json.loads(events[-2])["error"]["message"]
        assert metrics(url)["kvforge_router_stream_errors_total"] == 2

        fake.ready = False  # no replica ready: the router is not ready either, and says so
        until(lambda: httpx.get(f"{url}/health").status_code == 503, "the router's readiness turns 503")
        refused = generate(url, "x")
        assert refused.status_code == 503 and "no replica is ready" in refused.json()["error"]


@pytest.mark.parametrize("spec, expected", [
    ("127.0.0.1:8000", "must be three URLs"),
    ("http://127.0.0.1:{free},http://127.0.0.1:{free},http://127.0.0.1:{free}", "does not answer"),
    ("{wrong}", "serves cache namespace"),
])
def test_bad_replicas_are_refused_at_start_with_one_line(repo, tmp_path, spec, expected):
    from launcher.tritonserver import free_ports

    wrong = FakeReplica("0" * 64)
    try:
        spec = spec.format(free=free_ports(1)[0], wrong=wrong.spec)
        result = subprocess.run([sys.executable, "-m", "frontend.router", "--repo", str(repo),
                                 "--port", str(free_ports(1)[0]), "--replica", spec],
                                cwd=ROOT, capture_output=True, text=True, timeout=WAIT)
    finally:
        wrong.shutdown()
        wrong.server_close()
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_replica_failing_readiness_leaves_the_rotation_and_comes_back(router, replicas):
    """Replica 2 stops, then starts again (on its ports, an empty pool): back in the rotation, so
    the module's other tests find both, whatever the order."""
    replicas[1].stop()
    try:
        # at once (before a poll may have noticed): the retry covers it
        for seed in range(200, 204):
            response = generate(router, text(seed, words=20))
            assert response.status_code == 200, response.text
        until(lambda: per_replica(metrics(router), "kvforge_router_replica_ready") == {"1": 1, "2": 0},
              "replica 2 out of the rotation")
        before = metrics(router)
        for seed in range(300, 304):
            assert generate(router, text(seed, words=20)).status_code == 200
        assert delta(before, metrics(router), "kvforge_router_requests_total") == {"1": 4}
        assert httpx.get(f"{router}/health").json() == {"ready_replicas": [1]}
    finally:
        replicas[1].start()
    until(lambda: httpx.get(f"{router}/health").json() == {"ready_replicas": [1, 2]}, "replica 2 back")
