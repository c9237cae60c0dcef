"""FP8 mixture-of-experts: transformers' ``FP8Experts`` reading e4m3 expert weights and their scales directly.

:func:`fused_moe_fp8` is :func:`.fused_moe` over e4m3 weights: the same grouping of the (token, slot) pairs by
expert, the same gate/up, activation, down and top-k sum kernels, with each weight tile converted to the
activations' dtype in registers (exact: every e4m3 value is a bf16 and an fp16 value) and each K tile's partial
sum times its block of scales (per-channel or per-tensor scales: the finished sums). As in ``fp8_linear``, bf16
token rows go to fp16 first (``fp8_gemm.f16_rows``, each row times a power of two) where Triton loads e4m3
natively, so that the gate/up weights convert in one instruction per two values; the down projection's rows are
made inside the kernels and keep bf16. So a decode or verify step
reads each selected expert's e4m3 bytes once, on the tensor cores, with no host sync, and the routing weights and
the fp32 sum over the k slots stay inside the kernels (CUDA-graph capturable; a prefill's pairs go through the
same kernels, in 16-row blocks at every width: taller ones took 1.5-2.7x as long with e4m3 tiles).

Numerics (:func:`fused_moe_fp8_reference`): each projection is the weight dequantized in fp32, the product
accumulated in fp32 and rounded once to the activations' dtype (the contract of ``fp8_linear``); then, as in
:func:`.fused_moe`, the activation in that dtype, the down projection's output cast to fp32 times the routing
weight, the k contributions summed in fp32 and cast back once. Only the summation order inside the products
differs between the kernels and the reference.

W8A8 (``fused_moe_fp8(..., w8a8=True)``, :func:`fused_moe_w8a8_kernels`): transformers' ``FP8Experts`` compute
each expert's projections with its ``fp8_linear``, which quantizes the rows (per row and group of the weight's K
block, ``amax / 448``; per row without K blocks) and multiplies e4m3 by e4m3. The W8A8 kernels do the same with the
grouping above: the token rows quantized once for all experts (``fp8_w8a8.quantize_rows``), the gate/up and down
kernels multiplying e4m3 codes by e4m3 weights on the FP8 tensor cores (the weights as the MMA's rows, one group of
K per step, each partial times its rows' and its weight block's scales, as ``fp8_w8a8``'s GEMM; with the default
tiles the gate/up stacks a program's 32 gate rows over its 32 up rows into one 64-row tile, which Hopper's warpgroup
MMA reads from shared memory), the intermediate rows quantized by a launch of their own between the two. No weight
is converted. ``FP8Experts`` take them where ``fp8_w8a8.activations_quantized`` (bf16 / fp16 rows on a GPU with FP8
tensor cores) and the activations are dynamic (:func:`experts_w8a8`); elsewhere the weight-only kernels above. The
reference (``w8a8=True``) quantizes and dequantizes each projection's rows (``fp8_w8a8.dequantized_activations``)
before the products.

``FP8Experts`` modules whose gate this does not compute (a soft-capped or clamped SwiGLU, an activation other
than tanh-GELU or SiLU) or whose weights it does not take keep the per-pair path
(:func:`.fp8_gemm.fp8_expert_linear`: one matrix-vector product per (token, expert) pair, the module's own
``_apply_gate``), as do CPU tensors and autograd.
"""

import dataclasses

import torch
import torch.nn.functional as F

from ._dispatch import check, check_same_device, interpreting, needs_grad, pdl_args, pdl_wait, tl, triton, use_triton
from .activations import ACTIVATIONS, GELU_TANH_CONSTANTS, gated_activation, round_to
from .fp8_gemm import (
    ACTIVATION_DTYPES,
    E8M0_DTYPE,
    FP8_DTYPE,
    MIN_BLOCK_K,
    SCALE_DTYPES,
    dequantize_fp8,
    expert_scale_blocks,
    fp8_expert_linear,
    has_native_fp8,
    load_scale,
)
from .fp8_w8a8 import (
    GROUP,
    MAX_IMPRECISE_ACC,
    MIN_GROUP,
    activations_quantized,
    dequantized_activations,
    e4m3_dot,
    group_for,
    quantize_rows,
    row_codes,
)
from .fused_moe import (
    MAX_EXPERTS,
    MAX_TOP_K,
    Fp8Weights,
    MoeConfig,
    activation_name,
    config_for,
    gated_activation_reference,
    launch,
    program_rows,
    route_blocks,
    sum_parts,
)
from .skinny_gemm import load_k_tile

