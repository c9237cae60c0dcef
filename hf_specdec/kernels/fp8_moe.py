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

``FP8Experts`` modules whose gate this does not compute (a soft-capped or clamped SwiGLU, an activation other
than tanh-GELU or SiLU) or whose weights it does not take keep the per-pair path
(:func:`.fp8_gemm.fp8_expert_linear`: one matrix-vector product per (token, expert) pair, the module's own
``_apply_gate``), as do CPU tensors and autograd.
"""

import torch
import torch.nn.functional as F

from ._dispatch import check, check_same_device, needs_grad, use_triton
from .fp8_gemm import (
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    MIN_BLOCK_K,
    SCALE_DTYPES,
    dequantize_fp8,
    expert_scale_blocks,
    fp8_expert_linear,
    has_native_fp8,
)
from .fused_moe import (
    ACTIVATIONS,
    MAX_EXPERTS,
    MAX_TOP_K,
    Fp8Weights,
    MoeConfig,
    activation_name,
    config_for,
    gated_activation_reference,
    launch,
)

FP16_DOTS = True  # bf16 token rows multiply the gate/up weights as fp16 where e4m3 loads natively (False: as bf16)


def fused_moe_fp8(hidden_states: torch.Tensor,  # [tokens, hidden] bf16 / fp16
                  gate_up: torch.Tensor,  # [E, 2I, hidden] float8_e4m3fn: the gate's rows, then the up's
                  gate_up_scale: torch.Tensor,  # [E, sn, sk]
                  down: torch.Tensor,  # [E, hidden, I] float8_e4m3fn
                  down_scale: torch.Tensor,  # [E, sn, sk]
                  top_k_index: torch.Tensor,  # [tokens, top_k] int
                  top_k_weights: torch.Tensor,  # [tokens, top_k] float
                  *, activation: str, block_size=None, limit: float | None = None,
                  config: MoeConfig | None = None) -> torch.Tensor:  # [tokens, hidden] in hidden_states' dtype
    """The routed experts' weighted sum per token over e4m3 weights (module docstring); ``block_size``: the scales'
    ``(bn, bk)`` (None: the scale grid spans the weight, :func:`.fp8_gemm.expert_scale_blocks`). The kernels when
    :func:`fused_moe_fp8_eligible`, else :func:`fused_moe_fp8_reference`."""
    args = (hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights)
    _check_args(*args, activation, limit)
    if not fused_moe_fp8_eligible(*args, block_size=block_size):
        return fused_moe_fp8_reference(*args, activation=activation, block_size=block_size, limit=limit)
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
                           block_size=None) -> bool:
    """Whether :func:`fused_moe_fp8` runs the kernels for these (checked) arguments."""
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
    return True


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
                            activation: str, block_size=None, limit: float | None = None) -> torch.Tensor:
    """Torch version of :func:`fused_moe_fp8` (module docstring), one pass per selected expert (a host sync)."""
    dtype, inter = hidden_states.dtype, down.shape[2]
    gate_up_blocks = expert_scale_blocks(gate_up_scale, block_size, *gate_up.shape[1:])
    down_blocks = expert_scale_blocks(down_scale, block_size, *down.shape[1:])
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == e)
        x = hidden_states[token].float()
        w_gate_up = _dequantized(gate_up, gate_up_scale, e, gate_up_blocks)
        h = gated_activation_reference(F.linear(x, w_gate_up[:inter]).to(dtype),
                                       F.linear(x, w_gate_up[inter:]).to(dtype), activation, limit)
        y = F.linear(h.float(), _dequantized(down, down_scale, e, down_blocks)).to(dtype)
        out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(dtype)


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
    ``down_proj`` [E, H, I], e4m3 with ``*_scale_inv`` scales), weight-only. Where :func:`grouped_activation`
    names the gate and the kernels take the arguments: :func:`fused_moe_fp8`. Else each (token, slot) pair runs
    its expert's up projection (:func:`.fp8_gemm.fp8_expert_linear`), the module's own ``_apply_gate`` or
    activation, and its down projection; the top-k outputs, times their routing weights, are summed in fp32 in slot
    order. Expert-parallel sentinels (``top_k_index == E``) are not handled: such models keep their own forward
    (:func:`fp8_experts_fusible`)."""
    activation = grouped_activation(self)
    if activation is not None:
        args = (hidden_states, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                self.down_proj_scale_inv, top_k_index, top_k_weights)
        if fused_moe_fp8_eligible(*args, block_size=self.block_size):  # the module's own tensors: no argument checks
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


def fp8_experts_fusible(module) -> bool:
    """Whether :func:`fp8_experts_forward` computes what this ``FP8Experts`` module computes: e4m3 weights (not
    FP4-packed), no biases, not expert-parallel."""
    names = ("gate_up_proj", "gate_up_proj_scale_inv") if getattr(module, "has_gate", True) else (
        "up_proj", "up_proj_scale_inv")
    tensors = [getattr(module, n, None) for n in (*names, "down_proj", "down_proj_scale_inv")]
    return (all(isinstance(t, torch.Tensor) for t in tensors) and tensors[0].dtype == FP8_DTYPE
            and tensors[2].dtype == FP8_DTYPE and not getattr(module, "has_bias", False)
            and not getattr(module, "_is_expert_parallel", False) and hasattr(module, "_apply_gate"))
