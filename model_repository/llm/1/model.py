"""Triton model `llm`: streaming generation with continuous batching (kvforge's LLMEngine).

Decoupled: execute() only parses and submits, then returns; the engine's thread generates and
hands outputs to a sender thread, so a slow client never stalls decoding. The sender also
polls `is_cancelled()` every CANCEL_POLL_SECONDS (a client that went away frees its slot at the
next step), updates the custom metrics and latency histograms, and writes one access-log line
per request (ids and counts, never the text). Inputs and outputs use the names of the
TensorRT-LLM/vLLM backends, so /v2/models/llm/generate, /generate_stream and gRPC stream_infer
work as with those. Refusals for load (queue full, queue timeout) start with "UNAVAILABLE:".

Prefix caching: an optional `cache_salt` input isolates a tenant's cached prefixes, every
response carries `cached_tokens`, and a request with `clear_prefix_cache` true and the operator's
`control_key` (compared with env KVFORGE_CONTROL_KEY, the secret that guards Triton's model
control; no key set = refused) empties the prefix cache without a restart.
"""
import hmac
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.llm_engine import LLMEngine, QueueFullError, RequestError, SamplingParams
from runtime.triton_server import append_json_line

# is_cancelled() is a round trip to the server, so it is asked per request every this many
# seconds, not per token: a cancelled request generates at most this long plus one step. One
# still waiting for a slot costs no compute and is asked less often.
CANCEL_POLL_SECONDS = 0.02
WAITING_POLL_SECONDS = 0.2
METRICS_SECONDS = 0.1
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
UNAVAILABLE = "UNAVAILABLE:"  # the documented prefix of every refusal for load; retry later
# engine stats key -> custom metric on Triton's metrics port
METRICS = [
    ("kv_utilization", "kvforge_kv_cache_utilization",
     "Bytes the KV slot buffers hold over their budget kv_cache_bytes (0..1)", "GAUGE"),
    ("running", "kvforge_running_sequences", "Sequences in the running batch", "GAUGE"),
    ("waiting", "kvforge_waiting_sequences", "Requests waiting for a KV slot", "GAUGE"),
    ("generated_tokens", "kvforge_generated_tokens_total", "Tokens generated", "COUNTER"),
    ("steps", "kvforge_steps_total", "Engine steps run", "COUNTER"),
    ("multi_row_steps", "kvforge_batched_steps_total", "Engine steps that ran more than one sequence", "COUNTER"),
    ("finished", "kvforge_finished_requests_total", "Requests ended by a stop, their length or an error", "COUNTER"),
    ("cancelled", "kvforge_cancelled_requests_total", "Requests ended because their client went away", "COUNTER"),
    ("prefix_cache_queried_tokens", "kvforge_prefix_cache_queried_tokens_total",
     "Prompt tokens looked up in the prefix cache", "COUNTER"),
    ("prefix_cache_hit_tokens", "kvforge_prefix_cache_hit_tokens_total",
     "Prompt tokens whose KV came from the prefix cache", "COUNTER"),
    ("kv_host_pool_bytes", "kvforge_kv_host_pool_bytes", "Bytes of KV blocks in the host RAM pool", "GAUGE"),
    ("kv_host_pool_budget_bytes", "kvforge_kv_host_pool_budget_bytes", "Byte budget of the host RAM pool", "GAUGE"),
    ("blocks_evicted", "kvforge_kv_blocks_evicted_total", "KV blocks evicted from the host RAM pool", "COUNTER"),
    ("preempted_swap", "kvforge_preempted_swap_total",
     "Running sequences preempted with their KV swapped to the host pool (resumed, not recomputed)", "COUNTER"),
    ("preempted_recompute", "kvforge_preempted_recompute_total",
     "Running sequences preempted beyond the swap reserve (their KV recomputed)", "COUNTER"),
    ("loading", "kvforge_loading_sequences", "Requests waiting for their prefix to load from disk or Redis", "GAUGE"),
    ("tier_write_queue_blocks", "kvforge_kv_tier_write_queue_blocks",
     "KV blocks queued for the disk / Redis tiers", "GAUGE"),
    ("tier_write_dropped_blocks", "kvforge_kv_tier_write_dropped_blocks_total",
     "KV blocks not written to disk / Redis because the write queue was full", "COUNTER"),
    ("tier_loads_abandoned", "kvforge_kv_tier_loads_abandoned_total",
     "Prefix loads skipped because recomputing was estimated faster", "COUNTER"),
    ("tier_loads_expired", "kvforge_kv_tier_loads_expired_total",
     "Prefix loads given up at their recompute deadline", "COUNTER"),
    ("expired", "kvforge_expired_requests_total", "Requests ended by the queue or request timeout", "COUNTER"),
    ("cancel_poll_seconds", "kvforge_cancel_poll_seconds_total",
     "CPU seconds the sender spent asking whether clients went away (the cost of cancellation)", "COUNTER"),
]
# per lower tier (label tier="disk" | "redis"): engine stats["tiers"][tier] key -> custom metric
TIER_METRICS = [
    ("hit_tokens", "kvforge_kv_tier_hit_tokens_total", "Prompt tokens whose KV was loaded from the tier", "COUNTER"),
    ("read_bytes", "kvforge_kv_tier_read_bytes_total", "Bytes of KV read from the tier", "COUNTER"),
    ("written_bytes", "kvforge_kv_tier_written_bytes_total", "Bytes of KV written to the tier", "COUNTER"),
    ("evicted_blocks", "kvforge_kv_tier_evicted_blocks_total",
     "KV blocks the tier evicted for its byte budget (Redis evicts on its own: 0)", "COUNTER"),
    ("errors", "kvforge_kv_tier_errors_total", "Failed tier operations (each one a miss)", "COUNTER"),
    ("corrupt_blocks", "kvforge_kv_tier_corrupt_blocks_total", "Tier entries refused by their checksum or header",
     "COUNTER"),
    ("load_p50_seconds", "kvforge_kv_tier_load_seconds_p50", "Median latency of a load from the tier", "GAUGE"),
    ("load_p99_seconds", "kvforge_kv_tier_load_seconds_p99", "99th percentile latency of a load from the tier",
     "GAUGE"),
    ("bytes", "kvforge_kv_tier_bytes", "Bytes of KV the tier holds (disk; Redis: not tracked, 0)", "GAUGE"),
    ("enabled", "kvforge_kv_tier_enabled", "1 while the tier is in use, 0 once it switched itself off", "GAUGE"),
]
# latency histograms (seconds), observed by the sender as responses go out
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
HISTOGRAMS = [
    ("ttft", "kvforge_time_to_first_token_seconds", "From arrival to the first token sent"),
    ("inter_token", "kvforge_inter_token_seconds", "Between a stream's consecutive responses, per token"),
    ("queue", "kvforge_queue_wait_seconds", "From arrival until the request got a KV slot"),
    ("e2e", "kvforge_request_seconds", "From arrival to the final response"),
]