FP16_DOTS = True  # bf16 token rows multiply the gate/up weights as fp16 where e4m3 loads natively (False: as bf16)
# W8A8 expert kernels: (BLOCK_N, -, num_warps, num_stages) of the gate/up and down kernels (the K step is one group
# of the activations' scales); 16-row blocks at every width, as the weight-only FP8 kernels. W8A8_CONFIG: the tiles
# of the gate/up in two tiles (W8A8_STACKED_GATE_UP = False), the best of 24 configs per kernel at the 26B-A4B
# experts, 1 + 4 tokens graph-timed on an H200 (`moe_gpu_check --weights w8a8 --sweep`, before the stacked gate/up:
# benchmarks/results/moe_w8a8_sweep_h200.log): 101.7 us against 110.9 for (32, 128, 4, 4) / (64, 128, 4, 4)
W8A8_CONFIG = MoeConfig(block_m=16, gate_up=(32, GROUP, 2, 4), down=(64, GROUP, 4, 4))
# True: the W8A8 gate/up kernel multiplies one [64, K] tile a step, its 32 gate rows over its 32 up rows (the
# stacked weight's rows c and I + c), on Hopper's warpgroup MMA reading both e4m3 tiles from shared memory (4 warps,
# ~200 PTX instructions a K step); False: two [32, K] tiles converted to fp16 for the warp-level MMA (2 warps, ~900).
# At one token the expert layer is bound by its kernels' instructions, not its weight bytes (it takes as long with
# the weight tiles masked off: benchmarks/results/moe_w8a8_diag_h200.log). One 26B-A4B expert layer graph-timed on an
# H200 (stacked_gate_up_kernel_ab_h200.log): 1 / 4 / 8 tokens 30.8 -> 29.9, 68.9 -> 65.3, 107.4 -> 104.6 us; FP8
# decode A/B (stacked_gate_up_ab_h200.log) batch 1 1.053x, batch 8 1.017x. Its sums take Hopper's FP8 accumulation
# (fp8_w8a8.MAX_IMPRECISE_ACC): the same largest error against the reference, a few more outputs one e4m3 step off
# (stacked_gate_up_errors_h200.log). Read at each call (an A/B knob, with the CUDA graphs captured before it released)
W8A8_STACKED_GATE_UP = True
# the stacked gate/up's tiles: 4 warps for the warpgroup MMA (2 warps, or 16-wide tiles, fall back to the warp-level
# MMA); its stages and the down kernel's tiles are W8A8_CONFIG's, not swept again
W8A8_STACKED_CONFIG = dataclasses.replace(W8A8_CONFIG, gate_up=(32, GROUP, 4, 4))
# False: FP8Experts keep the weight-only kernels where their rows would be quantized (read at each call: an A/B knob,
# with the CUDA graphs captured before it released)
W8A8_EXPERTS = True


def w8a8_config() -> MoeConfig:
    """The W8A8 expert kernels' default tiles: :data:`W8A8_STACKED_CONFIG` where the gate/up stacks its tiles
    (:data:`W8A8_STACKED_GATE_UP`), else :data:`W8A8_CONFIG`."""
    return W8A8_STACKED_CONFIG if W8A8_STACKED_GATE_UP else W8A8_CONFIG


