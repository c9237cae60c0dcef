"""rms_norm: Gemma-style RMSNorm in one kernel.

``y = x * (mean(x^2) + eps) ** -0.5 [* weight]`` computed in fp32 and cast back to x's dtype — the
arithmetic of transformers' ``Gemma4RMSNorm`` (fp32 upcast, scale multiplied in fp32). Eager torch runs
it as ~8 kernels (cast, pow, mean, add, pow, mul, cast, mul, cast); on a decode step those launches, not
the bytes, are its cost, even inside a CUDA graph. One program per row.
"""

import torch

from ._dispatch import check, next_power_of_2, tl, triton, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr,  # x, out: [rows, dim] with row strides; weight: [dim]
    stride_x, stride_out, dim, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_squared = tl.sum(x * x, 0) / dim + eps
    y = x / tl.sqrt(mean_squared)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., dim] -> same shape and dtype; ``weight`` [dim] or None (no scale)."""
    check(weight is None or weight.shape == (x.shape[-1],),
          f"weight must be [dim={x.shape[-1]}], got {None if weight is None else tuple(weight.shape)}")
    if not use_triton(x) or x.numel() == 0 or x.shape[-1] > 65536:
        return rms_norm_reference(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    dim = rows.shape[1]
    block = next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), dim, eps,
        HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (transformers' Gemma4RMSNorm arithmetic)."""
    h = x.float()
    y = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)
