"""PagedKVCache: a ``transformers.Cache`` whose K/V live in fixed-size blocks, one pool per KV group.

Storage of group ``g`` is two tensors ``[num_layers_in_group, num_blocks, block_size, num_kv_heads,
head_dim]`` (K and V). Rows of a batch are independent sequences with their own lengths: a row's
tokens occupy positions ``0 .. len-1`` (left padding is never stored). One forward goes:

    meta = cache.begin_forward(num_new_tokens_per_row, q_len)   # allocate on the host; positions, slot
                                                                  # mappings and tables derived on the device
    model(..., cache=cache, paged_cache=cache)                   # update() stores K/V by slot mapping;
                                                                  # the "hf_specdec" attention reads pages
                                                                  # (past_key_values= before transformers 5.24)
    cache.commit(new_lengths)                                    # rollback rejected tokens, slide windows

Query slots of a forward are right-aligned: slot ``i`` of row ``b`` is padding iff
``i < q_len - num_new[b]``; the real slots hold positions ``len_before[b] ..`` in order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from hf_specdec.cache.block_manager import RELEASED, BlockManager
from hf_specdec.cache.kv_layout import KVLayout
from hf_specdec.kernels import store_kv
from hf_specdec.kernels.forward_meta import build_forward_meta, empty_forward_buffers


def to_device_async(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype -> the same tensors on ``device``, in one copy that does not wait for the
    device: a copy from pageable memory first waits for all queued device work, which would stall the host
    while a drafter's graph runs; staged through pinned memory it queues behind that work instead."""
    if len({t.dtype for t in tensors}) != 1:
        raise TypeError(f"to_device_async copies tensors of one dtype, got {sorted({str(t.dtype) for t in tensors})}.")
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return copy_packed(tensors, device, pinned=True)


class CountsStaging:
    """Small int32 rows to the device without waiting for it and without a pinned allocation per call: a ring of
    pinned host slots and device slots, each host slot reused once its last copy completed (an event per slot;
    with a ring of ``slots`` forwards that has long happened). What it returns is valid until ``slots`` more puts
    (every reader is a kernel queued before then, on the same stream)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, slots: int = 16):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty((slots, *shape), dtype=torch.int32, pin_memory=True)
            self.host_view = self.host.numpy()
            self.on_device = torch.empty((slots, *shape), dtype=torch.int32, device=device)
            # (each slot's views made once: indexing a tensor per put costs host time)
            self.host_slots, self.device_slots = list(self.host.unbind(0)), list(self.on_device.unbind(0))
            self.events: list[torch.cuda.Event | None] = [None] * slots
            self.next = 0

    def put(self, rows: list[list[int]]) -> torch.Tensor:
        if not self.cuda:
            return torch.tensor(rows, dtype=torch.int32, device=self.device)
        i = self.next
        self.next = (i + 1) % len(self.events)
        event = self.events[i]
        if event is not None:
            event.synchronize()
        else:
            event = self.events[i] = torch.cuda.Event()
        self.host_view[i] = rows
        out = self.device_slots[i]
        out.copy_(self.host_slots[i], non_blocking=True)  # on the device's current stream, which the event marks
        event.record(torch.cuda.current_stream(self.device))
        return out


@dataclass
class ForwardMeta:
    """Device-side description of the tokens of one forward (shared by every layer)."""

    q_len: int
    kv_lens: torch.Tensor  # [batch] int32, keys per row after this forward's append
    q_pos0: torch.Tensor  # [batch] int32, position of query slot 0 (negative for padded prefill rows)
    q_lens: torch.Tensor  # [batch] int32, real (non-padding) query slots per row
    position_ids: torch.Tensor  # [batch, q_len] int64, padding slots clamped to 0
    slot_mapping: list[torch.Tensor]  # per group: [batch * q_len] int64, -1 for padding
    block_tables: list[torch.Tensor]  # per group: [batch, max_blocks] int32, -1 where released/unused
    # the storage these fields view when the metadata was built on the device (``build_forward_meta``'s buffers:
    # slots and tables stacked over the groups), so it can be rebuilt in place; None otherwise
    buffers: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def over(cls, q_len: int, buffers: dict[str, torch.Tensor]) -> "ForwardMeta":
        """The metadata viewing ``buffers`` (``empty_forward_buffers``), filled or to be filled in place."""
        return cls(q_len=q_len, kv_lens=buffers["kv_lens"], q_pos0=buffers["q_pos0"], q_lens=buffers["q_lens"],
                   position_ids=buffers["positions"], slot_mapping=list(buffers["slots"].unbind(0)),
                   block_tables=list(buffers["tables"].unbind(0)), buffers=buffers)

    def rows(self, n: int) -> "ForwardMeta":
        """The first ``n`` rows (views), e.g. a CUDA graph's real rows of its batch bucket."""
        if self.kv_lens.shape[0] == n:
            return self
        return ForwardMeta(q_len=self.q_len, kv_lens=self.kv_lens[:n], q_pos0=self.q_pos0[:n], q_lens=self.q_lens[:n],
                           position_ids=self.position_ids[:n],
                           slot_mapping=[s[:n * self.q_len] for s in self.slot_mapping],
                           block_tables=[t[:n] for t in self.block_tables])

    def to(self, device: torch.device) -> "ForwardMeta":
        """The same description on another device (for layers whose pages live there): from one GPU to another, its
        tensors packed into one buffer and copied at once (each copy between GPUs is a dependency on the step's
        critical path: ten of them cost ~50 us of a 31B step split over two GPUs)."""
        tensors = [self.kv_lens, self.q_pos0, self.q_lens, self.position_ids, *self.slot_mapping, *self.block_tables]
        if self.kv_lens.is_cuda and device.type == "cuda":
            moved = copy_packed(tensors, device)
        else:
            moved = [t.to(device) for t in tensors]
        groups = len(self.slot_mapping)
        return ForwardMeta(self.q_len, *moved[:4], slot_mapping=moved[4:4 + groups], block_tables=moved[4 + groups:])


