"""w8a8_matmul: FP8 weights times FP8-quantized activations for a few rows, on the FP8 tensor cores.

transformers' own FP8 layers (``FP8Linear`` of its fine-grained FP8 quantizer) compute W8A8: each row of the
activations is quantized to e4m3 per group of K values (the weight's K block, 128), with the group's scale
``amax / 448`` (dynamic, the default ``activation_scheme``) or one stored scale (``"static"``); the e4m3 products
are summed in fp32 and each group's partial sum is multiplied by its row's scale and its weight block's scale.
This kernel computes that product without the activations' round trip through memory: each program quantizes
its rows' group in registers (the same IEEE operations for every program), then multiplies e4m3 by e4m3 on the
tensor cores. No weight is converted, so a step streams the stored bytes at the rate of the bf16 kernel instead of
the rate at which the weight-only kernel (:mod:`.fp8_gemm`) can convert them.

Numerics (the contract of :func:`w8a8_linear_reference`): ``x_q = e4m3(clamp(x / s, -448, 448))`` (ties to even)
per row and group, ``s = amax(|x_group|) / 448`` (1 for an all-zero group) or the static scale, then
``sum_groups(dot(x_q, w_q) * s) * weight_scale`` accumulated in fp32 and rounded once to the activation dtype.
The reference dequantizes both operands in fp32 and multiplies; the two differ only by fp32 rounding.

A row's quantization and sums depend on that row alone (its groups, its scale), never on the other rows of the
forward, and the tiles, K order and split-K parts depend on the weight's shape alone: a verify row rounds like a
decode row. Triton's CPU interpreter multiplies fp8 tiles as raw bytes and rounds fp32 -> e4m3 wrongly where the
rounding carries into the exponent: there the kernel rounds by :func:`round_e4m3` and multiplies in fp32 (every
e4m3 product and its fp32 sum are then the GPU's).
"""

import torch
import torch.nn.functional as F

from ._dispatch import (check, check_same_device, interpreting, needs_grad, pdl_args, pdl_wait, tl, triton,
                        use_triton)
from .fp8_gemm import (ACTIVATION_DTYPES, E8M0_DTYPE, FP8_DTYPE, MAX_KERNEL_ROWS, MAX_ROWS, SCALE_DTYPES,
                       config_for, dequantize_fp8, has_native_fp8, load_scale, scale_grid,
                       split_k_for)
from .skinny_gemm import load_k_tile, sum_splits

GROUP = 128  # activation values per scale along K (transformers' fine-grained FP8: the weight's K block)
E4M3_MAX = 448.0
# the dot's orientation: weights as the MMA's rows ([BLOCK_N, GROUP] x [GROUP, 16]) or the activations'
# ([16, GROUP] x [GROUP, BLOCK_N]); the sums are the same products in the same K order either way
SWAP = True
# the activations quantized by a launch of their own (codes and scales through memory, so the GEMM's loop only
# loads and multiplies), or by every program of the GEMM in registers
PREQUANTIZE = True
QUANTIZE_VALUES = 1024  # activation values per program of the quantizing launch


