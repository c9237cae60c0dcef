"""gelu_tanh_mul: ``gelu(gate, approximate="tanh") * up`` in one kernel (the gated MLP of Gemma 4).

Eagerly the activation and the product are two launches over the intermediate width; at decode their
bytes are ~100 KB, so the launches are their cost. The arithmetic is torch's: the activation in fp32
(``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``) rounded to the input dtype, then the product
rounded. tanh is written with exp (``1 - 2 / (exp(2z) + 1)``), within a few fp32 ulps of the libm tanh.
"""

import math

import torch

from ._dispatch import check, tl, triton, use_triton

_BLOCK = 1024


@triton.jit
def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, K_BETA: tl.constexpr,
                          K_KAPPA: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = K_BETA * (x + K_KAPPA * (x * x * x))
    # |2 * inner| > 80: tanh is +-1 in fp32 already; the clamp keeps exp finite
    tanh = 1.0 - 2.0 / (tl.exp(tl.minimum(tl.maximum(2.0 * inner, -80.0), 80.0)) + 1.0)
    act = (0.5 * x * (1.0 + tanh)).to(dtype).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (act * up).to(dtype), mask=mask)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for same-shape tensors; a new contiguous tensor."""
    check(gate.shape == up.shape and gate.dtype == up.dtype,
          f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not use_triton(gate) or gate.numel() == 0:
        return gelu_tanh_mul_reference(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    _gelu_tanh_mul_kernel[(triton.cdiv(n, _BLOCK),)](
        gate, up, out, n, BLOCK=_BLOCK, K_BETA=math.sqrt(2.0 / math.pi), K_KAPPA=0.044715, num_warps=4)
    return out


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (transformers' ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