def env_seconds(name):
    value = os.environ.get(name)
    return float(value) if value else None


class Client:
    """One request's response sender; without streaming, it gathers the output for one response."""

    def __init__(self, sender, stream: bool, log_id: str):
        self.sender, self.stream, self.log_id = sender, stream, log_id
        self.request_id = None  # set once the engine accepted the request
        self.cancelled = self.finished = False
        self.gathered = None
        self.arrived = time.perf_counter()
        self.first_token = self.last_sent = self.cancel_seen = None
        self.next_poll = 0.0


def one_value(request, name, default, convert):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"{name} must hold exactly one value (one prompt per request), got {values.size}")
    return convert(values[0])


def utf8(name):
    def convert(value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    return convert


def parse(request):
    stop = pb_utils.get_input_tensor_by_name(request, "stop")
    params = SamplingParams(
        max_tokens=one_value(request, "max_tokens", None, int),
        temperature=one_value(request, "temperature", 0.0, float),
        top_p=one_value(request, "top_p", 1.0, float),
        top_k=one_value(request, "top_k", 0, int),
        seed=one_value(request, "seed", None, int),
        stop=tuple(map(utf8("stop"), stop.as_numpy().reshape(-1))) if stop is not None else ())
    return one_value(request, "text_input", "", utf8("text_input")), params, one_value(request, "stream", False, bool)


def response(text, ids, cached_tokens=0):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array([ids], dtype=np.int32)),
        pb_utils.Tensor("cached_tokens", np.array([cached_tokens], dtype=np.int32))])


def cache_salt(request):
    """The request's optional cache_salt (raw bytes): it shares cached prefixes only with the same salt."""
    return one_value(request, "cache_salt", None, bytes)


def clear_prefix_cache(request, engine):
    """None for an ordinary request; else the response to the operator's clear request."""
    if not one_value(request, "clear_prefix_cache", False, bool):
        return None
    expected = os.environ.get("KVFORGE_CONTROL_KEY", "").encode()
    given = one_value(request, "control_key", b"", bytes)
    if not expected or not hmac.compare_digest(given, expected):
        return error("clearing the prefix cache needs the server's control key (control_key input)",
                     pb_utils.TritonError.INVALID_ARG)
    return response(f"cleared {engine.clear_prefix_cache()} prefix cache blocks", [])


