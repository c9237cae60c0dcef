"""w8a8_matmul: FP8 weights times FP8-quantized activations for a few rows, on the FP8 tensor cores.

transformers' own FP8 layers (``FP8Linear`` of its fine-grained FP8 quantizer) compute W8A8: each row of the
activations is quantized to e4m3 per group of K values (the weight's K block, 128), with the group's scale
``amax / 448`` (dynamic, the default ``activation_scheme``) or one stored scale (``"static"``); the e4m3 products
are summed in fp32 and each group's partial sum is multiplied by its row's scale and its weight block's scale.
transformers' compressed-tensors FP8 layers quantize each row with one scale (``per_row``). Here one launch
quantizes the rows (:func:`quantize_rows`), then the GEMM multiplies e4m3 by e4m3 on the tensor cores, the weights
as the MMA's rows (Hopper's warpgroup MMA then reads both tiles from shared memory). No weight is converted, so a
step streams the stored bytes near the bf16 kernel's rate instead of the rate at which the weight-only kernel
(:mod:`.fp8_gemm`) converts them: on an H200, 1.1-1.4x the weight-only kernel on the block-scaled Gemma-4-31B and
26B-A4B shapes at one row, 1.0-1.2x at 4-16 rows, and quantizing the rows in every program of the GEMM instead, or
the activations as the MMA's rows, was slower (``benchmarks/results/w8a8_*_h200.log``).

Numerics (the contract of :func:`w8a8_linear_reference`): ``x_q = e4m3(clamp(x / s, -448, 448))`` (ties to even)
per row and group, ``s = amax(|x_group|) / 448`` (1 for an all-zero group) or the static scale, then
``sum_groups(dot(x_q, w_q) * s) * weight_scale`` accumulated in fp32 and rounded once to the activation dtype.
The reference dequantizes both operands in fp32 and multiplies; the two differ by fp32 rounding, and on Hopper by
the FP8 tensor cores' own accumulation within one instruction (:data:`MAX_IMPRECISE_ACC`).

A row's quantization and sums depend on that row alone (its groups, its scale), never on the other rows of the
forward, and the tiles, K order and split-K parts depend on the weight's shape alone: a verify row rounds like a
decode row. Triton's CPU interpreter multiplies fp8 tiles as raw bytes and rounds fp32 -> e4m3 wrongly where the
rounding carries into the exponent: there the codes are rounded by :func:`round_e4m3` and kept as fp32 values, and
the GEMM multiplies in fp32 (every e4m3 product and its fp32 sum are the GPU's).
"""

import torch
import torch.nn.functional as F

from ._dispatch import check, check_same_device, interpreting, pdl_args, pdl_wait, tl, triton, write_count
from .fp8_gemm import (ACTIVATION_DTYPES, E8M0_DTYPE, FP8_DTYPE, MAX_ROWS, check_matmul_args, config_for,
                       dequantize_fp8, fp8_eligible, fp8_linear, has_native_fp8, load_scale, scale_grid, split_k_for)
from .skinny_gemm import load_k_tile, sum_splits

GROUP = 128  # activation values per scale along K (transformers' fine-grained FP8: the weight's K block)
E4M3_MAX = 448.0
# False: transformers' FP8 layers compute the weight-only product everywhere (read at each call: an A/B knob, with
# the CUDA graphs captured before it released)
W8A8 = True
# e4m3 products summed in the tensor cores before an fp32 add: 32, one MMA instruction's K; None: Triton's Hopper
# default, a whole group of 128. Hopper's FP8 MMA aligns its products to fewer bits than fp32 before adding them, so
# its sums drift from exact fp32 sums: on an H200 the test shapes' largest errors fell from ~0.1 to ~0.01-0.04 of
# outputs of magnitude ~10-30 with 32, at no measurable cost (``w8a8_check_h200.log``, "fast acc")
MAX_IMPRECISE_ACC = 32
MIN_GROUP = 32  # an e4m3 x e4m3 dot's smallest K (and one MMA instruction's)
QUANTIZE_VALUES = 1024  # activation values per program of the quantizing launch
ROW_BLOCK = 1024  # values per step of a row's amax (per-row scales)


