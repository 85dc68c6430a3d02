"""Triton model `llm`: streaming generation with continuous batching (kvforge's LLMEngine).

Decoupled: execute() only parses and submits, then returns; the engine's thread generates and
hands outputs to a sender thread, so a slow client never stalls decoding. The sender also
asks `is_cancelled()` as a request's outputs go out (a client that went away frees its slot at the
next step), updates the custom metrics and latency histograms, and writes one access-log line
per request (ids and counts, never the text). Inputs and outputs use the names, dtypes and
meanings of TensorRT-LLM's ensemble / tensorrt_llm_bls models (README "Inputs and outputs" lists
each), so /v2/models/llm/generate, /generate_stream and gRPC stream_infer work as with those; a
request with `stop` true is TensorRT-LLM's signal that ends the live request with the same
request id. Refusals for load (queue full, queue timeout) start with "UNAVAILABLE:".

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

from kvforge.errors import QueueFullError, RequestError
from kvforge.jsonlog import append_json_line
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.sequence import RequestOutput
from triton_models.requests import either, identity_only, one_value, refuse_unknown_parameters, strings, utf8

# is_cancelled() is a round trip to the server, as is every send and metric update, so a
# generating request is asked when one of its outputs goes out (once per engine step, the soonest
# the engine could stop it) but not more often than every CANCEL_POLL_SECONDS; one that has had no
# output for IDLE_POLL_SECONDS (waiting for a slot or in a long prefill) is asked by the timer.
CANCEL_POLL_SECONDS = 0.02
IDLE_POLL_SECONDS = 0.2
METRICS_SECONDS = 0.1
# A stream gets one response per token; only when the sender finds more than this many of one
# stream's outputs queued at once (the client or the response path fell behind the engine) does
# it merge them into one response, which says how many tokens it carries (num_output_tokens).
MAX_UNMERGED = 8
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

    def __init__(self, sender, stream: bool, log_id: str, outputs: frozenset, echo: str = "", triton_id: str = ""):
        self.sender, self.stream, self.log_id = sender, stream, log_id
        self.outputs = outputs  # the output names the client asked for: only those are built
        self.echo = echo  # the prompt text, sent before the output when exclude_input_in_output is false
        self.triton_id = triton_id  # the client's request id, which a `stop` request names
        self.request_id = None  # set once the engine accepted the request
        self.cancelled = self.finished = self.stopped = False
        self.gathered = None
        self.arrived = time.perf_counter()
        self.first_token = self.last_sent = self.cancel_seen = None
        self.last_poll = time.monotonic()  # arrival: the timer first asks IDLE_POLL_SECONDS later


def prompt_of(request, tokenizer):
    """(prompt for the engine, its text for echoing): text_input, or TensorRT-LLM's input_ids."""
    text = one_value(request, "text_input", None, utf8("text_input"))
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if text is not None and ids is not None:
        raise RequestError("send the prompt as text_input or as input_ids, not both")
    if ids is None:
        return text or "", text or ""
    ids = ids.as_numpy().reshape(-1).tolist()
    length = one_value(request, "input_lengths", len(ids), int)
    if not 0 <= length <= len(ids):
        raise RequestError(f"input_lengths must be in 0..{len(ids)} (the input_ids sent), got {length}")
    return ids[:length], tokenizer.decode(ids[:length])


def parse(request, engine):
    """(prompt, SamplingParams, stream, echo text) of a generation request."""
    refuse_unknown_parameters(request)
    identity_only(request, "beam_width", 1, "kvforge does not implement beam search")
    identity_only(request, "length_penalty", 1, "it scores beams and kvforge does not implement beam search")
    identity_only(request, "num_return_sequences", 1,
                  "kvforge returns one sequence per request; send several requests (the OpenAI API's n does)")
    pad_id = one_value(request, "pad_id", None, int)
    vocab = engine.limits.vocab_size
    if pad_id is not None and not 0 <= pad_id < vocab:  # kvforge never pads an output, so that is all
        raise RequestError(f"pad_id must be a token id in 0..{vocab - 1}, got {pad_id}")
    max_tokens = either(request, ("max_tokens", "request_output_len"), int)
    if max_tokens is None:
        raise RequestError("max_tokens is required: how many tokens to generate at most")
    top_p = one_value(request, "top_p", 1.0, float)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=one_value(request, "temperature", 0.0, float),
        top_p=1.0 if top_p == 0 else top_p,  # TensorRT-LLM reads top_p 0 as "off"
        top_k=one_value(request, "top_k", 0, int),
        seed=either(request, ("seed", "random_seed"), int),
        stop=strings(request, "stop_words"),
        bad_words=strings(request, "bad_words"),
        end_id=one_value(request, "end_id", None, int),
        repetition_penalty=one_value(request, "repetition_penalty", 1.0, float),
        presence_penalty=one_value(request, "presence_penalty", 0.0, float),
        frequency_penalty=one_value(request, "frequency_penalty", 0.0, float),
        min_tokens=either(request, ("min_tokens", "min_length"), int) or 0,
        logprobs=one_value(request, "return_log_probs", False, bool))
    prompt, prompt_text = prompt_of(request, engine.tokenizer)
    echo = prompt_text if not one_value(request, "exclude_input_in_output", True, bool) else ""
    return prompt, params, one_value(request, "stream", False, bool), echo