def copy_packed(tensors: list[torch.Tensor], device: torch.device, pinned: bool = False) -> list[torch.Tensor]:
    """``[t.to(device) for t in tensors]`` with one copy: their bytes concatenated where they are (each at an offset
    aligned to 16 bytes), copied, and viewed back as each tensor on ``device``; ``pinned``: host tensors staged
    through pinned memory, the copy queued without waiting for the device."""
    parts, spans, offset = [], [], 0
    for i, t in enumerate(tensors):
        data = t.contiguous().view(-1).view(torch.uint8)
        parts.append(data)
        spans.append((offset, data.numel()))
        pad = -(offset + data.numel()) % 16 if i + 1 < len(tensors) else 0
        if pad:
            parts.append(data.new_empty(pad))  # (never read: no kernel to fill it)
        offset += data.numel() + pad
    packed = torch.cat(parts)
    packed = packed.pin_memory().to(device, non_blocking=True) if pinned else packed.to(device)
    return [packed[start:start + n].view(t.dtype).view(t.shape) for (start, n), t in zip(spans, tensors)]


# On CPU a forward of at most this many query slots (batch x q_len: decode and verify steps) gets its metadata from
# the host's lists directly, a few small tensors: the torch derivation's ~20 ops cost ~60-90 us more per forward.
HOST_META_SLOTS = 256


