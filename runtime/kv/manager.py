"""KV memory, in real bytes: the runner's slot buffers, the prefix cache over the host block
pool (runtime/kv/block_pool.py), loads from the tiers below it, and swapping whole rows out
when running sequences outgrow the budget.

Slot buffers. Running sequences occupy runner rows 0..n-1; the runner allocates `rows x
capacity` and this manager keeps that within `kv_cache_bytes`: a sequence is admitted only if
the rows (a power of two, or as many as the budget holds below it; at most `slots`) at the
capacity bucket of what it needs still fit -
its promise (prompt + max_tokens) under "reserve" admission, what it holds now under
"optimistic" admission, where a batch that outgrows the budget preempts its youngest sequence
(swapped to the host pool within SWAP_RESERVE of it, else recomputed). The buffers are views of
one reservation of the budget (or of every slot at max_seq_len, if less), mapped at startup
(runtime/runners/ort.py SlotReservation): a resize or a row move never touches fresh pages. The
process holds the reservation (kv_bytes_held); utilization is the layout of now over the budget.

Prefix cache. On admission the longest cached prefix of full blocks (never the last prompt
token: its logits are needed) is copied into the row, and prefill starts after it. A request
whose next blocks are being computed by a running sequence waits for them instead of computing
them again. Filled blocks are copied out to the pool after each step (and written behind to
the lower tiers).
"""
from __future__ import annotations

import time

from kvforge.block_hash import block_hash, chain, placement_tags, root_hash
from runtime.kv.block_pool import HostBlockPool
from runtime.kv.tiers.lower import LowerTiers
from runtime.runners.base import Runner
from runtime.sequence import Sequence

SWAP_RESERVE = 0.5  # share of the host pool that swapped-out rows may take; beyond it, preempt by recompute


