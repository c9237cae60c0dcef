"""paged_attention: queries of a ragged batch attend to keys stored in pages.

One kernel serves every use: prefill (left-padded rows), decode (T=1), verify (T=k+1 causal queries
per row at per-row offsets), a drafter's query one position past another model's last key (Q-only),
bidirectional queries (``causal=False``), sliding windows and GQA.

Positions. Row b holds keys at logical positions ``0 .. kv_lens[b]-1``; key j lives in physical block
``block_tables[b, j // block_size]`` at offset ``j % block_size``. Query slot i of row b sits at
position ``p = q_pos0[b] + i``; slots ``i < q_len - q_lens[b]`` are left padding and output 0.
Key j is visible to a valid query at p iff::

    j < kv_lens[b]  and  (not causal or j <= p)  and  (sliding_window is None or j > p - sliding_window)

so a window of W keys includes the query's own position (the HF convention); without ``causal`` the
window still bounds keys from below. A valid query that sees no key outputs 0, never NaN. Table
entries of blocks that no query can see (released window blocks, the unused tail) are never read,
so they may hold anything (e.g. -1).

GPU design. One program per (query tile, kv head, row) attends for all ``group = num_heads //
num_kv_heads`` query heads of that kv head at once: its q tile is ``[BLOCK_T * group, head_dim]``, so
each K/V page is read once per kv head (GQA packing). It walks the row's block table from the first
block inside the window of its earliest query to the last key its latest query sees, with an online
(flash-decoding style) softmax in fp32. `_attend_key_range` is the loop over one key range: a split-KV
variant for long contexts runs it on fixed chunks of keys and merges the (acc, max, sum) partials.

Batch invariance. A query's output has the same bits whatever else the launch holds (more queries per row, a
tile that starts earlier, a wider block table): key tiles start on BLOCK_N multiples of the key position,
split-KV chunks are counted from key 0 with a size set by the batch and KV heads only (:func:`kv_chunk`), and
the merge adds the chunks in key order. Keys a query cannot see leave its running sums exactly unchanged. So a
verify step's k+1 queries per row get the bits of k+1 one-query decode steps at the same batch. All of this holds
for launches of fewer than :data:`PREFILL_QUERIES` queries a row; a prompt's launch (that many or more) is shaped
for throughput instead: its positions are never computed again by a decode or verify step of the target. (One
consequence: a target forward that keeps every position, as DFlash's prompt forward does, attends in its KV-shared
layers with the prompt's shape where a plain prompt forward attends with one query, so the two may round the last
prompt position differently.)
"""

import functools
import math
from array import array
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._dispatch import (check, check_paged_cache, check_same_device, gpu_index, interpreting, next_power_of_2,
                        pdl_args, pdl_wait, tl, triton, use_triton)

MAX_TRITON_HEAD_DIM = 512