def engine_options():
    """Prefix-cache knobs, per launch from the server's environment (python -m runtime.triton_server
    --prefix-cache/--kv-host-bytes/--kv-disk-dir/--kv-disk-bytes/--kv-redis-url set them):
    KVFORGE_PREFIX_CACHE=0|1, KVFORGE_KV_HOST_BYTES=N, KVFORGE_KV_DISK_DIR=DIR,
    KVFORGE_KV_DISK_BYTES=N, KVFORGE_KV_REDIS_URL=redis://..., KVFORGE_KV_REDIS_TTL=SECONDS.
    Never in the model config: a path or a Redis password must not reach metadata or logs."""
    enabled = os.environ.get("KVFORGE_PREFIX_CACHE", "1")
    if enabled not in ("0", "1"):
        raise ValueError(f"KVFORGE_PREFIX_CACHE must be 0 or 1 (got {enabled!r})")
    options = dict(prefix_cache=enabled == "1", kv_disk_dir=os.environ.get("KVFORGE_KV_DISK_DIR") or None,
                   kv_redis_url=os.environ.get("KVFORGE_KV_REDIS_URL") or None)
    for name, key in (("KVFORGE_KV_HOST_BYTES", "kv_host_bytes"), ("KVFORGE_KV_DISK_BYTES", "kv_disk_bytes"),
                      ("KVFORGE_KV_REDIS_TTL", "kv_redis_ttl")):
        value = os.environ.get(name, "")
        if not (value.isdigit() or value == ""):
            raise ValueError(f"{name} must be a whole number (got {value!r})")
        if value:
            options[key] = int(value)
    return options


def publish(metric, kind, value):
    if kind == "GAUGE":
        metric.set(value)
    elif value > metric.value():
        metric.increment(value - metric.value())


