"""The packed rows: runner row i holds running[i], and this module is the only one that moves,
resizes or writes them (the only caller of runner.resize / move / write_blocks).

Running sequences occupy runner rows 0..n-1, prompt rows before decoding rows: a step's chunk
rows are rows 0..P-1 up to the last one feeding a prompt (runtime/runners/base.py pack_step), so
a decoding row among them would attend with the chunk's width over the chunk's span. A new
sequence goes in front of the first decoding row (the one there moves, KV and all, to a new last
row); a leaving one's hole takes the last row; a prompt that finished prefilling ahead of a newer
one rotates behind it (prompts_first).

The runner allocates `rows x capacity` and these rows keep that within `kv_cache_bytes`: a
sequence is admitted only if the rows (a power of two, or as many as the budget holds below it;
at most `slots`) at the capacity bucket of what it needs still fit - its promise (prompt +
max_tokens) under "reserve" admission, what it holds now under "optimistic" admission, where a
batch that outgrows the budget preempts its youngest sequence (runtime/kv/manager.py). The
buffers are views of one reservation of the budget (or of every slot at max_seq_len, if less),
mapped at startup (runtime/runners/ort.py SlotReservation): a resize or a row move never touches
fresh pages. Bytes come from the manifest per cache tensor (kvforge.manifest.CacheTensor): a
slot of capacity C holds tensor.held(C) positions of each (min(C, tokens); a sliding layer's ring
all its cells, and no step writes more than the export's max_chunk per row: step_room).

Every copy is decided here and recorded, in order, as a KVCopies plan (`take_copies`): the
scheduler returns what its decisions imply and the engine runs it inside the timed step
(runtime/llm_engine.py: schedule's copies before the runner's step, postprocess's after it).
`self.capacity` and `self.allocated` are the layout decided so far; the runner has it once the
plan ran. Reads of a row (a store after a step) happen only with no copy pending.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable

from kvforge.manifest import slot_bytes
from runtime.runners.base import Blocks, Runner
from runtime.sequence import Sequence


class KVCopies:
    """KV copies between the runner's rows and the host pool, in the order they were decided."""

    def __init__(self, ops: list[Callable[[], None]] | None = None):
        self.ops = ops or []

    def __bool__(self) -> bool:
        return bool(self.ops)

    def run(self) -> None:
        for op in self.ops:
            op()
        self.ops = []