def fused_moe_fp8(hidden_states: torch.Tensor,  # [tokens, hidden] bf16 / fp16
                  gate_up: torch.Tensor,  # [E, 2I, hidden] float8_e4m3fn: the gate's rows, then the up's
                  gate_up_scale: torch.Tensor,  # [E, sn, sk]
                  down: torch.Tensor,  # [E, hidden, I] float8_e4m3fn
                  down_scale: torch.Tensor,  # [E, sn, sk]
                  top_k_index: torch.Tensor,  # [tokens, top_k] int
                  top_k_weights: torch.Tensor,  # [tokens, top_k] float
                  *, activation: str, block_size=None, limit: float | None = None,
                  config: MoeConfig | None = None, w8a8: bool = False
                  ) -> torch.Tensor:  # [tokens, hidden] in hidden_states' dtype
    """The routed experts' weighted sum per token over e4m3 weights (module docstring); ``block_size``: the scales'
    ``(bn, bk)`` (None: the scale grid spans the weight, :func:`.fp8_gemm.expert_scale_blocks`). ``w8a8``: the
    rows quantized as transformers' ``FP8Experts`` quantizes them (:func:`fused_moe_w8a8_kernels`), else weight-only.
    The kernels when :func:`fused_moe_fp8_eligible`, else :func:`fused_moe_fp8_reference`."""
    args = (hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights)
    _check_args(*args, activation, limit)
    if not fused_moe_fp8_eligible(*args, block_size=block_size, w8a8=w8a8):
        return fused_moe_fp8_reference(*args, activation=activation, block_size=block_size, limit=limit, w8a8=w8a8)
    if w8a8:
        return fused_moe_w8a8_kernels(*args, activation, block_size, limit, config)
    return _kernels(*args, activation, block_size, limit, config)


def _kernels(hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights, activation,
             block_size, limit=None, config=None) -> torch.Tensor:
    """The kernels' launch for arguments already checked and found eligible."""
    inter, native = down.shape[2], has_native_fp8(hidden_states.device)
    fp8 = Fp8Weights(gate_up_scale, down_scale, expert_scale_blocks(gate_up_scale, block_size, *gate_up.shape[1:]),
                     expert_scale_blocks(down_scale, block_size, *down.shape[1:]), inter, native,
                     fp16_dots=FP16_DOTS and native and hidden_states.dtype == torch.bfloat16)
    return launch(hidden_states, gate_up[:, :inter], gate_up[:, inter:], down, top_k_index, top_k_weights,
                  activation, limit, config or config_for(hidden_states.shape[0], fp8=True), fp8)


def fused_moe_fp8_eligible(hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights,
                           block_size=None, w8a8: bool = False) -> bool:
    """Whether :func:`fused_moe_fp8` runs the kernels for these (checked) arguments; ``w8a8``: also a device with
    e4m3 dots and activation groups of at least :data:`.fp8_w8a8.MIN_GROUP` values."""
    tensors = (hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights)
    if not (use_triton(hidden_states) and hidden_states.shape[0] > 0 and hidden_states.dtype in ACTIVATION_DTYPES
            and all(type(w) in (torch.Tensor, torch.nn.Parameter) and w.stride(2) == 1 for w in (gate_up, down))
            and gate_up.shape[0] <= MAX_EXPERTS and top_k_index.shape[1] <= MAX_TOP_K
            and len({t.device for t in tensors}) == 1 and not any(needs_grad(t) for t in tensors)):
        return False
    for weight, scale in ((gate_up, gate_up_scale), (down, down_scale)):
        _, bk = expert_scale_blocks(scale, block_size, *weight.shape[1:])
        if scale.shape[2] > 1 and (bk & -bk) < MIN_BLOCK_K:  # a K tile must lie inside one block of scales
            return False
        if w8a8 and not (has_native_fp8(hidden_states.device) and _activation_group(scale, bk)[1] >= MIN_GROUP):
            return False
    return True


def _activation_group(scale: torch.Tensor, bk: int) -> tuple[bool, int]:
    """(per_row, the kernels' K step) of one expert weight's activations: per row and group of the weight's K block
    with block scales (``fp8_w8a8.group_for``, as the dense layers: the block when it is a power of two of at most
    :data:`.fp8_w8a8.GROUP`, the checkpoints' 128; else its largest power-of-two divisor up to that, where
    transformers' kernel would take the whole block), else per row (one scale for the row, as transformers'
    ``fp8_linear`` without K blocks), stepping by :data:`.fp8_w8a8.GROUP`."""
    per_row = scale.shape[2] == 1
    return per_row, GROUP if per_row else group_for((0, bk), True)


