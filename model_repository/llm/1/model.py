"""Triton model `llm`: streaming generation with continuous batching (kvforge's LLMEngine).

Decoupled: execute() only parses and submits, then returns; the engine's thread generates and
hands outputs to a sender thread, so a slow client never stalls decoding. The sender also
polls `is_cancelled()` every CANCEL_POLL_SECONDS (a client that went away frees its slot at the
next step), updates the custom metrics and latency histograms, and writes one access-log line
per request (ids and counts, never the text). Inputs and outputs use the names, dtypes and
meanings of TensorRT-LLM's ensemble / tensorrt_llm_bls models (README "Inputs and outputs" lists
each), so /v2/models/llm/generate, /generate_stream and gRPC stream_infer work as with those; a
request with `stop` true is TensorRT-LLM's signal that ends the live request with the same
request id. Refusals for load (queue full, queue timeout) start with "UNAVAILABLE:".
"""
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from runtime.llm_engine import LLMEngine, QueueFullError, RequestError, SamplingParams
from runtime.sequence import RequestOutput
from runtime.triton_requests import either, identity_only, one_value, refuse_unknown_parameters, strings, utf8
from runtime.triton_server import append_json_line

# is_cancelled() is a round trip to the server, so it is asked per request every this many
# seconds, not per token: a cancelled request generates at most this long plus one step. One
# still waiting for a slot costs no compute and is asked less often.
CANCEL_POLL_SECONDS = 0.02
WAITING_POLL_SECONDS = 0.2
METRICS_SECONDS = 0.1
# A stream gets one response per token; only when the sender finds more than this many of one
# stream's outputs queued at once (the client or the response path fell behind the engine) does
# it merge them into one response, which says how many tokens it carries (num_output_tokens).
MAX_UNMERGED = 8
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
UNAVAILABLE = "UNAVAILABLE:"  # the documented prefix of every refusal for load; retry later
# engine stats key -> custom metric on Triton's metrics port
METRICS = [
    ("kv_utilization", "kvforge_kv_cache_utilization", "Share of KV cache blocks holding tokens (0..1)", "GAUGE"),
    ("running", "kvforge_running_sequences", "Sequences in the running batch", "GAUGE"),
    ("waiting", "kvforge_waiting_sequences", "Requests waiting for a KV slot", "GAUGE"),
    ("generated_tokens", "kvforge_generated_tokens_total", "Tokens generated", "COUNTER"),
    ("steps", "kvforge_steps_total", "Engine steps run", "COUNTER"),
    ("multi_row_steps", "kvforge_batched_steps_total", "Engine steps that ran more than one sequence", "COUNTER"),
    ("finished", "kvforge_finished_requests_total", "Requests ended by a stop, their length or an error", "COUNTER"),
    ("cancelled", "kvforge_cancelled_requests_total", "Requests ended because their client went away", "COUNTER"),
    ("expired", "kvforge_expired_requests_total", "Requests ended by the queue or request timeout", "COUNTER"),
    ("cancel_poll_seconds", "kvforge_cancel_poll_seconds_total",
     "CPU seconds the sender spent asking whether clients went away (the cost of cancellation)", "COUNTER"),
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

    def __init__(self, sender, stream: bool, log_id: str, echo: str = "", triton_id: str = ""):
        self.sender, self.stream, self.log_id = sender, stream, log_id
        self.echo = echo  # the prompt text, sent before the output when exclude_input_in_output is false
        self.triton_id = triton_id  # the client's request id, which a `stop` request names
        self.request_id = None  # set once the engine accepted the request
        self.cancelled = self.finished = self.stopped = False
        self.gathered = None
        self.arrived = time.perf_counter()
        self.first_token = self.last_sent = self.cancel_seen = None
        self.next_poll = 0.0


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


def response(out: RequestOutput, echo: str = ""):
    """One response of the llm model: the text and tokens of `out`, with their counts."""
    tensors = [
        # one text per response, 1-D like TensorRT-LLM's postprocessing output (llama-index iterates it)
        pb_utils.Tensor("text_output", np.array([(echo + out.text).encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array([out.token_ids], dtype=np.int32)),
        pb_utils.Tensor("num_input_tokens", np.array([[out.prompt_tokens]], dtype=np.int32)),
        pb_utils.Tensor("num_output_tokens", np.array([[len(out.token_ids)]], dtype=np.int32)),
        pb_utils.Tensor("sequence_length", np.array([[out.output_tokens]], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([[(out.finish_reason or "").encode()]], dtype=np.object_))]
    if out.logprobs is not None:
        tensors += [pb_utils.Tensor("cum_log_probs", np.array([[out.cum_logprob]], dtype=np.float32)),
                    pb_utils.Tensor("output_log_probs", np.array([[out.logprobs]], dtype=np.float32))]
    return pb_utils.InferenceResponse(output_tensors=tensors)


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
                                kv_cache_bytes=int(params["kv_cache_bytes"]))
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
        self.metrics = {key: family.Metric(labels=labels) for key, family in self.families.items()}
        for key, name, description in HISTOGRAMS:
            self.families[key] = pb_utils.MetricFamily(name, description, pb_utils.MetricFamily.HISTOGRAM)
        self.histograms = {key: self.families[key].Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for key, _, _ in HISTOGRAMS}
        self.sender = threading.Thread(target=self.send_loop, name="llm-sender", daemon=True)
        self.sender.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            log_id = log_id_of(request)
            try:
                if one_value(request, "stop", False, bool):
                    self.stop(request)
                    continue
                prompt, params, stream, echo = parse(request, self.engine)
                client = Client(sender, stream, log_id, echo, request.request_id())
                client.request_id = self.engine.submit(prompt, params, lambda out, c=client: self.outbox.put((c, out)),
                                                       queue_timeout=self.queue_timeout, timeout=self.request_timeout)
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
            client.sender.send(response(out, client.echo), flags=FINAL if out.finished else 0)
            client.echo = ""
        else:
            client.gathered = client.gathered.merge(out) if client.gathered else out
            if out.finished:
                client.sender.send(response(client.gathered, client.echo), flags=FINAL)

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
            if kind == "GAUGE":
                self.metrics[key].set(stats[key])
            elif stats[key] > self.metrics[key].value():
                self.metrics[key].increment(stats[key] - self.metrics[key].value())

    def finalize(self):
        self.engine.close()  # ends what is left with an error output, sent below
        self.outbox.put(None)
        self.sender.join()
        self.metrics.clear()  # metrics before their families, as the backend requires
        self.histograms.clear()
        self.families.clear()