class PackedRows:
    """Not thread-safe: the scheduler calls it under the engine's lock, the engine runs its copies."""

    def __init__(self, runner: Runner, slots: int, kv_cache_bytes: int, optimistic: bool = False):
        self.runner = runner
        self.slots = slots
        self.kv_cache_bytes = kv_cache_bytes
        # optimistic: admit on what sequences hold now (the batch may outgrow the budget: the
        # manager preempts); else reserve each promise (prompt + max_tokens) up front
        self.optimistic = optimistic
        self.max_seq_len = runner.manifest.max_seq_len
        self.tensors = runner.manifest.cache_tensors
        self._running: list[Sequence] = []
        self._capacities: dict[int, int] = {}  # rows -> _capacity_for(rows)
        self._copies: list[Callable[[], None]] = []
        self.counters = dict(resizes=0, row_moves=0)
        self.reserved_bytes = min(kv_cache_bytes, slots * slot_bytes(self.tensors, self.max_seq_len))
        runner.reserve(self.reserved_bytes, slots)
        runner.allocate(1, runner.bucket_for(1))
        self.allocated, self.capacity = runner.slots, runner.capacity

    @property
    def running(self) -> tuple[Sequence, ...]:
        """The sequences in rows 0..n-1 (a copy: only this module changes the rows)."""
        return tuple(self._running)

    def take_copies(self) -> KVCopies:
        """The copies decided since the last call, for the engine to run."""
        copies, self._copies = KVCopies(self._copies), []
        return copies

    # ------------------------------------------------------------------ admission arithmetic

    def _rows_for(self, sequences: int, tokens: int) -> int:
        """Runner rows for `sequences` packed rows at the capacity bucket of `tokens`: the next power
        of two, so rows grow rarely (a resize copies every row's KV), but within the slots and no
        more than the budget holds there (never fewer than `sequences`: then the byte check fails)."""
        held = self.kv_cache_bytes // self._slot_bytes(1, tokens)
        return min(self.slots, 1 << max(0, sequences - 1).bit_length(), max(sequences, held))

    def _slot_bytes(self, rows: int, tokens: int) -> int:
        return rows * slot_bytes(self.tensors, self.runner.bucket_for(tokens))

    def fits_ever(self, seq: Sequence) -> bool:
        return self._slot_bytes(1, seq.max_tokens_total) <= self.kv_cache_bytes

    def _needs(self, seq: Sequence) -> int:
        """Capacity seq needs: its promise when reserving, else what the next step writes (at most all its tokens)."""
        return len(seq.tokens) if self.optimistic else seq.max_tokens_total

    def can_admit(self, seq: Sequence, running: list[Sequence] | tuple[Sequence, ...] | None = None) -> bool:
        """Whether seq fits beside `running` (default: the rows' sequences)."""
        running = self._running if running is None else running
        if len(running) >= self.slots:
            return False
        longest = max(self._needs(s) for s in [*running, seq])
        return self._slot_bytes(self._rows_for(len(running) + 1, longest), longest) <= self.kv_cache_bytes

    def fits(self) -> bool:
        """Whether the next step of the rows fits the budget (always true when reserving)."""
        longest = max(map(self._needs, self._running))
        return self._slot_bytes(self._rows_for(len(self._running), longest), longest) <= self.kv_cache_bytes

    def step_room(self) -> int:
        """The widest next step: a step writes a window of its width into every row (the in-place
        scatter), so every row's cache plus the width must fit the largest capacity whose buffers
        stay within kv_cache_bytes (and max_seq_len), and at most the export's max_chunk (its
        rings hold one chunk beyond the window). At least 1: fits() holds."""
        room = max(1, self._capacity_for(len(self._running)) - max(s.num_cached for s in self._running))
        return min(room, self.runner.manifest.max_chunk or room)

    def _capacity_for(self, rows: int) -> int:
        """The largest capacity whose buffers for `rows` rows stay within kv_cache_bytes (and
        max_seq_len): a binary search over the buckets, kept per row count (it runs every step)."""
        if rows not in self._capacities:
            lo, hi = 1, self.max_seq_len
            while lo < hi:
                mid = (lo + hi + 1) // 2
                fits = self._slot_bytes(self._rows_for(rows, mid), mid) <= self.kv_cache_bytes
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            self._capacities[rows] = lo
        return self._capacities[rows]

    def ends(self) -> int:
        """Cache positions the longest row needs once its pending tokens (a prompt's rest) are in,
        and the next token written."""
        return max((s.num_cached + s.pending + 1 for s in self._running), default=1)

    # ------------------------------------------------------------------ the layout

    def _resize(self, capacity: int, rows: int, slots: int) -> None:
        self._copies.append(partial(self.runner.resize, capacity, rows, slots=slots))
        self.capacity, self.allocated = capacity, slots
        self.counters["resizes"] += 1

    def _make_room(self, sequences: int) -> None:
        """Enough runner rows for `sequences` packed rows (the ones before keep their KV). A
        capacity grown for a wide step (every row gets its width) may not hold one more row within
        the budget: it drops to what the rows hold, which admission checked against the budget."""
        capacity = self.capacity
        if self._slot_bytes(self._rows_for(sequences, capacity), capacity) > self.kv_cache_bytes:
            capacity = self.runner.bucket_for(min(self.ends(), self.max_seq_len))
        rows = self._rows_for(sequences, capacity)
        if rows > self.allocated or capacity < self.capacity:
            self._resize(capacity, sequences - 1, rows)

    def fit_capacity(self, tokens: int, ahead: int = 0) -> None:
        """A capacity holding `tokens` for the packed rows. Growing drops spare rows too:
        admission checked rows_for(running) x the longest promise against the budget. It grows
        at once to hold `ahead` tokens (the rows' ends once their pending tokens are in, see
        ends()) where the budget allows: a resize copies every row's KV, and growing bucket by
        bucket made a 2K-token prompt resize 13 times beside a decoding stream, 20-36 ms each
        past 1K tokens on small-llama, each one a stall for the stream."""
        rows = len(self._running)
        wanted = min(max(tokens, ahead), self.max_seq_len)
        if wanted > self.capacity and self._slot_bytes(self._rows_for(rows, wanted), wanted) > self.kv_cache_bytes:
            wanted = tokens
        if wanted > self.capacity:
            self._resize(self.runner.bucket_for(wanted), rows, self._rows_for(rows, wanted))

    def shrink(self) -> None:
        """A smaller bucket once the longest sequence has left (not below what a prompt still
        prefilling will need: see fit_capacity); rows are kept for the next ones until nothing
        runs (then the layout is one row of the smallest bucket, inside the reservation)."""
        capacity = self.runner.bucket_for(min(self.ends(), self.max_seq_len))
        slots = self.allocated if self._running else 1
        if capacity < self.capacity or slots < self.allocated:
            self._resize(capacity, len(self._running), slots)

    def refit(self) -> None:
        """After a preemption: exactly the rows and capacity the running sequences need, within the budget
        again (none may be left: a longrope row recomputed alone, runtime/scheduler.py)."""
        capacity = self.runner.bucket_for(max((s.num_cached + 1 for s in self._running), default=1))
        slots = self._rows_for(len(self._running), capacity)
        if (capacity, slots) != (self.capacity, self.allocated):
            self._resize(capacity, len(self._running), slots)

    # ------------------------------------------------------------------ rows joining, leaving, rotating

    def _move(self, src: int, dst: int, length: int) -> None:
        self._copies.append(partial(self.runner.move, src, dst, length))

    def place(self, seq: Sequence) -> int:
        """seq joins in front of the first decoding row (so a prefill step covers a short prefix of
        rows); the sequence there moves, KV and all, to a new last row. Returns seq's row."""
        row = next((i for i, s in enumerate(self._running) if s.pending == 1), len(self._running))
        self._make_room(len(self._running) + 1)
        if row < len(self._running):
            self._move(row, len(self._running), self._running[row].num_cached)
            self._running.append(self._running[row])
            self._running[row] = seq
        else:
            self._running.append(seq)
        return row

    def remove(self, row: int) -> Sequence:
        """Take row's sequence out of the packed rows; the last row moves into the hole."""
        seq, last = self._running[row], len(self._running) - 1
        if row != last:
            self._move(last, row, self._running[last].num_cached)
            self._running[row] = self._running[last]
        self._running.pop()
        return seq

    def prompts_first(self) -> None:
        """Rows still prefilling before the decoding ones, in their order (a prompt that finished
        prefilling ahead of a newer one, or the row that filled a hole, decodes among them). Each
        such row moves behind the last prefilling row: rows decoding..last rotate by one, through a
        spare row holding whichever of them has the least KV (every row's KV is copied once, that
        one's twice: a prompt just begun rather than the 2K-token row that finished ahead of it).
        Without room for a spare row within the slots and the byte budget, the rows stay as they are."""
        running = self._running
        while True:
            decoding = next((i for i, s in enumerate(running) if s.pending == 1), None)
            last_prompt = max((i for i, s in enumerate(running) if s.pending > 1), default=-1)
            spare = len(running)
            rows = self._rows_for(spare + 1, self.capacity)
            if decoding is None or last_prompt < decoding or rows <= spare or \
                    self._slot_bytes(rows, self.capacity) > self.kv_cache_bytes:
                return
            self._make_room(spare + 1)
            parked = min(range(decoding, last_prompt + 1), key=lambda i: running[i].num_cached)
            self._move(parked, spare, running[parked].num_cached)
            row = parked  # each row takes the KV of the one after it; the last prompt's, the decoding row's
            while (source := row + 1 if row < last_prompt else decoding) != parked:
                self._move(source, row, running[source].num_cached)
                row = source
            self._move(spare, row, running[parked].num_cached)
            running.insert(last_prompt, running.pop(decoding))
            self.counters["row_moves"] += 1

    # ------------------------------------------------------------------ blocks in and out of a row

    def copy_in(self, row: int, runs: list[tuple[int, Blocks]], then: Callable[[float], None] | None = None) -> None:
        """Write pool blocks into `row` (runs as HostBlockPool.runs gives them), then call
        then(seconds the copy took). The caller holds the blocks until the copy has run
        (KVManager.after_copies)."""
        self._copies.append(partial(self._write, row, runs, then))

    def _write(self, row: int, runs: list[tuple[int, Blocks]], then: Callable[[float], None] | None) -> None:
        began = time.perf_counter()
        for first, views in runs:
            self.runner.write_blocks(row, first, views)
        if then is not None:
            then(time.perf_counter() - began)

    def copy_out(self, row: int, blocks: int, into: Callable[[Blocks], None]) -> None:
        """Hand blocks 0..blocks-1 of `row` (a partial last one included) to `into`, in the plan's
        order: after the moves decided before it."""
        self._copies.append(lambda: into(self.runner.read_blocks(row, 0, blocks)))

    def read(self, row: int, start: int, n: int) -> Blocks:
        """Blocks start..start+n-1 of `row` now: only right after a step, whose copies have run
        (so the row holds what the rows say it holds)."""
        if self._copies:
            raise RuntimeError("a row is read while copies decided before it are still to run")
        return self.runner.read_blocks(row, start, n)

    def stats(self) -> dict:
        allocated = self.runner.kv_bytes_allocated
        return dict(kv_utilization=allocated / self.kv_cache_bytes, kv_bytes_allocated=allocated,
                    kv_bytes_held=self.runner.kv_bytes_held, kv_cache_bytes=self.kv_cache_bytes,
                    capacity=self.runner.capacity, **self.counters)