@triton.jit
def round_e4m3(v):
    """fp32 values -> the nearest float8_e4m3fn values (ties to even; |v| <= 448 expected), still fp32."""
    biased = ((v.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    step = ((tl.maximum(biased, 121) - 3) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3); 2**-9 below 2**-6
    magic = 12582912.0  # 1.5 * 2**23: t + magic rounds t to an integer, ties to even, for |t| < 2**22
    return ((v / step + magic) - magic) * step


@triton.jit
def to_e4m3(xf, s, EMULATE: tl.constexpr):
    """``xf / s`` (IEEE-rounded, as torch divides: Triton's ``/`` is the GPU's approximate division) clamped to
    +-448, as e4m3 (float8; their fp32 values where EMULATE)."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(xf, s), -448.0), 448.0)
    if EMULATE:
        return round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def e4m3_dot(w, q, EMULATE: tl.constexpr, IMPRECISE_ACC: tl.constexpr):
    """``w @ q.T`` in fp32 ([BLOCK_N, BLOCK_M]): e4m3 weights as the MMA's rows times e4m3 codes; EMULATE: the codes
    are fp32 values and both are multiplied in fp32 (every e4m3 product and its fp32 sum are the GPU's)."""
    if EMULATE:
        return tl.dot(w.to(tl.float32), tl.trans(q), input_precision="ieee")
    return tl.dot(w, tl.trans(q), max_num_imprecise_acc=IMPRECISE_ACC)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, qs_ptr, a_ptr, K, stride_xm, groups, GROUP_K: tl.constexpr,
                            GROUPS_PER_PROGRAM: tl.constexpr, STATIC: tl.constexpr, EMULATE: tl.constexpr,
                            PDL: tl.constexpr):
    """Row ``program_id(0)``'s groups ``program_id(1) * GROUPS_PER_PROGRAM ...`` -> e4m3 codes and their scales
    [rows, groups]: ``amax / 448`` per group (1 for an all-zero group), or the static scale."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    ks = g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    ok = ks < K
    xf = tl.load(x_ptr + row * stride_xm + ks, mask=ok, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.zeros([GROUPS_PER_PROGRAM], dtype=tl.float32) + tl.load(a_ptr).to(tl.float32)
    else:
        amax = tl.max(tl.abs(xf), axis=1)
        s = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q_ptr + row * K + ks, to_e4m3(xf, s[:, None], EMULATE), mask=ok)
    tl.store(qs_ptr + row * groups + g, s, mask=g < groups)


@triton.jit
def _quantize_row_kernel(x_ptr, q_ptr, qs_ptr, K, stride_xm, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
                         PDL: tl.constexpr):
    """Row ``program_id(0)`` -> e4m3 codes and one scale, ``amax / 448`` over the row (1 for a zero row)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        top = tl.maximum(top, tl.abs(tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K,
                                             other=0.0).to(tl.float32)))
    amax = tl.max(top, axis=0)
    s = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
    for k0 in range(0, K, BLOCK):
        ok = k0 + offs < K
        xf = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + k0 + offs, to_e4m3(xf, s, EMULATE), mask=ok)
    tl.store(qs_ptr + row, s)


@triton.jit
def store_row_codes(y, row, ks, g, q_ptr, qs_ptr, dim, groups, EMULATE: tl.constexpr):
    """For a kernel that computes whole groups of a row (a norm, a gated activation): row ``row``'s values ``y``
    [n, group] at columns ``ks`` (groups ``g``; rounded to the activation dtype) -> their e4m3 codes ``q_ptr[row,
    ks]`` and scales ``qs_ptr[row, g]`` ([rows, dim] and [rows, groups], :func:`row_code_args`), as
    :func:`quantize_rows` computes them from the stored row: ``amax / 448`` per group (1 for an all-zero group)."""
    ok = ks < dim
    yf = tl.where(ok, y.to(tl.float32), 0.0)
    amax = tl.max(tl.abs(yf), axis=1)
    s = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q_ptr + row * dim + ks, to_e4m3(yf, s[:, None], EMULATE), mask=ok)
    tl.store(qs_ptr + row * groups + g, s, mask=g < groups)