@triton.jit
def round_e4m3(v):
    """fp32 values -> the nearest float8_e4m3fn values (ties to even; |v| <= 448 expected), still fp32."""
    biased = ((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    step = ((tl.maximum(biased, 121) - 3) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3); 2**-9 below 2**-6
    magic = 12582912.0  # 1.5 * 2**23: t + magic rounds t to an integer, ties to even, for |t| < 2**22
    return ((v / step + magic) - magic) * step


@triton.jit
def quantize_group(x, static_scale, STATIC: tl.constexpr, EMULATE: tl.constexpr):
    """A rows x GROUP tile -> (its e4m3 codes: float8 on the GPU, their fp32 values where EMULATE, the rows'
    scales [rows] fp32)."""
    xf = x.to(tl.float32)
    if STATIC:
        s = tl.zeros([x.shape[0]], dtype=tl.float32) + static_scale
    else:
        amax = tl.max(tl.abs(xf), axis=1)
        s = tl.where(amax > 0.0, amax / 448.0, 1.0)
    v = tl.minimum(tl.maximum(xf / s[:, None], -448.0), 448.0)
    if EMULATE:
        return round_e4m3(v), s
    return v.to(tl.float8e4nv), s


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, qs_ptr, a_ptr, K, stride_xm, groups, GROUP_K: tl.constexpr,
                          GROUPS_PER_PROGRAM: tl.constexpr, STATIC: tl.constexpr, EMULATE: tl.constexpr,
                          PDL: tl.constexpr):
    """Row ``program_id(0)``'s groups ``program_id(1) * GROUPS_PER_PROGRAM ...`` -> e4m3 codes (fp32 values where
    EMULATE) and their scales [rows, groups]."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    ks = g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    ok = ks < K
    x = tl.load(x_ptr + row * stride_xm + ks, mask=ok, other=0.0)
    static_scale = tl.load(a_ptr).to(tl.float32) if STATIC else 1.0
    q, s = quantize_group(x, static_scale, STATIC, EMULATE)
    tl.store(q_ptr + row * K + ks, q, mask=ok)
    tl.store(qs_ptr + row * groups + g, s, mask=g < groups)


@triton.jit
def _w8a8_kernel(x_ptr, w_ptr, s_ptr, a_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 stride_sn, stride_sk, scale_bn, scale_bk, k_per_split, stride_split, xs_ptr, groups,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                 SCALE_PER_K: tl.constexpr, SCALE_E8M0: tl.constexpr, STATIC: tl.constexpr,
                 EMULATE: tl.constexpr, SWAP_AB: tl.constexpr, PREQUANT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    s_rows = s_ptr + (cols // scale_bn).to(tl.int64) * stride_sn
    static_scale = tl.load(a_ptr).to(tl.float32) if STATIC else 1.0
    subs = tl.arange(0, BLOCK_K // GROUP_K)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_PER_K:  # the weight scales of the tile's groups (each inside one block of scales), in one load
            sub_k = tl.minimum((k0 + subs * GROUP_K) // scale_bk, (K - 1) // scale_bk)
            scales = load_scale(s_rows[:, None] + sub_k[None, :] * stride_sk, col_ok[:, None], SCALE_E8M0)
        for j in tl.static_range(BLOCK_K // GROUP_K):
            w, x = load_k_tile(w_rows, x_rows, k0 + j * GROUP_K, K, col_ok, row_ok, GROUP_K)
            if PREQUANT:  # codes and scales from _quantize_rows_kernel
                xq = x
                xs = tl.load(xs_ptr + rows * groups + (k0 + j * GROUP_K) // GROUP_K, mask=row_ok, other=1.0)
            else:
                xq, xs = quantize_group(x, static_scale, STATIC, EMULATE)
            if EMULATE:
                w = w.to(tl.float32)
            if SWAP_AB:
                if EMULATE:
                    part = tl.dot(w, tl.trans(xq), input_precision="ieee")
                else:
                    part = tl.dot(w, tl.trans(xq))
                part = part * xs[None, :]
                if SCALE_PER_K:
                    part = part * tl.sum(tl.where(subs[None, :] == j, scales, 0.0), axis=1)[:, None]
            else:
                if EMULATE:
                    part = tl.dot(xq, tl.trans(w), input_precision="ieee")
                else:
                    part = tl.dot(xq, tl.trans(w))
                part = part * xs[:, None]
                if SCALE_PER_K:
                    part = part * tl.sum(tl.where(subs[None, :] == j, scales, 0.0), axis=1)[None, :]
            acc += part
    if SWAP_AB:
        if not SCALE_PER_K:
            acc = acc * load_scale(s_rows, col_ok, SCALE_E8M0)[:, None]
        out = (y_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows.to(tl.int64)[None, :] * stride_ym
               + cols[:, None])
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])
    else:
        if not SCALE_PER_K:
            acc = acc * load_scale(s_rows, col_ok, SCALE_E8M0)[None, :]
        out = (y_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows.to(tl.int64)[:, None] * stride_ym
               + cols[None, :])
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def group_for(block_size, scale_per_k: bool, k: int) -> int:
    """Activation values per scale along K: the weight's K block (a power of two of at least 16, at most
    :data:`GROUP`) with block scales, else :data:`GROUP`."""
    if scale_per_k:
        _, bk = block_size
        return min(GROUP, bk & -bk)
    return GROUP


def w8a8_matmul(x: torch.Tensor,  # [rows, K] bf16 / fp16
                weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
                scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)], channel [N] / [N, 1] / [1, N], or one element
                block_size=None, activation_scale: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None, split_k: int | None = None,
                swap: bool | None = None, prequantize: bool | None = None) -> torch.Tensor:
    """``w8a8_linear_reference(x, weight, scale, block_size, activation_scale)`` by the kernel ([rows, N], in
    ``x.dtype``). ``activation_scale``: one fp32 element (static activations), or None (dynamic, per row and
    group)."""
    _check_args(x, weight, scale, activation_scale)
    rows, k = x.shape
    n = weight.shape[0]
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    scale_per_k = grid.shape[1] > 1
    group = group_for((bn, bk), scale_per_k, k)
    check(group >= 16, f"block_size[1]={bk} must be a multiple of 16 for the kernel (w8a8_linear takes the "
          "reference for such scales)")
    block_n, block_k, warps, stages = config or config_for(n, k, scale_per_k)
    block_k = max(block_k, group) // group * group
    split = split_k if split_k is not None else split_k_for(n, k, block_n, block_k)
    check(isinstance(split, int) and split >= 1, f"split_k must be a positive int, got {split!r}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    if x.stride(-1) != 1:
        x = x.contiguous()
    emulate = interpreting(_w8a8_kernel) or not has_native_fp8(x.device)
    dtype = torch.float32 if split > 1 or emulate else x.dtype
    out = torch.empty(split, rows, n, dtype=dtype, device=x.device)
    static = activation_scale is not None
    e8m0 = grid.dtype == E8M0_DTYPE
    prequantize = PREQUANTIZE if prequantize is None else prequantize
    groups = triton.cdiv(k, group)
    xs = grid  # unread unless prequantized
    if prequantize:
        codes = torch.empty(rows, k, dtype=torch.float32 if emulate else FP8_DTYPE, device=x.device)
        xs = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
        per_program = max(1, QUANTIZE_VALUES // group)
        _quantize_rows_kernel[(rows, triton.cdiv(groups, per_program))](
            x, codes, xs, activation_scale if static else xs, k, x.stride(0), groups, GROUP_K=group,
            GROUPS_PER_PROGRAM=per_program, STATIC=static, EMULATE=emulate, num_warps=4, **pdl_args(x))
        x, out_dtype = codes, x.dtype
    else:
        out_dtype = x.dtype
    _w8a8_kernel[(triton.cdiv(rows, MAX_ROWS), triton.cdiv(n, block_n), split)](
        x, weight, grid.view(torch.uint8) if e8m0 else grid, activation_scale if static else grid, out,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(1), grid.stride(0), grid.stride(1), bn, bk,
        k_per_split, out.stride(0), xs, groups,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_K=group, SCALE_PER_K=scale_per_k,
        SCALE_E8M0=e8m0, STATIC=static, EMULATE=emulate, SWAP_AB=SWAP if swap is None else swap,
        PREQUANT=prequantize, num_warps=warps, num_stages=stages, **pdl_args(out))
    if split == 1:
        return out[0].to(out_dtype)
    return sum_splits(out, torch.float32 if emulate else out_dtype).to(out_dtype)


def _check_args(x, weight, scale, activation_scale) -> None:
    check(x.dim() == 2 and 0 < x.shape[0] <= MAX_KERNEL_ROWS,
          f"w8a8_matmul takes [1..{MAX_KERNEL_ROWS}, K] rows (reshape(-1, K); w8a8_linear takes any), got "
          f"{tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, f"activations must be bfloat16 or float16, got {x.dtype}")
    check(weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(weight.dim() == 2 and weight.shape[1] == x.shape[1],
          f"weight must be [N, K={x.shape[1]}], got shape {tuple(weight.shape)}")
    check(weight.stride(1) == 1, f"weight rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    check(activation_scale is None or (isinstance(activation_scale, torch.Tensor) and activation_scale.numel() == 1
                                       and activation_scale.is_floating_point()),
          "activation_scale must be one floating-point element (static activations) or None (dynamic), got "
          f"{getattr(activation_scale, 'shape', activation_scale)!r}")
    check_same_device(x=x, weight=weight, scale=scale,
                      **({} if activation_scale is None else {"activation_scale": activation_scale}))


def quantize_activations(x: torch.Tensor,  # [..., K]
                         group: int = GROUP, activation_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x``'s e4m3 codes [..., K], their scales [..., ceil(K / group)] fp32) as the kernel computes them: per row
    and group of ``group`` values, ``amax / 448`` (1 for an all-zero group), or the static ``activation_scale``."""
    k = x.shape[-1]
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).unflatten(-1, (groups, group))
    if activation_scale is None:
        amax = xf.abs().amax(dim=-1)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    else:
        s = activation_scale.float().reshape(()).expand(xf.shape[:-1])
    codes = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return codes.flatten(-2)[..., :k], s


