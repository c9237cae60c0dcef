"""argmax: the index of each row's largest value, in two launches.

A greedy step ends in an argmax over the vocabulary (128k-262k logits per row). torch's reduction runs one row's
argmax on a few thread blocks: 27 us a step for a 128,896-wide fp32 row on an H200, where reading it takes about
one. Here a first launch cuts every row into chunks, one program each, and writes each chunk's largest value and its
first index; a second launch picks, per row, the first chunk holding the row's largest value. The result is torch's:
the first index of the largest value, and a NaN counts as larger than any number (the first NaN wins).
"""

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton

CHUNK = 2048  # values per program of the first launch


@triton.jit
def _chunk_max_kernel(x_ptr, value_ptr, index_ptr, width, stride_row, chunks, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    nan = x != x
    x = tl.where(nan, float("inf"), x)
    best = tl.max(x, 0)
    # the first NaN if the chunk has one (a NaN beats +inf), else the first column holding the largest value
    first_nan = tl.min(tl.where(nan, cols, width), 0)
    first_best = tl.min(tl.where((x == best) & ok, cols, width), 0)
    has_nan = first_nan < width
    index = tl.where(has_nan, first_nan, first_best)
    slot = row * chunks + chunk
    tl.store(value_ptr + slot, tl.where(has_nan, float("nan"), best))
    tl.store(index_ptr + slot, index)


@triton.jit
def _row_max_kernel(value_ptr, index_ptr, out_ptr, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < chunks
    v = tl.load(value_ptr + row * chunks + offs, mask=ok, other=float("-inf"))
    i = tl.load(index_ptr + row * chunks + offs, mask=ok, other=2147483647)
    nan = v != v
    v = tl.where(nan, float("inf"), v)
    best = tl.max(v, 0)
    first_nan = tl.min(tl.where(nan & ok, i, 2147483647), 0)
    first_best = tl.min(tl.where((v == best) & ok, i, 2147483647), 0)
    tl.store(out_ptr + row, tl.where(first_nan < 2147483647, first_nan, first_best).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for x [..., width] of floats (int64, shape x.shape[:-1]): the kernels on the GPU
    for fp32 / bf16 / fp16 rows of two chunks or more, torch otherwise (the first index of the maximum either way)."""
    check(x.is_floating_point(), f"argmax takes floating-point scores, got {x.dtype}")
    check(x.dim() >= 1 and x.shape[-1] > 0, f"argmax needs a non-empty last dim, got shape {tuple(x.shape)}")
    width = x.shape[-1]
    if (not use_triton(x) or width < 2 * CHUNK or x.numel() == 0 or width >= 2**31
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):  # fp64 would compare in fp32
        return argmax_reference(x)
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    chunks = triton.cdiv(width, CHUNK)
    values = torch.empty(rows.shape[0], chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows.shape[0], chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows.shape[0], chunks)](rows, values, indices, width, rows.stride(0), chunks, CHUNK=CHUNK,
                                               num_warps=8, **pdl_args(x))
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    _row_max_kernel[(rows.shape[0],)](values, indices, out, chunks, BLOCK=max(16, next_power_of_2(chunks)),
                                      num_warps=1, **pdl_args(x))
    return out.view(x.shape[:-1])


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle."""
    return torch.argmax(x, dim=-1)
