"""qkv_norm_rope: the per-head RMSNorm and rotary embedding of q, k and v in one kernel.

Gemma 4 attention normalises every head of q, k and v (``q_norm``, ``k_norm``, ``v_norm``: transformers'
``Gemma4RMSNorm``) and rotates q and k (``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``).
Eagerly that is 3 norms and 2 x 5 rotary ops (mul, neg, cat, mul, add): ~13 launches per layer whose
bytes are a few KB at decode, so launches are their cost even inside a CUDA graph. Here one program per
(token, head) reads the head once and writes it normalised and rotated.

The arithmetic is transformers': the norm in fp32 (``x * rsqrt(mean(x^2) + eps) * weight``) cast to the
input dtype, then the rotary products each rounded to that dtype as eager torch does (``x * cos``,
``rotate_half(x) * sin``, their sum), with no fused multiply-add, so fp32 and bf16 match the eager ops up
to the order of the mean's sum.
"""

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton
from .rms_norm import rms_norm_reference


@triton.jit
def _norm_rope_head(
    x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr,  # this head's input and output rows, the token's cos/sin rows
    eps, dim,
    HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / dim + eps)
    y = x * inv_rms
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = y.to(dtype)
    if ROPE:
        # rotate_half(y)[d] = -y[d + dim/2] for the first half, y[d - dim/2] for the second
        half = dim // 2
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        yp = xp * inv_rms
        if HAS_WEIGHT:
            yp = yp * tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        yp = yp.to(dtype).to(tl.float32)
        rotated = tl.where(d < half, -yp, yp)
        c = tl.load(cos_ptr + d, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + d, mask=mask, other=0.0).to(tl.float32)
        a = (y.to(tl.float32) * c).to(dtype).to(tl.float32)
        b = (rotated * s).to(dtype).to(tl.float32)
        y = (a + b).to(dtype)
    tl.store(out_ptr + d, y, mask=mask)


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr,  # [tokens, heads, dim], dim contiguous
    q_w_ptr, k_w_ptr, v_w_ptr, cos_ptr, sin_ptr,  # weights [dim]; cos/sin [batch, seq, dim]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, seq_len,
    q_heads, k_heads, dim, q_eps, k_eps, v_eps,
    Q_W: tl.constexpr, K_W: tl.constexpr, V_W: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rope = cos_ptr + (token // seq_len) * stride_cb + (token % seq_len) * stride_ct
    rope_sin = sin_ptr + (token // seq_len) * stride_cb + (token % seq_len) * stride_ct
    if head < q_heads:
        out = token * q_heads * dim + head * dim
        _norm_rope_head(q_ptr + token * stride_qt + head * stride_qh, q_out_ptr + out, q_w_ptr, rope, rope_sin,
                        q_eps, dim, Q_W, True, BLOCK_D)
    elif head < q_heads + k_heads:
        h = head - q_heads
        out = token * k_heads * dim + h * dim
        _norm_rope_head(k_ptr + token * stride_kt + h * stride_kh, k_out_ptr + out, k_w_ptr, rope, rope_sin,
                        k_eps, dim, K_W, True, BLOCK_D)
    else:
        h = head - q_heads - k_heads
        out = token * k_heads * dim + h * dim
        _norm_rope_head(v_ptr + token * stride_vt + h * stride_vh, v_out_ptr + out, v_w_ptr, rope, rope_sin,
                        v_eps, dim, V_W, False, BLOCK_D)


def qkv_norm_rope(
    q: torch.Tensor,  # [batch, seq, q_heads, dim]
    k: torch.Tensor | None,  # [batch, seq, kv_heads, dim] or None (q only, e.g. a Q-only drafter)
    v: torch.Tensor | None,  # like k (may be k itself: Gemma 4's k_eq_v layers normalise the raw keys)
    weights: tuple,  # (q_weight, k_weight, v_weight): [dim] or None for a norm without scale
    eps: tuple,  # (q_eps, k_eps, v_eps)
    cos: torch.Tensor,  # [batch or 1, seq, dim]
    sin: torch.Tensor,
) -> tuple:
    """(rope(norm(q)), rope(norm(k)), norm(v)) as new contiguous tensors (None where the input was None):
    the ops of transformers' Gemma 4 attention between the projections and the cache, in one launch."""
    batch, seq, q_heads, dim = q.shape
    check((k is None) == (v is None), "give both k and v, or neither")
    check(dim % 2 == 0, f"rotary needs an even head_dim, got {dim}")
    check(cos.shape[-1] == dim and sin.shape == cos.shape,
          f"cos/sin must be [batch, seq, head_dim={dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if k is not None:
        check(k.shape[:2] == q.shape[:2] and k.shape[3] == dim and v.shape == k.shape,
              f"k and v must be [batch={batch}, seq={seq}, kv_heads, {dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
    if not use_triton(q) or q.numel() == 0:
        return qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin)
    kv_heads = 0 if k is None else k.shape[2]
    tokens = batch * seq
    flat = [None if t is None else _rows(t) for t in (q, k, v)]
    outs = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    cos3 = cos.expand(batch, seq, dim)
    sin3 = sin.expand(batch, seq, dim)
    if sin3.stride() != cos3.stride():
        sin3 = sin3.contiguous()
        cos3 = cos3.contiguous()
    check(cos3.stride(2) == 1, "cos/sin must be contiguous in head_dim")
    # q only: the k/v arguments repeat q's tensors (no program reads them: kv_heads is 0)
    qf, kf, vf = flat if k is not None else flat[:1] * 3
    qo, ko, vo = outs if k is not None else outs[:1] * 3
    w = [wt if wt is not None else qf for wt in weights]
    block = next_power_of_2(dim)
    _qkv_norm_rope_kernel[(tokens, q_heads + 2 * kv_heads)](
        qf, kf, vf, qo, ko, vo, w[0], w[1], w[2], cos3, sin3,
        qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        cos3.stride(0), cos3.stride(1), seq,
        q_heads, kv_heads, dim, float(eps[0]), float(eps[1]), float(eps[2]),
        Q_W=weights[0] is not None, K_W=weights[1] is not None, V_W=weights[2] is not None, BLOCK_D=block,
        num_warps=max(1, min(8, block // 128)),
        # separate roundings, as eager torch: no fused multiply-add in the rotary sum
        **({} if _interpreting() else {"enable_fp_fusion": False}), **pdl_args(qo),
    )
    return tuple(outs)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[batch, seq, heads, dim] -> [tokens, heads, dim] with dim contiguous (a view when it can be)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[2], t.shape[3])
    except RuntimeError:
        return t.reshape(-1, t.shape[2], t.shape[3])


def _interpreting() -> bool:
    return type(_qkv_norm_rope_kernel).__name__ == "InterpretedFunction"


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)`` for x [batch, seq, heads, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin) -> tuple:
    """Torch version: the CPU path and the test oracle (the eager ops of transformers' Gemma 4 attention)."""
    q_out = rotary_reference(rms_norm_reference(q, weights[0], eps[0]), cos, sin)
    if k is None:
        return q_out, None, None
    k_out = rotary_reference(rms_norm_reference(k, weights[1], eps[1]), cos, sin)
    return q_out, k_out, rms_norm_reference(v, weights[2], eps[2])