def w8a8_linear_reference(x: torch.Tensor,  # [..., K]
                          weight: torch.Tensor, scale: torch.Tensor, block_size=None,
                          activation_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The contract: ``x`` quantized by :func:`quantize_activations` (groups of the weight's K block, at most
    :data:`GROUP`) and dequantized in fp32, the weight dequantized in fp32, ``x @ w.T`` accumulated in fp32, rounded
    once to ``x.dtype`` ([..., N])."""
    check(weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(weight.dim() == 2 and x.dim() > 0 and x.shape[-1] == weight.shape[1],
          f"x [..., K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    n, k = weight.shape
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    group = group_for((bn, bk), grid.shape[1] > 1, k)
    codes, s = quantize_activations(x, group, activation_scale)
    dense_x = codes.float() * s.repeat_interleave(group, dim=-1)[..., :k]
    return F.linear(dense_x, dequantize_fp8(weight, scale, block_size)).to(x.dtype)


def w8a8_eligible(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size=None,
                  activation_scale: torch.Tensor | None = None) -> bool:
    """Whether :func:`w8a8_linear` runs the kernel for these arguments (else the reference)."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1] or scale.dtype not in SCALE_DTYPES:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    ok = (use_triton(x) and x.device == weight.device == scale.device and x.dtype in ACTIVATION_DTYPES
          and weight.dtype == FP8_DTYPE and type(weight) in (torch.Tensor, torch.nn.Parameter)
          and weight.layout == torch.strided and weight.stride(1) == 1 and 0 < rows <= MAX_KERNEL_ROWS
          and (activation_scale is None or activation_scale.device == x.device)
          and not needs_grad(x) and not needs_grad(weight) and not needs_grad(scale))
    if not ok:
        return False
    grid, _, bk = scale_grid(scale, block_size, *weight.shape)
    return grid.shape[1] == 1 or (bk & -bk) >= 16


def w8a8_linear(x: torch.Tensor,  # [..., K] bf16 / fp16 (any float dtype on the reference path)
                weight: torch.Tensor,  # [N, K] float8_e4m3fn
                scale: torch.Tensor, block_size=None, activation_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 ``x @ (weight * scale).T`` ([..., N], no bias): the kernel when :func:`w8a8_eligible`, else
    :func:`w8a8_linear_reference`."""
    if not w8a8_eligible(x, weight, scale, block_size, activation_scale):
        return w8a8_linear_reference(x, weight, scale, block_size, activation_scale)
    rows = x.reshape(-1, x.shape[-1])
    return w8a8_matmul(rows, weight, scale, block_size, activation_scale).view(*x.shape[:-1], weight.shape[0])