def _check_args(x, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights, activation, limit) -> None:
    check(x.dim() == 2, f"hidden_states must be [tokens, hidden] (reshape(-1, hidden)), got {tuple(x.shape)}")
    tokens, hidden = x.shape
    check(gate_up.dtype == FP8_DTYPE and gate_up.dim() == 3 and gate_up.shape[2] == hidden
          and gate_up.shape[1] % 2 == 0, f"gate_up must be [num_experts, 2 * inter, hidden={hidden}] float8_e4m3fn, "
          f"got {gate_up.dtype} {tuple(gate_up.shape)}")
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    check(down.dtype == FP8_DTYPE and tuple(down.shape) == (experts, hidden, inter),
          f"down must be [num_experts={experts}, hidden={hidden}, inter={inter}] float8_e4m3fn, got {down.dtype} "
          f"{tuple(down.shape)}")
    for name, scale in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        check(isinstance(scale, torch.Tensor) and scale.dtype in SCALE_DTYPES and scale.dim() == 3
              and scale.shape[0] == experts, f"{name} must be [num_experts={experts}, sn, sk] of "
              f"{[str(d) for d in SCALE_DTYPES]}, got {getattr(scale, 'dtype', None)} "
              f"{tuple(getattr(scale, 'shape', ()))}")
    check(top_k_index.dim() == 2 and top_k_index.shape[0] == tokens and top_k_weights.shape == top_k_index.shape,
          f"top_k_index and top_k_weights must both be [tokens={tokens}, top_k], got {tuple(top_k_index.shape)} "
          f"and {tuple(top_k_weights.shape)}")
    check(not top_k_index.is_floating_point() and top_k_index.dtype != torch.bool,
          f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(limit is None or (activation == "silu" and limit > 0),
          f"limit clamps the silu activation only and must be > 0 (None for no clamp), got {limit!r}")
    check_same_device(hidden_states=x, gate_up=gate_up, down=down, top_k_index=top_k_index,
                      top_k_weights=top_k_weights)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, expert: int, blocks: tuple[int, int]) -> torch.Tensor:
    """Expert ``expert``'s weight in fp32 (its scale grid cut to the weight: transformers may allocate more rows)."""
    (n, k), (bn, bk) = weight.shape[1:], blocks
    return dequantize_fp8(weight[expert], scale[expert, :-(-n // bn), :-(-k // bk)], (bn, bk))


def fused_moe_fp8_reference(hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights, *,
                            activation: str, block_size=None, limit: float | None = None,
                            w8a8: bool = False) -> torch.Tensor:
    """Torch version of :func:`fused_moe_fp8` (module docstring), one pass per selected expert (a host sync).
    ``w8a8``: each projection's rows quantized and dequantized first (``fp8_w8a8.dequantized_activations``, per row
    and group of the weight's K block, or per row without K blocks)."""
    dtype, inter = hidden_states.dtype, down.shape[2]
    gate_up_blocks = expert_scale_blocks(gate_up_scale, block_size, *gate_up.shape[1:])
    down_blocks = expert_scale_blocks(down_scale, block_size, *down.shape[1:])

    def rows(v: torch.Tensor, scale: torch.Tensor, blocks: tuple[int, int]) -> torch.Tensor:
        if not w8a8:
            return v.float()
        per_row, group = _activation_group(scale, blocks[1])
        return dequantized_activations(v, v.shape[-1] if per_row else group)

    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == e)
        x = rows(hidden_states[token], gate_up_scale, gate_up_blocks)
        w_gate_up = _dequantized(gate_up, gate_up_scale, e, gate_up_blocks)
        h = gated_activation_reference(F.linear(x, w_gate_up[:inter]).to(dtype),
                                       F.linear(x, w_gate_up[inter:]).to(dtype), activation, limit)
        y = F.linear(rows(h, down_scale, down_blocks), _dequantized(down, down_scale, e, down_blocks)).to(dtype)
        out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(dtype)


# ---------------------------------------------------------------- W8A8: e4m3 rows times e4m3 experts


@triton.jit
def _w8a8_gate_up_kernel(
    q_ptr, qs_ptr, wg_ptr, wu_ptr, inter_ptr, row_pair_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, num_experts, top_k, hidden, inter_size, limit, stride_qs_row, stride_qs_group,
    stride_ge, stride_gn, stride_ue, stride_un, s_ptr, stride_se, stride_sn, stride_sk, scale_bn, scale_bk, up_row0,
    ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr, SCALE_PER_K: tl.constexpr, SCALE_E8M0: tl.constexpr, EMULATE: tl.constexpr,
    EMULATE_BF16: tl.constexpr, FEW_PAIRS: tl.constexpr, K_BETA: tl.constexpr, K_KAPPA: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr, PDL: tl.constexpr, STACKED: tl.constexpr = False,
):
    """One program per (block, BLOCK_N columns of I): the block's token codes [BLOCK_M, H] (gathered by token)
    times the expert's gate and up tiles, the weights as the MMA's rows, one group of K per step, each partial
    times its rows' and its weight block's scales; then the activation, written [BLOCK_M, BLOCK_N] in the
    activations' dtype (padding rows: zeros)."""
    pdl_wait(PDL)
    lead, expert, rows, _, row_ok, token, cols, col_ok = program_rows(
        tl.program_id(0), row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, top_k, inter_size,
        BLOCK_M, BLOCK_N, FEW_PAIRS)
    if not lead:
        return
    q_rows = q_ptr + token[:, None] * hidden
    qs_rows = qs_ptr + token * stride_qs_row
    if STACKED:  # one [2 * BLOCK_N, GROUP_K] tile a step: the gate's rows, then the up's (the warpgroup MMA with
        # the default tiles: 4 warps, BLOCK_N 32)
        half = tl.arange(0, 2 * BLOCK_N) // BLOCK_N
        c2 = tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N) % BLOCK_N
        c2_ok = c2 < inter_size
        stacked_row = (c2 + half * up_row0).to(tl.int64)  # the row of the stacked [E, 2I, H] weight
        w2_rows = wg_ptr + expert * stride_ge + stacked_row[:, None] * stride_gn
        s2_cols = s_ptr + expert * stride_se + (stacked_row // scale_bn) * stride_sn
        acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, GROUP_K):
            w, q = load_k_tile(w2_rows, q_rows, k0, hidden, c2_ok, row_ok, GROUP_K)
            qs = tl.load(qs_rows + (k0 // GROUP_K) * stride_qs_group, mask=row_ok, other=1.0)[None, :]
            part = e4m3_dot(w, q, EMULATE, IMPRECISE_ACC) * qs
            if SCALE_PER_K:  # the group lies inside one block of weight scales
                part = part * load_scale(s2_cols + (k0 // scale_bk) * stride_sk, c2_ok, SCALE_E8M0)[:, None]
            acc += part
        if not SCALE_PER_K:  # one scale per row (or per tensor): on the finished sums
            acc = acc * load_scale(s2_cols, c2_ok, SCALE_E8M0)[:, None]
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_N, BLOCK_M]), (1, 2, 0)))
    else:
        g_rows = wg_ptr + expert * stride_ge + cols.to(tl.int64)[:, None] * stride_gn
        u_rows = wu_ptr + expert * stride_ue + cols.to(tl.int64)[:, None] * stride_un
        sg_cols = s_ptr + expert * stride_se + (cols // scale_bn).to(tl.int64) * stride_sn
        su_cols = s_ptr + expert * stride_se + ((up_row0 + cols) // scale_bn).to(tl.int64) * stride_sn
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, GROUP_K):
            g, q = load_k_tile(g_rows, q_rows, k0, hidden, col_ok, row_ok, GROUP_K)
            ks = k0 + tl.arange(0, GROUP_K)
            u = tl.load(u_rows + ks[None, :], mask=col_ok[:, None] & (ks < hidden)[None, :], other=0.0,
                        eviction_policy="evict_first")  # the same tile of the up half (the codes loaded once)
            qs = tl.load(qs_rows + (k0 // GROUP_K) * stride_qs_group, mask=row_ok, other=1.0)[None, :]
            part_g = e4m3_dot(g, q, EMULATE, IMPRECISE_ACC) * qs
            part_u = e4m3_dot(u, q, EMULATE, IMPRECISE_ACC) * qs
            if SCALE_PER_K:  # the group lies inside one block of weight scales
                part_g = part_g * load_scale(sg_cols + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)[:, None]
                part_u = part_u * load_scale(su_cols + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)[:, None]
            acc_g += part_g
            acc_u += part_u
        if not SCALE_PER_K:  # one scale per column (or per tensor): on the finished sums
            acc_g = acc_g * load_scale(sg_cols, col_ok, SCALE_E8M0)[:, None]
            acc_u = acc_u * load_scale(su_cols, col_ok, SCALE_E8M0)[:, None]
    dtype: tl.constexpr = inter_ptr.dtype.element_ty
    h = gated_activation(round_to(acc_g, dtype, EMULATE_BF16), round_to(acc_u, dtype, EMULATE_BF16), limit, 1.0,
                         dtype, ACTIVATION, HAS_LIMIT, EMULATE_BF16, K_BETA, K_KAPPA)
    tl.store(inter_ptr + rows[None, :] * inter_size + cols[:, None], h, mask=col_ok[:, None])


@triton.jit
def _w8a8_down_kernel(
    c_ptr, cs_ptr, wd_ptr, out_ptr, weights_ptr, row_pair_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, num_experts, hidden, inter_size, stride_cs_row, stride_cs_group, stride_de, stride_dn,
    s_ptr, stride_se, stride_sn, stride_sk, scale_bn, scale_bk,
    DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr,
    SCALE_PER_K: tl.constexpr, SCALE_E8M0: tl.constexpr, EMULATE: tl.constexpr, EMULATE_BF16: tl.constexpr,
    FEW_PAIRS: tl.constexpr, IMPRECISE_ACC: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (block, BLOCK_N columns of H): the block's intermediate codes times the expert's down tiles
    as in the gate/up kernel, rounded to DTYPE, times each pair's routing weight, written fp32 to row ``pair``."""
    pdl_wait(PDL)
    lead, expert, rows, pair, row_ok, _, cols, col_ok = program_rows(
        tl.program_id(0), row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, 1, hidden,
        BLOCK_M, BLOCK_N, FEW_PAIRS)
    if not lead:
        return
    c_rows = c_ptr + rows[:, None] * inter_size
    cs_rows = cs_ptr + rows * stride_cs_row
    w_rows = wd_ptr + expert * stride_de + cols.to(tl.int64)[:, None] * stride_dn
    s_cols = s_ptr + expert * stride_se + (cols // scale_bn).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, inter_size, GROUP_K):
        w, c = load_k_tile(w_rows, c_rows, k0, inter_size, col_ok, row_ok, GROUP_K)
        cs = tl.load(cs_rows + (k0 // GROUP_K) * stride_cs_group, mask=row_ok, other=1.0)[None, :]
        part = e4m3_dot(w, c, EMULATE, IMPRECISE_ACC) * cs
        if SCALE_PER_K:
            part = part * load_scale(s_cols + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)[:, None]
        acc += part
    if not SCALE_PER_K:
        acc = acc * load_scale(s_cols, col_ok, SCALE_E8M0)[:, None]
    # the projection's output in the activations' dtype, then .float() * the routing weight
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = round_to(acc, DTYPE, EMULATE_BF16) * weight[None, :]
    tl.store(out_ptr + pair[None, :] * hidden + cols[:, None], y, mask=row_ok[None, :] & col_ok[:, None])


def fused_moe_w8a8_kernels(hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights,
                           activation, block_size, limit=None, config=None) -> torch.Tensor:
    """W8A8 experts for arguments already checked and found eligible (``fused_moe_fp8(..., w8a8=True)``): the
    token rows quantized once for every expert (``fp8_w8a8.quantize_rows``, one launch), the gate/up kernel, the
    intermediate rows quantized (one launch), the down kernel, the top-k sum. A row's codes and scales depend on
    that row alone and each (token, expert) pair is a column of its own in the MMAs, so a token's output does not
    depend on the other tokens of its forward."""
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    config = config or w8a8_config()
    tokens, hidden = x.shape
    experts, inter = down.shape[0], down.shape[2]
    top_k = top_k_index.shape[1]
    pairs = tokens * top_k
    few_pairs, row_pair, block_expert, num_blocks, max_blocks = route_blocks(top_k_index, experts, config.block_m)
    emulate = interpreting(_w8a8_gate_up_kernel)
    emulate_bf16 = emulate and x.dtype == torch.bfloat16
    common = dict(BLOCK_M=config.block_m, EMULATE=emulate, EMULATE_BF16=emulate_bf16, FEW_PAIRS=few_pairs,
                  IMPRECISE_ACC=MAX_IMPRECISE_ACC)
    # gate/up: the token rows' codes, then the kernel
    bn, bk = expert_scale_blocks(gate_up_scale, block_size, *gate_up.shape[1:])
    per_row, step = _activation_group(gate_up_scale, bk)
    codes, scales = quantize_rows(x, step, per_row=per_row, emulate=emulate, attached=row_codes(hidden_states))
    intermediate = torch.empty(max_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
    block_n, _, warps, stages = config.gate_up
    e8m0 = gate_up_scale.dtype == E8M0_DTYPE
    grid_scale = gate_up_scale.view(torch.uint8) if e8m0 else gate_up_scale
    _w8a8_gate_up_kernel[(max_blocks, triton.cdiv(inter, block_n))](
        codes, scales, gate_up, gate_up[:, inter:], intermediate, row_pair, block_expert, num_blocks,
        pairs, experts, top_k, hidden, inter, float(limit or 0.0), scales.stride(0), 0 if per_row else 1,
        gate_up.stride(0), gate_up.stride(1), gate_up.stride(0), gate_up.stride(1), grid_scale, *grid_scale.stride(),
        bn, bk, inter, ACTIVATION=activation, HAS_LIMIT=limit is not None, BLOCK_N=block_n, GROUP_K=step,
        SCALE_PER_K=not per_row, SCALE_E8M0=e8m0, **GELU_TANH_CONSTANTS, num_warps=warps, num_stages=stages, **common,
        STACKED=W8A8_STACKED_GATE_UP, **pdl_args(intermediate))
    # down: the intermediate rows' codes, then the kernel (rows of blocks past the real count hold no values and are
    # never read; quantizing them costs a few rows' work)
    bn, bk = expert_scale_blocks(down_scale, block_size, *down.shape[1:])
    per_row, step = _activation_group(down_scale, bk)
    codes, scales = quantize_rows(intermediate, step, per_row=per_row, emulate=emulate)
    parts = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, _, warps, stages = config.down
    e8m0 = down_scale.dtype == E8M0_DTYPE
    grid_scale = down_scale.view(torch.uint8) if e8m0 else down_scale
    _w8a8_down_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        codes, scales, down, parts, top_k_weights.reshape(-1).float(), row_pair, block_expert, num_blocks,
        pairs, experts, hidden, inter, scales.stride(0), 0 if per_row else 1, down.stride(0), down.stride(1),
        grid_scale, *grid_scale.stride(), bn, bk, DTYPE=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
        BLOCK_N=block_n, GROUP_K=step, SCALE_PER_K=not per_row, SCALE_E8M0=e8m0, num_warps=warps, num_stages=stages,
        **common, **pdl_args(parts))
    return sum_parts(parts, tokens, top_k, x.dtype, emulate_bf16)


# ---------------------------------------------------------------- transformers' FP8Experts


def grouped_activation(experts) -> str | None:
    """The activation :func:`fused_moe_fp8` computes for this ``FP8Experts`` module (a stacked gate/up, the class's
    own ``act(gate) * up`` with no soft cap, clamp or alpha), or None: the per-pair path."""
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if (not getattr(experts, "has_gate", False) or getattr(apply_gate, "__qualname__", "") != "FP8Experts._apply_gate"
            or any(getattr(experts, name, None) is not None
                   for name in ("gate_softcap", "up_softcap", "swiglu_alpha", "swiglu_limit", "limit"))):
        return None
    return activation_name(getattr(experts, "act_fn", None))


def fp8_experts_forward(self, hidden_states: torch.Tensor,  # [tokens, hidden]
                        top_k_index: torch.Tensor,  # [tokens, top_k]
                        top_k_weights: torch.Tensor) -> torch.Tensor:  # [tokens, top_k] -> [tokens, hidden]
    """``forward`` of transformers' ``FP8Experts`` (``gate_up_proj`` [E, 2I, H] or ``up_proj`` [E, I, H], and
    ``down_proj`` [E, H, I], e4m3 with ``*_scale_inv`` scales). Where :func:`grouped_activation` names the gate
    and the kernels take the arguments: the W8A8 kernels where :func:`experts_w8a8` (transformers' arithmetic),
    else the weight-only ones (:func:`fused_moe_fp8`). Experts whose activation groups would be under 32 values (a
    K block of 16) keep the weight-only kernels even where the dense layers take their W8A8 reference: the experts'
    reference syncs with the host, which CUDA graphs cannot capture. Else each (token, slot) pair runs
    its expert's up projection (:func:`.fp8_gemm.fp8_expert_linear`), the module's own ``_apply_gate`` or
    activation, and its down projection; the top-k outputs, times their routing weights, are summed in fp32 in slot
    order. Expert-parallel sentinels (``top_k_index == E``) are not handled: such models keep their own forward
    (:func:`fp8_experts_fusible`)."""
    activation = grouped_activation(self)
    if activation is not None:
        args = (hidden_states, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                self.down_proj_scale_inv, top_k_index, top_k_weights)
        # the module's own tensors: no argument checks
        if experts_w8a8(self, hidden_states) and fused_moe_fp8_eligible(*args, block_size=self.block_size,
                                                                         w8a8=True):
            return fused_moe_w8a8_kernels(*args, activation, self.block_size)
        if fused_moe_fp8_eligible(*args, block_size=self.block_size):
            return _kernels(*args, activation, self.block_size)
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    x = hidden_states[:, None].expand(tokens, top_k, hidden_states.shape[-1]).reshape(tokens * top_k, -1)
    if self.has_gate:
        h = self._apply_gate(fp8_expert_linear(x, self.gate_up_proj, self.gate_up_proj_scale_inv, ids,
                                               self.block_size))
    else:
        h = self.act_fn(fp8_expert_linear(x, self.up_proj, self.up_proj_scale_inv, ids, self.block_size))
    out = fp8_expert_linear(h, self.down_proj, self.down_proj_scale_inv, ids, self.block_size)
    out = out.view(tokens, top_k, -1) * top_k_weights[..., None].to(out.dtype)
    return out.float().sum(dim=1).to(hidden_states.dtype)


def experts_w8a8(experts, hidden_states: torch.Tensor) -> bool:
    """Whether an ``FP8Experts`` module's grouped kernels quantize the rows (W8A8), as transformers' own forward
    does: where ``fp8_w8a8.activations_quantized`` (bf16 / fp16 rows on a GPU with FP8 tensor cores) and the
    module's activations are dynamic. Static activation scales (one per expert) keep the weight-only product: the
    rows would need codes per expert."""
    return (W8A8_EXPERTS and activations_quantized(hidden_states)
            and getattr(experts, "activation_scheme", "dynamic") == "dynamic")


def experts_input_group(experts, hidden_states: torch.Tensor) -> int | None:
    """How an ``FP8Experts`` module under ``enable`` quantizes its token rows [..., hidden] where its grouped kernels
    compute W8A8 (:func:`experts_w8a8`) in groups: the values per scale; else None (one scale per row too)."""
    if (getattr(vars(experts).get("forward"), "__func__", None) is not fp8_experts_forward
            or grouped_activation(experts) is None or not experts_w8a8(experts, hidden_states)):
        return None
    steps = []
    for weight, scale in ((experts.gate_up_proj, experts.gate_up_proj_scale_inv),
                          (experts.down_proj, experts.down_proj_scale_inv)):
        _, bk = expert_scale_blocks(scale, experts.block_size, *weight.shape[1:])
        steps.append(_activation_group(scale, bk))
    if min(step for _, step in steps) < MIN_GROUP:  # the weight-only kernels (fused_moe_fp8_eligible)
        return None
    per_row, step = steps[0]
    return None if per_row else step


def fp8_experts_fusible(module) -> bool:
    """Whether :func:`fp8_experts_forward` computes what this ``FP8Experts`` module computes: e4m3 weights (not
    FP4-packed), no biases, not expert-parallel."""
    names = ("gate_up_proj", "gate_up_proj_scale_inv") if getattr(module, "has_gate", True) else (
        "up_proj", "up_proj_scale_inv")
    tensors = [getattr(module, n, None) for n in (*names, "down_proj", "down_proj_scale_inv")]
    return (all(isinstance(t, torch.Tensor) for t in tensors) and tensors[0].dtype == FP8_DTYPE
            and tensors[2].dtype == FP8_DTYPE and not getattr(module, "has_bias", False)
            and not getattr(module, "_is_expert_parallel", False) and hasattr(module, "_apply_gate"))
