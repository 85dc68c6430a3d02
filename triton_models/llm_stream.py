"""The `llm` model's way back to its clients: one ResponseStream per request, and the sender
thread that turns the engine's outputs into responses.

The engine's thread only queues its outputs here, so a slow client never stalls decoding. The
sender thread only sends: it asks `is_cancelled()` as a request's outputs go out (a client that
went away frees its slot at the next step) and writes one access-log line per request (ids and
counts, never the text). Metrics are a second thread's work (MetricsPublisher): each metric update
is a round trip to the server and the engine's stats take the engine's lock, and neither may hold
a token on its way out. With $KVFORGE_TOKEN_TRACE=1 the access-log line also carries each
response's [engine time, send start, send end, tokens] (CLOCK_MONOTONIC seconds, comparable
across this host's processes): where a stream's gap was spent (bench section stream_gaps).
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from kvforge import env, llm_io
from kvforge.errors import CANCELLED, INTERNAL, INVALID, UNAVAILABLE, Kind, KVForgeError, QueueFullError
from kvforge.jsonlog import append_json_line
from runtime.sequence import RequestOutput
from triton_models.llm_metrics import EngineMetrics
from triton_models.llm_request import ALL_OUTPUTS
from triton_models.responses import CANCELLED_MESSAGE, FINAL, send_error

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

# llm output -> its value in one response, with TensorRT-LLM's shapes (dtypes: llm_io.OUTPUTS)
VALUES = {
    # one text per response, 1-D like TensorRT-LLM's postprocessing output (llama-index iterates it)
    "text_output": lambda out, echo: [(echo + out.text).encode("utf-8")],
    "output_ids": lambda out, echo: [out.token_ids],
    "num_input_tokens": lambda out, echo: [[out.prompt_tokens]],
    "num_output_tokens": lambda out, echo: [[len(out.token_ids)]],
    "sequence_length": lambda out, echo: [[out.output_tokens]],
    "finish_reason": lambda out, echo: [[(out.finish_reason or "").encode()]],
    "cum_log_probs": lambda out, echo: [[out.cum_logprob]],
    "output_log_probs": lambda out, echo: [[out.logprobs]],
    "output_top_log_probs": lambda out, echo: top_array(out, 1),
    "output_top_token_ids": lambda out, echo: top_array(out, 0),
    "cached_tokens": lambda out, echo: [[out.cached_tokens]],
}
# outputs only for requests that asked for them: log-probs, top log-probs (RequestOutput's field)
ASKED_FOR = {"cum_log_probs": "logprobs", "output_log_probs": "logprobs",
             "output_top_log_probs": "top_logprobs", "output_top_token_ids": "top_logprobs"}


def top_array(out: RequestOutput, part: int) -> np.ndarray:
    """[1 beam, tokens, k] of the tokens' top ids (part 0) or log-probs (part 1)."""
    k = len(out.top_logprobs[0]) if out.top_logprobs else 0
    values = [[pair[part] for pair in top] for top in out.top_logprobs]
    return np.array(values).reshape(1, 1, len(values), k)


def response(out: RequestOutput, echo: str = "", names=ALL_OUTPUTS):
    """One response of the llm model: the requested outputs of `out` (Triton would drop the
    others after they crossed to the server; not building them saves that work per token)."""
    sent = [name for name in llm_io.OUTPUTS
            if name in names and (name not in ASKED_FOR or getattr(out, ASKED_FOR[name]) is not None)]
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(name, np.array(VALUES[name](out, echo), dtype=llm_io.OUTPUTS[name].numpy_dtype))
        for name in sent])


def error_kind(out: RequestOutput, stopped: bool) -> Kind | None:
    """The kind of error an engine output ends its request with; None for a normal end."""
    if out.finish_reason == "cancelled":
        return None if stopped else CANCELLED  # a `stop` signal ends the stream normally
    if out.finish_reason == "timeout":
        return UNAVAILABLE
    return INTERNAL if out.error else None  # "error": a failed step, an engine shut down


class ResponseStream:
    """One request's responses on their way to its client; without streaming, it gathers the
    outputs for one response at the end."""

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
        self.trace = [] if env.traces_tokens() else None  # [engine time, send start, send end, tokens] per response