@triton.jit
def _attend_key_range(
    q,  # [BLOCK_M, BLOCK_D] queries of the tile, in the dtype of both matmuls
    pos,  # [BLOCK_M] query positions
    row_valid,  # [BLOCK_M] real (non-padding, in-range) query rows
    acc, m_i, l_i,  # [BLOCK_M, BLOCK_D], [BLOCK_M], [BLOCK_M] running output, max and sum (base 2)
    k_cache_ptr, v_cache_ptr, block_table_ptr,  # block_table_ptr: this row's [max_blocks_per_row]
    kv_head, kv_lo, kv_hi,  # keys [kv_lo, kv_hi) of this row
    num_kv_heads, head_dim, block_size, max_blocks_per_row, qk_scale, sliding_window,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    # Start on a BLOCK_N boundary so that pages are read whole; keys below kv_lo stay masked (their
    # pages may be released).
    for n0 in range((kv_lo // BLOCK_N) * BLOCK_N, kv_hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        logical = j // block_size
        j_valid = (j >= kv_lo) & (j < kv_hi) & (logical < max_blocks_per_row)
        physical = tl.load(block_table_ptr + logical, mask=j_valid, other=0).to(tl.int64)
        kv_offset = ((physical * block_size + j % block_size) * num_kv_heads + kv_head) * head_dim
        k = tl.load(k_cache_ptr + kv_offset[None, :] + d[:, None],
                    mask=j_valid[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = row_valid[:, None] & j_valid[None, :]
        if CAUSAL:
            visible &= j[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible &= j[None, :] > pos[:, None] - sliding_window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(v_cache_ptr + kv_offset[:, None] + d[None, :],
                    mask=j_valid[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [batch, q_len, num_heads, head_dim], any strides
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    block_tables_ptr,  # [batch, max_blocks_per_row] int32
    kv_lens_ptr, q_pos0_ptr, q_lens_ptr,  # [batch] int32
    out_ptr,  # [batch, q_len, num_heads, head_dim], any strides
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_table_row, q_len, num_kv_heads, head_dim, block_size, max_blocks_per_row,
    qk_scale, sliding_window,
    part_acc_ptr, part_ml_ptr,  # split-KV partials: [batch, q_len, num_heads, num_splits, head_dim] and [..., 2]
    num_splits, chunk_keys,
    sinks_ptr,  # [num_heads]: each query head's learned sink logit (HAS_SINKS)
    GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + row)
    pos0 = tl.load(q_pos0_ptr + row)
    first_valid_slot = q_len - tl.load(q_lens_ptr + row)

    # Tile row m is query slot tile*BLOCK_T + m // GROUP of q head kv_head*GROUP + m % GROUP.
    m = tl.arange(0, BLOCK_M)
    slot = tile * BLOCK_T + m // GROUP
    head = kv_head * GROUP + m % GROUP
    in_tile = (m < BLOCK_T * GROUP) & (slot < q_len)
    row_valid = in_tile & (slot >= first_valid_slot)
    pos = pos0 + slot

    # Keys any valid query of the tile can see: [kv_lo, kv_hi).
    lo_slot = tl.maximum(tile * BLOCK_T, first_valid_slot)
    hi_slot = tl.minimum(tile * BLOCK_T + BLOCK_T, q_len)
    kv_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_hi, pos0 + hi_slot)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(pos0 + lo_slot - sliding_window + 1, 0)
    kv_hi = tl.where(lo_slot < hi_slot, kv_hi, kv_lo)  # an all-padding tile reads nothing

    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + row * stride_qb + slot[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SPLIT:
        # Split-KV: this program takes one chunk of chunk_keys keys, counted from key 0 (not from the tile's first
        # key), so a query sees the same chunks, walked and merged in the same order, in a decode step and in a
        # verify step whose tile starts earlier (batch invariance). Chunks before or after a query's keys are
        # exact no-ops for it, here and in the merge.
        chunk_lo = (kv_lo // chunk_keys + split) * chunk_keys
        kv_hi = tl.minimum(kv_hi, chunk_lo + chunk_keys)
        kv_lo = tl.maximum(kv_lo, chunk_lo)
    acc, m_i, l_i = _attend_key_range(
        q, pos, row_valid, acc, m_i, l_i,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + row * stride_table_row,
        kv_head, kv_lo, kv_hi,
        num_kv_heads, head_dim, block_size, max_blocks_per_row, qk_scale, sliding_window,
        BLOCK_N, BLOCK_D, CAUSAL, HAS_WINDOW, DOT_PRECISION,
    )
    if SPLIT:
        # Partials (unnormalised acc, max, sum) for _merge_splits_kernel; padding rows write acc 0, l 0.
        part = ((row * q_len + slot) * (num_kv_heads * GROUP) + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=in_tile[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=in_tile)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=in_tile)
    else:
        if HAS_SINKS:
            # The sink joins the softmax's denominator, not its values: exp(sink) added to the sum at a common max.
            sink = tl.load(sinks_ptr + head, mask=in_tile, other=0.0).to(tl.float32) * 1.4426950408889634  # base 2
            m_f = tl.maximum(m_i, sink)
            m_f = tl.where(m_f == float("-inf"), 0.0, m_f)  # no key and a sink of -inf: sums stay 0, not NaN
            alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_f))  # 0 where no key was seen
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_f)
        # Padding rows and queries without a visible key have acc = 0, l = 0: they output 0.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * stride_ob + slot[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
                 mask=in_tile[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr,  # [batch, q_len, num_heads, num_splits, head_dim], [..., num_splits, 2] fp32
    out_ptr,  # [batch, q_len, num_heads, head_dim], any strides
    stride_ob, stride_ot, stride_oh, stride_od,
    q_len, num_heads, head_dim, num_splits,
    sinks_ptr,  # [num_heads]: each query head's learned sink logit (HAS_SINKS)
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # One program per (row, query slot, q head): softmax-weighted sum of the split partials, one split after the
    # other in key order (a fixed order, whatever the number of splits: empty ones add exact zeros). The splits
    # are read GROUP at a time (GROUP divides num_splits) in an unrolled body, so their loads are in flight
    # together (read one per loop step, each load's latency added up: ~5 us for 16 splits).
    row_slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = row_slot // q_len
    slot = row_slot % q_len
    base = (row_slot * num_heads + head) * num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    m = tl.load(part_ml_ptr + base * 2)
    for s0 in range(0, num_splits, GROUP):
        for j in tl.static_range(GROUP):
            m = tl.maximum(m, tl.load(part_ml_ptr + (base + s0 + j) * 2))
    if HAS_SINKS:  # the sink joins the denominator, after the splits (as in the unsplit kernel)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e): base 2 like m
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    l = 0.0
    for s0 in range(0, num_splits, GROUP):
        for j in tl.static_range(GROUP):
            part = base + s0 + j
            m_s = tl.load(part_ml_ptr + part * 2)
            w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_safe))
            total += tl.load(part_acc_ptr + part * head_dim + d, mask=d_mask, other=0.0) * w
            l += tl.load(part_ml_ptr + part * 2 + 1) * w
    if HAS_SINKS:
        l += tl.exp2(sink - m_safe)
    out = total / tl.where(l == 0.0, 1.0, l)
    tl.store(out_ptr + row * stride_ob + slot * stride_ot + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class _Tiles:
    block_t: int  # query slots per program
    block_m: int  # rows of the q tile: block_t * group, padded to a power of 2 (>= 16 for tl.dot)
    block_n: int  # keys per loop step
    block_d: int  # head_dim padded to a power of 2
    num_warps: int
    num_stages: int | None = None  # None: Triton's default


def _pick_tiles(head_dim: int, group: int, q_len: int, block_n: int | None = None, ieee: bool = False,
                prompt_rows: int | None = None, wide_steps: bool = False) -> _Tiles:
    """Tile sizes from head_dim: K, V and q tiles (x num_stages) must fit shared memory, and
    head_dim 512 leaves room only for 16 x 32 tiles. At most 32 q rows: from 64 rows Hopper's dot becomes a
    warpgroup MMA, whose rounding a one-query decode tile (16 rows) would not share. ``ieee``: fp32 dots (no
    tensor-core path), whose 32-row tiles at head_dim 128 and 256 spilled registers at the bf16 settings: 8 warps,
    and 16 keys per step at 256 (H200, graph-timed: a verify of 8 queries at head_dim 128 178 -> 20 us, at 256
    278 -> 49 us; docs/perf_log.md, session 26).

    A prompt's launch (:func:`is_prefill`, half-precision, head_dim <= 256) takes query tiles ``prompt_rows`` times
    as tall (default :data:`PREFILL_ROWS`; the launcher passes :func:`prompt_rows` of its GPU): no decode or verify
    query shares a launch with it, so its rounding need not be theirs, and each K/V tile loaded serves twice the
    queries (H200, a 2048-token prompt: E2B sliding layer 0.16 -> 0.09 ms, Step 3.5 sliding 0.75 -> 0.34). At head_dim
    512 the taller tile needs 16-key steps to fit shared memory, slower than the 16-row tile (E2B full layer 0.84 ->
    0.93 ms), so it keeps that.

    ``wide_steps`` (the launcher's :func:`wide_key_steps` of the GPU): decode and verify launches (not a prompt's,
    not fp32) at head_dim 256 and 512 walk :data:`WIDE_KEY_STEPS` keys a loop step, :data:`WIDE_KEY_STAGES` stages
    deep. Both launches of a layer take the same steps (a query's keys are summed in the same order in a decode and in
    a verify step)."""
    block_d = max(16, next_power_of_2(head_dim))
    max_m, default_n, num_warps = {16: (32, 64, 4), 32: (32, 64, 4), 64: (32, 64, 4),
                                   128: (32, 64, 4), 256: (32, 32, 8), 512: (16, 32, 8)}[block_d]
    if is_prefill(q_len) and not ieee and block_d <= 256:
        max_m *= PREFILL_ROWS if prompt_rows is None else prompt_rows
    block_m = max(16, next_power_of_2(group), min(max_m, next_power_of_2(group * q_len)))
    stages = None
    if ieee and block_m >= 32 and block_d in (128, 256):
        num_warps, default_n = 8, 16 if block_d == 256 else default_n
    elif wide_steps and WIDE_KEY_STEPS and not ieee and not is_prefill(q_len) and block_d in (256, 512):
        default_n, stages = WIDE_KEY_STEPS, WIDE_KEY_STAGES
    return _Tiles(block_t=block_m // group, block_m=block_m, block_n=block_n or default_n,
                  block_d=block_d, num_warps=num_warps, num_stages=stages)


# A launch of this many query slots per row or more is a prompt's (decode runs 1, a verify k + 1, a DFlash block its
# width, 16 in the published drafters): it takes no split-KV chunks, and taller query tiles (:func:`_pick_tiles`).
# Its queries are computed once (no later decode or verify step of the target computes a prompt position again), so
# they need not share a decode step's chunks and tile rounding; the chunks (64 keys at batch 1) made a 2048-token
# prompt write its queries' fp32 partials 32 (full layers) to 64 (sliding windows) times over for the merge to read
# back (H200, batch 1, one layer: E2B sliding 1.07 -> 0.09 ms, full 1.74 -> 0.84; Step 3.5 sliding 8.43 -> 0.34;
# docs/perf_log.md, session 42). A verify of k >= 63 drafts would take this shape too (then its queries' bits are not
# a decode step's). PREFILL_QUERIES = a huge number gives a prompt the decode launch shape; PREFILL_ROWS = 1 keeps its
# no-chunk launch on the decode step's tile heights.
PREFILL_QUERIES = 64
PREFILL_ROWS = 2


# The taller prompt tiles hold a 64 x 256 query tile beside three stages of K and V tiles, ~128 KB of shared memory
# a program: GPUs that give a program less (sm_86, sm_89, sm_120: ~99 KB) keep the decode step's tile heights.
PROMPT_TILE_SHARED_BYTES = 160 * 1024

# Decode and verify tiles at head_dim 256 and 512 (:func:`_pick_tiles`): 64 keys a loop step, two stages, instead of
# 32 keys at Triton's default depth. A split-KV chunk of 64 keys is then one step, and an unsplit row's walk half as
# many (H200, graph-timed, 640 keys: batch 1 decode 0.9-1.3 us faster a launch on the E2B, 26B-A4B and 31B layers,
# batch 8 sliding layers of 8-16 KV heads 1.33-1.38x; docs/perf_log.md, session 55). The K and V tiles of a step at
# head_dim 512 take 128 KB: GPUs whose programs may take less than WIDE_STEP_SHARED_BYTES keep 32-key steps.
# WIDE_KEY_STEPS = 0 keeps them everywhere.
WIDE_KEY_STEPS = 64
WIDE_KEY_STAGES = 2
WIDE_STEP_SHARED_BYTES = 160 * 1024


def is_prefill(q_len: int) -> bool:
    return q_len >= PREFILL_QUERIES


def prompt_rows(device: torch.device) -> int:
    """How many times taller a prompt's query tiles are on ``device`` (:data:`PREFILL_ROWS` where its shared memory
    holds them, else 1; the interpreter: PREFILL_ROWS)."""
    return PREFILL_ROWS if device.type != "cuda" else _prompt_rows_on(gpu_index(device))


@functools.cache
def _prompt_rows_on(index: int) -> int:
    """:func:`prompt_rows` of GPU ``index``, known once."""
    return PREFILL_ROWS if shared_memory_bytes(index) >= PROMPT_TILE_SHARED_BYTES else 1


def wide_key_steps(device: torch.device) -> bool:
    """Whether decode and verify tiles on ``device`` may take :data:`WIDE_KEY_STEPS` keys a step (the interpreter:
    yes)."""
    return device.type != "cuda" or _wide_key_steps_on(gpu_index(device))


@functools.cache
def _wide_key_steps_on(index: int) -> bool:
    """:func:`wide_key_steps` of GPU ``index``, known once."""
    return shared_memory_bytes(index) >= WIDE_STEP_SHARED_BYTES


def shared_memory_bytes(index: int) -> int:
    """The most shared memory a program may take on GPU ``index`` (0 when the driver cannot say)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - an older or other driver: keep the decode tiles
        return 0


def paged_attention(
    q: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks_per_row] int32
    kv_lens: torch.Tensor,  # [batch] int32
    q_pos0: torch.Tensor,  # [batch] int32
    q_lens: torch.Tensor,  # [batch] int32
    *,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    out: torch.Tensor | None = None,  # [batch, q_len, num_heads, head_dim]
    validate: bool = True,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Attention of `q` over paged K/V (see the module docstring); returns [batch, q_len, num_heads,
    head_dim] in q.dtype, written into `out` when given. Softmax of ``scale * q.k`` in fp32.

    ``sinks``: one learned logit per query head that joins each query's softmax denominator and carries no value
    (gpt-oss's attention sinks): the weights of the keys become ``exp(s_j) / (sum_i exp(s_i) + exp(sink))``. A query
    that sees no key still outputs 0.

    The Triton path never syncs with the host, so it can be captured in a CUDA graph. ``validate=False``
    skips the argument checks: for callers whose metadata comes from a PagedKVCache (every layer of every
    step; the checks cost a quarter of a small decode call on CPU).
    """
    if validate:
        _check_paged_attention_args(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens,
                                    scale, sliding_window, out, sinks)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    if use_triton(q):
        run = _paged_attention_triton
    elif sinks is not None:  # the CPU's SDPA paths have no sink term: the reference's own softmax
        run = paged_attention_reference
    elif q.device.type == "cpu" and q.shape[1] > 1 and causal and paged_attention_prompt(
            q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, scale=scale, sliding_window=sliding_window,
            out=out):
        # a prompt's forward on CPU (every row's keys are its own queries'): causal attention without a mask
        return out
    elif q.device.type == "cpu" and q.shape[0] == 1 and paged_attention_rows(
            q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, scale=scale, sliding_window=sliding_window,
            causal=causal, out=out):
        # one row on CPU (the latency case): its keys without a gather or a mask. With several rows one SDPA per
        # row costs as much as the reference's one padded, masked SDPA for all (measured on a 2-core CPU)
        return out
    else:
        run = paged_attention_reference
    run(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens,
        scale=scale, sliding_window=sliding_window, causal=causal, out=out, sinks=sinks)
    return out


# Split-KV: below this many programs per launch the GPU is underfilled (H100/H200: 132 SMs), so key ranges
# are cut into chunks that run in parallel and are merged after. The chunk size depends on the batch and the
# KV heads only (never on the number of queries per row, the block table's width or the lengths), so a decode
# step and a verify step of the same batch cut a query's keys alike: chunks of at least 64 keys (at batch 1 a
# decode step's few programs per layer would otherwise each walk hundreds of keys one tile at a time), sized
# to give about TARGET_PROGRAMS programs at a context of TYPICAL_KEYS; a launch with half the target of
# (row, kv head) pairs already fills the GPU and does not split.
TARGET_PROGRAMS = 2 * 132
TYPICAL_KEYS = 2048
MIN_KEYS_PER_SPLIT = 64
NO_SPLIT = 0


def kv_chunk(rows_x_kv_heads: int, block_n: int) -> int:
    """Keys per split-KV chunk for a launch of ``rows_x_kv_heads`` (row, kv head) pairs, a power of two and a
    multiple of ``block_n``; NO_SPLIT when the pairs alone fill the GPU."""
    if rows_x_kv_heads >= TARGET_PROGRAMS // 2:
        return NO_SPLIT
    chunk = max(MIN_KEYS_PER_SPLIT, block_n, TYPICAL_KEYS * rows_x_kv_heads // TARGET_PROGRAMS)
    return next_power_of_2(chunk)


def num_kv_splits(chunk: int, max_keys: int, aligned_start: bool) -> int:
    """Chunks that cover any query tile's key range of at most ``max_keys`` keys (one more when the range may start
    inside a chunk: sliding windows), rounded up to a power of two (a row's growing context then changes the
    grid only at every doubling, and a CUDA graph keeps it); 1 without a chunk."""
    if chunk == NO_SPLIT:
        return 1
    chunks = -(-max_keys // chunk) + (0 if aligned_start else 1)
    return next_power_of_2(max(1, chunks))


def _paged_attention_triton(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, *, scale,
                            sliding_window, causal, out, block_n=None, kv_chunk_keys=None,
                            num_stages=None, sinks=None) -> torch.Tensor:
    batch, q_len, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check(head_dim <= MAX_TRITON_HEAD_DIM, f"the Triton kernel supports head_dim <= {MAX_TRITON_HEAD_DIM}, "
          f"got {head_dim}: set HF_SPECDEC_FORCE_TRITON=0 to use the torch reference")
    group = num_heads // num_kv_heads
    # Triton's CPU interpreter (3.9) multiplies bf16 tiles as their raw uint16 bits: upcast there.
    upcast_dot = q.dtype == torch.bfloat16 and interpreting(_paged_attention_kernel)
    ieee = q.dtype == torch.float32 or upcast_dot
    tiles = _pick_tiles(head_dim, group, q_len, block_n, ieee=q.dtype == torch.float32,
                        prompt_rows=prompt_rows(q.device) if is_prefill(q_len) else None,
                        wide_steps=wide_key_steps(q.device))
    if num_stages is not None:
        tiles = dataclasses.replace(tiles, num_stages=num_stages)
    tiles_per_row = triton.cdiv(q_len, tiles.block_t)
    if kv_chunk_keys is not None:
        chunk = kv_chunk_keys
    else:
        chunk = NO_SPLIT if is_prefill(q_len) else kv_chunk(batch * num_kv_heads, tiles.block_n)
    max_keys = block_tables.shape[1] * block_size
    if sliding_window is not None and causal:  # a causal window bounds any tile's keys
        max_keys = min(max_keys, sliding_window + q_len)
    num_splits = num_kv_splits(chunk, max_keys, aligned_start=sliding_window is None)
    grid = (tiles_per_row * num_splits, num_kv_heads, batch)
    if num_splits > 1:
        part_acc = torch.empty(batch * q_len * num_heads * num_splits * head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * q_len * num_heads * num_splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, out,
        *q.stride(), *out.stride(),
        block_tables.stride(0), q_len, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        scale * math.log2(math.e), sliding_window or 0,
        part_acc, part_ml, num_splits, max(chunk, 1), out if sinks is None else sinks,
        GROUP=group, BLOCK_T=tiles.block_t, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d, CAUSAL=causal, HAS_WINDOW=sliding_window is not None,
        # fp32 inputs must not be rounded to tf32: fp32 is the exactness dtype of the tests.
        DOT_PRECISION="ieee" if ieee else "tf32",
        UPCAST_DOT=upcast_dot, SPLIT=num_splits > 1, HAS_SINKS=sinks is not None,
        num_warps=tiles.num_warps, **({} if tiles.num_stages is None else {"num_stages": tiles.num_stages}),
        **pdl_args(out),
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch * q_len, num_heads)](
            part_acc, part_ml, out, *out.stride(), q_len, num_heads, head_dim, num_splits,
            out if sinks is None else sinks,
            BLOCK_D=tiles.block_d, GROUP=math.gcd(8, num_splits), HAS_SINKS=sinks is not None, **pdl_args(out),
        )
    return out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, kv_lens: torch.Tensor, q_pos0: torch.Tensor,
                              q_lens: torch.Tensor, *, scale: float, sliding_window: int | None = None,
                              causal: bool = True, out: torch.Tensor | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Torch version of paged_attention (the same arguments and shapes): the CPU path and the test oracle.

    Gathers each row's visible pages into dense fp32 [batch, num_kv_heads, L, head_dim] keys/values
    and runs one masked fp32 SDPA for the whole batch (with ``sinks``, a softmax of its own over the scores and the
    sinks). Reads L from the device (one sync).
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    slots, visible, sees_key = _plan(block_tables, kv_lens, q_pos0, q_lens, q_len, k_cache.shape[1], sliding_window,
                                     causal)
    keys, values = (cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
                    .view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).float() for cache in (k_cache, v_cache))

    # GQA: the group's q heads are stacked along the query axis, so K/V are never repeated.
    group = num_heads // num_kv_heads
    qg = q.float().unflatten(2, (num_kv_heads, group)).permute(0, 2, 3, 1, 4)  # [batch, kv, group, q_len, D]
    qg = qg.reshape(batch, num_kv_heads, group * q_len, head_dim)
    if visible.numel() * group <= MAX_KEPT_MASK:
        mask = _grouped_mask(visible, group)
    else:  # a long prefill: its mask is not kept between layers (it would hold 4 bytes per query and key)
        mask = visible[:, None].expand(-1, group, -1, -1).reshape(batch, 1, group * q_len, -1)
    if sinks is None:
        result = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    else:
        result = _attend_with_sinks(qg, keys, values, mask, scale, sinks.float().view(num_kv_heads, group), q_len)
    # Queries that see no key output 0, whatever the SDPA backend makes of an all-masked row.
    if sees_key is not None:
        result = torch.where(sees_key[:, None, None, :, None].expand(-1, 1, group, -1, -1)
                             .reshape(batch, 1, group * q_len, 1), result, 0.0)
    result = result.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    result = result.reshape(batch, q_len, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


def _attend_with_sinks(qg, keys, values, mask, scale, sinks, q_len):
    """Softmax attention whose denominator also holds each head's ``exp(sink)``: qg [batch, kv, group * q_len, D]
    (the group's heads stacked along the queries), mask additive or boolean (True: visible), sinks [kv, group]."""
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sink = sinks[:, :, None].expand(-1, -1, q_len).reshape(1, sinks.shape[0], -1, 1)
    combined = torch.cat([scores, sink.expand(scores.shape[0], -1, -1, -1)], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # the sink's share is dropped: it carries no value
    return torch.matmul(probs, values)


def _visible_key_range(kv_lens, q_pos0, q_lens, q_len, sliding_window, causal):
    """Per row, the keys [kv_lo, kv_hi) that some valid query sees: [batch] each."""
    kv_hi = torch.minimum(kv_lens, q_pos0 + q_len) if causal else kv_lens
    kv_lo = torch.zeros_like(kv_hi)
    if sliding_window is not None:
        kv_lo = (q_pos0 + q_len - q_lens - sliding_window + 1).clamp_min(0)
    return kv_lo, torch.where(q_lens > 0, kv_hi, kv_lo)


# Every layer of a KV group reads the same rows in one forward, so the slot gather and the mask are built once per
# forward, not per layer, and kept with the forward's metadata: plans in a dict attached to its ``kv_lens`` tensor
# (which all its KV groups share), under the identities of the other metadata tensors; masks on their plan's
# ``visible`` tensor. They go when the forward's metadata does, so nothing is held past a call. (The CPU path never
# updates metadata tensors in place; holding them keeps their ids from being reused.)
KEPT_PLANS = "_hf_specdec_plans"
KEPT_MASKS = "_hf_specdec_masks"


def kept_plans(kv_lens: torch.Tensor) -> dict:
    """The plans kept with a forward's metadata (created empty at first use): ``{key: (metadata, plan)}``."""
    kept = kv_lens.__dict__.get(KEPT_PLANS)
    if kept is None:
        kept = kv_lens.__dict__[KEPT_PLANS] = {}
    return kept


def _cached_plan(build, block_tables, kv_lens, q_pos0, q_lens, *args):
    """``build(block_tables, kv_lens, q_pos0, q_lens, *args)``, once per forward: kept with ``kv_lens``
    (:func:`kept_plans`) under the other metadata tensors' identities, ``build`` and ``args``."""
    others = (block_tables, q_pos0, q_lens)  # kv_lens holds the entry: not in it (no reference cycle)
    kept = kept_plans(kv_lens)
    key = (build, *map(id, others), *args)
    hit = kept.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], others)):
        return hit[1]
    plan = build(block_tables, kv_lens, q_pos0, q_lens, *args)
    kept[key] = (others, plan)
    return plan


MAX_KEPT_MASK = 1 << 20  # elements of the largest mask kept for the other layers of a forward (4 MB)


def _grouped_mask(visible: torch.Tensor, group: int) -> torch.Tensor:
    """``visible`` [batch, q_len, L] as the additive fp32 mask of the GQA layout [batch, 1, group * q_len, L] (0 where
    the key is visible, -inf elsewhere: what SDPA makes of a boolean mask at every call), built once per plan and
    group, not per layer (decode and verify forwards; a long prefill's mask is not kept, :data:`MAX_KEPT_MASK`)."""
    kept = visible.__dict__.setdefault(KEPT_MASKS, {})
    if group in kept:
        return kept[group]
    batch, q_len, _ = visible.shape
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, float("-inf"))
    kept[group] = mask = mask[:, None].expand(-1, group, -1, -1).reshape(batch, 1, group * q_len, -1)
    return mask


def _plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window, causal):
    """(slots [batch * L] into the flattened cache, visible [batch, q_len, L], which queries see some key
    [batch, q_len] or None if all do) for this forward's rows."""
    return _cached_plan(_build_plan, block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window,
                        causal)


def _build_plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window, causal, host=None):
    """``host``: the key ranges and slots from host lists (default: for CPU tensors, where a ~30-op plan costs
    more than the few lists of a small batch), else from tensor ops on the metadata's device."""
    if kv_lens.device.type == "cpu" if host is None else host:
        ranges, slots, one_query_each = _key_slots_from_host(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size,
                                                             sliding_window, causal)
        counts = torch.tensor([hi - lo for lo, hi in ranges], dtype=torch.int32)
        in_range = torch.arange(slots.shape[0] // max(1, len(ranges))) < counts[:, None]
        if one_query_each:  # one query per row sees exactly its range: no position arithmetic
            sees_key = None if all(hi > lo for lo, hi in ranges) else (counts > 0)[:, None]
            return slots, in_range[:, None, :], sees_key
        key_pos = torch.tensor([lo for lo, _ in ranges], dtype=torch.long)[:, None] + torch.arange(in_range.shape[1])
    else:
        kv_lo, kv_hi = _visible_key_range(kv_lens, q_pos0, q_lens, q_len, sliding_window, causal)
        slots, key_pos, in_range = _key_slots(block_tables, block_size, kv_lo, kv_hi)
    steps = torch.arange(q_len, device=kv_lens.device)
    pos = (q_pos0[:, None] + steps)[:, :, None]  # [batch, q_len, 1]
    visible = (steps >= q_len - q_lens[:, None])[:, :, None] & in_range[:, None, :]
    if causal:
        visible &= key_pos[:, None, :] <= pos
    if sliding_window is not None:
        visible &= key_pos[:, None, :] > pos - sliding_window  # [batch, q_len, L]
    sees_key = visible.any(-1)  # [batch, q_len]; None when every query sees a key (nothing to zero)
    sees_key = None if bool(sees_key.all()) else sees_key
    return slots, visible, sees_key


def _key_slots_from_host(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window, causal):
    """:func:`_visible_key_range` and :func:`_key_slots`'s slots (the same values) from host lists: per row the
    key range (lo, hi), the slots [batch * L] (int64), and whether every row has exactly one query."""
    ranges, lengths = [], q_lens.tolist()
    for kv_len, pos0, n in zip(kv_lens.tolist(), q_pos0.tolist(), lengths):
        hi = min(kv_len, pos0 + q_len) if causal else kv_len
        lo = 0 if sliding_window is None else max(0, pos0 + q_len - n - sliding_window + 1)
        ranges.append((lo, hi if n > 0 else lo))
    width = max([1] + [hi - lo for lo, hi in ranges])
    slots = array("q")
    for table, (lo, hi) in zip(block_tables.tolist() if block_tables.shape[1] else [[0]] * len(ranges), ranges):
        if hi <= lo:  # no visible key: a harmless read of block 0
            slots.extend([lo % block_size] * width)
            continue
        first = len(slots)
        _extend_with_slots(slots, table, block_size, lo, hi)
        slots.extend([slots[first]] * (width - (hi - lo)))  # past the range: the row's first visible key
    return ranges, _int64_tensor(slots), q_len == 1 and all(n == 1 for n in lengths)


def _extend_with_slots(slots: array, table: list[int], block_size: int, lo: int, hi: int) -> None:
    """Append the cache slots of positions [lo, hi) of a row with block table ``table`` (a position past the table
    reads its last block, as :func:`_key_slots` clamps)."""
    last = len(table) - 1
    for start in range(lo - lo % block_size, hi, block_size):  # the blocks the range covers
        base = table[min(start // block_size, last)] * block_size - start
        slots.extend(range(base + max(start, lo), base + min(start + block_size, hi)))


def _int64_tensor(values: array) -> torch.Tensor:
    """A CPU int64 tensor over an ``array("q")`` (no per-element conversion, as ``torch.tensor(list)`` does)."""
    return torch.frombuffer(values, dtype=torch.int64) if values else torch.zeros(0, dtype=torch.int64)


# Query positions per SDPA call of a prompt's sliding-window layer on CPU (:func:`paged_attention_prompt`): each chunk
# attends over its own keys and the window before it, not over the whole prompt
PROMPT_CHUNK = 256


def paged_attention_prompt(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, *, scale, sliding_window,
                           out) -> bool:
    """The CPU path of a prompt's causal forward: where every row's keys are exactly its own valid queries' (nothing
    cached before the forward: key positions 0 .. n - 1 for the row's n valid queries, left-padded), each row
    attends with SDPA's causal form (no mask: the CPU kernel skips the key blocks above the diagonal), and a sliding
    window's layer in chunks of :data:`PROMPT_CHUNK` queries over their keys and the window before them (a band,
    not the whole square under a mask). Padding query slots output 0. Writes ``out`` and returns True, or returns
    False (nothing written) for any other forward."""
    plan = _prompt_plan(block_tables, kv_lens, q_pos0, q_lens, q.shape[1], k_cache.shape[1])
    if plan is None:
        return False
    slots, rows, bands = plan
    q_len = q.shape[1]
    keys_from, values_from = _keys_of_rows(k_cache, v_cache, slots)
    window = sliding_window if sliding_window is not None else q_len
    for b, (first, count) in enumerate(rows):
        pad = q_len - count
        if pad:
            out[b, :pad].zero_()
        if not count:
            continue
        queries = q[b, pad:].transpose(0, 1)[None]  # [1, heads, n, D]: the row's valid slots
        keys, values = _row_views(keys_from, first, count), _row_views(values_from, first, count)
        if q.dtype != torch.float32:
            queries, keys, values = queries.float(), keys.float(), values.float()
        target = out[b, pad:]
        if count <= window:  # every query sees all keys up to its own
            result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                    enable_gqa=True)
            target.copy_(result[0].transpose(0, 1))
            continue
        for start in range(0, count, PROMPT_CHUNK):
            stop = min(count, start + PROMPT_CHUNK)
            lo = max(0, start - window + 1)  # the earliest key the chunk's first query sees
            result = F.scaled_dot_product_attention(queries[:, :, start:stop], keys[:, :, lo:stop],
                                                    values[:, :, lo:stop], attn_mask=_band(bands, start, stop, window),
                                                    scale=scale, enable_gqa=True)
            target[start:stop].copy_(result[0].transpose(0, 1))
    return True


def _band(bands: dict, start: int, stop: int, window: int) -> torch.Tensor:
    """Which keys [max(0, start - window + 1), stop) the queries at positions [start, stop) see under a causal window
    of ``window`` keys ([queries, keys] bool), kept in ``bands`` (the forward's plan: built once for every row and
    layer of the forward that has this chunk, and gone with the forward)."""
    band = bands.get((start, stop, window))
    if band is None:
        key_pos = torch.arange(max(0, start - window + 1), stop)[None, :]
        pos = torch.arange(start, stop)[:, None]
        band = bands[start, stop, window] = (key_pos <= pos) & (key_pos > pos - window)
    return band


def _prompt_plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size):
    """(slots, rows, band masks) for :func:`paged_attention_prompt`, or None where it does not apply: per row (its
    first key in the cache, or in the gathered keys; its number of keys), ``slots`` None when every row's keys lie in
    consecutive slots, else every row's key slots one after the other; the band masks of its sliding layers' chunks
    (:func:`_band`), filled as they are first needed."""
    return _cached_plan(_build_prompt_plan, block_tables, kv_lens, q_pos0, q_lens, q_len, block_size)


def _build_prompt_plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size):
    rows, consecutive, ranges = [], True, []
    tables = block_tables.tolist()
    for table, kv_len, pos0, count in zip(tables, kv_lens.tolist(), q_pos0.tolist(), q_lens.tolist()):
        # the row's valid queries sit at positions 0 .. count - 1 and its keys are exactly theirs
        if kv_len != count or pos0 + q_len - count != 0:
            return None
        ranges.append((0, count))
        if not count:
            rows.append((0, 0))
            continue
        pages = _row_pages(table, block_size, 0, count)
        if pages is None:
            return None  # a key without a block: left to the reference's checks
        first, row_consecutive = pages
        consecutive &= row_consecutive
        rows.append((first, count))
    return (*_gathered(rows, consecutive, tables, ranges, block_size), {})  # {}: the forward's band masks


def _row_pages(table: list[int], block_size: int, lo: int, hi: int) -> tuple[int, bool] | None:
    """(the cache slot of key ``lo``, whether the blocks of keys [lo, hi) are consecutive in the cache) of a row with
    block table ``table``, or None where one of those keys has no block."""
    blocks = table[lo // block_size:(hi - 1) // block_size + 1]
    if len(blocks) != (hi - 1) // block_size - lo // block_size + 1 or min(blocks) < 0:
        return None
    return blocks[0] * block_size + lo % block_size, all(b == blocks[0] + i for i, b in enumerate(blocks))


def _gathered(rows: list[tuple], consecutive: bool, tables: list[list[int]], ranges: list[tuple[int, int]],
              block_size: int):
    """A CPU plan's (slots, rows): where every row's keys lie in consecutive slots, no slots and each row's first key
    in the cache; otherwise every row's key slots one row after the other (``ranges``: its keys [lo, hi)), gathered
    once per layer, and each row's first key among them. A row entry is (first key, *the rest as given)."""
    if consecutive:
        return None, rows
    slots, starts = array("q"), []
    for table, (lo, hi) in zip(tables, ranges):
        starts.append(len(slots))
        if hi > lo:
            _extend_with_slots(slots, table, block_size, lo, hi)
    return _int64_tensor(slots), [(start, *rest) for start, (_, *rest) in zip(starts, rows)]


def _keys_of_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None):
    """The [slots, kv heads, D] keys and values a CPU plan's rows index: the caches themselves, or their ``slots``
    gathered."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    keys, values = (cache.view(-1, num_kv_heads, head_dim) for cache in (k_cache, v_cache))
    if slots is None:
        return keys, values
    return keys.index_select(0, slots), values.index_select(0, slots)


def _row_views(source: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Keys (or values) ``first .. first + count - 1`` of ``source`` [slots, kv heads, D] as a [1, kv heads, count, D]
    view: 4D, as the CPU's fused SDPA kernel takes them (3D inputs run the ~3x slower math path)."""
    _, num_kv_heads, head_dim = source.shape
    return source.as_strided((1, num_kv_heads, count, head_dim),
                             (count * num_kv_heads * head_dim, head_dim, num_kv_heads * head_dim, 1),
                             source.storage_offset() + first * num_kv_heads * head_dim)


def paged_attention_rows(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens, *, scale, sliding_window,
                         causal, out) -> bool:
    """The CPU path of decode and verify forwards: each row attends over its own visible keys only (no padding to
    the widest row, and no mask where every query sees every key, as for one query per row), one fp32 SDPA per
    row. Where every row's keys lie in consecutive slots (blocks handed out in order, the usual case at batch 1)
    they are views of the cache; otherwise one gather brings every row's keys together first. Writes ``out`` and
    returns True, or returns False (nothing written) where a row has a padded query slot (a left-padded prefill)
    or a query that sees no key: the reference then runs."""
    plan = _row_plan(block_tables, kv_lens, q_pos0, q_lens, q.shape[1], k_cache.shape[1], sliding_window, causal,
                     q.shape[2] // k_cache.shape[2])
    if plan is None:
        return False
    slots, rows = plan
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys_from, values_from = _keys_of_rows(k_cache, v_cache, slots)
    upcast = q.dtype != torch.float32
    for b, (first, count, mask) in enumerate(rows):
        keys, values = _row_views(keys_from, first, count), _row_views(values_from, first, count)
        # GQA: a KV head's q heads are consecutive, stacked along the query axis (K/V are never repeated)
        qg = q[b]
        if q_len > 1:
            qg = qg.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(1, num_kv_heads, group * q_len, head_dim)
        if upcast:
            qg, keys, values = qg.float(), keys.float(), values.float()
        result = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        result = result.view(num_kv_heads, group, q_len, head_dim)
        out[b].view(q_len, num_kv_heads, group, head_dim).copy_(
            result.view(q_len, num_kv_heads, group, head_dim) if q_len == 1 else result.permute(2, 0, 1, 3))
    return True


def _row_plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window, causal, group):
    """(slots, rows) for :func:`paged_attention_rows`, or None where it does not apply. ``slots``: None when every
    row's keys lie in consecutive slots, else every row's key slots one row after the other (gathered once per
    layer). Per row (its first key in the cache, or in the gathered keys; its number of keys; the mask
    [group * q_len, keys], or None when every query sees every key)."""
    return _cached_plan(_build_row_plan, block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window,
                        causal, group)


def _build_row_plan(block_tables, kv_lens, q_pos0, q_lens, q_len, block_size, sliding_window, causal, group):
    if any(n != q_len for n in q_lens.tolist()):
        return None
    rows, consecutive, ranges = [], True, []
    tables = block_tables.tolist()
    for table, kv_len, pos0 in zip(tables, kv_lens.tolist(), q_pos0.tolist()):
        # the keys some query sees, as _visible_key_range (every query slot is real here)
        hi = min(kv_len, pos0 + q_len) if causal else kv_len
        lo = 0 if sliding_window is None else max(0, pos0 - sliding_window + 1)
        ranges.append((lo, hi))
        if hi <= lo:
            return None
        pages = _row_pages(table, block_size, lo, hi)
        if pages is None:
            return None  # a visible key without a block: left to the reference's checks
        first, row_consecutive = pages
        consecutive &= row_consecutive
        mask = None
        if q_len > 1 and (causal or sliding_window is not None):
            key_pos = torch.arange(lo, hi)[None, :]
            pos = torch.arange(pos0, pos0 + q_len)[:, None]
            visible = torch.ones(q_len, hi - lo, dtype=torch.bool)
            if causal:
                visible &= key_pos <= pos
            if sliding_window is not None:
                visible &= key_pos > pos - sliding_window
            if not bool(visible.any(-1).all()):
                return None
            mask = None if bool(visible.all()) else visible.repeat(group, 1)
        rows.append((first, hi - lo, mask))
    return _gathered(rows, consecutive, tables, ranges, block_size)


def _key_slots(block_tables, block_size, kv_lo, kv_hi):
    """Cache slots [batch * L] of each row's keys [kv_lo, kv_hi), their positions [batch, L], and whether
    each lies in the range [batch, L].

    Slots past a row's range point at the row's first visible key instead, so no released block or
    never-written slot (a cache from torch.empty may hold NaN, which would survive a masked softmax as
    0 * NaN) is ever read; rows without any visible key read block 0 and are zeroed by the caller."""
    width = max(1, int((kv_hi - kv_lo).max()))
    key_pos = kv_lo.long()[:, None] + torch.arange(width, device=kv_lo.device)  # [batch, L]
    in_range = key_pos < kv_hi[:, None]
    safe_pos = torch.where(in_range, key_pos, kv_lo.long()[:, None])
    if block_tables.shape[1] == 0:  # nothing is cached at all
        block_tables = block_tables.new_zeros(block_tables.shape[0], 1)
    blocks = block_tables.gather(1, (safe_pos // block_size).clamp(0, block_tables.shape[1] - 1))
    blocks = torch.where((kv_hi > kv_lo)[:, None], blocks.long(), 0)  # a row with no key: a harmless read
    return (blocks * block_size + safe_pos % block_size).view(-1), key_pos, in_range


def _check_paged_attention_args(q, k_cache, v_cache, block_tables, kv_lens, q_pos0, q_lens,
                                scale, sliding_window, out, sinks=None) -> None:
    check_paged_cache(k_cache, v_cache)
    check(q.dim() == 4, f"q must be [batch, q_len, num_heads, head_dim], got shape {tuple(q.shape)}")
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check(head_dim == k_cache.shape[3], f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}: "
          "pass the cache of this layer's KV group")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} must be a multiple of the cache's "
          f"num_kv_heads {num_kv_heads} (GQA)")
    check(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}: cast q to the cache dtype")
    check(block_tables.dim() == 2 and block_tables.shape[0] == batch,
          f"block_tables must be [batch={batch}, max_blocks_per_row], got shape {tuple(block_tables.shape)}")
    check(block_tables.dtype == torch.int32 and block_tables.stride(1) == 1,
          f"block_tables must be int32 with contiguous rows, got {block_tables.dtype} with strides "
          f"{block_tables.stride()}: pass block_tables.to(torch.int32).contiguous()")
    for name, t in (("kv_lens", kv_lens), ("q_pos0", q_pos0), ("q_lens", q_lens)):
        check(t.shape == (batch,) and t.dtype == torch.int32 and t.stride(0) == 1,
              f"{name} must be a contiguous [batch={batch}] int32 tensor, got {tuple(t.shape)} {t.dtype}: "
              f"pass {name}.to(torch.int32).contiguous()")
    check(sliding_window is None or sliding_window >= 1, f"sliding_window must be None or >= 1, got {sliding_window}")
    check(isinstance(scale, (int, float)), f"scale must be a python float, got {type(scale).__name__}")
    if sinks is not None:
        check(sinks.shape == (num_heads,) and sinks.is_floating_point(),
              f"sinks must be one float logit per query head, [{num_heads}], got {tuple(sinks.shape)} {sinks.dtype}")
        check_same_device(q=q, sinks=sinks)
    if out is not None:
        check(out.shape == q.shape and out.dtype == q.dtype,
              f"out must be {tuple(q.shape)} {q.dtype} like q, got {tuple(out.shape)} {out.dtype}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, kv_lens=kv_lens, q_pos0=q_pos0,
                      q_lens=q_lens, **({} if out is None else {"out": out}))