@triton.jit
def _w8a8_kernel(q_ptr, w_ptr, s_ptr, qs_ptr, y_ptr, M, N, K, stride_wn, stride_ym, stride_sn, stride_sk,
                 scale_bn, scale_bk, k_per_split, stride_split, stride_qs_row, stride_qs_group,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, SCALE_PER_K: tl.constexpr,
                 SCALE_E8M0: tl.constexpr, EMULATE: tl.constexpr, IMPRECISE_ACC: tl.constexpr, PDL: tl.constexpr):
    # the weights are the MMA's rows: [BLOCK_N, GROUP_K] x [GROUP_K, 16 rows] (Hopper's warpgroup MMA reads both
    # e4m3 tiles from shared memory), one group of K per step; each partial times its rows' and its weight block's
    # scales
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (cols // scale_bn).to(tl.int64) * stride_sn
    qs_rows = qs_ptr + rows.to(tl.int64) * stride_qs_row
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, GROUP_K):
        w, q = load_k_tile(w_rows, q_rows, k0, K, col_ok, row_ok, GROUP_K)
        qs = tl.load(qs_rows + (k0 // GROUP_K) * stride_qs_group, mask=row_ok, other=1.0)
        part = e4m3_dot(w, q, EMULATE, IMPRECISE_ACC) * qs[None, :]
        if SCALE_PER_K:  # the group lies inside one block of weight scales
            part = part * load_scale(s_rows + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)[:, None]
        acc += part
    if not SCALE_PER_K:
        acc = acc * load_scale(s_rows, col_ok, SCALE_E8M0)[:, None]
    out = (y_ptr + tl.program_id(2).to(tl.int64) * stride_split + rows.to(tl.int64)[None, :] * stride_ym
           + cols[:, None])
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])


def group_for(block_size, scale_per_k: bool) -> int:
    """Activation values per scale along K: the weight's K block (a power of two of at least 16, at most
    :data:`GROUP`) with block scales, else :data:`GROUP`."""
    if scale_per_k:
        return min(GROUP, block_size[1] & -block_size[1])
    return GROUP