def coalesce(items):
    """[(stream, output, emitted)] in arrival order -> what to send: each output alone unless one
    stream has more than MAX_UNMERGED queued, which then go as one response (emitted: the last's)."""
    by_stream = {}
    for stream, out, emitted in items:
        by_stream.setdefault(stream, []).append((out, emitted))
    for stream, outs in by_stream.items():
        if len(outs) <= MAX_UNMERGED:
            yield from ((stream, out, emitted) for out, emitted in outs)
        else:
            merged = outs[0][0]
            for out, _ in outs[1:]:
                merged = merged.merge(out)
            yield stream, merged, outs[-1][1]


def drain(q: queue.Queue, timeout: float) -> list:
    """Everything queued, once something is (or after `timeout` seconds: maybe nothing)."""
    try:
        items = [q.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class MetricsPublisher:
    """The metrics thread: the engine's stats every METRICS_SECONDS (at once when a request
    finished) and the latency observations the sender queues, off the sender's path."""

    def __init__(self, engine, metrics: EngineMetrics, sender_stats):
        self.engine, self.metrics, self.sender_stats = engine, metrics, sender_stats
        self.observations = queue.Queue()
        self.thread = threading.Thread(target=self.run, name="llm-metrics", daemon=True)
        self.thread.start()

    FINISHED, CLOSE = "request finished", "close"  # queued beside the histograms' names

    def observe(self, histogram: str, seconds: float) -> None:
        self.observations.put((histogram, seconds))

    def request_finished(self) -> None:
        """Publish the stats at once (a request's counts change when it ends)."""
        self.observations.put((self.FINISHED, 0.0))

    def run(self) -> None:
        next_publish = 0.0
        while True:
            items = drain(self.observations, max(0.0, next_publish - time.monotonic()))
            names = {name for name, _ in items}
            for histogram, seconds in items:
                if histogram not in (self.FINISHED, self.CLOSE):
                    self.metrics.observe(histogram, seconds)
            if self.CLOSE in names:
                return
            if self.FINISHED in names or time.monotonic() >= next_publish:
                self.metrics.publish(dict(self.engine.stats(), **self.sender_stats()))
                next_publish = time.monotonic() + METRICS_SECONDS

    def close(self) -> None:
        self.observations.put((self.CLOSE, 0.0))
        self.thread.join()
        self.metrics.close()


class ResponseSender:
    """The sender thread of one llm model instance, and the streams it has live."""

    def __init__(self, engine, metrics: EngineMetrics, access_log: Path | None):
        self.engine, self.access_log = engine, access_log
        self.outbox = queue.Queue()
        self.live = set()
        self.by_triton_id = {}  # request id -> live ResponseStream, for TensorRT-LLM's `stop` requests
        self.live_lock = threading.Lock()
        self.poll_seconds = 0.0
        self.metrics = MetricsPublisher(engine, metrics, lambda: dict(cancel_poll_seconds=self.poll_seconds))
        self.thread = threading.Thread(target=self.run, name="llm-sender", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the model's side

    def on_output(self, stream: ResponseStream):
        """The engine's callback for the request behind `stream` (it runs on the engine thread)."""
        return lambda out: self.outbox.put((stream, out, time.perf_counter()))

    def track(self, stream: ResponseStream) -> None:
        """The engine accepted the request: from now on it is polled for cancellation."""
        with self.live_lock:
            if not stream.finished:  # a short request may be done already
                self.live.add(stream)
                if stream.triton_id:
                    self.by_triton_id[stream.triton_id] = stream

    def stop(self, triton_id: str) -> None:
        """End the live request with this Triton request id; its stream ends normally."""
        with self.live_lock:
            stream = self.by_triton_id.get(triton_id) if triton_id else None
            if stream is not None:
                stream.stopped = True
        if stream is not None:
            self.engine.cancel(stream.request_id)

    def refuse(self, sender, log_id: str, error: KVForgeError) -> None:
        """A request that never reached the engine: its error, and its access-log line."""
        send_error(sender, error.kind, str(error))
        if isinstance(error, QueueFullError):
            self.log(dict(request_id=log_id, finish_reason="queue_full"))
        else:
            reason = "invalid" if error.kind is INVALID else error.kind.name
            self.log(dict(request_id=log_id, finish_reason=reason, error=str(error)[:200]))

    def close(self) -> None:
        """After the engine closed (its last outputs are queued): send them, then stop."""
        self.outbox.put(None)
        self.thread.join()
        self.metrics.close()

    # ------------------------------------------------------------------ the sender thread

    def log(self, record: dict) -> None:
        append_json_line(self.access_log, dict(source="engine", **record))

    def run(self) -> None:
        next_poll = 0.0
        stopping = False
        while not stopping:
            items = drain(self.outbox, CANCEL_POLL_SECONDS)
            stopping = None in items
            for stream, out, emitted in coalesce(item for item in items if item is not None):
                try:
                    self.send(stream, out, emitted)
                except Exception as e:  # one request's failed send must not stop every other stream
                    pb_utils.Logger.log_error(f"llm: sending a response failed: {e}")
            now = time.monotonic()
            if now >= next_poll:
                self.poll_cancelled()
                next_poll = now + CANCEL_POLL_SECONDS

    def check_cancelled(self, stream: ResponseStream) -> None:
        """Once the client went away, the engine ends the request with a "cancelled" output."""
        started = time.thread_time()
        stream.last_poll = time.monotonic()
        if stream.request_id is not None and not stream.cancelled and stream.sender.is_cancelled():
            stream.cancelled, stream.cancel_seen = True, time.perf_counter()
            self.engine.cancel(stream.request_id)
        self.poll_seconds += time.thread_time() - started

    def poll_cancelled(self) -> None:
        """The timer's share: requests that had no output for IDLE_POLL_SECONDS."""
        now = time.monotonic()
        with self.live_lock:
            idle = [s for s in self.live if now - s.last_poll >= IDLE_POLL_SECONDS]
        for stream in idle:
            self.check_cancelled(stream)

    def send(self, stream: ResponseStream, out: RequestOutput, emitted: float) -> None:
        if not out.finished and time.monotonic() - stream.last_poll >= CANCEL_POLL_SECONDS:
            self.check_cancelled(stream)
        if stream.cancelled and not out.finished:
            return
        if out.finished:
            with self.live_lock:
                stream.finished = True
                self.live.discard(stream)
                if self.by_triton_id.get(stream.triton_id) is stream:
                    del self.by_triton_id[stream.triton_id]
        sending = time.perf_counter()
        kind = error_kind(out, stream.stopped)
        if kind is not None:
            send_error(stream.sender, kind, out.error or CANCELLED_MESSAGE)
        elif stream.stream:
            stream.sender.send(response(out, stream.echo, stream.outputs), flags=FINAL if out.finished else 0)
            stream.echo = ""
        else:
            stream.gathered = stream.gathered.merge(out) if stream.gathered else out
            if out.finished:
                stream.sender.send(response(stream.gathered, stream.echo, stream.outputs), flags=FINAL)
        if stream.trace is not None:
            stream.trace.append([round(emitted, 6), round(sending, 6), round(time.perf_counter(), 6),
                                 len(out.token_ids)])
        self.observe(stream, out)

    def observe(self, stream: ResponseStream, out: RequestOutput) -> None:
        """Latency histograms once the response went out; the access-log line when it was the last."""
        now = time.perf_counter()
        if out.token_ids:
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.observe("ttft", now - stream.arrived)
            elif stream.stream:
                self.metrics.observe("inter_token", (now - stream.last_sent) / len(out.token_ids))
            stream.last_sent = now
        if not out.finished:
            return
        self.metrics.observe("e2e", now - stream.arrived)
        if out.queue_seconds is not None:
            self.metrics.observe("queue", out.queue_seconds)
        if out.handoff_seconds is not None:
            self.metrics.observe("handoff", out.handoff_seconds)
        self.metrics.request_finished()  # after its observations: a scrape that counts it sees them
        ttft = stream.first_token - stream.arrived if stream.first_token else None
        self.log(dict(request_id=stream.log_id, engine_id=stream.request_id, stream=stream.stream,
                      prompt_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
                      finish_reason=out.finish_reason, error=out.error and out.error[:200],
                      queue_ms=round(1000 * (out.queue_seconds or 0), 2),
                      ttft_ms=round(1000 * ttft, 2) if ttft is not None else None,
                      total_ms=round(1000 * (now - stream.arrived), 2),
                      # from seeing the cancellation to the engine's last output: at most one step
                      stop_ms=round(1000 * (now - stream.cancel_seen), 2) if stream.cancel_seen else None,
                      **({"trace": stream.trace} if stream.trace is not None else {})))