@dataclass
class ForwardPlan:
    """What the host decided for one forward, on the device: per row the tokens the cache held before it and the
    tokens it appends, and the rows' block tables. :meth:`meta` derives the :class:`ForwardMeta` the layers read
    (one launch on CUDA), into new buffers or into a CUDA graph's static ones."""

    q_len: int
    counts: torch.Tensor  # [2, batch] int32: tokens before this forward, new tokens
    tables: torch.Tensor  # [groups, batch, width] int32, -1 where released or unused
    block_size: int
    # on CPU, for a small forward: (tokens before, new tokens, each group's rows' tables padded to one width) as lists
    host: tuple[list[int], list[int], list[list[list[int]]]] | None = None

    @property
    def num_new(self) -> torch.Tensor:
        """[batch] int32: the tokens each row appends (right-aligned in the query slots)."""
        return self.counts[1]

    def meta(self, rows: int | None = None, width: int | None = None, out: ForwardMeta | None = None) -> ForwardMeta:
        """The forward's metadata, in ``out``'s buffers (a :meth:`ForwardMeta.over` view) or in new ones of ``rows``
        rows (default the batch; rows past it are padding: no query, no key, no slot, no page) and block tables
        ``width`` wide (default the rows' own)."""
        if out is None and rows is None and width is None and self.host is not None:
            return self._meta_from_host()
        groups, batch, own_width = self.tables.shape
        if out is None:
            out = ForwardMeta.over(self.q_len, empty_forward_buffers(
                rows or batch, self.q_len, groups, width or own_width, self.counts.device))
        else:
            have_rows, have_width = out.buffers["tables"].shape[1:]
            if have_rows < batch or have_width < own_width or out.q_len != self.q_len:
                raise RuntimeError(f"a forward of {batch} rows x {self.q_len} slots with block tables {own_width} wide "
                                   f"does not fit metadata buffers of {have_rows} rows x {out.q_len} slots, "
                                   f"{have_width} wide")
        build_forward_meta(self.counts, self.tables, self.q_len, self.block_size, out.buffers, validate=False)
        return out

    def _meta_from_host(self) -> ForwardMeta:
        """:meth:`meta` from the host's lists (what ``build_forward_meta`` derives, computed in Python)."""
        before, num_new, tables = self.host
        q_len, size = self.q_len, self.block_size
        kv_lens = [b + n for b, n in zip(before, num_new)]
        positions = [[max(kv - q_len + i, 0) for i in range(q_len)] for kv in kv_lens]
        slots = [[table[p // size] * size + p % size if i >= q_len - n else -1
                  for table, row, n in zip(group, positions, num_new) for i, p in enumerate(row)]
                 for group in tables]
        i32 = torch.int32
        return ForwardMeta.over(q_len, dict(
            kv_lens=torch.tensor(kv_lens, dtype=i32), q_pos0=torch.tensor([kv - q_len for kv in kv_lens], dtype=i32),
            q_lens=torch.tensor(num_new, dtype=i32), positions=torch.tensor(positions, dtype=torch.int64),
            slots=torch.tensor(slots, dtype=torch.int64), tables=torch.tensor(tables, dtype=i32)))


class StaticPlan:
    """A CUDA graph's own copy of a forward plan's inputs for every row of its batch bucket -- the counts [2, rows]
    and block tables [groups, rows, width] -- from which the graph derives the forward's metadata itself
    (:meth:`derive`, captured at the graph's start). A replay then copies the plan's counts, and its tables when they
    changed (a block was allocated or released), with :meth:`load` instead of launching the derivation from the host.
    Rows past the plan's are padding: no query, no key, no slot, no page."""

    def __init__(self, counts: torch.Tensor, tables: torch.Tensor, q_len: int, block_size: int, meta: ForwardMeta):
        """``counts``, ``tables``: the graph's static tensors (:meth:`inputs_for`); ``meta``: its static metadata,
        which :meth:`derive` rebuilds in place."""
        self.counts, self.tables, self.q_len, self.block_size, self.meta = counts, tables, q_len, block_size, meta
        self._rows: int | None = None  # the rows of the last plan loaded (the rows past it are padding)
        self._tables_of: torch.Tensor | None = None  # the plan tables last copied in (rebuilt when blocks change)

    @staticmethod
    def inputs_for(plan: ForwardPlan, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New static (counts, tables) of ``rows`` rows and tables ``width`` wide, holding ``plan``'s."""
        groups, batch, own_width = plan.tables.shape
        counts = torch.zeros(2, rows, dtype=torch.int32, device=plan.counts.device)
        tables = torch.full((groups, rows, width), RELEASED, dtype=torch.int32, device=plan.counts.device)
        counts[:, :batch] = plan.counts
        tables[:, :batch, :own_width] = plan.tables
        return counts, tables

    def load(self, plan: ForwardPlan) -> None:
        """``plan``'s counts and tables into the static ones (queued on the device; nothing waits)."""
        batch, own_width = plan.tables.shape[1:]
        have_rows, have_width = self.tables.shape[1:]
        if batch > have_rows or own_width > have_width or plan.q_len != self.q_len:
            raise RuntimeError(f"a forward of {batch} rows x {plan.q_len} slots with block tables {own_width} wide "
                               f"does not fit a graph of {have_rows} rows x {self.q_len} slots, {have_width} wide")
        self.counts[:, :batch].copy_(plan.counts)
        if batch != self._rows:
            self.counts[:, batch:].zero_()
            self.tables[:, batch:].fill_(RELEASED)
            self._rows, self._tables_of = batch, None
        if plan.tables is not self._tables_of:
            self.tables[:, :batch, :own_width].copy_(plan.tables)
            self.tables[:, :batch, own_width:].fill_(RELEASED)
            self._tables_of = plan.tables

    def derive(self) -> ForwardMeta:
        """The forward's metadata from the static counts and tables, into the static metadata (inside the graph)."""
        build_forward_meta(self.counts, self.tables, self.q_len, self.block_size, self.meta.buffers, validate=False)
        return self.meta


class PagedKVCache(Cache):
    def __init__(self, layout: KVLayout, num_blocks: list[int], batch_size: int, *, block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 storage: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                 storage_blocks: list[int] | None = None):
        """``num_blocks[g]``: blocks group g may hand out. ``storage``: K/V tensors of a pool reused across requests
        (CUDA graphs write into fixed addresses), else the cache allocates its own, of ``storage_blocks[g]``
        blocks (default ``num_blocks``), grown as blocks past them are handed out."""
        super().__init__(layers=[])
        self.layout = layout
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        # Sliding groups keep two positions more than the target needs: a drafter's Q-only query sits one
        # position after the last cached token and (Gemma 4's assistant) sees `window + 1` keys back.
        windows = [None if g.sliding_window is None else g.sliding_window + 2 for g in layout.groups]
        self.manager = BlockManager(num_blocks, block_size, windows)
        self.seq_ids = [self.manager.add_sequence() for _ in range(batch_size)]
        self.growable = storage is None
        self.k_storage, self.v_storage = storage if storage is not None else allocate_storage(
            layout, storage_blocks or num_blocks, block_size, dtype, self.device)
        self.meta: ForwardMeta | None = None
        self._meta_copies: dict[torch.device, ForwardMeta] = {}  # ``meta`` on the devices of other groups' pages
        self._context_tables: dict[int, torch.Tensor] = {}  # device block tables between forwards, per group
        self._tables: torch.Tensor | None = None  # every group's block tables on the device (_device_tables)
        self._tables_version = -1  # the manager's version they were built at
        self._table_lists: list[list[list[int]]] = []  # the same tables as host lists (CPU metadata, ForwardPlan.host)
        self._counts = CountsStaging((2, batch_size), self.device)  # each forward's per-row counts (plan_forward)
        # When the cache holds one tensor-parallel rank's contiguous share of every layer's KV heads: the ranks'
        # group (``local_heads`` / ``gather_heads``), with which a drafter's Q-only attention over these pages
        # (``paged_query_attention``) attends with the matching query heads and gathers the others. None otherwise.
        self.head_shard = None
        # during a checked forward (a prefill): the layers that stored K/V and the layers whose attention read pages
        self.layers_seen: tuple[set[int], set[int]] | None = None

    def widen_windows(self, extra: int) -> None:
        """Sliding groups keep ``extra`` more positions behind a row's length: for forwards queued before the
        lengths they read were committed (the lengths then run up to ``extra`` past the positions still read)."""
        self.manager.windows = [None if w is None else w + extra for w in self.manager.windows]

    @property
    def num_used_blocks(self) -> list[int]:
        """Blocks in use per KV group (all zero after :meth:`free`)."""
        return [pool.num_used for pool in self.manager.pools]

    # ---- step bookkeeping ---------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def seq_lens(self) -> list[int]:
        return [self.manager.num_tokens(s) for s in self.seq_ids]

    def plan_forward(self, num_new: list[int], q_len: int) -> ForwardPlan:
        """Allocate room for ``num_new[b]`` tokens per row (right-aligned in ``q_len`` query slots) and put what the
        device needs to describe the forward there: two small per-row counts, and the block tables when a block
        was allocated or released since the last forward (they are kept on the device between forwards)."""
        if len(num_new) != self.batch_size:
            raise ValueError(f"num_new has {len(num_new)} rows, the cache {self.batch_size}.")
        if any(n > q_len or n < 0 for n in num_new):
            raise ValueError(f"each row needs 0 <= num_new <= q_len={q_len}, got {num_new}.")
        before = self._allocate(num_new)
        counts = self._counts.put([before, num_new])
        host = None
        tables = self._device_tables()
        if self.device.type == "cpu" and len(num_new) * q_len <= HOST_META_SLOTS:
            host = (before, list(num_new), self._table_lists)
        return ForwardPlan(q_len=q_len, counts=counts, tables=tables, block_size=self.block_size, host=host)

    def plan_at(self, start: torch.Tensor, q_len: int) -> ForwardPlan:
        """A forward of ``q_len`` tokens per row at positions ``start[b] ..``, positions only the device knows
        (``start`` [batch] int32 on the cache's device, each at most the row's length: e.g. after an acceptance the
        host has not read yet). Room for ``q_len`` tokens past every row's length is allocated (the longest case):
        the lengths grow by ``q_len`` until the next :meth:`commit` sets them."""
        return self.plan_counts(torch.stack([start.to(torch.int32), torch.full_like(start, q_len, dtype=torch.int32)]),
                                q_len)

    def plan_counts(self, counts: torch.Tensor, q_len: int) -> ForwardPlan:
        """:meth:`plan_at` with each row's number of new tokens only the device knows too: ``counts`` [2, batch] int32
        on the cache's device (contiguous): the tokens before the forward (each at most the row's length) and the new
        ones (at most ``q_len``, right-aligned in the query slots)."""
        if tuple(counts.shape) != (2, self.batch_size) or counts.dtype != torch.int32:
            raise ValueError(f"counts must be [2, {self.batch_size}] int32, got {tuple(counts.shape)} {counts.dtype}.")
        self._allocate([q_len] * self.batch_size)
        return ForwardPlan(q_len=q_len, counts=counts, tables=self._device_tables(), block_size=self.block_size)

    def _allocate(self, num_new: list[int]) -> list[int]:
        """Room for ``num_new[b]`` more tokens per row (the lengths grow); returns the lengths before."""
        before = self.seq_lens
        self.meta = None
        self._context_tables.clear()
        self._meta_copies.clear()
        self.manager.append({s: n for s, n in zip(self.seq_ids, num_new) if n})
        self._fit_storage()
        self._check_windows(before, num_new)
        return before

    def begin(self, plan: ForwardPlan) -> ForwardMeta:
        """Derive ``plan``'s metadata into new buffers and make it this forward's (what the layers store and read
        by)."""
        self.meta = plan.meta()
        return self.meta

    def begin_forward(self, num_new: list[int], q_len: int) -> ForwardMeta:
        """Allocate room for ``num_new[b]`` tokens per row and describe the forward for the kernels."""
        return self.begin(self.plan_forward(num_new, q_len))

    def _check_windows(self, before: list[int], num_new: list[int]) -> None:
        """A row's new tokens start at its length; that position's block must not have slid out of a window."""
        for g, window in enumerate(self.manager.windows):
            if window is None:
                continue
            for seq, start, n in zip(self.seq_ids, before, num_new):
                if n and self.manager.block_table(seq, g)[start // self.block_size] == RELEASED:
                    raise IndexError(f"a new token's position slid out of group {g}'s window.")

    def _device_tables(self) -> torch.Tensor:
        """[groups, batch, width] int32 block tables on the cache's device, rebuilt when the manager's tables
        changed (``width``: the longest table, at least 1)."""
        if self._tables is None or self._tables_version != self.manager.version:
            tables = [[self.manager.block_table(s, g) for s in self.seq_ids] for g in range(self.manager.num_groups)]
            width = max(1, max((len(t) for group in tables for t in group), default=0))
            self._table_lists = [[t + [RELEASED] * (width - len(t)) for t in group] for group in tables]
            self._tables = to_device_async([torch.tensor(self._table_lists, dtype=torch.int32)], self.device)[0]
            self._tables_version = self.manager.version
        return self._tables

    def _fit_storage(self) -> None:
        """Grow a group's own storage (doubling, up to its pool) when a block past it was handed out; the
        pages keep their contents and ids."""
        for g, pool in enumerate(self.manager.pools):
            have = self.k_storage[g].shape[1]
            if pool.high_water <= have:
                continue
            if not self.growable:
                raise RuntimeError(f"group {g} handed out block {pool.high_water - 1} past its fixed storage of {have}")
            blocks = min(pool.num_blocks, max(2 * have, pool.high_water))
            for storage in (self.k_storage, self.v_storage):
                grown = storage[g].new_zeros((storage[g].shape[0], blocks, *storage[g].shape[2:]))
                grown[:, :have] = storage[g]
                storage[g] = grown

    @contextlib.contextmanager
    def forward_with(self, meta: ForwardMeta):
        """While open, layers store and read K/V as described by ``meta`` (e.g. a CUDA graph's static copy of
        a forward's metadata) instead of the forward :meth:`begin_forward` set up."""
        live, self.meta = self.meta, meta
        copies, self._meta_copies = self._meta_copies, {}
        try:
            yield meta
        finally:
            self.meta, self._meta_copies = live, copies

    def block_table_tensor(self, group: int, device="cache") -> torch.Tensor:
        """[batch, max_blocks] int32 block tables of a group (-1 where released or unused); on the cache's
        device unless ``device=None`` (host)."""
        rows = [self.manager.block_table(s, group) for s in self.seq_ids]
        width = max(1, max(len(r) for r in rows))
        table = torch.tensor([r + [RELEASED] * (width - len(r)) for r in rows], dtype=torch.int32)
        return table if device is None else to_device_async([table], self.group_device(group))[0]

    def group_device(self, group: int) -> torch.device:
        """Where a group's pages live: its own device when the layout names one (layers placed on several devices),
        else the cache's."""
        device = self.layout.groups[group].device
        return self.device if device is None else torch.device(device)

    def meta_on(self, device: torch.device) -> ForwardMeta:
        """This forward's :class:`ForwardMeta` on ``device`` (copied once per forward for each other device)."""
        if device == self.meta.kv_lens.device:
            return self.meta
        if device not in self._meta_copies:
            self._meta_copies[device] = self.meta.to(device)
        return self._meta_copies[device]

    def commit(self, new_lens: list[int]) -> None:
        """Keep ``new_lens[b]`` tokens of each row (rollback of rejected drafts) and slide the windows."""
        for s, n in zip(self.seq_ids, new_lens):
            self.manager.truncate(s, n)
            self.manager.slide(s)
        self.meta = None
        self._context_tables.clear()
        self._meta_copies.clear()

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the rows ``rows`` (indices into the batch, distinct, at least one), in that order: row ``i``
        of the batch after is row ``rows[i]`` before; the other rows' blocks go back to the pools. Between
        forwards only (after a :meth:`commit`)."""
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < self.batch_size for r in rows):
            raise ValueError(f"keep_rows takes distinct row indices below the batch size {self.batch_size} (at least "
                             f"one), got {rows}.")
        kept = set(rows)
        for b, seq in enumerate(self.seq_ids):
            if b not in kept:
                self.manager.free_sequence(seq)
        self.seq_ids = [self.seq_ids[r] for r in rows]
        self._tables = None  # the rows' order changed even where no block did
        self._counts = CountsStaging((2, len(rows)), self.device)
        self.meta = None
        self._context_tables.clear()
        self._meta_copies.clear()

    def context_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache, block_tables) of a layer's pages between forwards (for a drafter reading the
        committed context); the tables are built once per commit."""
        group, index = self.layout.layer_slot[layer_idx]
        if group not in self._context_tables:
            self._context_tables[group] = self._device_tables()[group].to(self.group_device(group))
        return self.k_storage[group][index], self.v_storage[group][index], self._context_tables[group]

    def layer_storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) [num_blocks, block_size, kv_heads, head_dim] of a layer (its producer's if shared)."""
        group, index = self.layout.layer_slot[layer_idx]
        return self.k_storage[group][index], self.v_storage[group][index]

    def free(self) -> None:
        """Return every block to the pools (the cache can not be used afterwards)."""
        for s in self.seq_ids:
            self.manager.free_sequence(s)
        self.seq_ids = []

    # ---- pages --------------------------------------------------------------------------------
    def layer_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
        """(k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim], block_tables, sliding_window) of a
        layer; a KV-shared layer gets its producer's pages."""
        group, index = self.layout.layer_slot[layer_idx]
        window = self.layout.groups[group].sliding_window
        tables = self.meta_on(self.k_storage[group].device).block_tables[group]
        return self.k_storage[group][index], self.v_storage[group][index], tables, window

    def gather(self, row: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Dense K/V ``[kv_heads, n, head_dim]`` of the live positions ``[start, len)`` of one row, and start."""
        group, index = self.layout.layer_slot[layer_idx]
        seq = self.seq_ids[row]
        length = self.manager.num_tokens(seq)
        table = self.manager.block_table(seq, group)
        start = next((j * self.block_size for j, b in enumerate(table) if b != RELEASED), length)
        slots = torch.tensor(self.manager.slots(seq, group, start, length), dtype=torch.long,
                             device=self.k_storage[group].device)
        k = self.k_storage[group][index].flatten(0, 1)[slots].transpose(0, 1)
        v = self.v_storage[group][index].flatten(0, 1)[slots].transpose(0, 1)
        return k, v, start

    # ---- transformers.Cache API ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this forward's K/V ``[batch, kv_heads, q_len, head_dim]`` into the layer's pages."""
        if self.meta is None:
            raise RuntimeError(
                "PagedKVCache is filled by hf_specdec's generate loop (begin_forward/commit). To run a plain "
                "forward with a cache, pass a transformers DynamicCache instead."
            )
        if layer_idx not in self.layout.layer_slot:
            raise ValueError(
                f"the model stores K/V for layer {layer_idx}, which its config does not describe (layers run more than "
                "once, or K/V slots beyond the layers): hf_specdec's paged cache holds one slot per layer of the "
                "config. Use the model without hf_specdec.enable()."
            )
        if self.layers_seen is not None:
            self.layers_seen[0].add(layer_idx)
        group, index = self.layout.layer_slot[layer_idx]
        batch, heads, q_len, dim = key_states.shape
        if q_len != self.meta.q_len:
            raise ValueError(f"layer {layer_idx} stores {q_len} tokens per row, the forward has {self.meta.q_len}.")
        if heads != self.layout.groups[group].num_kv_heads:
            raise ValueError(
                f"layer {layer_idx} stores {heads} KV heads but its KV group holds "
                f"{self.layout.groups[group].num_kv_heads}: the cache layout does not describe this model's attention "
                "(was the model changed or re-sharded after hf_specdec.enable? call hf_specdec.enable(model) again)."
            )
        pages = self.k_storage[group].device  # a layer's own device (split_by_device)
        store_kv(key_states.transpose(1, 2).reshape(batch * q_len, heads, dim).to(pages),
                 value_states.transpose(1, 2).reshape(batch * q_len, heads, dim).to(pages),
                 self.k_storage[group][index], self.v_storage[group][index], self.meta_on(pages).slot_mapping[group],
                 validate=False)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.seq_lens, default=0)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query, layer_idx: int = 0) -> tuple[int, int]:
        q_len = query if isinstance(query, int) else query.shape[-1]
        return self.get_seq_length() + q_len, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def crop(self, max_length: int) -> None:
        for s in self.seq_ids:
            n = self.manager.num_tokens(s)
            self.manager.truncate(s, max(0, n + max_length) if max_length < 0 else min(n, max_length))

    def __len__(self) -> int:
        return self.layout.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [self.layout.group_of(i).is_sliding for i in range(self.layout.num_layers)]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.layout.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.layout.num_layers


def allocate_storage(layout: KVLayout, num_blocks: list[int], block_size: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed K and V storage ``[layers_in_group, num_blocks[g], block_size, kv_heads, head_dim]`` per group, on the
    group's own device where the layout names one, else on ``device``."""
    k_storage, v_storage = [], []
    for grp, n in zip(layout.groups, num_blocks):
        shape = (len(grp.layers), n, block_size, grp.num_kv_heads, grp.head_dim)
        where = device if grp.device is None else torch.device(grp.device)
        k_storage.append(torch.zeros(shape, dtype=dtype, device=where))
        v_storage.append(torch.zeros(shape, dtype=dtype, device=where))
    return k_storage, v_storage