def quantize_rows(x: torch.Tensor,  # [rows, K] bf16 / fp16, rows contiguous
                  group: int, activation_scale: torch.Tensor | None = None, per_row: bool = False,
                  emulate: bool = False, attached: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, K] (fp32 values where ``emulate``), their scales fp32: [rows, ceil(K / group)], or [rows,
    1] with ``per_row``), one launch: :func:`quantize_activations` on the device. ``attached``: x's rows quantized
    already by the kernel that computed them (:func:`row_codes` of the tensor x was reshaped from), returned instead
    where they are what this call computes (dynamic scales per group, this group, these codes' dtype)."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"quantize_rows takes [rows, K] with contiguous rows, got shape "
          f"{tuple(x.shape)} strides {x.stride()}: pass x.contiguous()")
    rows, k = x.shape
    if (attached is not None and activation_scale is None and not per_row and attached[0] == group
            and attached[1].shape == x.shape and attached[1].device == x.device
            and attached[1].dtype == (torch.float32 if emulate else FP8_DTYPE)):
        return attached[1], attached[2]
    codes = torch.empty(rows, k, dtype=torch.float32 if emulate else FP8_DTYPE, device=x.device)
    if per_row:
        scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        _quantize_row_kernel[(rows,)](x, codes, scales, k, x.stride(0), BLOCK=ROW_BLOCK, EMULATE=emulate,
                                      num_warps=4, **pdl_args(x))
        return codes, scales
    groups = triton.cdiv(k, group)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    per_program = max(1, QUANTIZE_VALUES // group)
    static = activation_scale is not None
    _quantize_groups_kernel[(rows, triton.cdiv(groups, per_program))](
        x, codes, scales, activation_scale if static else scales, k, x.stride(0), groups, GROUP_K=group,
        GROUPS_PER_PROGRAM=per_program, STATIC=static, EMULATE=emulate, num_warps=4, **pdl_args(x))
    return codes, scales


def w8a8_matmul(x: torch.Tensor,  # [rows, K] bf16 / fp16
                weight: torch.Tensor,  # [N, K] float8_e4m3fn, rows contiguous
                scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)], channel [N] / [N, 1] / [1, N], or one element
                block_size=None, activation_scale: torch.Tensor | None = None, per_row: bool = False,
                config: tuple[int, int, int, int] | None = None, split_k: int | None = None,
                attached: tuple | None = None) -> torch.Tensor:
    """``w8a8_linear_reference(x, weight, scale, block_size, activation_scale, per_row)`` by the kernels ([rows,
    N], in ``x.dtype``): the rows quantized by one launch (:func:`quantize_rows`), then the GEMM. ``activation_scale``:
    one element (static activations), or None (dynamic: per row and group, or per row with ``per_row``). ``attached``:
    x's rows quantized already by the kernel that computed them (:func:`row_codes`; :func:`quantize_rows` takes them
    where they are what this product quantizes)."""
    _check_args(x, weight, scale, activation_scale, per_row)
    rows, k = x.shape
    n = weight.shape[0]
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    scale_per_k = grid.shape[1] > 1
    group = group_for((bn, bk), scale_per_k)
    check(group >= MIN_GROUP, f"block_size[1]={bk} must be a multiple of {MIN_GROUP} for the kernel (an e4m3 dot's "
          "smallest K; w8a8_linear takes the reference for such scales)")
    # config: (BLOCK_N, -, num_warps, num_stages); the K step is one group, so every scale layout takes the block
    # scales' configs (the per-channel ones stream 256-deep tiles in 4 stages: 67 us against 60 on the 31B gate/up
    # at one group per step, w8a8_check_h200.log)
    block_n, _, warps, stages = config or config_for(n, k, True)
    split = split_k if split_k is not None else split_k_for(n, k, block_n, group)
    check(isinstance(split, int) and split >= 1, f"split_k must be a positive int, got {split!r}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), group) * group
    split = triton.cdiv(k, k_per_split)
    if x.stride(-1) != 1:
        x = x.contiguous()
    emulate = codes_emulated(x.device)
    codes, scales = quantize_rows(x, group, activation_scale, per_row, emulate, attached=attached)
    out = torch.empty(split, rows, n, dtype=torch.float32 if split > 1 or emulate else x.dtype, device=x.device)
    e8m0 = grid.dtype == E8M0_DTYPE
    _w8a8_kernel[(triton.cdiv(rows, MAX_ROWS), triton.cdiv(n, block_n), split)](
        codes, weight, grid.view(torch.uint8) if e8m0 else grid, scales, out, rows, n, k, weight.stride(0),
        out.stride(1), grid.stride(0), grid.stride(1), bn, bk, k_per_split, out.stride(0), scales.stride(0),
        0 if per_row else 1,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, GROUP_K=group, SCALE_PER_K=scale_per_k, SCALE_E8M0=e8m0,
        EMULATE=emulate, IMPRECISE_ACC=MAX_IMPRECISE_ACC, num_warps=warps, num_stages=stages, **pdl_args(out))
    if split == 1:
        return out[0].to(x.dtype)
    return sum_splits(out, torch.float32 if emulate else x.dtype).to(x.dtype)


def _check_args(x, weight, scale, activation_scale, per_row) -> None:
    check_matmul_args(x, weight, scale, "w8a8_matmul", "w8a8_linear")
    _check_activation_scale(activation_scale, per_row)
    if activation_scale is not None:
        check_same_device(x=x, activation_scale=activation_scale)


def _check_activation_scale(activation_scale, per_row) -> None:
    check(activation_scale is None or (isinstance(activation_scale, torch.Tensor) and activation_scale.numel() == 1
                                       and activation_scale.is_floating_point()),
          "activation_scale must be one floating-point element (static activations) or None (dynamic), got "
          f"{getattr(activation_scale, 'shape', activation_scale)!r}")
    check(not (per_row and activation_scale is not None), "per_row takes dynamic activations (activation_scale=None)")


def quantize_activations(x: torch.Tensor,  # [..., K]
                         group: int = GROUP, activation_scale: torch.Tensor | None = None, per_row: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x``'s e4m3 codes [..., K], their scales [..., ceil(K / group)] fp32) as the kernels compute them: per row
    and group of ``group`` values (``per_row``: one group, the whole row), ``amax / 448`` (1 for an all-zero group),
    or the static ``activation_scale``."""
    k = x.shape[-1]
    group = k if per_row else group
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).unflatten(-1, (groups, group))
    if activation_scale is None:
        amax = xf.abs().amax(dim=-1)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    else:
        s = activation_scale.float().reshape(()).expand(xf.shape[:-1])
    codes = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return codes.flatten(-2)[..., :k], s


def dequantized_activations(x: torch.Tensor, group: int, activation_scale: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """``x`` quantized by :func:`quantize_activations` and dequantized, in fp32: what the kernels multiply."""
    k = x.shape[-1]
    codes, s = quantize_activations(x, group, activation_scale)
    return codes.float() * s.repeat_interleave(group, dim=-1)[..., :k]


def w8a8_linear_reference(x: torch.Tensor,  # [..., K]
                          weight: torch.Tensor, scale: torch.Tensor, block_size=None,
                          activation_scale: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
    """The contract: ``x`` quantized by :func:`quantize_activations` (groups of the weight's K block, at most
    :data:`GROUP`, or whole rows) and dequantized in fp32, the weight dequantized in fp32, ``x @ w.T`` accumulated
    in fp32, rounded once to ``x.dtype`` ([..., N])."""
    check(weight.dtype == FP8_DTYPE, f"weight must be float8_e4m3fn, got {weight.dtype}")
    check(weight.dim() == 2 and x.dim() > 0 and x.shape[-1] == weight.shape[1],
          f"x [..., K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check_activation_scale(activation_scale, per_row)
    n, k = weight.shape
    grid, bn, bk = scale_grid(scale, block_size, n, k)
    group = k if per_row else group_for((bn, bk), grid.shape[1] > 1)
    return F.linear(dequantized_activations(x, group, activation_scale),
                    dequantize_fp8(weight, scale, block_size)).to(x.dtype)


def w8a8_eligible(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size=None,
                  activation_scale: torch.Tensor | None = None) -> bool:
    """Whether :func:`w8a8_linear` runs the kernels for these arguments (else the reference): where the weight-only
    kernel would (:func:`.fp8_gemm.fp8_eligible`), on a device with e4m3 dots, with groups of at least
    :data:`MIN_GROUP` values (a K block of 16 or 48 takes the reference), a static scale beside x."""
    if not (fp8_eligible(x, weight, scale, block_size) and has_native_fp8(x.device)
            and (activation_scale is None or activation_scale.device == x.device)):
        return False
    grid, bn, bk = scale_grid(scale, block_size, *weight.shape)
    return group_for((bn, bk), grid.shape[1] > 1) >= MIN_GROUP


def w8a8_linear(x: torch.Tensor,  # [..., K] bf16 / fp16 (any float dtype on the reference path)
                weight: torch.Tensor,  # [N, K] float8_e4m3fn
                scale: torch.Tensor, block_size=None, activation_scale: torch.Tensor | None = None,
                per_row: bool = False) -> torch.Tensor:
    """W8A8 ``x @ (weight * scale).T`` ([..., N], no bias): the kernels when :func:`w8a8_eligible`, else
    :func:`w8a8_linear_reference`."""
    if not w8a8_eligible(x, weight, scale, block_size, activation_scale):
        return w8a8_linear_reference(x, weight, scale, block_size, activation_scale, per_row)
    rows = x.reshape(-1, x.shape[-1])
    return w8a8_matmul(rows, weight, scale, block_size, activation_scale, per_row,
                       attached=row_codes(x)).view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- rows quantized by the kernel that computed them

_ROW_CODES = "_hf_specdec_row_codes"


def check_quantize_group(group: int | None, largest: int) -> None:
    """A kernel's ``quantize_group``: None, or a power of two up to ``largest`` values."""
    check(group is None or (isinstance(group, int) and 0 < group <= largest and group & (group - 1) == 0),
          f"quantize_group must be None or a power of two up to {largest}, got {group!r}")


def row_code_args(rows: torch.Tensor, group: int | None) -> tuple:
    """The (codes, scales, groups) arguments of a kernel that quantizes the [n, dim] ``rows`` it computes in groups of
    ``group`` (:func:`store_row_codes`): empty codes [n, dim] (fp32 values where the device has no e4m3 type, the
    interpreter's emulation, as :func:`quantize_rows`) and scales [n, ceil(dim / group)] fp32; without a group,
    placeholders the kernel does not touch."""
    if group is None:
        return rows, rows, 0
    n, dim = rows.shape
    groups = -(-dim // group)
    return (torch.empty(n, dim, dtype=torch.float32 if codes_emulated(rows.device) else FP8_DTYPE, device=rows.device),
            torch.empty(n, groups, dtype=torch.float32, device=rows.device), groups)


def codes_emulated(device) -> bool:
    """Whether e4m3 codes on ``device`` are kept as their fp32 values (Triton's interpreter, GPUs without e4m3)."""
    return interpreting(_w8a8_kernel) or not has_native_fp8(device)


def attach_row_codes(x: torch.Tensor, group: int | None, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` carrying its rows' codes and scales (dynamic, ``group`` values per scale; None: nothing attached), for
    the FP8 products that read x next (:func:`row_codes`): they skip their own quantizing launch. Returns x. Meant
    for a tensor that a fused forward computes and hands straight to those products (the attachment cannot follow
    in-place writes to an inference tensor, see :func:`row_codes`)."""
    if group is not None:
        setattr(x, _ROW_CODES, (group, write_count(x), codes, scales))
    return x


def row_codes(x: torch.Tensor) -> tuple | None:
    """(group, codes [rows, K], scales) attached to ``x`` by :func:`attach_row_codes`, or None (none attached, or
    x written in place since, where torch counts writes: tensors made under ``torch.inference_mode``, as in
    ``generate``, count none, so there the attachment relies on no write between the kernel and the products). A
    view of x is another tensor object: it carries none unless attached to it too."""
    found = getattr(x, _ROW_CODES, None)
    if found is None or found[1] != write_count(x):
        return None
    return found[0], *found[2:]


def reshape_with_codes(x: torch.Tensor, shape) -> torch.Tensor:
    """``x.reshape(shape)`` (the same rows: the last dimension kept) carrying x's attached codes, if any."""
    out = x.reshape(shape)
    found = row_codes(x)
    return out if found is None else attach_row_codes(out, *found)


def fp8_linear_input_group(module, k: int) -> int | None:
    """How this module's forward under ``enable`` quantizes its [..., k] rows where the layers compute W8A8 in
    groups: the values per scale of a fine-grained ``FP8Linear`` with dynamic activations and K blocks narrower
    than k (:func:`fp8_linear_forward`); None for anything else (another forward, static scales, one scale per row
    as for compressed-tensors layers, groups the kernels do not take)."""
    if (getattr(vars(module).get("forward"), "__func__", None) is not fp8_linear_forward
            or getattr(module, "activation_scheme", "dynamic") != "dynamic"
            or module.weight.dtype != FP8_DTYPE or module.weight.shape[1] != k):
        return None
    block = module.block_size
    if block is None or block[1] >= k:  # one scale per row
        return None
    grid, bn, bk = scale_grid(module.weight_scale_inv, block, *module.weight.shape)
    group = group_for((bn, bk), grid.shape[1] > 1)
    return group if group >= MIN_GROUP else None


# ---------------------------------------------------------------- transformers' FP8 layers


def activations_quantized(x: torch.Tensor) -> bool:
    """Whether transformers' FP8 layers quantize ``x`` (:func:`fp8_linear_forward`): bf16 / fp16 activations on a
    GPU with FP8 tensor cores (sm_89+). Elsewhere (CPU, fp32 activations, older GPUs) no FP8 product is fast, and
    the layers compute the weight-only product (:func:`.fp8_gemm.fp8_linear`), the more accurate one: quantized
    activations would turn the last-bit differences of torch's CPU kernels between a one-row and a k+1-row forward
    into different codes, where the GPU's kernels compute each row alike."""
    return W8A8 and x.is_cuda and x.dtype in ACTIVATION_DTYPES and has_native_fp8(x.device)


def fp8_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of transformers' fine-grained ``FP8Linear`` (``weight`` e4m3 [N, K], ``weight_scale_inv``
    block [ceil(N/bn), ceil(K/bk)] or a scalar with ``block_size=None``, optional ``bias``) through
    :func:`fine_grained_fp8_linear`, with the layer's stored ``activation_scale`` where its scheme is ``"static"``. A
    weight the loader left dense (more than one byte per value) takes ``F.linear``, as the module's own forward
    does."""
    if self.weight.element_size() > 1:
        return F.linear(x, self.weight, self.bias)
    static = getattr(self, "activation_scheme", "dynamic") == "static"
    return _add_bias(fine_grained_fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size,
                                             self.activation_scale if static else None), self.bias)


def fine_grained_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_size,
                            activation_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The product of fine-grained FP8 weights (one layer's, or stacked layers' sharing dynamic activations).
    Where :func:`activations_quantized`, transformers' own arithmetic through :func:`w8a8_linear`: dynamic
    activations per row and group of the weight's K block, or per row without block scales or with a block as wide
    as K; or the static ``activation_scale``. Elsewhere the weight-only product (:func:`.fp8_gemm.fp8_linear`)."""
    if not activations_quantized(x):
        return fp8_linear(x, weight, scale, block_size)
    per_row = activation_scale is None and (block_size is None or block_size[1] >= x.shape[-1])
    return w8a8_linear(x, weight, scale, block_size, activation_scale, per_row)


def compressed_fp8_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of transformers' compressed-tensors FP8 linear (``weight`` e4m3 [N, K], per-channel or
    per-tensor ``weight_scale`` as fp32 [1, N], optional ``bias``): where :func:`activations_quantized`,
    :func:`w8a8_linear` with one scale per row, as transformers' own forward quantizes the activations for dynamic
    and static checkpoints alike; elsewhere the weight-only product."""
    if not activations_quantized(x):
        return _add_bias(fp8_linear(x, self.weight, self.weight_scale), self.bias)
    return _add_bias(w8a8_linear(x, self.weight, self.weight_scale, per_row=True), self.bias)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def fp8_linear_fusible(module) -> bool:
    """Whether :func:`fp8_linear_forward` serves this ``FP8Linear``: e4m3 weights (or a weight the loader left
    dense), not FP4-packed int8 ones; a static activation scheme with its scale."""
    weight = getattr(module, "weight", None)
    if getattr(module, "activation_scheme", "dynamic") == "static" and not isinstance(
            getattr(module, "activation_scale", None), torch.Tensor):
        return False
    return isinstance(weight, torch.Tensor) and (weight.dtype == FP8_DTYPE or weight.element_size() > 1)