class KVManager:
    """Not thread-safe: the scheduler calls it under the engine's lock."""

    def __init__(self, runner: Runner, slots: int, kv_cache_bytes: int, pool: HostBlockPool | None,
                 namespace: bytes, tiers: LowerTiers | None = None, optimistic: bool = False):
        self.runner = runner
        self.slots = slots
        self.kv_cache_bytes = kv_cache_bytes
        self.pool = pool
        self.namespace = namespace
        # optimistic: admit on what sequences hold now, and preempt (swap / recompute) when they
        # outgrow the budget; else reserve each promise (prompt + max_tokens) up front
        self.optimistic = optimistic
        self.swapped_blocks = 0  # pool blocks holding swapped-out rows, within SWAP_RESERVE of the pool
        self.tiers = tiers  # disk / Redis below the pool (runtime/kv/tiers/); needs the pool
        # request id -> pool blocks a loading request holds (its RAM hit and what arrived), so
        # promoting the rest of its prefix cannot evict the head
        self.loading_refs: dict[int, list[int]] = {}
        if tiers is not None:
            pool.on_evict = tiers.demote
        self.block_tokens = runner.block.tokens
        self._capacities: dict[int, int] = {}  # rows -> _capacity_for(rows)
        self.bytes_per_token = runner.manifest.kv_bytes_per_token
        self.in_flight: dict[bytes, int] = {}  # block hash -> request id of the running sequence computing it
        self.counters = dict(prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, copy_in_blocks=0,
                             copy_in_seconds=0.0, copy_out_blocks=0, copy_out_seconds=0.0, resizes=0, row_moves=0)
        runner.reserve(min(kv_cache_bytes, slots * runner.manifest.max_seq_len * runner.manifest.kv_bytes_per_token))
        runner.allocate(1, runner.bucket_for(1))

    # ------------------------------------------------------------------ slot buffers

    def _rows_for(self, sequences: int, tokens: int) -> int:
        """Runner rows for `sequences` packed rows at the capacity bucket of `tokens`: the next power
        of two, so rows grow rarely (a resize copies every row's KV), but within the slots and no
        more than the budget holds there (never fewer than `sequences`: then the byte check fails)."""
        held = self.kv_cache_bytes // self._slot_bytes(1, tokens)
        return min(self.slots, 1 << max(0, sequences - 1).bit_length(), max(sequences, held))

    def _slot_bytes(self, rows: int, tokens: int) -> int:
        return rows * self.runner.bucket_for(tokens) * self.bytes_per_token

    def fits_ever(self, seq: Sequence) -> bool:
        return self._slot_bytes(1, seq.max_tokens_total) <= self.kv_cache_bytes

    def _needs(self, seq: Sequence) -> int:
        """Capacity seq needs: its promise when reserving, else what the next step writes (at most all its tokens)."""
        return len(seq.tokens) if self.optimistic else seq.max_tokens_total

    def can_admit(self, seq: Sequence, running: list[Sequence]) -> bool:
        if len(running) >= self.slots:
            return False
        longest = max(self._needs(s) for s in [*running, seq])
        return self._slot_bytes(self._rows_for(len(running) + 1, longest), longest) <= self.kv_cache_bytes

    def fits(self, running: list[Sequence]) -> bool:
        """Whether the next step of `running` fits the budget (always true when reserving)."""
        longest = max(map(self._needs, running))
        return self._slot_bytes(self._rows_for(len(running), longest), longest) <= self.kv_cache_bytes

    def preempt(self, seq: Sequence, row: int) -> list[int] | None:
        """seq leaves the batch for now: its row goes to pool blocks (returned; None when the swap
        reserve is used up or there is no pool: seq will be recomputed from its tokens). Requests
        waiting for blocks it announced compute them themselves."""
        for h in seq.block_hashes:
            if self.in_flight.get(h) == seq.request_id:
                del self.in_flight[h]
        blocks = -(-seq.num_cached // self.block_tokens)
        swapped = None
        if self.pool is not None and self.swapped_blocks + blocks <= SWAP_RESERVE * self.pool.num_blocks:
            swapped = self.swap_out(seq, row)
        if swapped is None:
            if self.pool is not None:
                self.pool.release(seq.pool_blocks[::-1])
            seq.pool_blocks, seq.num_stored_blocks, seq.num_cached, seq.stores_blocks = [], 0, 0, True
        else:
            self.swapped_blocks += len(swapped)
        return swapped

    def _make_room(self, sequences: int) -> None:
        """Enough runner rows for `sequences` packed rows (the ones before keep their KV)."""
        rows = self._rows_for(sequences, self.runner.capacity)
        if rows > self.runner.slots:
            self.runner.resize(self.runner.capacity, sequences - 1, slots=rows)
            self.counters["resizes"] += 1

    def step_room(self, running: list[Sequence]) -> int:
        """The widest next step for `running`: a step writes a window of its width into every row
        (the in-place scatter), so every row's cache plus the width must fit the largest capacity
        whose buffers stay within kv_cache_bytes (and max_seq_len). At least 1: fits() holds."""
        return max(1, self._capacity_for(len(running)) - max(s.num_cached for s in running))

    def _capacity_for(self, rows: int) -> int:
        """The largest capacity whose buffers for `rows` rows stay within kv_cache_bytes (and
        max_seq_len): a binary search over the buckets, kept per row count (it runs every step)."""
        if rows not in self._capacities:
            lo, hi = 1, self.runner.manifest.max_seq_len
            while lo < hi:
                mid = (lo + hi + 1) // 2
                fits = self._slot_bytes(self._rows_for(rows, mid), mid) <= self.kv_cache_bytes
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            self._capacities[rows] = lo
        return self._capacities[rows]

    def fit_capacity(self, tokens: int, rows: int, ahead: int = 0) -> None:
        """A capacity holding `tokens` for packed rows 0..rows-1. Growing drops spare rows too:
        admission checked rows_for(running) x the longest promise against the budget. It grows
        at once to hold `ahead` tokens (the rows' ends once their pending tokens are in, see
        ends()) where the budget allows: a resize copies every row's KV, and growing bucket by
        bucket made a 2K-token prompt resize 13 times beside a decoding stream, 20-36 ms each
        past 1K tokens on small-llama, each one a stall for the stream."""
        wanted = min(max(tokens, ahead), self.runner.manifest.max_seq_len)
        if wanted > self.runner.capacity and self._slot_bytes(self._rows_for(rows, wanted), wanted) > self.kv_cache_bytes:
            wanted = tokens
        if wanted > self.runner.capacity:
            self.runner.resize(self.runner.bucket_for(wanted), rows, slots=self._rows_for(rows, wanted))
            self.counters["resizes"] += 1

    @staticmethod
    def ends(running: list[Sequence]) -> int:
        """Cache positions the longest row needs once its pending tokens (a prompt's rest) are in,
        and the next token written."""
        return max((s.num_cached + s.pending + 1 for s in running), default=1)

    def shrink(self, running: list[Sequence]) -> None:
        """A smaller bucket once the longest sequence has left (not below what a prompt still
        prefilling will need: see fit_capacity); rows are kept for the next ones until nothing
        runs (then the layout is one row of the smallest bucket, inside the reservation)."""
        capacity = self.runner.bucket_for(min(self.ends(running), self.runner.manifest.max_seq_len))
        slots = self.runner.slots if running else 1
        if capacity < self.runner.capacity or slots < self.runner.slots:
            self.runner.resize(capacity, len(running), slots=slots)
            self.counters["resizes"] += 1

    def refit(self, running: list[Sequence]) -> None:
        """After a preemption: exactly the rows and capacity `running` needs, within the budget again."""
        capacity = self.runner.bucket_for(max(s.num_cached + 1 for s in running))
        slots = self._rows_for(len(running), capacity)
        if (capacity, slots) != (self.runner.capacity, self.runner.slots):
            self.runner.resize(capacity, len(running), slots=slots)
            self.counters["resizes"] += 1

    def insert_row(self, running: list[Sequence], row: int, seq: Sequence) -> None:
        """seq becomes runner row `row` of the packed rows (running[i] is row i); the sequence
        there moves, KV and all, to a new last row."""
        self._make_room(len(running) + 1)
        if row < len(running):
            self.runner.move(row, len(running), running[row].num_cached)
            running.append(running[row])
            running[row] = seq
        else:
            running.append(seq)

    def prompts_first(self, running: list[Sequence]) -> None:
        """Rows still prefilling before the decoding ones, in their order: a step's chunk rows are
        rows 0..P-1 up to the last one feeding a prompt (runtime/runners/base.py pack_step), so a
        decoding row among them (a prompt that finished prefilling ahead of a newer one, or the
        row that filled a hole) would attend with the chunk's width over the chunk's span. Each
        such row moves behind the last prefilling row: rows decoding..last rotate by one, through a
        spare row holding whichever of them has the least KV (every row's KV is copied once, that
        one's twice: a prompt just begun rather than the 2K-token row that finished ahead of it).
        Without room for a spare row within the slots and the byte budget, the rows stay as they are."""
        while True:
            decoding = next((i for i, s in enumerate(running) if s.pending == 1), None)
            last_prompt = max((i for i, s in enumerate(running) if s.pending > 1), default=-1)
            spare = len(running)
            rows = self._rows_for(spare + 1, self.runner.capacity)
            if decoding is None or last_prompt < decoding or rows <= spare or \
                    self._slot_bytes(rows, self.runner.capacity) > self.kv_cache_bytes:
                return
            self._make_room(spare + 1)
            parked = min(range(decoding, last_prompt + 1), key=lambda i: running[i].num_cached)
            self.runner.move(parked, spare, running[parked].num_cached)
            row = parked  # each row takes the KV of the one after it; the last prompt's, the decoding row's
            while (source := row + 1 if row < last_prompt else decoding) != parked:
                self.runner.move(source, row, running[source].num_cached)
                row = source
            self.runner.move(spare, row, running[parked].num_cached)
            running.insert(last_prompt, running.pop(decoding))
            self.counters["row_moves"] += 1

    def remove_row(self, running: list[Sequence], row: int) -> Sequence:
        """Take row's sequence out of the packed rows; the last row moves into the hole."""
        seq, last = running[row], len(running) - 1
        if row != last:
            self.runner.move(last, row, running[last].num_cached)
            running[row] = running[last]
        running.pop()
        return seq

    @property
    def utilization(self) -> float:
        return self.runner.kv_bytes_allocated / self.kv_cache_bytes

    # ------------------------------------------------------------------ prefix cache

    def _hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The chain hashes of seq's first `blocks` full blocks (computed once, extended as it grows)."""
        hashes, b = seq.block_hashes, self.block_tokens
        parent = hashes[-1] if hashes else root_hash(self.namespace, seq.cache_salt)
        for i in range(len(hashes), blocks):
            parent = block_hash(parent, seq.tokens[i * b:(i + 1) * b])
            hashes.append(parent)
        return hashes[:blocks]

    def match(self, seq: Sequence) -> tuple[list[int], bool]:
        """(ids of the cached blocks seq can start from, whether its next block is being computed
        by a running sequence - then it should wait for it)."""
        if self.pool is None:
            return [], False
        hashes = self._hashes(seq, (seq.num_prompt - 1) // self.block_tokens)
        hit = self.pool.lookup(hashes)
        return hit, len(hit) < len(hashes) and hashes[len(hit)] in self.in_flight

    def uncached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens seq would compute if admitted now (its RAM prefix hit aside)."""
        return seq.num_prompt - len(self.match(seq)[0]) * self.block_tokens

    def cached_blocks(self, token_ids: list[int], salt: bytes | None) -> tuple[list[bytes], dict]:
        """The hashes and copies of the leading full blocks of token_ids (the last token's block
        never: a prompt's last token is always recomputed) that the pool holds."""
        if self.pool is None:
            return [], {}
        hashes = chain(self.namespace, salt, token_ids, (len(token_ids) - 1) // self.block_tokens, self.block_tokens)
        found = self.pool.lookup(hashes)
        return hashes[:len(found)], self.pool.get(found)

    def admit(self, seq: Sequence, row: int, hit: list[int], rows: int) -> None:
        """seq now owns row `row` of `rows` packed rows: copy its cached prefix in, and announce the prompt blocks
        it is about to compute so that requests with the same prefix wait for them."""
        self.counters["prefix_cache_queried_tokens"] += seq.num_prompt
        if self.pool is None:
            return
        if hit:
            began = time.perf_counter()
            tokens = len(hit) * self.block_tokens
            self.fit_capacity(tokens + 1, rows)
            self.pool.acquire(hit)
            self._copy_in(row, hit)
            self.counters["copy_in_seconds"] += time.perf_counter() - began
            self.counters["copy_in_blocks"] += len(hit)
            self.counters["prefix_cache_hit_tokens"] += tokens
            seq.num_cached = seq.cached_tokens = tokens
            seq.pool_blocks, seq.num_stored_blocks = list(hit), len(hit)
        self._drop_loading_refs(seq)
        for h in self._hashes(seq, seq.num_prompt // self.block_tokens)[len(hit):]:
            self.in_flight.setdefault(h, seq.request_id)

    def store(self, seq: Sequence, row: int) -> None:
        """Copy the blocks seq has filled since the last call out to the pool."""
        full = seq.num_cached // self.block_tokens
        start = seq.num_stored_blocks
        if self.pool is None or full <= start or not seq.stores_blocks:
            return
        hashes = self._hashes(seq, full)[start:]
        for h in hashes:
            if self.in_flight.get(h) == seq.request_id:
                del self.in_flight[h]
        began = time.perf_counter()
        data = self.runner.read_blocks(row, start, len(hashes))
        ids = self.pool.put(data, hashes)
        if self.tiers is not None:  # write-behind: every full block reaches disk / Redis when it is made
            self.tiers.store(hashes, data, placement_tags(seq.block_hashes, start, len(hashes)))
        self.counters["copy_out_seconds"] += time.perf_counter() - began
        self.counters["copy_out_blocks"] += len(hashes)
        seq.pool_blocks += ids
        seq.num_stored_blocks = full
        if len(ids) < len(hashes):  # the pool is full of referenced blocks: a gap ends seq's chain
            seq.stores_blocks = False

    # ------------------------------------------------------------------ lower tiers (disk, Redis)

    def start_load(self, seq: Sequence, hit: list[int], recompute_seconds: float | None) -> bool:
        """Ask the tiers below RAM for the prompt blocks after `hit` (once per request); True if
        seq should wait in the loading state for them."""
        if self.tiers is None or seq.tiers_checked:
            return False
        seq.tiers_checked = True
        hashes = self._hashes(seq, (seq.num_prompt - 1) // self.block_tokens)[len(hit):]
        if not hashes:
            return False
        self.pool.acquire(hit)
        self.loading_refs[seq.request_id] = list(hit)
        tags = placement_tags(seq.block_hashes, len(hit), len(hashes))
        self.tiers.request_load(seq.request_id, hashes, tags, recompute_seconds)
        return True

    def finish_loads(self) -> list[int]:
        """Promote finished loads into the RAM pool, held for their request until it is admitted
        (match then finds them); returns the request ids whose loads ended."""
        ended = []
        for request_id, hashes, found in self.tiers.finished_loads() if self.tiers is not None else []:
            if found:
                ids = self.pool.put({name: [block[name] for block in found] for name in self.pool.arrays}, hashes)
                if request_id in self.loading_refs:
                    self.loading_refs[request_id] += ids
                else:  # the request went on without it: the blocks stay cached for the next one
                    self.pool.release(ids[::-1])
            ended.append(request_id)
        return ended

    def _drop_loading_refs(self, seq: Sequence) -> None:
        if self.pool is not None:
            self.pool.release(self.loading_refs.pop(seq.request_id, [])[::-1])

    def release(self, seq: Sequence) -> None:
        """seq left: its references go (tail first, so the tail is evicted first); its announced
        blocks are no longer coming."""
        if self.pool is not None:
            self.pool.release(seq.pool_blocks[::-1])
            if seq.swapped_blocks is not None:  # cancelled while preempted
                self.pool.release(seq.swapped_blocks)
                self.swapped_blocks -= len(seq.swapped_blocks)
        seq.pool_blocks, seq.swapped_blocks = [], None
        self._drop_loading_refs(seq)
        for h in seq.block_hashes:
            if self.in_flight.get(h) == seq.request_id:
                del self.in_flight[h]

    def clear(self) -> int:
        """Empty the prefix cache (running sequences keep their slots); returns the blocks dropped."""
        return self.pool.clear() if self.pool is not None else 0

    # ------------------------------------------------------------------ whole rows (swap)

    def swap_out(self, seq: Sequence, row: int) -> list[int] | None:
        """Copy row's cached tokens, partial last block included, to anonymous pool blocks (one
        reference each, held by the caller); None if the pool cannot hold them."""
        blocks = -(-seq.num_cached // self.block_tokens)
        if self.pool is None or len(self.pool.free) + len(self.pool.evictable) < blocks:
            return None
        ids = self.pool.put(self.runner.read_blocks(row, 0, blocks), [None] * blocks)
        assert len(ids) == blocks
        return ids

    def swap_in(self, seq: Sequence, row: int, blocks: list[int], rows: int) -> None:
        """Copy a swapped-out row back into row `row` of `rows` packed rows and free its blocks."""
        self.fit_capacity(seq.num_cached + 1, rows)
        self._copy_in(row, blocks)
        self.pool.release(blocks)
        self.swapped_blocks = max(0, self.swapped_blocks - len(blocks))

    def _copy_in(self, row: int, blocks: list[int]) -> None:
        for first, views in self.pool.runs(blocks):
            self.runner.write_blocks(row, first, views)

    def stats(self) -> dict:
        pool = self.pool
        tiers = self.tiers.stats() if self.tiers is not None else LowerTiers.no_stats()
        return dict(kv_utilization=self.utilization, kv_bytes_allocated=self.runner.kv_bytes_allocated,
                    kv_bytes_held=self.runner.kv_bytes_held,
                    kv_cache_bytes=self.kv_cache_bytes, capacity=self.runner.capacity, **self.counters,
                    kv_host_pool_bytes=pool.bytes_used if pool else 0,
                    kv_host_pool_budget_bytes=pool.budget_bytes if pool else 0,
                    kv_host_pool_blocks=pool.num_blocks if pool else 0,
                    **(pool.counters if pool else dict(blocks_evicted=0, blocks_stored=0, blocks_deduplicated=0,
                                                       blocks_dropped=0)), **tiers)
