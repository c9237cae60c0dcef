"""fp8_linear: ``x @ dequantize(weight, scale).T`` for a few rows, reading FP8 weights and their scales directly.

A decode or verify step of an FP8 weight-only target streams each weight once; reading the stored e4m3 bytes
(and their scales) instead of a bf16 copy halves the bytes a step reads. The kernel has the shape of
:mod:`.skinny_gemm`: each program owns 16 rows (padded) and ``BLOCK_N`` output columns, walks K in ``BLOCK_K``
tiles, converts each weight tile to the activation dtype in registers and multiplies on the tensor cores. More
than 16 rows (a verify step of a batch, a prefill) take several row tiles; the programs of one column block are
launched next to each other, so the tiles after the first read the weight tile from L2.

Formats. ``weight`` is float8_e4m3fn ``[N, K]``; the real weight is ``weight * scale`` (the scale multiplies:
transformers' fine-grained FP8 stores it as ``weight_scale_inv``, compressed-tensors as ``weight_scale``). The
scale is one of
- per block: ``[ceil(N / bn), ceil(K / bk)]`` with ``block_size=(bn, bk)`` (usually 128 x 128);
- per output channel: ``[N]``, ``[N, 1]`` or ``[1, N]`` (``block_size=None``);
- per tensor: one element, any shape (``block_size`` ignored).
Scales are fp32, bf16, fp16 or float8_e8m0fnu (powers of two).

Numerics (the contract of :func:`fp8_linear_reference`): the weights dequantized in fp32, the product
accumulated in fp32 and rounded once to the activation dtype. The kernel gets the same sums: e4m3 values are
exact in bf16 and fp16, so the tensor cores form exact products, and each K tile's fp32 partial sum is
multiplied by its scale block (per-block scales: a K tile is one or several dots, none straddling two blocks,
with the tile's scales read in one load) or the finished sum by the row's scale (per channel / tensor). Only
the summation order differs. This is not what transformers' own ``FP8Linear`` and ``CompressedTensorsFP8Linear``
compute: they quantize the activations to FP8 too (W8A8); the weight-only product here is the more accurate of
the two.

Converting e4m3 on the GPU: from sm_89 (Ada, Hopper) Triton lowers ``fp8e4nv -> fp16`` to one
``cvt.rn.f16x2.e4m3x2`` per two values (plus two more to reach bf16), so the kernel loads the fp8 tensor natively
there, and bf16 rows are first turned into fp16 rows, each times the power of two that puts its largest magnitude
in [2**14, 2**15) (:func:`f16_rows`, one launch; the sum is scaled back exactly), so that the dots take the weights
in fp16: the kernel is bound by this per-weight work, not by bandwidth (1.05-1.2x on an H200). A value below 2**-28
of its row's largest loses bits in fp16 (it would add less than 2**-28 of that row's terms). Older GPUs have no
e4m3 type in Triton: the kernel then loads the bytes as uint8 and builds each value by integer ops
(:func:`e4m3_bits_to_float`, bit-exact). Triton's CPU interpreter loads
float8_e4m3fn tensors and converts every finite value exactly (NaN codes read as +-480; quantized weights hold
none), so the tests run both paths on CPU.

Every row is computed by a program of the same shape with the same K order whatever the number of rows, so a
row's result does not depend on the batch. More than ``MAX_KERNEL_ROWS`` rows, fp32 activations and anything
autograd tracks take the reference, which materializes an fp32 copy of the weight.

Mixture-of-experts weights (``[E, N, K]`` e4m3 with ``[E, ceil(N / bn), ceil(K / bk)]`` scales, transformers'
``FP8Experts``) mostly go through the grouped expert kernels (:mod:`.fp8_moe`); those whose gate they do not
compute go through :func:`fp8_expert_linear`: each (token, expert) pair is one matrix-vector product of
its expert's weight (:func:`fp8_expert_matmul`, one program per pair and ``BLOCK_N`` columns), so a decode or
verify step reads the selected experts' bytes with no host sync (CUDA-graph capturable); the products are exact
in fp32 and summed in fp32 as the reference does. A pair's result does not depend on the other pairs. Many
pairs (prefill) take one dequantized GEMM per selected expert instead.
"""

import torch
import torch.nn.functional as F

from ._dispatch import (check, check_same_device, gpu_capability, gpu_index, interpreting, needs_grad, pdl_args,
                        pdl_wait, tl, triton, use_triton)