# output name -> its array for one response (TensorRT-LLM's shapes and dtypes)
OUTPUTS = {
    # one text per response, 1-D like TensorRT-LLM's postprocessing output (llama-index iterates it)
    "text_output": lambda out, echo: np.array([(echo + out.text).encode("utf-8")], dtype=np.object_),
    "output_ids": lambda out, echo: np.array([out.token_ids], dtype=np.int32),
    "num_input_tokens": lambda out, echo: np.array([[out.prompt_tokens]], dtype=np.int32),
    "num_output_tokens": lambda out, echo: np.array([[len(out.token_ids)]], dtype=np.int32),
    "sequence_length": lambda out, echo: np.array([[out.output_tokens]], dtype=np.int32),
    "finish_reason": lambda out, echo: np.array([[(out.finish_reason or "").encode()]], dtype=np.object_),
    "cached_tokens": lambda out, echo: np.array([[out.cached_tokens]], dtype=np.int32),
}
LOGPROB_OUTPUTS = {
    "cum_log_probs": lambda out, echo: np.array([[out.cum_logprob]], dtype=np.float32),
    "output_log_probs": lambda out, echo: np.array([[out.logprobs]], dtype=np.float32),
}
ALL_OUTPUTS = frozenset(OUTPUTS) | frozenset(LOGPROB_OUTPUTS)


def response(out: RequestOutput, echo: str = "", names=ALL_OUTPUTS):
    """One response of the llm model: the requested outputs of `out` (Triton would drop the
    others after they crossed to the server; not building them saves that work per token)."""
    arrays = {**OUTPUTS, **(LOGPROB_OUTPUTS if out.logprobs is not None else {})}
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, make(out, echo))
                                                      for name, make in arrays.items() if name in names])


def coalesce(items):
    """[(client, output)] in arrival order -> what to send: each output alone unless one client
    has more than MAX_UNMERGED queued, which then go as one response."""
    by_client = {}
    for client, out in items:
        by_client.setdefault(client, []).append(out)
    for client, outs in by_client.items():
        if len(outs) <= MAX_UNMERGED:
            yield from ((client, out) for out in outs)
        else:
            merged = outs[0]
            for out in outs[1:]:
                merged = merged.merge(out)
            yield client, merged


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
    cleared = engine.clear_prefix_cache()
    return response(RequestOutput(0, f"cleared {cleared} prefix cache blocks", [], finished=True,
                                  finish_reason="stop"))


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


