"""Section fleet: replicas behind the router, per routing policy (issue 22).

`replicas` launchers of the section's model on this host (1 ONNX Runtime thread each: the cores
are shared, as `make fleet` shares them), all on one shared Redis tier, behind the router
(`python -m frontend.router`, started for each run with its --policy). Two workloads, streamed
through the router's /v2 generate_stream:

- multi-turn chat: `conversations` conversations x `turns` turns, each turn resending the history
  (the previous answers as text) plus new user text, one X-Session-ID per conversation;
  `concurrency` clients take the conversations' next turns in rotation (arrivals interleaved);
- shared documents: `documents` documents x `questions` questions, question 1 of every document,
  then question 2 ..., each question its own session.

Per policy (round-robin, affinity, kv): prompt tokens served from RAM / loaded from Redis /
computed, summed from the replicas' metrics (and the computed ones per replica: the load
balance), TTFT p50/p99, throughput. Then the multi-turn workload on one replica alone (the
hit-rate target's reference), the kv router with one replica SIGKILLed mid-run (requests lost
before / after their first token, the hit rate the rest keeps), and every policy again with a
3-primary Redis Cluster instead of one Redis. Each run starts cold: the RAM pools are cleared
through the router and Redis is flushed. The same texts every run, so policies see one workload.

Time budget: 15 minutes (two fleets of 3 small-llama replicas started, 15 runs: 10 minutes on the
2 cores here at load average 5); --quick (2 replicas of the small trained model, 3 conversations x
2 turns, one 128-token document): 3 minutes (70 s here).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import ROOT, finish_figure, rendered, run_module, say, section_ran, skipped, table, target
from bench.prefix_cache import Texts, section_engine

POLICIES = ("round-robin", "affinity", "kv")  # frontend/router/policies.py's, the baselines first
TIERS = {"redis": "one Redis", "redis_cluster": "Redis Cluster"}
CONTROL_KEY = "bench-fleet-control-key-0123456789"
START_TIMEOUT = 300.0  # a replica loading small-llama on shared cores
REQUEST_TIMEOUT = 600.0


@dataclass(frozen=True)
class Shape:
    replicas: int
    conversations: int
    turns: int
    user_tokens: int  # new user text per turn
    answer_tokens: int
    documents: int
    document_tokens: int
    questions: int
    question_tokens: int
    concurrency: int
    kill_after: int  # multi-turn requests completed before a replica is killed
    host_bytes: int  # each replica's RAM pool: the whole workload fits, so only routing decides a RAM hit


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(replicas=2, conversations=3, turns=2, user_tokens=32, answer_tokens=4, documents=1,
                     document_tokens=128, questions=2, question_tokens=16, concurrency=2, kill_after=2,
                     host_bytes=64 << 20)
    return Shape(replicas=3, conversations=12, turns=5, user_tokens=96, answer_tokens=16, documents=4,
                 document_tokens=1024, questions=6, question_tokens=32, concurrency=3, kill_after=30,
                 host_bytes=512 << 20)


@dataclass
class Conversation:
    """A session's turns: each sends the history so far plus its user text (a document's question:
    one turn)."""

    session: str
    user_texts: list[str]
    history: str = ""
    turn: int = 0


def multi_turn_workload(texts: Texts, s: Shape) -> list[list[str]]:
    return [[texts.take(s.user_tokens) for _ in range(s.turns)] for _ in range(s.conversations)]


def document_workload(texts: Texts, s: Shape) -> list[list[str]]:
    documents = [texts.take(s.document_tokens) for _ in range(s.documents)]
    return [[documents[d] + "\n# question: " + texts.take(s.question_tokens)]
            for _ in range(s.questions) for d in range(s.documents)]  # question 1 of every document, then 2 ...


# ---------------------------------------------------------------- the fleet

@contextlib.contextmanager
def environment(name: str, value: str):
    """os.environ[name] = value while the block runs (the replicas inherit it as they start)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class Fleet:
    """`count` launchers on free ports sharing the Redis tier at `redis_url`, 1 thread each."""

    def __init__(self, repo: Path, count: int, redis_url: str, host_bytes: int, logs: Path):
        from launcher.harness import TritonServer, free_ports

        self.servers, ports = [], free_ports(4 * count)  # in one call: all different
        for i in range(count):
            http, grpc, metrics, openai = ports[4 * i:4 * i + 4]
            self.servers.append(TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                                             openai_port=openai, control_key=CONTROL_KEY,
                                             ready_timeout=START_TIMEOUT, log_dir=logs / f"replica-{i + 1}",
                                             extra_args=["--kv-redis-url", redis_url,
                                                         "--kv-host-bytes", str(host_bytes)]))
        self.repo, self.logs = repo, logs

    def start(self) -> "Fleet":
        from kvforge.engine_config import variable

        with environment(variable("threads"), "1"):
            for i, server in enumerate(self.servers, 1):  # from this thread: a replica dies with its starter
                say(f"fleet: starting replica {i}/{len(self.servers)}")
                server.start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def live(self) -> list:
        return [s for s in self.servers if s.process is not None and s.process.poll() is None]

    def kill(self, server) -> None:
        """SIGKILL a replica's launcher and its tritonserver: a crash, not a drain."""
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()

    def counters(self, servers: list | None = None) -> dict[int, dict]:
        """The prefix-cache counters of `servers` (default: all) that are alive (replica number ->
        name -> value)."""
        import httpx

        from frontend.router.replicas import metric

        out = {}
        for number, server in enumerate(self.servers, 1):
            if server in self.live() and server in (servers or self.servers):
                text = httpx.get(server.metrics_url, timeout=30).text
                out[number] = {"queried": metric(text, "kvforge_prefix_cache_queried_tokens_total"),
                               "hit": metric(text, "kvforge_prefix_cache_hit_tokens_total"),
                               "redis": metric(text, "kvforge_kv_tier_hit_tokens_total", 'tier="redis"'),
                               "redis_load_p50_s": metric(text, "kvforge_kv_tier_load_seconds_p50", 'tier="redis"'),
                               "busy": metric(text, "kvforge_running_sequences")
                               + metric(text, "kvforge_waiting_sequences") + metric(text, "kvforge_loading_sequences")
                               + metric(text, "kvforge_kv_tier_write_queue_blocks")}
        return out

    def settled(self, servers: list | None = None) -> dict[int, dict]:
        """The counters once every replica is idle, its writes to Redis done and its metrics
        published (two reads agree)."""
        previous = None
        for _ in range(240):
            now = self.counters(servers)
            if now == previous and all(c["busy"] == 0 for c in now.values()):
                return now
            previous = now
            time.sleep(0.5)
        return previous

    @contextlib.contextmanager
    def router(self, policy: str, servers: list | None = None):
        """The router over `servers` (default: every replica), cold: RAM pools cleared."""
        import httpx

        from launcher.harness import free_ports

        port, servers = free_ports(1)[0], servers or self.servers
        specs = [f"http://{s.http_url},http://{s.host}:{s.openai_port},http://{s.host}:{s.metrics_port}"
                 for s in servers]
        log = self.logs / f"router-{policy}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen([sys.executable, "-m", "frontend.router", "--repo", str(self.repo),
                                        "--port", str(port), "--policy", policy,
                                        *[a for spec in specs for a in ("--replica", spec)]],
                                       cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the router exited: {log.read_text()[-500:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the router did not answer /health")
                time.sleep(0.2)
            cleared = httpx.post(f"{url}/v2/models/llm/generate", timeout=60, json={
                "text_input": "", "max_tokens": 1, "clear_prefix_cache": True, "control_key": CONTROL_KEY})
            if cleared.status_code != 200:
                raise RuntimeError(f"clear_prefix_cache through the router failed: {cleared.text[:300]}")
            yield url
        finally:
            process.terminate()
            process.wait(60)


def flush(redis_ports: list[int]) -> None:
    """Empty the Redis tier (every primary of a cluster)."""
    import redis

    for port in redis_ports:
        client = redis.Redis(port=port, socket_timeout=30)
        client.flushall()
        client.close()


def cluster_ports(count: int) -> list[int]:
    """`count` ports whose cluster bus (port + 10000) is free too, all <= 55535."""
    from kvforge.net import port_in_use

    ports, port = [], 21000
    while len(ports) < count:
        if not port_in_use("127.0.0.1", port) and not port_in_use("127.0.0.1", port + 10000):
            ports.append(port)
        port += 1
    return ports


# ---------------------------------------------------------------- requests and runs

def stream(client, url: str, prompt: str, session: str, max_tokens: int) -> dict:
    """One streamed /v2 request: TTFT, its text, tokens, the cached and prompt tokens it reports,
    and an error (before or after its first token) if it failed."""
    import httpx

    began = time.perf_counter()
    record = {"ttft_s": None, "text": "", "tokens": 0, "cached_tokens": 0, "input_tokens": 0, "error": None}
    try:
        with client.stream("POST", f"{url}/v2/models/llm/generate_stream", headers={"X-Session-ID": session},
                           json={"text_input": prompt, "max_tokens": max_tokens}) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return record
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = str(event["error"])[:200]
                    return record
                if record["ttft_s"] is None and event.get("output_ids"):
                    record["ttft_s"] = time.perf_counter() - began
                record["text"] += event.get("text_output", "")
                record["tokens"] += len(event.get("output_ids", []))
                record["cached_tokens"] = event.get("cached_tokens", record["cached_tokens"])
                record["input_tokens"] = event.get("num_input_tokens", record["input_tokens"])
    except httpx.HTTPError as e:
        record["error"] = f"{type(e).__name__}: {e}"[:200]
    return record


def run_workload(url: str, workload: list[list[str]], s: Shape, prefix: str, after=None) -> tuple[list[dict], float]:
    """`s.concurrency` clients; each takes the conversation at the head of the rotation, sends its
    next turn and puts it back at the tail. after(completed, sent) runs after each request.
    Returns the records in arrival order and the wall time."""
    import httpx

    waiting = deque(Conversation(f"{prefix}-{i}", texts) for i, texts in enumerate(workload))
    records: list[dict] = []
    lock = threading.Condition()

    def client_loop():
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            while True:
                with lock:
                    while not waiting and any(r is None for r in records):
                        lock.wait()  # every conversation left is in flight: its next turn comes later
                    if not waiting:
                        return
                    conversation = waiting.popleft()
                    slot = len(records)
                    records.append(None)
                prompt = conversation.history + conversation.user_texts[conversation.turn]
                record = stream(client, url, prompt, conversation.session, s.answer_tokens)
                conversation.history, conversation.turn = prompt + record.pop("text"), conversation.turn + 1
                with lock:
                    records[slot] = record
                    if conversation.turn < len(conversation.user_texts):
                        waiting.append(conversation)
                    completed, sent = sum(r is not None for r in records), len(records)
                    lock.notify_all()
                if after:
                    after(completed, sent)

    began = time.perf_counter()
    clients = [threading.Thread(target=client_loop) for _ in range(s.concurrency)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    return records, time.perf_counter() - began


def hit_rate(records: list[dict]) -> float | None:
    """Cached share of the prompt tokens, as the responses report them (RAM and Redis alike)."""
    prompt = sum(r["input_tokens"] for r in records)
    return round(100 * sum(r["cached_tokens"] for r in records) / prompt, 2) if prompt else None


def summary(records: list[dict], wall: float, before: dict, after: dict) -> dict:
    """A run's figures: TTFT, throughput, losses, and the prompt tokens by source per replica."""
    done = [r for r in records if r["error"] is None]
    ttft = [1e3 * r["ttft_s"] for r in done if r["ttft_s"] is not None]
    replicas = {}
    for number in after:
        d = {k: after[number][k] - before.get(number, {}).get(k, 0) for k in ("queried", "hit", "redis")}
        replicas[str(number)] = {"prompt_tokens": int(d["queried"]), "ram_tokens": int(d["hit"] - d["redis"]),
                                 "redis_tokens": int(d["redis"]), "computed_tokens": int(d["queried"] - d["hit"]),
                                 "redis_load_p50_ms": round(1e3 * after[number]["redis_load_p50_s"], 2)}
    queried = sum(r["prompt_tokens"] for r in replicas.values())
    computed = [r["computed_tokens"] for r in replicas.values()]
    share = lambda key: round(100 * sum(r[key] for r in replicas.values()) / queried, 2) if queried else None
    return {"requests": len(records), "completed": len(done),
            "lost_before_first_token": sum(r["error"] is not None and r["ttft_s"] is None for r in records),
            "lost_after_first_token": sum(r["error"] is not None and r["ttft_s"] is not None for r in records),
            "errors": [r["error"] for r in records if r["error"]][:3],
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if ttft else None,
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if ttft else None,
            "wall_s": round(wall, 2), "requests_per_s": round(len(done) / wall, 3),
            "generated_tokens_per_s": round(sum(r["tokens"] for r in done) / wall, 2),
            "hit_percent": {"ram": share("ram_tokens"), "redis": share("redis_tokens"), "none": share("computed_tokens")},
            "reported_hit_percent": hit_rate(done),
            "load_imbalance": round(max(computed) / max(min(computed), 1), 2) if len(computed) > 1 else None,
            "replicas": replicas}


def measured_run(fleet: Fleet, redis_ports: list[int], policy: str, workload: list[list[str]], s: Shape,
                 label: str, servers: list | None = None, after=None) -> tuple[dict, list[dict]]:
    say(f"fleet: {label}, policy {policy}")
    with fleet.router(policy, servers) as url:  # the previous run settled: its writes reached Redis
        flush(redis_ports)
        before = fleet.counters(servers)
        records, wall = run_workload(url, workload, s, label, after)
        result = summary(records, wall, before, fleet.settled(servers))
    return {"policy": policy, **result}, records


def policy_runs(fleet: Fleet, redis_ports: list[int], workloads: dict, s: Shape) -> dict:
    return {name: {policy: measured_run(fleet, redis_ports, policy, workload, s, name)[0] for policy in POLICIES}
            for name, workload in workloads.items()}


def killed_replica_run(fleet: Fleet, redis_ports: list[int], workload: list[list[str]], s: Shape) -> dict:
    """The kv router while the last replica is SIGKILLed after `kill_after` completed requests."""
    victim, killed, lock = fleet.servers[-1], {}, threading.Lock()

    def after(completed: int, sent: int) -> None:
        with lock:
            if completed >= s.kill_after and not killed:
                killed["sent"] = sent
                fleet.kill(victim)

    result, records = measured_run(fleet, redis_ports, "kv", workload, s, "multi_turn-killed", after=after)
    sent = killed.get("sent", len(records))  # requests sent before the kill (some still in flight then)
    return {**result, "killed_replica": len(fleet.servers), "killed_after_requests": s.kill_after,
            "hit_percent_before_kill": hit_rate([r for r in records[:sent] if r["error"] is None]),
            "hit_percent_after_kill": hit_rate([r for r in records[sent:] if r["error"] is None])}


def run(params, artifacts) -> dict:
    from launcher.redis_cluster import RedisCluster
    from launcher.redis_server import RedisServer
    from launcher.harness import free_ports

    s = shape(params.quick)
    model, engine_dir, texts = section_engine(params, artifacts)
    repo = artifacts.root / "model_repository_fleet"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    workloads = {"multi_turn": multi_turn_workload(texts, s), "shared_document": document_workload(texts, s)}
    logs = artifacts.root / "fleet-logs"
    load_at_start = os.getloadavg()
    results: dict = {}

    with RedisServer(free_ports(1)[0], maxmemory="2gb") as redis_server:
        fleet = Fleet(repo, s.replicas, redis_server.url, s.host_bytes, logs / "redis")
        try:
            fleet.start()
            ports = [redis_server.port]
            results["redis"] = policy_runs(fleet, ports, workloads, s)
            results["single_replica"] = measured_run(fleet, ports, "kv", workloads["multi_turn"], s,
                                                     "multi_turn-single", servers=fleet.servers[:1])[0]
            results["killed_replica"] = killed_replica_run(fleet, ports, workloads["multi_turn"], s)
        finally:
            fleet.stop()
    with RedisCluster(cluster_ports(3), maxmemory="1gb") as cluster:
        fleet = Fleet(repo, s.replicas, cluster.url, s.host_bytes, logs / "cluster")
        try:
            fleet.start()
            results["redis_cluster"] = policy_runs(fleet, cluster.primaries, workloads, s)
        finally:
            fleet.stop()

    return {"model": model, "engine": str(engine_dir), "shape": s.__dict__, **results,
            "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
            "method": "every run cold (RAM pools cleared through the router, Redis flushed), the same texts; "
                      "TTFT = send to the first streamed token through the router; hit shares from the replicas' "
                      "metrics: RAM = prefix-cache hit tokens - Redis tier hit tokens, Redis = the Redis tier's hit "
                      "tokens, none = prompt tokens computed; load imbalance = max / min computed tokens per replica",
            "units": {"ttft_p50_ms": "ms", "ttft_p99_ms": "ms", "wall_s": "s", "requests_per_s": "requests/s",
                      "generated_tokens_per_s": "tokens/s", "hit_percent": "% of prompt tokens",
                      "reported_hit_percent": "% of prompt tokens", "prompt_tokens": "tokens",
                      "computed_tokens": "tokens", "redis_load_p50_ms": "ms", "load_imbalance": "x"}}


# ---------------------------------------------------------------- report (targets, bench.md, plot)

NAMES = ("Fleet: KV-aware RAM prefix hit rate >= 90% of the single-replica hit rate (multi-turn)",
         "Fleet: KV-aware TTFT p50 <= 0.5x round-robin's (multi-turn)",
         "Fleet: KV-aware load (prompt tokens computed) within 1.5x between replicas (multi-turn)",
         "Fleet: Redis Cluster load time within 1.5x of one primary's (round-robin, multi-turn)",
         "Fleet: a killed Redis primary costs only its slots' hits",
         "Fleet: a replica killed mid-run loses no request before its first token")


def targets(results: dict) -> list[dict]:
    section = results.get("fleet")
    if not section_ran(section):
        return [skipped(n, "", "fleet section did not run") for n in NAMES]
    kv, rr = section["redis"]["multi_turn"]["kv"], section["redis"]["multi_turn"]["round-robin"]
    single = section["single_replica"]
    reference = single["hit_percent"]["ram"] + single["hit_percent"]["redis"]
    ram = kv["hit_percent"]["ram"]
    rows = [target(NAMES[0], ">= 90%", f"{100 * ram / reference:.0f}% ({ram:.1f}% vs {reference:.1f}%)",
                   ram >= 0.9 * reference, "RAM hit share of the prompt tokens, kv router over "
                   f"{section['shape']['replicas']} replicas vs one replica serving it all")]
    ratio = kv["ttft_p50_ms"] / rr["ttft_p50_ms"]
    rows.append(target(NAMES[1], "<= 0.5x", f"{ratio:.2f}x ({kv['ttft_p50_ms']:.0f} vs {rr['ttft_p50_ms']:.0f} ms)",
                       ratio <= 0.5, "round-robin loads the history from the shared Redis instead of recomputing it"))
    rows.append(target(NAMES[2], "<= 1.5x", f"{kv['load_imbalance']:.2f}x", kv["load_imbalance"] <= 1.5,
                       "max / min prompt tokens computed per replica: " + ", ".join(
                           f"{n}: {r['computed_tokens']:,}" for n, r in kv["replicas"].items())))
    one, many = (section[tier]["multi_turn"]["round-robin"] for tier in ("redis", "redis_cluster"))
    loads = [float(np.median([r["redis_load_p50_ms"] for r in run["replicas"].values()])) for run in (one, many)]
    if min(loads) > 0:
        rows.append(target(NAMES[3], "<= 1.5x", f"{loads[1] / loads[0]:.2f}x ({loads[1]:.1f} vs {loads[0]:.1f} ms)",
                           loads[1] <= 1.5 * loads[0], "median over replicas of each one's p50 Redis load latency"))
    else:
        rows.append(skipped(NAMES[3], "<= 1.5x", "no load from Redis in one of the two runs"))
    rows.append(skipped(NAMES[4], "only its slots", "not run here: tests/test_redis_cluster.py kills a primary and "
                        "checks the blocks it held are the only ones lost (docs/kv-tiers.md)"))
    killed = section["killed_replica"]
    rows.append(target(NAMES[5], "0", f"{killed['lost_before_first_token']} of {killed['requests']}",
                       killed["lost_before_first_token"] == 0,
                       f"{killed['lost_after_first_token']} broke after their first token; hit rate "
                       f"{killed['hit_percent_before_kill']}% before the kill, {killed['hit_percent_after_kill']}% after"))
    return rows


def plot(plt, results: dict, out: Path) -> None:
    section, path = results.get("fleet"), out / "fleet.png"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(section):
        runs = [(f"{workload.split('_')[-1]}, {TIERS[tier]}\n{policy}", section[tier][workload][policy])
                for workload in ("multi_turn", "shared_document") for tier in ("redis", "redis_cluster")
                for policy in POLICIES]
        x = np.arange(len(runs))
        left.bar(x - 0.2, [r["ttft_p50_ms"] or 0 for _, r in runs], 0.4, label="p50")
        left.bar(x + 0.2, [r["ttft_p99_ms"] or 0 for _, r in runs], 0.4, label="p99")
        left.set(ylabel="TTFT (ms)", title="TTFT per workload, Redis tier and policy")
        bottom = np.zeros(len(runs))
        for source in ("ram", "redis", "none"):
            share = np.array([r["hit_percent"][source] or 0 for _, r in runs])
            right.bar(x, share, 0.6, bottom=bottom, label=source)
            bottom += share
        right.set(ylabel="% of prompt tokens", title="Where the prompt's KV came from")
        for ax in (left, right):
            ax.set_xticks(x, [name for name, _ in runs], fontsize=6, rotation=60)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, path, section, "fleet", [left, right])


def markdown(results: dict) -> list[str]:
    section = results.get("fleet")
    if not rendered(section):
        return []
    s, load = section["shape"], section["load_average"]
    rows = []
    for workload in ("multi_turn", "shared_document"):
        for tier in ("redis", "redis_cluster"):
            for policy in POLICIES:
                rows.append(row(f"{workload}, {TIERS[tier]}", policy, section[tier][workload][policy]))
    rows.append(row("multi_turn, one Redis, 1 replica", "kv", section["single_replica"]))
    killed = section["killed_replica"]
    rows.append(row(f"multi_turn, one Redis, replica {killed['killed_replica']} killed after "
                    f"{killed['killed_after_requests']} requests (survivors' counters)", "kv", killed))
    return [f"## Fleet ({section['model'].split('/')[-1]}, {s['replicas']} replicas x 1 thread; load average "
            f"{load['start'][0]:.2f} -> {load['end'][0]:.2f})", "",
            f"Multi-turn: {s['conversations']} conversations x {s['turns']} turns ({s['user_tokens']} new tokens and "
            f"{s['answer_tokens']} answer tokens per turn, history resent), {s['concurrency']} clients; shared "
            f"documents: {s['documents']} x {s['document_tokens']} tokens, {s['questions']} questions each. Hit "
            "shares from the replicas' metrics; computed tokens per replica show the load balance.", "",
            *table(["workload, tier", "policy", "RAM / Redis / none (% of prompt tokens)", "TTFT p50 / p99 (ms)",
                    "requests/s", "tokens/s", "prompt tokens computed per replica", "lost before / after 1st token"],
                   rows),
            "", f"Killed replica: hit rate (as the responses report it) {killed['hit_percent_before_kill']}% before, "
                f"{killed['hit_percent_after_kill']}% after the kill."]


def row(label: str, policy: str, run: dict) -> list:
    hits = run["hit_percent"]
    return [label, policy, " / ".join("-" if hits[k] is None else f"{hits[k]:.1f}" for k in ("ram", "redis", "none")),
            f"{run['ttft_p50_ms']} / {run['ttft_p99_ms']}", f"{run['requests_per_s']:.2f}",
            f"{run['generated_tokens_per_s']:.1f}",
            ", ".join(f"{r['computed_tokens']:,}" for r in run["replicas"].values()),
            f"{run['lost_before_first_token']} / {run['lost_after_first_token']}"]