from .skinny_gemm import load_k_tile, sum_splits

MAX_ROWS = 16  # rows per program (tl.dot's smallest M)
MAX_KERNEL_ROWS = 8192  # more rows take the reference
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16, E8M0_DTYPE) if d is not None)
MIN_BLOCK_K = 16  # tl.dot's smallest K
FP16_DOTS = True  # bf16 rows multiply fp8 weights as fp16 (see fp8_matmul); False: as bf16


@triton.jit
def e4m3_bits_to_float(bits):
    """float8_e4m3fn bytes (uint8) -> their fp32 values, bit-exact for every finite code. The byte's exponent and
    mantissa, moved into fp16's bit positions, are the value times 2**-8 (the exponent biases differ by 8, and
    e4m3 subnormals land on fp16 subnormals the same way); fp16 -> fp32 and the power of two are exact."""
    bits = bits.to(tl.uint16)
    half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def load_scale(ptrs, mask, E8M0: tl.constexpr):
    """Scales at ``ptrs`` as fp32; E8M0: uint8 exponents, 2**(e - 127) (0 reads as 0, not 2**-127)."""
    if E8M0:
        exponent = tl.load(ptrs, mask=mask, other=127).to(tl.int32)
        return (exponent << 23).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=1.0).to(tl.float32)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, inv_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     stride_sn, stride_sk, scale_bn, scale_bk, k_per_split, stride_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
                     SCALE_PER_K: tl.constexpr, NATIVE_FP8: tl.constexpr, SCALE_E8M0: tl.constexpr,
                     UPCAST: tl.constexpr, F16_ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row tiles of one column block run side by side
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    s_rows = s_ptr + (cols // scale_bn).to(tl.int64) * stride_sn  # each column's row of scales
    subs = tl.arange(0, BLOCK_K // SUB_K)
    # split-K: program_id(2) takes K in [k_lo, k_hi) (a multiple of BLOCK_K from 0) and writes an fp32 partial
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_PER_K:
            # the scales of the tile's SUB_K-wide parts (each inside one block of scales along K), in one load
            sub_k = tl.minimum((k0 + subs * SUB_K) // scale_bk, (K - 1) // scale_bk)
            scales = load_scale(s_rows[:, None] + sub_k[None, :] * stride_sk, col_ok[:, None], SCALE_E8M0)
        for j in tl.static_range(BLOCK_K // SUB_K):
            w, x = load_k_tile(w_rows, x_rows, k0 + j * SUB_K, K, col_ok, row_ok, SUB_K)
            if NATIVE_FP8:
                w = w.to(x.dtype)  # F16_ROWS: x is fp16, one conversion per two weights
            else:
                w = e4m3_bits_to_float(w).to(x.dtype)
            if UPCAST:
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))
            if SCALE_PER_K:
                acc += part * tl.sum(tl.where(subs[None, :] == j, scales, 0.0), axis=1)[None, :]
            else:
                acc += part
    if not SCALE_PER_K:
        acc = acc * load_scale(s_rows, col_ok, SCALE_E8M0)[None, :]
    if F16_ROWS:  # undo the rows' powers of two (exact)
        acc = acc * tl.load(inv_ptr + rows, mask=row_ok, other=1.0)[:, None]
    out = (y_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows.to(tl.int64)[:, None] * stride_ym
           + cols[None, :])
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _f16_rows_kernel(x_ptr, y_ptr, inv_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)`` of ``x`` (bf16) as fp16 times the power of two that puts its largest magnitude in
    [2**14, 2**15), and that power's inverse (fp32) in ``inv_ptr``. bf16 has 8 significant bits, fp16 11: every
    value down to 2**-28 of the row's largest converts exactly, and nothing overflows."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        values = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(values))
    biased = ((tl.max(top, axis=0).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)  # 0: a zero row
    power = tl.minimum(tl.maximum(268 - biased, 14), 240)  # 2**(14 - exponent), as a biased exponent
    scale = (power << 23).to(tl.float32, bitcast=True)
    for k0 in range(0, K, BLOCK):
        ok = k0 + offs < K
        values = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * K + k0 + offs, (values * scale).to(tl.float16), mask=ok)
    tl.store(inv_ptr + row, ((254 - power) << 23).to(tl.float32, bitcast=True))


F16_ROWS_BLOCK = 1024


def f16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [rows, K] bf16 as fp16 rows scaled by powers of two, the inverse powers [rows] fp32), one launch:
    ``x == y.float() * inverse[:, None]`` wherever a value is at least 2**-28 of its row's largest."""
    rows, k = x.shape
    y = torch.empty(rows, k, dtype=torch.float16, device=x.device)
    inverse = torch.empty(rows, dtype=torch.float32, device=x.device)
    _f16_rows_kernel[(rows,)](x, y, inverse, k, x.stride(0), BLOCK=F16_ROWS_BLOCK,
                                   **pdl_args(x))
    return y, inverse


@triton.jit
def _fp8_expert_gemv_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xp, stride_we, stride_wn,
                            stride_se, stride_sn, stride_sk, stride_yp, scale_bn, scale_bk,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_PER_K: tl.constexpr,
                            NATIVE_FP8: tl.constexpr, SCALE_E8M0: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + (cols // scale_bn).to(tl.int64) * stride_sn
    x_row = x_ptr + pair * stride_xp
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        w = w.to(tl.float32) if NATIVE_FP8 else e4m3_bits_to_float(w)
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)  # e4m3 x bf16/fp16 products are exact in fp32
        if SCALE_PER_K:
            acc += part * load_scale(s_rows + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)
        else:
            acc += part
    if not SCALE_PER_K:
        acc = acc * load_scale(s_rows, col_ok, SCALE_E8M0)
    tl.store(y_ptr + pair * stride_yp + cols, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------- scale layouts


def scale_grid(scale: torch.Tensor, block_size, n: int, k: int) -> tuple[torch.Tensor, int, int]:
    """``scale`` as a 2-D grid ``[ceil(n / bn), ceil(k / bk)]`` and its ``(bn, bk)``: weight ``[i, j]`` takes
    ``grid[i // bn, j // bk]``. Raises ValueError for a scale that fits none of the layouts (module docstring)."""
    check(isinstance(scale, torch.Tensor) and scale.dtype in SCALE_DTYPES,
          f"scale must be a tensor of {[str(d) for d in SCALE_DTYPES]}, got "
          f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if scale.numel() == 1:
        return scale.reshape(1, 1), max(n, 1), max(k, 1)
    if block_size is None:
        check(tuple(scale.shape) in ((n,), (n, 1), (1, n)),
              f"with block_size=None the scale is per tensor (one element) or per output channel ([{n}], [{n}, 1] "
              f"or [1, {n}]), got shape {tuple(scale.shape)}; pass block_size=(bn, bk) for block scales")
        return scale.reshape(n, 1), 1, max(k, 1)
    check(len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size),
          f"block_size must be two positive ints (bn, bk) or None, got {block_size!r}")
    bn, bk = block_size
    grid = (-(-n // bn), -(-k // bk))
    check(tuple(scale.shape) == grid, f"block scales for a [{n}, {k}] weight with block_size={tuple(block_size)} "
          f"must be [ceil({n}/{bn}), ceil({k}/{bk})] = {list(grid)}, got {list(scale.shape)}")
    return scale, bn, bk


def dequantize_fp8(weight: torch.Tensor,  # [N, K] float8_e4m3fn
                   scale: torch.Tensor, block_size=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight * scale`` as a dense ``[N, K]`` tensor: computed in fp32, then cast to ``dtype``."""
    check(weight.dim() == 2, f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    rows = grid.float()[torch.arange(n, device=grid.device) // bn]  # [N, K blocks]
    dense = weight.float()
    for j in range(grid.shape[1]):  # one K block at a time: no second [N, K] temporary
        dense[:, j * bk:(j + 1) * bk] *= rows[:, j:j + 1]
    return dense.to(dtype)


def quantize_fp8(weight: torch.Tensor,  # [N, K]
                 block_size=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale) with ``weight ~= fp8 * scale``: per-block amax scales
    ``[ceil(N / bn), ceil(K / bk)]`` (partial edge blocks included), or one per output channel (``[N, 1]``)
    with ``block_size=None``. For tests and benchmarks; checkpoints bring their own."""
    n, k = weight.shape
    bn, bk = block_size if block_size is not None else (1, max(k, 1))
    grid = (-(-n // bn), -(-k // bk))
    padded = F.pad(weight.float().abs(), (0, grid[1] * bk - k, 0, grid[0] * bn - n))
    amax = padded.view(grid[0], bn, grid[1], bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.finfo(FP8_DTYPE).max, torch.ones_like(amax))
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    fp8 = (weight.float() / full).clamp(-448.0, 448.0).to(FP8_DTYPE)
    return fp8, scale


# ---------------------------------------------------------------- launcher, reference, dispatch


def config_for(n: int, k: int, block_scales: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an fp8 ``[n, k]`` weight. Wide outputs: 64-column programs;
    block scales 128-deep K tiles (one dot per block of scales) in 6 stages, per-channel scales 256-deep in 4 (with
    fp16 dots, an H200 sweep put them 1.05-1.2x ahead of the 32-column programs the H100 sweep had chosen with bf16
    dots, ``fp8_gpu_check_sweep_fp16dots_h200.log``; end to end, the 31B cut to 12 layers decodes 1.04-1.06x faster at
    batch 1 and 1.06-1.08x at batch 8 on an H200, as fast at batch 1 and 1.07-1.08x at batch 8 on an H100). Narrow
    outputs (fewer 32-column blocks than :data:`SPLIT_K_BELOW_PROGRAMS`: the o and down projections, the 26B-A4B's
    projections) split K (:func:`split_k_for`) over :data:`NARROW_CONFIG` programs."""
    if -(-n // 32) < SPLIT_K_BELOW_PROGRAMS:
        return NARROW_CONFIG
    if block_scales:
        return 64, 128, 4, 6
    return 64, 256, 4, 4


# Split-K: a weight of fewer 32-column blocks than SPLIT_K_BELOW_PROGRAMS (2 per SM of an H100 or H200) splits K so
# that narrow outputs keep bytes in flight on every SM: 64-column programs over 128-deep K tiles, K cut into parts
# of at least MIN_TILES_PER_SPLIT tiles until the launch has about SPLIT_PROGRAMS programs (at most MAX_SPLIT_K
# parts); the fp32 partials are summed in split order by a second launch. On an H200 this runs the 31B's down
# projection [5376, 21504] in 42-45 us against 51 us for 32-column programs in 4 parts, o [5376, 8192] in 18 against
# 23-27 (benchmarks/results/fp8_split_k_sweep_h200.log).
NARROW_CONFIG = (64, 128, 4, 3)
SPLIT_K_BELOW_PROGRAMS = 264
SPLIT_PROGRAMS = 504
MAX_SPLIT_K = 8
MIN_TILES_PER_SPLIT = 2


def split_k_for(n: int, k: int, block_n: int, block_k: int) -> int:
    """Parts of K for an ``[n, k]`` weight in ``block_n`` x ``block_k`` tiles. The weight's shape alone decides
    (never the number of rows), so a verify row is summed in the same parts as a decode row."""
    if -(-n // 32) >= SPLIT_K_BELOW_PROGRAMS:
        return 1
    column_blocks, tiles = -(-n // block_n), -(-k // block_k)
    return max(1, min(MAX_SPLIT_K, -(-SPLIT_PROGRAMS // column_blocks), tiles // MIN_TILES_PER_SPLIT))


def fp8_matmul(x: torch.Tensor,  # [rows, K] bf16 / fp16
               weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
               scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)], channel [N] / [N, 1] / [1, N], or one element
               block_size=None, config: tuple[int, int, int, int] | None = None,
               native_fp8: bool | None = None, split_k: int | None = None,
               fp16_dots: bool | None = None) -> torch.Tensor:
    """``x @ dequantize_fp8(weight, scale, block_size).T`` by the kernel, in ``x.dtype`` ([rows, N]).
    ``native_fp8``: load float8 values (default where the device has them: sm_89+, the interpreter) or bytes
    converted by integer ops. ``split_k``: parts of K (default :func:`split_k_for`, from the weight's shape: a
    row's result never depends on the number of rows). ``fp16_dots`` (default: bf16 rows with native fp8): the
    rows go to fp16 first (:func:`f16_rows`), so that each weight needs one conversion (e4m3 -> fp16) instead of
    three (e4m3 -> fp16 -> fp32 -> bf16)."""
    check_matmul_args(x, weight, scale)
    rows, k = x.shape
    n = weight.shape[0]
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    scale_per_k = grid.shape[1] > 1
    block_n, block_k, warps, stages = config or config_for(n, k, scale_per_k)
    if scale_per_k:
        check((bk & -bk) >= MIN_BLOCK_K, f"block_size[1]={bk} must be a multiple of {MIN_BLOCK_K} for the kernel "
              "(fp8_linear takes the reference for such scales)")
    x, sub_k, native_fp8, e8m0, upcast = _launch_setup(x, grid, bk, block_k, scale_per_k, native_fp8,
                                                       _fp8_gemm_kernel)
    if fp16_dots is None:
        fp16_dots = FP16_DOTS and native_fp8 and x.dtype == torch.bfloat16
    check(not fp16_dots or (native_fp8 and x.dtype == torch.bfloat16),
          "fp16_dots takes bf16 rows and native fp8 loads")
    rows_in, inverse = f16_rows(x) if fp16_dots else (x, x)  # inverse: unread without fp16 dots
    block_k = max(block_k, sub_k)  # a K tile of BLOCK_K / SUB_K parts, each inside one block of scales
    split = split_k if split_k is not None else split_k_for(n, k, block_n, block_k)
    check(isinstance(split, int) and split >= 1, f"split_k must be a positive int, got {split!r}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty part
    dtype = torch.float32 if upcast or split > 1 else x.dtype
    out = torch.empty(split, rows, n, dtype=dtype, device=x.device)
    _fp8_gemm_kernel[(triton.cdiv(rows, MAX_ROWS), triton.cdiv(n, block_n), split)](
        rows_in, weight if native_fp8 else weight.view(torch.uint8), grid.view(torch.uint8) if e8m0 else grid, out,
        inverse, rows, n, k, rows_in.stride(0), weight.stride(0), out.stride(1), grid.stride(0), grid.stride(1), bn,
        bk, k_per_split, out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=sub_k, SCALE_PER_K=scale_per_k,
        NATIVE_FP8=native_fp8, SCALE_E8M0=e8m0, UPCAST=upcast, F16_ROWS=fp16_dots, num_warps=warps,
        num_stages=stages, **pdl_args(out))
    if split == 1:
        return out[0].to(x.dtype)
    return sum_splits(out, torch.float32 if upcast else x.dtype).to(x.dtype)


def _launch_setup(x, scale, bk, block_k, scale_per_k, native_fp8, kernel):
    """What both launchers settle before a launch -> (x with contiguous rows, the K step of one dot (it must not
    straddle two scale blocks), native fp8 loads, e8m0 scales, upcast). Triton's CPU interpreter (3.9) multiplies
    bf16 tiles as their raw uint16 bits and truncates fp32 -> bf16 casts: there the tiles go to fp32 (``upcast``)
    and torch rounds the fp32 result."""
    if scale_per_k:
        block_k = min(block_k, bk & -bk)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if native_fp8 is None:
        native_fp8 = has_native_fp8(x.device)
    upcast = x.dtype == torch.bfloat16 and interpreting(kernel)
    return x, block_k, native_fp8, scale.dtype == E8M0_DTYPE, upcast


def check_matmul_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, name: str = "fp8_matmul",
                      linear: str = "fp8_linear") -> None:
    """The rows, weight and scale that an FP8 GEMM launcher (``name``; ``linear`` takes any rows) takes."""
    check(x.dim() == 2 and 0 < x.shape[0] <= MAX_KERNEL_ROWS,
          f"{name} takes [1..{MAX_KERNEL_ROWS}, K] rows (reshape(-1, K); {linear} takes any), got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, f"activations must be bfloat16 or float16, got {x.dtype}")
    check(weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(weight.dim() == 2 and weight.shape[1] == x.shape[1],
          f"weight must be [N, K={x.shape[1]}], got shape {tuple(weight.shape)}")
    check(weight.stride(1) == 1, f"weight rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    check_same_device(x=x, weight=weight, scale=scale)


def has_native_fp8(device: torch.device) -> bool:
    """Whether Triton has the e4m3 type on ``device``: sm_89+ GPUs, and the CPU interpreter."""
    return device.type != "cuda" or gpu_capability(gpu_index(device)) >= (8, 9)


def fp8_linear_reference(x: torch.Tensor,  # [..., K]
                         weight: torch.Tensor, scale: torch.Tensor, block_size=None) -> torch.Tensor:
    """The contract: the weight dequantized in fp32, ``x @ w.T`` accumulated in fp32, rounded once to
    ``x.dtype`` ([..., N])."""
    check(weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(weight.dim() == 2 and x.dim() > 0 and x.shape[-1] == weight.shape[1],
          f"x [..., K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    return F.linear(x.float(), dequantize_fp8(weight, scale, block_size)).to(x.dtype)


def fp8_eligible(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size=None) -> bool:
    """Whether :func:`fp8_linear` runs the kernel for these arguments (else the reference); a scale that fits
    no layout raises ValueError (:func:`scale_grid`)."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1] or scale.dtype not in SCALE_DTYPES:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    ok = (use_triton(x) and x.device == weight.device == scale.device and x.dtype in ACTIVATION_DTYPES
          and weight.dtype == FP8_DTYPE and type(weight) in (torch.Tensor, torch.nn.Parameter)
          and weight.layout == torch.strided and weight.stride(1) == 1 and 0 < rows <= MAX_KERNEL_ROWS
          and not needs_grad(x) and not needs_grad(weight) and not needs_grad(scale))
    if not ok:
        return False
    grid, _, bk = scale_grid(scale, block_size, *weight.shape)
    return grid.shape[1] == 1 or (bk & -bk) >= MIN_BLOCK_K  # K tiles of a power of two inside a scale block


def fp8_linear(x: torch.Tensor,  # [..., K] bf16 / fp16 (any float dtype on the reference path)
               weight: torch.Tensor,  # [N, K] float8_e4m3fn
               scale: torch.Tensor, block_size=None) -> torch.Tensor:
    """``x @ (weight * scale).T`` ([..., N], no bias): the kernel when :func:`fp8_eligible`, else
    :func:`fp8_linear_reference`."""
    if not fp8_eligible(x, weight, scale, block_size):
        return fp8_linear_reference(x, weight, scale, block_size)
    rows = x.reshape(-1, x.shape[-1])
    return fp8_matmul(rows, weight, scale, block_size).view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- mixture-of-experts weights [E, N, K]

# (token, expert) pairs above which fp8_expert_linear runs one GEMM per selected expert (a host sync), outside CUDA
# graph capture: a prefill's pairs. Decode and verify forwards stay on the kernel, whose pairs are computed one per
# program (a pair's result does not depend on the others), so a verify step and a decode step round alike.
MAX_EXPERT_PAIRS = 4096


def expert_scale_blocks(scale: torch.Tensor, block_size, n: int, k: int) -> tuple[int, int]:
    """``(bn, bk)`` of per-expert scales ``[E, sn, sk]`` for ``[E, n, k]`` weights: ``weight[e, i, j]`` takes
    ``scale[e, i // bn, j // bk]``. ``block_size=None``: the grid spans the weight (one scale per expert, or one
    per half of a stacked gate/up). Rows past ``ceil(n / bn)`` are unused (transformers allocates at least two
    for a stacked gate/up)."""
    check(isinstance(scale, torch.Tensor) and scale.dtype in SCALE_DTYPES and scale.dim() == 3,
          f"expert scales must be a [E, sn, sk] tensor of {[str(d) for d in SCALE_DTYPES]}, got "
          f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    sn, sk = scale.shape[1:]
    if block_size is None:
        return -(-n // sn), -(-k // sk)
    check(len(block_size) == 2 and all(isinstance(b, int) and b > 0 for b in block_size),
          f"block_size must be two positive ints (bn, bk) or None, got {block_size!r}")
    bn, bk = block_size
    check(sk == -(-k // bk) and sn >= -(-n // bn), f"block scales for [E, {n}, {k}] weights with block_size="
          f"{tuple(block_size)} must be [E, ceil({n}/{bn}), ceil({k}/{bk})], got {list(scale.shape)}")
    return bn, bk


def fp8_expert_matmul(x: torch.Tensor,  # [pairs, K] bf16 / fp16
                      weight: torch.Tensor,  # [E, N, K] float8_e4m3fn, rows contiguous
                      scale: torch.Tensor,  # [E, sn, sk]
                      expert_ids: torch.Tensor,  # [pairs] int, each in [0, E)
                      block_size=None, block_n: int = 32, block_k: int = 256,
                      native_fp8: bool | None = None) -> torch.Tensor:
    """``y[p] = x[p] @ dequantize(weight[expert_ids[p]]).T`` by the kernel, in ``x.dtype`` ([pairs, N])."""
    check(x.dim() == 2 and x.dtype in ACTIVATION_DTYPES, f"x must be [pairs, K] bfloat16 or float16, got "
          f"{x.dtype} {tuple(x.shape)}")
    check(weight.dtype == FP8_DTYPE and weight.dim() == 3 and weight.shape[2] == x.shape[1]
          and weight.stride(2) == 1, f"weight must be [E, N, K={x.shape[1]}] float8_e4m3fn with contiguous rows, "
          f"got {weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
    check(expert_ids.shape == (x.shape[0],) and not expert_ids.is_floating_point(),
          f"expert_ids must be [pairs={x.shape[0]}] integers, got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    check_same_device(x=x, weight=weight, scale=scale, expert_ids=expert_ids)
    pairs, k = x.shape
    n = weight.shape[1]
    bn, bk = expert_scale_blocks(scale, block_size, n, k)
    scale_per_k = scale.shape[2] > 1
    x, block_k, native_fp8, e8m0, upcast = _launch_setup(x, scale, bk, block_k, scale_per_k, native_fp8,
                                                         _fp8_expert_gemv_kernel)
    out = torch.empty(pairs, n, dtype=torch.float32 if upcast else x.dtype, device=x.device)
    if pairs == 0:
        return out.to(x.dtype)
    _fp8_expert_gemv_kernel[(pairs, triton.cdiv(n, block_n))](
        x, expert_ids, weight if native_fp8 else weight.view(torch.uint8),
        scale.view(torch.uint8) if e8m0 else scale, out, n, k, x.stride(0), weight.stride(0), weight.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), bn, bk,
        BLOCK_N=block_n, BLOCK_K=block_k, SCALE_PER_K=scale_per_k, NATIVE_FP8=native_fp8, SCALE_E8M0=e8m0,
        num_warps=4, **pdl_args(out))
    return out.to(x.dtype)


def fp8_expert_linear_reference(x: torch.Tensor,  # [pairs, K]
                                weight: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor,
                                block_size=None) -> torch.Tensor:
    """The contract of :func:`fp8_expert_matmul` for any pairs and dtypes: per selected expert, its weight
    dequantized in fp32 and the pairs' product accumulated in fp32, rounded once to ``x.dtype`` ([pairs, N]).
    Reads the selected experts on the host (a sync)."""
    n, k = weight.shape[1:]
    bn, bk = expert_scale_blocks(scale, block_size, n, k)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for expert in expert_ids.unique().tolist():
        rows = (expert_ids == expert).nonzero().squeeze(1)
        grid = scale[expert, :-(-n // bn), :-(-k // bk)]
        out[rows] = fp8_linear_reference(x[rows], weight[expert], grid, (bn, bk))
    return out


def fp8_expert_eligible(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor,
                        block_size=None) -> bool:
    """Whether :func:`fp8_expert_linear` runs the kernel (else a GEMM per selected expert)."""
    if not (use_triton(x) and x.dim() == 2 and x.shape[0] > 0 and x.dtype in ACTIVATION_DTYPES
            and (x.shape[0] <= MAX_EXPERT_PAIRS or (x.is_cuda and torch.cuda.is_current_stream_capturing()))
            and weight.dtype == FP8_DTYPE and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.dim() == 3 and weight.stride(2) == 1 and scale.dtype in SCALE_DTYPES
            and x.device == weight.device == scale.device == expert_ids.device
            and not needs_grad(x) and not needs_grad(weight) and not needs_grad(scale)):
        return False
    bn, bk = expert_scale_blocks(scale, block_size, *weight.shape[1:])
    return scale.shape[2] == 1 or (bk & -bk) >= MIN_BLOCK_K


def fp8_expert_linear(x: torch.Tensor,  # [pairs, K]
                      weight: torch.Tensor,  # [E, N, K] float8_e4m3fn
                      scale: torch.Tensor,  # [E, sn, sk]
                      expert_ids: torch.Tensor,  # [pairs]
                      block_size=None) -> torch.Tensor:
    """``x[p] @ dequantize(weight[expert_ids[p]]).T`` for every pair ([pairs, N]): the kernel when
    :func:`fp8_expert_eligible` (no host sync), else :func:`fp8_expert_linear_reference`."""
    if fp8_expert_eligible(x, weight, scale, expert_ids, block_size):
        return fp8_expert_matmul(x, weight, scale, expert_ids, block_size)
    return fp8_expert_linear_reference(x, weight, scale, expert_ids, block_size)