def error(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def log_id_of(request):
    """The id the front (or a gRPC client's `request_id` parameter) gave the request."""
    try:
        given = json.loads(request.parameters() or "{}").get("request_id")
    except ValueError:
        given = None
    return str(given)[:64] if given else (request.request_id() or None)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.engine = LLMEngine(Path(args["model_repository"]).parent / params["engine_dir"],
                                slots=int(params["slots"]), max_waiting=int(params["max_waiting"]),
                                kv_cache_bytes=int(params["kv_cache_bytes"]), **engine_options())
        self.queue_timeout = env_seconds("KVFORGE_QUEUE_TIMEOUT")
        self.request_timeout = env_seconds("KVFORGE_REQUEST_TIMEOUT")
        access_log = os.environ.get("KVFORGE_ACCESS_LOG")
        self.access_log = Path(access_log) if access_log else None
        self.outbox = queue.Queue()
        self.live = set()
        self.live_lock = threading.Lock()
        self.poll_seconds = 0.0
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # MetricFamily exists only in a model instance's stub, not while Triton loads this file
        self.families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                         for key, name, description, kind in METRICS}
        self.metrics = {key: family.Metric(labels=labels) for key, family in self.families.items()}
        for key, name, description in HISTOGRAMS:
            self.families[key] = pb_utils.MetricFamily(name, description, pb_utils.MetricFamily.HISTOGRAM)
        self.histograms = {key: self.families[key].Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for key, _, _ in HISTOGRAMS}
        tiers = list(self.engine.stats()["tiers"])
        self.tier_families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                              for key, name, description, kind in TIER_METRICS} if tiers else {}
        self.tier_metrics = {(tier, key, kind): self.tier_families[key].Metric(labels={**labels, "tier": tier})
                             for tier in tiers for key, _, _, kind in TIER_METRICS}
        self.sender = threading.Thread(target=self.send_loop, name="llm-sender", daemon=True)
        self.sender.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            log_id = log_id_of(request)
            try:
                control = clear_prefix_cache(request, self.engine)
                if control is not None:
                    sender.send(control, flags=FINAL)
                    continue
                prompt, params, stream = parse(request)
                client = Client(sender, stream, log_id)
                client.request_id = self.engine.submit(prompt, params, lambda out, c=client: self.outbox.put((c, out)),
                                                       cache_salt=cache_salt(request), queue_timeout=self.queue_timeout,
                                                       timeout=self.request_timeout)
                with self.live_lock:
                    if not client.finished:  # a short request may be done already
                        self.live.add(client)
            except QueueFullError as e:
                sender.send(error(f"{UNAVAILABLE} {e}", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
                self.log(dict(request_id=log_id, finish_reason="queue_full"))
            except RequestError as e:
                sender.send(error(str(e), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                self.log(dict(request_id=log_id, finish_reason="invalid", error=str(e)[:200]))
        return None

    def log(self, record):
        append_json_line(self.access_log, dict(source="engine", **record))

    def send_loop(self):
        next_poll = next_metrics = 0.0
        stopping = False
        while not stopping:
            try:
                items = [self.outbox.get(timeout=CANCEL_POLL_SECONDS)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            # a stream that fell behind the engine gets its queued tokens as one response
            pending = {}
            for item in items:
                if item is None:
                    stopping = True
                    continue
                client, out = item
                pending[client] = pending[client].merge(out) if client in pending else out
            for client, out in pending.items():
                try:
                    self.send(client, out)
                except Exception as e:  # one request's failed send must not stop every other stream
                    pb_utils.Logger.log_error(f"llm: sending a response failed: {e}")
            now = time.monotonic()
            if now >= next_poll:
                self.poll_cancelled()
                next_poll = now + CANCEL_POLL_SECONDS
            if now >= next_metrics:
                self.update_metrics()
                next_metrics = now + METRICS_SECONDS

    def check_cancelled(self, client):
        """True once the client went away; the engine then ends the request with a "cancelled" output."""
        if client.request_id is not None and not client.cancelled and client.sender.is_cancelled():
            client.cancelled, client.cancel_seen = True, time.perf_counter()
            self.engine.cancel(client.request_id)
        return client.cancelled

    def send(self, client, out):
        if client.cancelled and not out.finished:
            return
        if out.finished:
            with self.live_lock:
                client.finished = True
                self.live.discard(client)
        self.observe(client, out)
        if out.finish_reason == "cancelled":
            client.sender.send(error("the request was cancelled", pb_utils.TritonError.CANCELLED), flags=FINAL)
        elif out.finish_reason == "timeout":
            client.sender.send(error(f"{UNAVAILABLE} {out.error}", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        elif out.error:
            client.sender.send(error(out.error, pb_utils.TritonError.INTERNAL), flags=FINAL)
        elif client.stream:
            client.sender.send(response(out.text, out.token_ids, out.cached_tokens), flags=FINAL if out.finished else 0)
        else:
            client.gathered = client.gathered.merge(out) if client.gathered else out
            if out.finished:
                client.sender.send(response(client.gathered.text, client.gathered.token_ids, out.cached_tokens),
                                   flags=FINAL)

    def observe(self, client, out):
        """Latency histograms as the response goes out; the access-log line when it is the last."""
        now = time.perf_counter()
        if out.token_ids:
            if client.first_token is None:
                client.first_token = now
                self.histograms["ttft"].observe(now - client.arrived)
            elif client.stream:
                self.histograms["inter_token"].observe((now - client.last_sent) / len(out.token_ids))
            client.last_sent = now
        if not out.finished:
            return
        self.histograms["e2e"].observe(now - client.arrived)
        if out.queue_seconds is not None:
            self.histograms["queue"].observe(out.queue_seconds)
        ttft = client.first_token - client.arrived if client.first_token else None
        self.log(dict(request_id=client.log_id, engine_id=client.request_id, stream=client.stream,
                      prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
                      finish_reason=out.finish_reason, error=out.error and out.error[:200],
                      queue_ms=round(1000 * (out.queue_seconds or 0), 2),
                      ttft_ms=round(1000 * ttft, 2) if ttft is not None else None,
                      total_ms=round(1000 * (now - client.arrived), 2),
                      # from seeing the cancellation to the engine's last output: at most one step
                      stop_ms=round(1000 * (now - client.cancel_seen), 2) if client.cancel_seen else None))

    def poll_cancelled(self):
        started, now = time.thread_time(), time.monotonic()
        with self.live_lock:
            clients = [c for c in self.live if c.next_poll <= now]
        for client in clients:
            self.check_cancelled(client)
            client.next_poll = now + (CANCEL_POLL_SECONDS if client.first_token else WAITING_POLL_SECONDS)
        if clients:  # an idle server's counter stays put
            self.poll_seconds += time.thread_time() - started

    def update_metrics(self):
        stats = dict(self.engine.stats(), cancel_poll_seconds=self.poll_seconds)
        for key, _, _, kind in METRICS:
            publish(self.metrics[key], kind, stats[key])
        for (tier, key, kind), metric in self.tier_metrics.items():
            publish(metric, kind, stats["tiers"][tier][key])

    def finalize(self):
        self.engine.close()  # ends what is left with an error output, sent below
        self.outbox.put(None)
        self.sender.join()
        self.metrics.clear()  # metrics before their families, as the backend requires
        self.histograms.clear()
        self.tier_metrics.clear()
        self.families.clear()
        self.tier_families.clear()
