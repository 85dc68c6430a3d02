"""LLMEngine: continuous-batching generation over an engine dir, driven by one background thread.

    engine = LLMEngine("model_repository/llm/1/engine")
    request_id = engine.submit("def f(x):", SamplingParams(max_tokens=32), on_output=print)
    engine.cancel(request_id)
    outputs = engine.generate(["a", "b"], SamplingParams(max_tokens=8))  # one merged output each
    engine.clear_prefix_cache()  # the operator's reset; outputs say how many prompt tokens were cached

`on_output` runs on the engine thread: it must only hand the output on (e.g. to a queue).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from kvforge.manifest import Manifest, ManifestError, cache_namespace
from kvforge.block_hash import MAX_CACHE_SALT_BYTES
from kvforge.errors import EngineError, RequestError
from kvforge.engine_config import EngineConfig
from kvforge.limits import Limits, mib
from runtime.disaggregation import Disaggregation, PrefillWorker
from runtime.grammar import Grammars
from runtime.kv.block_pool import HostBlockPool, default_kv_host_bytes
from runtime.kv.manager import KVManager
from runtime.kv.rows import KVCopies
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.disk import DiskTier
from runtime.kv.tiers.lower import LowerTiers
from runtime.kv.tiers.redis import RedisTier
from runtime.runners import open_runner
from runtime.runners.base import Batch
from runtime.sampling import SamplingParams, check_vocabulary
from runtime.scheduler import Scheduler
from runtime.sequence import RequestOutput, Sequence
from runtime.speculation import NgramIndex, Speculation
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

log = logging.getLogger("kvforge.engine")
LOAD_POLL_SECONDS = 0.01
# generate() waits at most this long by default; close() this long for the engine thread (a step
# in flight finishes first: generous for a big model's prefill chunk on a busy CPU)
GENERATE_TIMEOUT = 600.0
CLOSE_TIMEOUT = 120.0
Prompt = str | list[int]


class LLMEngine:
    def __init__(self, engine_dir: Path | str, config: EngineConfig | None = None, *,
                 disaggregation: Disaggregation | None = None, speculation: Speculation | None = None, **settings):
        """config: the engine's settings (kvforge/engine_config.py says what each does); keyword
        settings replace single ones: LLMEngine(engine_dir, slots=4, prefix_cache=False).
        disaggregation and speculation tune in process what the settings make of them (the
        prefill worker's queue, lease and timeout; the drafts' n-grams and rows); by default
        they follow config's disaggregate / pd_* and speculative / speculative_tokens."""
        config = self.config = dataclasses.replace(config or EngineConfig(), **settings)
        engine_dir = Path(engine_dir)
        manifest = Manifest.load(engine_dir)
        if manifest.kv_layout != "inplace":
            raise ManifestError(f"continuous batching needs the inplace KV layout; {engine_dir} is "
                                f"{manifest.kv_layout} (re-export with --kv-layout inplace)")
        self.manifest = manifest
        kv_host_bytes = default_kv_host_bytes() if config.kv_host_bytes is None else config.kv_host_bytes
        self.limits = Limits.from_manifest(manifest, config.slots, config.max_waiting, config.kv_cache_bytes,
                                           host_pool_bytes=kv_host_bytes if config.prefix_cache else 0)
        self.tokenizer = Tokenizer(engine_dir, manifest)
        self.grammars = Grammars(engine_dir / "tokenizer.json", manifest.model.vocab_size, self.tokenizer.eos_token_ids)
        self.runner = open_runner(engine_dir, config.threads, config.spin_us)
        pool = HostBlockPool(self.runner.block, kv_host_bytes) if config.prefix_cache else None
        self._cond = threading.Condition()
        namespace = cache_namespace(manifest)
        self.tiers, self.pd, self._remote = None, None, {}
        self.pd_counters = dict(pd_remote_prefills=0, pd_local_prefills=0, pd_handoffs=0, pd_handoff_bytes=0,
                                pd_handoff_failures=0, pd_handoff_expired=0)
        if disaggregation is None and config.disaggregate:
            disaggregation = Disaggregation(threads=config.prefill_threads, transport=config.pd_transport,
                                            threshold_tokens=config.pd_threshold)
        if disaggregation is not None:
            if pool is None:
                raise ValueError("disaggregated serving hands the KV over as a prefix hit: it needs the prefix cache")
            self.pd = PrefillWorker(engine_dir, dataclasses.replace(disaggregation, redis_url=config.kv_redis_url),
                                    self._handed_off)
        handoff = [self.pd.handoff] if self.pd is not None and self.pd.handoff is not None else []
        if pool is not None and (config.kv_disk_dir or config.kv_redis_url or handoff):
            codec = BlockCodec(self.runner.block, namespace)
            tiers = handoff + ([DiskTier(Path(config.kv_disk_dir), config.kv_disk_bytes, codec)]
                               if config.kv_disk_dir else [])
            tiers += [RedisTier(config.kv_redis_url, codec, config.kv_redis_ttl)] if config.kv_redis_url else []
            self.tiers = LowerTiers(codec, tiers, wake=self._wake, lock=self._cond)
        self.kv = KVManager(self.runner, self.limits.slots, self.limits.kv_cache_bytes, pool, namespace, self.tiers,
                            optimistic=config.admission == "optimistic")
        if speculation is None and config.speculative == "ngram":
            speculation = Speculation(max_draft_tokens=config.speculative_tokens)
        self.speculates_by_default = speculation is not None
        itl_target = None if config.itl_target_ms is None else config.itl_target_ms / 1000
        self.scheduler = Scheduler(self.kv, manifest.max_seq_len, self.limits.max_waiting, config.prefill_budget,
                                   itl_target, config.itl_target_steps, config.solo_prefill_tokens,
                                   config.scheduler == "stall-free", speculation or Speculation(),
                                   config.attention_scores_bytes)
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvforge-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: Prompt, params: SamplingParams | None = None,
               on_output: Callable[[RequestOutput], None] | None = None, *,
               cache_salt: bytes | None = None, queue_timeout: float | None = None,
               timeout: float | None = None) -> int:
        """Queue a request; returns its id. Raises RequestError (QueueFullError when saturated).
        cache_salt: the request shares cached prefixes only with requests of the same salt.
        A request still waiting for a slot after queue_timeout seconds, or still running after
        timeout seconds, ends with finish_reason "timeout" (None: the config's queue_timeout and
        request_timeout; unset: no bound)."""
        seq = self._prepare(prompt, params, on_output, cache_salt, queue_timeout, timeout)
        self._enqueue([seq])
        return seq.request_id

    def _prepare(self, prompt: Prompt, params: SamplingParams | None, on_output, cache_salt: bytes | None,
                 queue_timeout: float | None, timeout: float | None) -> Sequence:
        """A request's checks, its tokenization and its guide's grammar, on the caller's thread and
        without the engine's lock: a long prompt being tokenized or a schema being compiled holds
        no step and no other request."""
        params = params or SamplingParams()
        params.validate()
        if cache_salt is not None and (not isinstance(cache_salt, bytes) or len(cache_salt) > MAX_CACHE_SALT_BYTES):
            raise RequestError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes")
        ids = self._prompt_ids(prompt)
        limit = self.limits.max_seq_len
        if len(ids) >= limit:
            raise RequestError(f"the prompt is {len(ids)} tokens; the context holds {limit} tokens "
                               "including at least one generated token")
        if params.max_tokens > limit - len(ids):
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                               f"the context of {limit} tokens; ask for at most {limit - len(ids)} tokens")
        check_vocabulary(params, self.limits.vocab_size)
        if params.bad_words:
            params = dataclasses.replace(params, bad_word_ids=tuple(
                tuple(self.tokenizer.encode(word, add_special_tokens=False)) for word in params.bad_words))
        end_ids = (params.end_id,) if params.end_id is not None else self.tokenizer.eos_token_ids
        seq = Sequence(next(self._ids), ids, params, on_output or (lambda out: None),
                       IncrementalDetokenizer(self.tokenizer, ids),
                       frozenset(end_ids) | frozenset(params.stop_token_ids),
                       cache_salt=cache_salt or None)
        if params.speculative == "ngram" or (params.speculative is None and self.speculates_by_default):
            seq.ngrams = NgramIndex(self.scheduler.speculation.max_ngram)
            seq.draft_limit = self.scheduler.speculation.max_draft_tokens
        queue_timeout = self.config.queue_timeout if queue_timeout is None else queue_timeout
        timeout = self.config.request_timeout if timeout is None else timeout
        if queue_timeout is not None:
            seq.queue_deadline = seq.arrived + queue_timeout
        if timeout is not None:
            seq.deadline = seq.arrived + timeout
        if not self.kv.rows.fits_ever(seq):
            limits = self.limits
            raise RequestError(f"the request needs {self.runner.bucket_for(seq.max_tokens_total)} KV tokens (the "
                               f"capacity bucket of its {len(ids)}-token prompt plus max_tokens {params.max_tokens}) "
                               f"but the cache holds {limits.kv_tokens} (kv_cache_bytes {mib(limits.kv_cache_bytes)} "
                               f"at {limits.kv_bytes_per_token} bytes per token), so it could never run: lower "
                               "max_tokens or shorten the prompt (the server's KV_CACHE_MIB sets the budget)")
        if params.guide is not None:  # compiled last, once every cheaper check passed
            seq.constraint = self.grammars.constraint(params.guide, seq.stop_token_ids)
            seq.jump_forward = self.config.jump_forward and not params.logprobs
        return seq

    def _enqueue(self, seqs: list[Sequence]) -> None:
        """Prepared requests join the queue (or go to the prefill worker) as one arrival."""
        remote = []
        with self._cond:
            if self._closed:
                raise EngineError("the engine is shut down")
            for seq in seqs:
                if self.pd is not None and self.pd.accepts(self.kv.prefix.uncached_tokens(seq)):
                    self.scheduler.check_room(len(self._remote))
                    self._remote[seq.request_id] = seq
                    self.pd_counters["pd_remote_prefills"] += 1
                    remote.append(seq)
                else:
                    self.scheduler.add(seq, len(self._remote))
                    self.pd_counters["pd_local_prefills"] += self.pd is not None
            self._cond.notify()
        for seq in remote:
            if not self.pd.submit(seq.request_id, seq.tokens[:seq.num_prompt], seq.cache_salt):
                self._handed_off(seq.request_id, False, {"error": "the prefill worker is not reachable"})

    def _handed_off(self, request_id: int, ok: bool, report: dict) -> None:
        """The prefill worker is done with a request (or failed it): it joins the queue, its
        prompt blocks waiting in the hand-off tier (or Redis) as a prefix hit; a failed hand-off
        is prefilled here."""
        with self._cond:
            seq = self._remote.pop(request_id, None)
            if seq is None:
                return  # cancelled meanwhile
            if ok:
                self.pd_counters["pd_handoffs"] += 1
                self.pd_counters["pd_handoff_bytes"] += report["bytes"]
                seq.handoff_seconds = report["write_seconds"]
            else:
                log.warning("hand-off of request %d failed (%s): prefilling it here", request_id, report["error"])
                self.pd_counters["pd_handoff_failures"] += 1
                self.pd_counters["pd_handoff_expired"] += bool(report.get("expired"))
                self.pd_counters["pd_local_prefills"] += 1
            self.scheduler.add(seq, elsewhere=None)
            self._cond.notify()

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if len(prompt) > self.limits.max_prompt_chars:
                raise RequestError(f"the prompt is {len(prompt)} characters; the limit is "
                                   f"{self.limits.max_prompt_chars} for a {self.limits.max_seq_len}-token context")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < self.limits.vocab_size for t in prompt):
                raise RequestError(f"prompt token ids must be in 0..{self.limits.vocab_size - 1}")
            ids = list(prompt)
        else:
            raise RequestError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    def cancel(self, request_id: int) -> bool:
        """Stop a request at the next step and free its slot; False if it is not live."""
        with self._cond:
            remote = self._remote.pop(request_id, None)
            known = remote is not None or self.scheduler.cancel(request_id)
            self._cond.notify()
        if remote is not None:  # being prefilled elsewhere: the worker stops, its hand-off is discarded
            self.pd.cancel(request_id, remote.tokens[:remote.num_prompt], remote.cache_salt)
            with self._cond:
                self.scheduler.counters["cancelled"] += 1
            self._emit([(remote, remote.finish("cancelled"))])
        return known

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 timeout: float | None = GENERATE_TIMEOUT) -> list[RequestOutput]:
        """Blocking convenience: run all prompts together (one params for all, or one per prompt)
        and return each request's outputs merged into one; raise RequestError if any fails.
        Waits at most `timeout` seconds for all of them (None: without a bound); past it, the
        requests still live are cancelled and TimeoutError says so."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        done = threading.Semaphore(0)
        results: dict[int, RequestOutput] = {}

        def collect(out: RequestOutput) -> None:
            results[out.request_id] = results[out.request_id].merge(out) if out.request_id in results else out
            if out.finished:
                done.release()

        seqs = [self._prepare(prompt, p, collect, None, None, None) for prompt, p in zip(prompts, params, strict=True)]
        self._enqueue(seqs)  # the prompts reach the scheduler together, as one arrival
        ids = [seq.request_id for seq in seqs]
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in ids:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.acquire(timeout=left):
                live = [i for i in ids if i not in results or not results[i].finished]
                for request_id in live:
                    self.cancel(request_id)
                raise TimeoutError(f"generation did not finish within {timeout:g} s; its {len(live)} unfinished "
                                   f"request(s) were cancelled (pass a larger timeout, or None for no bound)")
        errors = [results[i].error for i in ids if results[i].error]
        if errors:
            raise RequestError(errors[0])
        return [results[i] for i in ids]

    def stats(self) -> dict:
        with self._cond:
            s = self.scheduler
            return dict(running=len(s.running), waiting=len(s.waiting), loading=s.loading, slots=self.limits.slots,
                        threads=self.runner.threads,
                        step_budget=s.step_budget(), decode_step_seconds=s.costs.decode_seconds,
                        prompt_token_seconds=s.costs.prompt_token_seconds,
                        prompt_step_fixed_seconds=s.costs.prompt_step_fixed_seconds,
                        prefix_cache=self.kv.pool is not None, **self.kv.stats(), **s.counters, **self.pd_counters,
                        **self.grammars.counters,
                        pd_prefill_queue=len(self._remote), pd_prefill_worker_up=int(self.pd is not None and self.pd.up))

    def cached_blocks(self, token_ids: list[int], salt: bytes | None) -> tuple[list[bytes], dict]:
        """The leading full blocks of a prompt in the prefix cache: hashes and copies (what a
        prefill worker hands over)."""
        with self._cond:
            return self.kv.prefix.cached_blocks(token_ids, salt)

    def clear_prefix_cache(self) -> int:
        """Forget every cached prefix block (running requests are unaffected); returns how many."""
        with self._cond:
            return self.kv.prefix.clear()

    # ------------------------------------------------------------------ the step loop

    def _loop(self) -> None:
        while True:
            outputs = []
            with self._cond:
                while not self._closed and not self.scheduler.has_work():
                    self._cond.wait()
                if self._closed:
                    break
            try:
                began = time.perf_counter()
                with self._cond:
                    outputs, batch, copies = self.scheduler.schedule()
                if batch is not None:
                    outputs += self._step(batch, copies, began)
                else:
                    copies.run()  # the rows cancelled or expired requests left, given back
                    if not outputs:  # only loads are pending: sleep until one ends (or a deadline passes)
                        with self._cond:
                            self._cond.wait(LOAD_POLL_SECONDS)
            except Exception as e:  # a failed step ends the running requests, not the engine
                log.exception("engine step failed")
                with self._cond:
                    outputs += self.scheduler.fail_running(f"the engine step failed: {e}")
            self._emit(outputs)
        with self._cond:
            s = self.scheduler
            left, self._remote = [*s.waiting, *s.running, *self._remote.values()], {}
            outputs = [(seq, seq.finish("error", "the engine shut down")) for seq in left]
        self._emit(outputs)

    def _step(self, batch: Batch, copies: KVCopies, began: float) -> list[tuple[Sequence, RequestOutput]]:
        """Run one batch and the KV copies the scheduler decided before and after it: the work done
        without the lock (it touches the runner, and pool blocks the step's rows hold). The
        scheduler measures the whole step, from scheduling it to its outputs, copies included, not
        the runner alone."""
        copies.run()  # rows moved and resized, prefix hits and swapped-out rows copied in
        logits = self.runner.step(batch.input_ids, batch.write_positions, batch.num_new, batch.logit_positions,
                                  batch.prompt_lengths)
        with self._cond:
            outputs, copies = self.scheduler.postprocess(batch, logits)
        copies.run()  # finished rows refilled, the buffers shrunk
        with self._cond:
            self.scheduler.measured(batch, time.perf_counter() - began)
        return outputs

    @staticmethod
    def _emit(outputs: list[tuple[Sequence, RequestOutput]]) -> None:
        for seq, out in outputs:
            try:
                seq.on_output(out)
            except Exception:
                log.exception("on_output of request %d failed", out.request_id)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop the engine: the step in flight finishes, requests left end with an error output,
        queued disk / Redis writes are flushed (within the tiers' drain bound). Raises EngineError
        if the engine thread has not stopped within `timeout` seconds (a step or an on_output
        callback that never returns); the tiers are closed all the same."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        if self.pd is not None:
            self.pd.close()
        if self.tiers is not None:
            self.tiers.close()  # flushes queued disk / Redis writes within the exit timeout
        if self._thread.is_alive():
            raise EngineError(f"the engine thread did not stop within {timeout:g} s of close(): a step or an "
                              "on_output callback is stuck")
        if self.kv.pool is not None:  # its mapped pages go back now, not when a collection finds the engine
            self.kv.pool.close()
        self.runner.close()  # and the KV reservation's

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
