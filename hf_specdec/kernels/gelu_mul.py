"""gelu_tanh_mul: ``gelu(gate, approximate="tanh") * up`` in one kernel (the gated MLP of Gemma 4); silu_mul:
``silu(gate) * up``, with Step 3.5's optional clamps (``silu(gate).clamp(max=c) * up.clamp(-c, c)``);
head_gate_mul: ``x * sigmoid(gate)`` with one gate per head (Step 3.5's head-wise attention gate).

Eagerly the activation and the product are two launches over the intermediate width (five with the clamps); at
decode their bytes are ~100 KB, so the launches are their cost. The arithmetic is torch's: the activation in fp32
(``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``, or ``x / (1 + exp(-x))``) rounded to the input
dtype, the clamps on the rounded values, then the product rounded. tanh is written with exp (``1 - 2 / (exp(2z) +
1)``), within a few fp32 ulps of the libm tanh.
"""

import torch

from ._dispatch import check, pdl_args, pdl_wait, tl, triton, use_triton
from .activations import GELU_TANH_CONSTANTS, gated_activation
from .fp8_w8a8 import attach_row_codes, check_quantize_group, codes_emulated, row_code_args, store_row_codes

_BLOCK = 1024


@triton.jit
def _gated_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_gate, stride_up, limit, q_ptr, qs_ptr, groups,
                      BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, K_BETA: tl.constexpr,
                      K_KAPPA: tl.constexpr, GROUP: tl.constexpr, CODES: tl.constexpr, EMULATE: tl.constexpr,
                      PDL: tl.constexpr):
    # program (row, c): values c * BLOCK ... of the row (CODES: as a [BLOCK // GROUP, GROUP] tile, with their e4m3
    # codes and scales per group, for the W8A8 product that reads them)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if CODES:
        g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    y = gated_activation(x, up, limit, 1.0, dtype, ACTIVATION, CLAMP, False, K_BETA, K_KAPPA).to(dtype)
    tl.store(out_ptr + row * width + cols, y, mask=mask)
    if CODES:
        store_row_codes(y, row, cols, g, q_ptr, qs_ptr, width, groups, EMULATE)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, quantize_group: int | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for same-shape tensors; a new contiguous tensor. The inputs may
    be column slices of a wider tensor (e.g. the two halves of one stacked gate/up projection): only the
    last dimension has to be contiguous. ``quantize_group`` (a power of two up to 1024): the kernel also writes the
    output rows' e4m3 codes, per group of that many values, for the W8A8 product that reads them
    (``fp8_w8a8.attach_row_codes``; the torch path attaches none)."""
    check_quantize_group(quantize_group, _BLOCK)
    return _gated_mul(gate, up, silu=False, limit=None, quantize_group=quantize_group)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``silu(gate) * up``; with ``limit``, ``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)`` (Step 3.5's
    clamped SwiGLU). The inputs as :func:`gelu_tanh_mul`'s."""
    check(limit is None or limit > 0, f"limit must be > 0 (None for no clamp), got {limit!r}")
    return _gated_mul(gate, up, silu=True, limit=limit)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, silu: bool, limit: float | None,
               quantize_group: int | None = None) -> torch.Tensor:
    check(gate.shape == up.shape and gate.dtype == up.dtype,
          f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not use_triton(gate) or gate.numel() == 0:
        return silu_mul_reference(gate, up, limit) if silu else gelu_tanh_mul_reference(gate, up)
    width = gate.shape[-1]
    gate2, up2 = _rows(gate, width), _rows(up, width)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    codes = row_code_args(out.view(-1, width), quantize_group)
    _gated_mul_kernel[(gate2.shape[0], triton.cdiv(width, _BLOCK))](
        gate2, up2, out, width, gate2.stride(0), up2.stride(0), float(limit or 0.0), *codes, BLOCK=_BLOCK,
        ACTIVATION="silu" if silu else "gelu_tanh", CLAMP=limit is not None, **GELU_TANH_CONSTANTS,
        GROUP=quantize_group or _BLOCK, CODES=quantize_group is not None, EMULATE=codes_emulated(gate.device),
        num_warps=4, **pdl_args(out))
    return attach_row_codes(out, quantize_group, *codes[:2])


@triton.jit
def _head_gate_kernel(x_ptr, gate_ptr, out_ptr, head_dim, stride_x_row, stride_x_head, stride_gate,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_gate + head).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch.sigmoid in the gate's dtype
    x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (row * tl.num_programs(1) + head) * head_dim + cols, (x * s).to(dtype), mask=mask)


def head_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(gate).unsqueeze(-1)`` for x [..., heads, head_dim] and gate [..., heads] of one dtype
    (each head's rows scaled by its gate): one launch; a new contiguous tensor. ``gate`` may be a column slice of a
    wider tensor (a stacked projection's output), x may have strided rows and heads."""
    check(gate.shape == x.shape[:-1] and gate.dtype == x.dtype,
          f"gate must be x's shape without its last dim {tuple(x.shape[:-1])} in x's dtype {x.dtype}, got "
          f"{tuple(gate.shape)} {gate.dtype}")
    if not use_triton(x) or x.numel() == 0:
        return head_gate_mul_reference(x, gate)
    heads, head_dim = x.shape[-2:]
    rows = x.reshape(-1, heads, head_dim) if x.stride(-1) == 1 else x.contiguous().view(-1, heads, head_dim)
    gates = _rows(gate, heads)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _head_gate_kernel[(rows.shape[0], heads)](rows, gates, out, head_dim, rows.stride(0), rows.stride(1),
                                              gates.stride(0), BLOCK=triton.next_power_of_2(head_dim),
                                              num_warps=1, **pdl_args(out))
    return out


def head_gate_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (Step 3.5's attention gate)."""
    return x * torch.sigmoid(gate).unsqueeze(-1).to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (Step 3.5's ``clamped_swiglu``)."""
    act = torch.nn.functional.silu(gate)
    if limit is not None:
        act = act.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return act * up


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as [rows, width] with contiguous columns: a view when the leading dimensions collapse."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, width)
    except RuntimeError:
        return t.reshape(-1, width)


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (transformers' ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def is_gelu_tanh(act) -> bool:
    """Whether the activation module ``act`` is transformers' tanh-approximated GELU (what :func:`gelu_tanh_mul`
    computes; its python-formula variant rounds differently and is not)."""
    return (type(act).__name__ in ("GELUTanh", "PytorchGELUTanh")
            and not getattr(act, "use_gelu_tanh_python", False)
            and getattr(getattr(act, "act", None), "keywords", {}).get("approximate") == "tanh")
