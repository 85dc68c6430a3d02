"""The prefill worker process of disaggregated serving (runtime/disaggregation.py starts it):
its own LLMEngine prefills the prompts the decode engine sends, then writes their full KV blocks
to the hand-off (/dev/shm, or the Redis tier written through) and reports each one done.

    python -m runtime.prefill_worker --engine DIR --socket PATH [--handoff-dir DIR] [ENGINE SETTINGS]

ENGINE SETTINGS are its engine's, as kvforge/engine_config.py derives their flags (the decode
side gives --slots 1 and the worker's threads as its engine's --decode-threads).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

from kvforge import env
from kvforge.block_hash import placement_tags
from kvforge.engine_config import EngineConfig, add_flags, from_flags, given, variable
from kvforge.errors import KVForgeError
from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
from runtime.disaggregation import LEASE_SECONDS
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.handoff import HandoffTier
from runtime.kv.tiers.redis import RedisTier
from runtime.llm_engine import LLMEngine, SamplingParams

log = logging.getLogger("kvforge.prefill_worker")
# Niceness added to the worker's: it runs below the decode engine, so where both share cores a
# prefill chunk waits for a decode step instead of stretching it (bench mixed_load's arrivals,
# disaggregated with 1 + 1 threads on 2 cores, the worker reniced from outside, 6 rounds each:
# the stream's ITL p99 / p50 2.43x at nice 10 vs 2.99x at 0, long-prompt TTFT 6.47 vs 6.66 s).
NICE = 10

def serve(engine_dir: Path, socket: Path, config: EngineConfig, handoff_dir: Path | None,
          lease_seconds: float) -> None:
    manifest = Manifest.load(engine_dir)
    codec = BlockCodec(kv_block_spec(manifest), cache_namespace(manifest))
    if handoff_dir is not None:
        transport = HandoffTier(handoff_dir, codec)
    else:
        transport = RedisTier(os.environ[variable("kv_redis_url")], codec, ttl_seconds=int(lease_seconds))
    parent, send_lock, cancelled = os.getppid(), threading.Lock(), set()
    submitted_at, request_ids = {}, {}  # job -> when it arrived; job -> its request in this engine
    with LLMEngine(engine_dir, config) as engine, \
            Listener(str(socket), family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(env.PD_AUTHKEY))) as listener:
        conn = listener.accept()

        def reply(report: dict) -> None:
            with send_lock:
                conn.send_bytes(json.dumps(report).encode())

        def hand_off(job: int, ids: list[int], salt: bytes | None, out, submitted: float) -> None:
            if out.error or job in cancelled:
                reply({"job": job, "ok": False, "error": out.error or "cancelled"})
                return
            began = time.perf_counter()
            hashes, blocks = engine.cached_blocks(ids, salt)
            entries = [(h, codec.encode(h, {name: array[i] for name, array in blocks.items()}))
                       for i, h in enumerate(hashes)]
            # grouped as the engine reads them; acknowledged only when every block is stored
            stored = transport.put_many(entries, placement_tags(hashes, 0, len(hashes)))
            if job in cancelled and handoff_dir is not None:  # cancelled while written: nobody takes it
                transport.discard(hashes)
            ok = stored == len(entries)
            reply({"job": job, "ok": ok, "blocks": len(hashes), "bytes": sum(len(raw) for _, raw in entries),
                   "prefill_seconds": began - submitted, "write_seconds": time.perf_counter() - began,
                   "error": None if ok else "the hand-off could not be written (is /dev/shm full?)"})

        def hand_off_or_fail(*args) -> None:
            try:
                hand_off(*args)
            except Exception as e:  # noqa: BLE001 - the decode side must hear of it, or it waits for the timeout
                log.exception("hand-off failed")
                reply({"job": args[0], "ok": False, "error": f"the prefill worker failed: {e}"})

        def on_output(job, ids, salt, out):
            if out.finished:
                submitted = submitted_at.pop(job)
                request_ids.pop(job, None)
                threading.Thread(target=hand_off_or_fail, args=(job, ids, salt, out, submitted), daemon=True).start()

        def watch_parent():
            while os.getppid() == parent:
                if handoff_dir is not None:
                    transport.sweep(lease_seconds)
                time.sleep(0.5)
            os._exit(0)  # the decode side is gone: nobody will take what this computes

        threading.Thread(target=watch_parent, daemon=True).start()
        while True:
            try:
                message = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            job = message["job"]
            if message["op"] == "cancel":
                cancelled.add(job)
                if job in request_ids:
                    engine.cancel(request_ids.pop(job))
                continue
            ids, salt = message["ids"], bytes.fromhex(message["salt"]) if message["salt"] else None
            submitted_at[job] = time.perf_counter()
            try:
                request_ids[job] = engine.submit(ids, SamplingParams(max_tokens=1),
                                                 lambda out, j=job, i=ids, s=salt: on_output(j, i, s, out),
                                                 cache_salt=salt)
            except KVForgeError as e:  # e.g. its queue is full: the decode side prefills it
                submitted_at.pop(job)
                reply({"job": job, "ok": False, "error": str(e)})
                continue
            if job not in submitted_at:  # it finished before submit returned
                request_ids.pop(job, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.prefill_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=Path, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--handoff-dir", type=Path, default=None, help="the shared-memory hand-off (default: Redis)")
    parser.add_argument("--lease-seconds", type=float, default=LEASE_SECONDS)
    add_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[kvforge prefill worker] %(message)s")
    os.nice(NICE)  # before the engine starts its threads: they inherit it
    serve(args.engine, args.socket, from_flags(given(args)), args.handoff_dir, args.lease_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