class Published:
    """A custom metric and the value last sent to it: each set/increment is a round trip to the
    server, so only changes are sent, and a counter's value is never read back."""

    def __init__(self, metric, kind):
        self.metric, self.kind, self.value = metric, kind, 0

    def update(self, value):
        if value == self.value:
            return
        if self.kind == "GAUGE":
            self.metric.set(value)
        elif value > self.value:
            self.metric.increment(value - self.value)
        self.value = value


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
        self.by_triton_id = {}  # request id -> live Client, for TensorRT-LLM's `stop` requests
        self.live_lock = threading.Lock()
        self.poll_seconds = 0.0
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # MetricFamily exists only in a model instance's stub, not while Triton loads this file
        self.families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                         for key, name, description, kind in METRICS}
        self.metrics = {key: Published(self.families[key].Metric(labels=labels), kind) for key, _, _, kind in METRICS}
        for key, name, description in HISTOGRAMS:
            self.families[key] = pb_utils.MetricFamily(name, description, pb_utils.MetricFamily.HISTOGRAM)
        self.histograms = {key: self.families[key].Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for key, _, _ in HISTOGRAMS}
        tiers = list(self.engine.stats()["tiers"])
        self.tier_families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                              for key, name, description, kind in TIER_METRICS} if tiers else {}
        self.tier_metrics = {(tier, key): Published(self.tier_families[key].Metric(labels={**labels, "tier": tier}), kind)
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
                if one_value(request, "stop", False, bool):
                    self.stop(request)
                    continue
                prompt, params, stream, echo = parse(request, self.engine)
                client = Client(sender, stream, log_id, frozenset(request.requested_output_names()) or ALL_OUTPUTS,
                                echo, request.request_id())
                client.request_id = self.engine.submit(prompt, params, lambda out, c=client: self.outbox.put((c, out)),
                                                       cache_salt=cache_salt(request), queue_timeout=self.queue_timeout,
                                                       timeout=self.request_timeout)
                with self.live_lock:
                    if not client.finished:  # a short request may be done already
                        self.live.add(client)
                        if client.triton_id:
                            self.by_triton_id[client.triton_id] = client
            except QueueFullError as e:
                sender.send(error(f"{UNAVAILABLE} {e}", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
                self.log(dict(request_id=log_id, finish_reason="queue_full"))
            except RequestError as e:
                sender.send(error(str(e), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                self.log(dict(request_id=log_id, finish_reason="invalid", error=str(e)[:200]))
        return None

    def stop(self, request):
        """TensorRT-LLM's stop signal (llama-index sends one after every request): end the live
        request with this request id; its stream ends with what it has generated so far."""
        # llama-index marks its stop request with a "Streaming" parameter; nothing else may come along
        refuse_unknown_parameters(request, allowed=("Streaming",))
        with self.live_lock:
            client = self.by_triton_id.get(request.request_id()) if request.request_id() else None
            if client is not None:
                client.stopped = True
        if client is not None:
            self.engine.cancel(client.request_id)
        request.get_response_sender().send(flags=FINAL)

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
            stopping = None in items
            for client, out in coalesce(item for item in items if item is not None):
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
        """Once the client went away, the engine ends the request with a "cancelled" output."""
        started = time.thread_time()
        client.last_poll = time.monotonic()
        if client.request_id is not None and not client.cancelled and client.sender.is_cancelled():
            client.cancelled, client.cancel_seen = True, time.perf_counter()
            self.engine.cancel(client.request_id)
        self.poll_seconds += time.thread_time() - started

    def send(self, client, out):
        if not out.finished and time.monotonic() - client.last_poll >= CANCEL_POLL_SECONDS:
            self.check_cancelled(client)
        if client.cancelled and not out.finished:
            return
        if out.finished:
            with self.live_lock:
                client.finished = True
                self.live.discard(client)
                if self.by_triton_id.get(client.triton_id) is client:
                    del self.by_triton_id[client.triton_id]
        self.observe(client, out)
        if out.finish_reason == "cancelled" and not client.stopped:
            client.sender.send(error("the request was cancelled", pb_utils.TritonError.CANCELLED), flags=FINAL)
        elif out.finish_reason == "timeout":
            client.sender.send(error(f"{UNAVAILABLE} {out.error}", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        elif out.error:
            client.sender.send(error(out.error, pb_utils.TritonError.INTERNAL), flags=FINAL)
        elif client.stream:
            client.sender.send(response(out, client.echo, client.outputs), flags=FINAL if out.finished else 0)
            client.echo = ""
        else:
            client.gathered = client.gathered.merge(out) if client.gathered else out
            if out.finished:
                client.sender.send(response(client.gathered, client.echo, client.outputs), flags=FINAL)

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
        """The timer's share: requests that had no output for IDLE_POLL_SECONDS."""
        now = time.monotonic()
        with self.live_lock:
            idle = [c for c in self.live if now - c.last_poll >= IDLE_POLL_SECONDS]
        for client in idle:
            self.check_cancelled(client)

    def update_metrics(self):
        stats = dict(self.engine.stats(), cancel_poll_seconds=self.poll_seconds)
        for key, metric in self.metrics.items():
            metric.update(stats[key])
        for (tier, key), metric in self.tier_metrics.items():
            metric.update(stats["tiers"][tier][key])

    def finalize(self):
        self.engine.close()  # ends what is left with an error output, sent below
        self.outbox.put(None)
        self.sender.join()
        self.metrics.clear()  # metrics before their families, as the backend requires
        self.histograms.clear()
        self.tier_metrics.clear()
        self.families.clear()
        self.tier_families.clear()
