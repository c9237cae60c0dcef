"""forward_meta: a forward's per-token metadata (positions, slot mappings, key lengths, block tables) built on the
device from two small per-row counts.

The host decides, per row, how many tokens the cache held before this forward and how many it appends, and keeps
the rows' block tables on the device (re-uploaded only when a block was allocated or released). Everything the
layers read is derived from those in one launch:

- ``kv_lens[b] = before[b] + new[b]`` (keys after the append), ``q_lens[b] = new[b]``,
  ``q_pos0[b] = kv_lens[b] - q_len`` (position of query slot 0; negative for a left-padded prefill row);
- ``positions[b, i] = max(q_pos0[b] + i, 0)``;
- per KV group, the slot of each new token (the last ``new[b]`` query slots of the row): its block from the
  row's table times the block size plus its offset; -1 for padding slots (nothing is stored);
- the block tables, copied into buffers that may be wider (-1 past a row's table).

Rows past the counts (a CUDA graph's padding rows up to its batch bucket) get no query, no key, no slot and no
page. A graph's static buffers are written in place (``out=``), so a replay copies two small tensors instead of
every field, and the host runs none of the per-token tensor ops.
"""

from __future__ import annotations

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton


@triton.jit
def _forward_meta_kernel(
    counts_ptr,  # [2, rows] int32: tokens before this forward, new tokens
    src_tables_ptr,  # [groups, rows, src_width] int32
    kv_lens_ptr, q_pos0_ptr, q_lens_ptr,  # [out_rows] int32
    positions_ptr,  # [out_rows, q_len] int64
    slots_ptr,  # [groups, out_rows * q_len] int64
    tables_ptr,  # [groups, out_rows, width] int32
    rows, src_width, out_rows, width, q_len, block_size,
    NUM_GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # One program per output row.
    row = tl.program_id(0)
    live = row < rows
    live_row = tl.minimum(row, rows - 1)  # padding rows read the last row's counts, then drop them
    before = tl.where(live, tl.load(counts_ptr + live_row), 0)
    new = tl.where(live, tl.load(counts_ptr + rows + live_row), 0)
    kv_len = before + new
    pos0 = tl.where(live, kv_len - q_len, 0)
    tl.store(kv_lens_ptr + row, kv_len)
    tl.store(q_pos0_ptr + row, pos0)
    tl.store(q_lens_ptr + row, new)
    for q0 in range(0, q_len, BLOCK_Q):
        i = q0 + tl.arange(0, BLOCK_Q)
        in_q = i < q_len
        pos = tl.maximum(pos0 + i, 0)
        tl.store(positions_ptr + row.to(tl.int64) * q_len + i, tl.where(live, pos, 0).to(tl.int64), mask=in_q)
        is_new = in_q & (i >= q_len - new)  # none in a padding row (new = 0)
        for g in tl.static_range(NUM_GROUPS):
            src = src_tables_ptr + (g * rows + live_row).to(tl.int64) * src_width
            block = tl.load(src + pos // block_size, mask=is_new, other=-1).to(tl.int64)
            slot = tl.where(is_new, block * block_size + pos % block_size, -1)
            tl.store(slots_ptr + (g * out_rows + row).to(tl.int64) * q_len + i, slot, mask=in_q)
    own_width = tl.where(live, src_width, 0)  # a padding row has no page
    for g in tl.static_range(NUM_GROUPS):
        src = src_tables_ptr + (g * rows + live_row).to(tl.int64) * src_width
        dst = tables_ptr + (g * out_rows + row).to(tl.int64) * width
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            table = tl.load(src + w, mask=w < own_width, other=-1)
            tl.store(dst + w, table, mask=w < width)


def empty_forward_buffers(rows: int, q_len: int, groups: int, width: int, device) -> dict[str, torch.Tensor]:
    """Uninitialised output buffers of :func:`build_forward_meta` for ``rows`` rows and tables ``width`` wide."""
    i32 = dict(dtype=torch.int32, device=device)
    return dict(kv_lens=torch.empty(rows, **i32), q_pos0=torch.empty(rows, **i32), q_lens=torch.empty(rows, **i32),
                positions=torch.empty(rows, q_len, dtype=torch.int64, device=device),
                slots=torch.empty(groups, rows * q_len, dtype=torch.int64, device=device),
                tables=torch.empty(groups, rows, width, **i32))


def build_forward_meta(counts: torch.Tensor, tables: torch.Tensor, q_len: int, block_size: int,
                       out: dict[str, torch.Tensor], validate: bool = True) -> dict[str, torch.Tensor]:
    """Fill ``out`` (:func:`empty_forward_buffers`, at least as many rows as ``counts`` and tables at least as wide)
    with the metadata of a forward of ``q_len`` query slots per row.

    ``counts`` [2, rows] int32: per row the tokens the cache held before this forward, and the tokens it appends
    (right-aligned in the query slots); ``tables`` [groups, rows, width] int32: the rows' block tables (-1 where
    released or unused), holding every new token's block. Returns ``out``. Never syncs with the host.
    ``validate=False`` skips the argument checks (for PagedKVCache, which builds every argument itself)."""
    if validate:
        _check_args(counts, tables, q_len, block_size, out)
    if use_triton(counts):
        groups, rows, src_width = tables.shape
        out_rows, width = out["tables"].shape[1:]
        _forward_meta_kernel[(out_rows,)](
            counts, tables, out["kv_lens"], out["q_pos0"], out["q_lens"], out["positions"], out["slots"],
            out["tables"], rows, src_width, out_rows, width, q_len, block_size,
            NUM_GROUPS=groups, BLOCK_Q=min(next_power_of_2(q_len), 256), BLOCK_W=min(next_power_of_2(width), 256),
            **pdl_args(counts),
        )
        return out
    return build_forward_meta_reference(counts, tables, q_len, block_size, out)


def build_forward_meta_reference(counts, tables, q_len: int, block_size: int, out: dict[str, torch.Tensor]):
    """Torch version of :func:`build_forward_meta`: the CPU path and the test oracle."""
    rows = counts.shape[1]
    before, new = counts[0].long(), counts[1].long()
    kv_lens = before + new
    q_pos0 = kv_lens - q_len
    slot_index = torch.arange(q_len, device=counts.device)
    positions = (q_pos0[:, None] + slot_index[None, :]).clamp_(min=0)
    is_new = slot_index[None, :] >= (q_len - new)[:, None]
    block_index = torch.where(is_new, positions // block_size, 0)
    offsets = positions % block_size
    for field in ("kv_lens", "q_pos0", "q_lens", "positions"):
        out[field][rows:] = 0
    out["slots"].fill_(-1)
    out["tables"].fill_(-1)
    out["kv_lens"][:rows] = kv_lens
    out["q_pos0"][:rows] = q_pos0
    out["q_lens"][:rows] = new
    out["positions"][:rows] = positions
    out_rows = out["tables"].shape[1]
    for g in range(tables.shape[0]):
        blocks = tables[g].gather(1, block_index).long()
        slots = torch.where(is_new, blocks * block_size + offsets, -1)
        out["slots"][g].view(out_rows, q_len)[:rows] = slots
        out["tables"][g, :rows, :tables.shape[2]] = tables[g]
    return out


def _check_args(counts, tables, q_len, block_size, out) -> None:
    check(counts.dim() == 2 and counts.shape[0] == 2 and counts.dtype == torch.int32 and counts.is_contiguous(),
          f"counts must be a contiguous [2, rows] int32 tensor, got {tuple(counts.shape)} {counts.dtype}")
    rows = counts.shape[1]
    check(tables.dim() == 3 and tables.shape[1] == rows and tables.dtype == torch.int32 and tables.is_contiguous(),
          f"tables must be a contiguous [groups, rows={rows}, width] int32 tensor, got {tuple(tables.shape)} "
          f"{tables.dtype}")
    check(q_len >= 1 and block_size >= 1, f"q_len and block_size must be >= 1, got {q_len}, {block_size}")
    groups, out_rows, width = out["tables"].shape
    check(groups == tables.shape[0] and out_rows >= rows and width >= tables.shape[2],
          f"out holds {groups} groups x {out_rows} rows x {width} blocks; the forward has {tables.shape[0]} x "
          f"{rows} x {tables.shape[2]}")
    check(tuple(out["positions"].shape) == (out_rows, q_len)
          and tuple(out["slots"].shape) == (groups, out_rows * q_len),
          f"out's positions {tuple(out['positions'].shape)} / slots {tuple(out['slots'].shape)} do not match "
          f"{out_rows} rows of {q_len} query slots")
    check(all(t.is_contiguous() and t.device == counts.device for t in out.values()) and tables.device == counts.device,
          "counts, tables and every out buffer must be contiguous on one device")
