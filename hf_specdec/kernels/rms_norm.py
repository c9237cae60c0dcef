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


@triton.jit
def _norm_add_kernel(
    x_ptr, res_ptr, w_ptr, sum_ptr, scale_ptr, w2_ptr, out2_ptr,  # rows [rows, dim]; w, w2 [dim]; scale [1]
    stride_x, stride_res, stride_sum, stride_out2, dim, eps, eps2,
    HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, NEXT_HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, 0) / dim + eps)
    y = (y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    s = (tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32))
    s = s.to(dtype)
    if HAS_SCALE:
        s = (s.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(dtype)
    tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
    if HAS_NEXT:
        t = s.to(tl.float32)
        z = t * tl.math.rsqrt(tl.sum(t * t, 0) / dim + eps2)
        if NEXT_HAS_WEIGHT:
            z = z * tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out2_ptr + row * stride_out2 + cols, z.to(dtype), mask=mask)


def norm_add(
    x: torch.Tensor,  # [..., dim]: a sublayer's output
    residual: torch.Tensor,  # like x
    weight: torch.Tensor,  # [dim]: the sublayer's post-norm
    eps: float,
    *,
    scale: torch.Tensor | None = None,  # [1]: multiplies the sum (Gemma 4's layer_scalar)
    next_weight: torch.Tensor | None = None,  # [dim] of the norm that reads the sum next (None: no scale)
    next_eps: float | None = None,  # None: no next norm
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``s = (residual + rms_norm(x, weight)) [* scale]`` and, with ``next_eps``, ``rms_norm(s, next_weight)``:
    the sandwich-norm seams of a Gemma 4 block (post-norm, residual add, layer scalar, the next pre-norm),
    each result rounded to x's dtype as eager torch rounds it, in one launch instead of up to ~20."""
    dim = x.shape[-1]
    check(residual.shape == x.shape and weight.shape == (dim,),
          f"residual must be x's shape {tuple(x.shape)} and weight [{dim}], got {tuple(residual.shape)}, "
          f"{tuple(weight.shape)}")
    if not use_triton(x) or x.numel() == 0 or dim > 65536:
        return norm_add_reference(x, residual, weight, eps, scale=scale, next_weight=next_weight, next_eps=next_eps)
    rows, res = x.reshape(-1, dim), residual.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    res = res if res.stride(-1) == 1 else res.contiguous()
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    nxt = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if next_eps is not None else None
    block = next_power_of_2(dim)
    _norm_add_kernel[(rows.shape[0],)](
        rows, res, weight, total, scale if scale is not None else weight,
        next_weight if next_weight is not None else weight, nxt if nxt is not None else total,
        rows.stride(0), res.stride(0), total.stride(0), (nxt if nxt is not None else total).stride(0), dim,
        float(eps), float(next_eps or 0.0),
        HAS_SCALE=scale is not None, HAS_NEXT=next_eps is not None, NEXT_HAS_WEIGHT=next_weight is not None,
        BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )
    return total.view(x.shape), None if nxt is None else nxt.view(x.shape)


def norm_add_reference(x, residual, weight, eps, *, scale=None, next_weight=None, next_eps=None):
    """Torch version: the CPU path and the test oracle (the eager ops of transformers' Gemma 4 block)."""
    total = residual + rms_norm_reference(x, weight, eps)
    if scale is not None:
        total = (total * scale).to(total.dtype)  # transformers: `hidden_states *= layer_scalar`, in place
    return total, None if next_eps is None else rms_norm_reference(total, next_weight, next_eps)
