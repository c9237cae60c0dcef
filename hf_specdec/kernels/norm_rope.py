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
    eps, dim, rot,  # rot: the rotated dims (the first ``rot`` of the head; the rest pass through)
    HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # the normalised values rounded to the dtype before the weight product (Qwen3)
):
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    x = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / dim + eps)
    y = x * inv_rms
    if HAS_WEIGHT:
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:
            w = WEIGHT_OFFSET + w
        if ROUND_FIRST:
            y = y.to(dtype).to(tl.float32)
        y = y * w
    y = y.to(dtype)
    if ROPE:
        # rotate_half(y)[d] = -y[d + rot/2] for the first half, y[d - rot/2] for the second (d < rot)
        half = rot // 2
        rotating = mask & (d < rot)
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(x_ptr + partner, mask=rotating, other=0.0).to(tl.float32)
        yp = xp * inv_rms
        if HAS_WEIGHT:
            wp = tl.load(w_ptr + partner, mask=rotating, other=0.0).to(tl.float32)
            if WEIGHT_OFFSET != 0.0:
                wp = WEIGHT_OFFSET + wp
            if ROUND_FIRST:
                yp = yp.to(dtype).to(tl.float32)
            yp = yp * wp
        yp = yp.to(dtype).to(tl.float32)
        rotated = tl.where(d < half, -yp, yp)
        c = tl.load(cos_ptr + d, mask=rotating, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + d, mask=rotating, other=0.0).to(tl.float32)
        a = (y.to(tl.float32) * c).to(dtype).to(tl.float32)
        b = (rotated * s).to(dtype).to(tl.float32)
        y = tl.where(rotating, (a + b).to(dtype), y)
    tl.store(out_ptr + d, y, mask=mask)


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr,  # [tokens, heads, dim], dim contiguous
    q_w_ptr, k_w_ptr, v_w_ptr, cos_ptr, sin_ptr,  # weights [dim]; cos/sin [batch, seq, rot]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, seq_len,
    q_heads, k_heads, dim, rot, q_eps, k_eps, v_eps,
    Q_W: tl.constexpr, K_W: tl.constexpr, V_W: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    rope = cos_ptr + (token // seq_len) * stride_cb + (token % seq_len) * stride_ct
    rope_sin = sin_ptr + (token // seq_len) * stride_cb + (token % seq_len) * stride_ct
    if head < q_heads:
        out = token * q_heads * dim + head * dim
        _norm_rope_head(q_ptr + token * stride_qt + head * stride_qh, q_out_ptr + out, q_w_ptr, rope, rope_sin,
                        q_eps, dim, rot, Q_W, True, BLOCK_D, WEIGHT_OFFSET, ROUND_FIRST)
    elif head < q_heads + k_heads:
        h = head - q_heads
        out = token * k_heads * dim + h * dim
        _norm_rope_head(k_ptr + token * stride_kt + h * stride_kh, k_out_ptr + out, k_w_ptr, rope, rope_sin,
                        k_eps, dim, rot, K_W, True, BLOCK_D, WEIGHT_OFFSET, ROUND_FIRST)
    else:
        h = head - q_heads - k_heads
        out = token * k_heads * dim + h * dim
        _norm_rope_head(v_ptr + token * stride_vt + h * stride_vh, v_out_ptr + out, v_w_ptr, rope, rope_sin,
                        v_eps, dim, rot, V_W, False, BLOCK_D, WEIGHT_OFFSET, ROUND_FIRST)


def qkv_norm_rope(
    q: torch.Tensor,  # [batch, seq, q_heads, dim]
    k: torch.Tensor | None,  # [batch, seq, kv_heads, dim] or None (q only, e.g. a Q-only drafter)
    v: torch.Tensor | None,  # like k (may be k itself: Gemma 4's k_eq_v layers normalise the raw keys), or None
    weights: tuple,  # (q_weight, k_weight, v_weight): [dim] or None for a norm without scale
    eps: tuple,  # (q_eps, k_eps, v_eps)
    cos: torch.Tensor,  # [batch or 1, seq, rot]: rot = dim, or fewer (partial rotary: the first rot dims)
    sin: torch.Tensor,
    *,
    weight_offset: float = 0.0,  # 1: heads scaled by 1 + weight (zero-centred norm weights, Step 3.5)
    round_before_weight: bool = False,  # Qwen3's norms: the normalised heads rounded to the dtype, then times weight
) -> tuple:
    """(rope(norm(q)), rope(norm(k)), norm(v)) as new contiguous tensors (None where the input was None):
    the ops of transformers' Gemma 4 attention between the projections and the cache, in one launch. With v
    None (k given) the values are left to the caller (Step 3.5 does not normalise them); with ``cos`` narrower
    than the heads only their first ``cos.shape[-1]`` dims rotate (neox halves of those), the rest pass
    through normalised. ``round_before_weight``: each weight product reads the normalised values rounded to the dtype
    and is rounded itself (``weight * norm(x).to(dtype)``, as transformers' Qwen3 norms), instead of one rounding of
    the fp32 product (Gemma 4's)."""
    batch, seq, q_heads, dim = q.shape
    rot = cos.shape[-1]
    check(k is not None or v is None, "v needs k: give k and v, k alone, or neither")
    check(rot % 2 == 0 and 0 < rot <= dim, f"rotary needs an even number of rotated dims <= head_dim={dim}, got {rot}")
    check(sin.shape == cos.shape,
          f"cos/sin must be [batch, seq, rotary dims], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    check(weight_offset == 0.0 or all(w is not None for w, t in zip(weights, (q, k, v)) if t is not None),
          f"weight_offset={weight_offset} scales by offset + weight: every normalised input needs its weight")
    check(not round_before_weight or weight_offset == 0.0, "round_before_weight takes no weight_offset")
    check(not round_before_weight or all(w is None or w.dtype == q.dtype for w in weights),
          f"round_before_weight rounds each weight product to the heads' dtype {q.dtype}: pass weights in it")
    if k is not None:
        check(k.shape[:2] == q.shape[:2] and k.shape[3] == dim and (v is None or v.shape == k.shape),
              f"k and v must be [batch={batch}, seq={seq}, kv_heads, {dim}], got {tuple(k.shape)}, "
              f"{None if v is None else tuple(v.shape)}")
    if not use_triton(q) or q.numel() == 0:
        return qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin, weight_offset=weight_offset,
                                       round_before_weight=round_before_weight)
    kv_heads = 0 if k is None else k.shape[2]
    v_heads = 0 if v is None else kv_heads
    tokens = batch * seq
    flat = [None if t is None else _rows(t) for t in (q, k, v)]
    outs = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    cos3 = cos.expand(batch, seq, rot)
    sin3 = sin.expand(batch, seq, rot)
    if sin3.stride() != cos3.stride():
        sin3 = sin3.contiguous()
        cos3 = cos3.contiguous()
    check(cos3.stride(2) == 1, "cos/sin must be contiguous in their last dim")
    # missing k / v: their arguments repeat q's tensors (no program reads them: their head counts are 0)
    qf, kf, vf = (t if t is not None else flat[0] for t in flat)
    qo, ko, vo = (t if t is not None else outs[0] for t in outs)
    w = [wt if wt is not None else qf for wt in weights]
    block = next_power_of_2(dim)
    _qkv_norm_rope_kernel[(tokens, q_heads + kv_heads + v_heads)](
        qf, kf, vf, qo, ko, vo, w[0], w[1], w[2], cos3, sin3,
        qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        cos3.stride(0), cos3.stride(1), seq,
        q_heads, kv_heads, dim, rot, float(eps[0]), float(eps[1]), float(eps[2]),
        Q_W=weights[0] is not None, K_W=weights[1] is not None, V_W=weights[2] is not None, BLOCK_D=block,
        WEIGHT_OFFSET=float(weight_offset), ROUND_FIRST=round_before_weight, num_warps=max(1, min(8, block // 128)),
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
    """transformers' ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)`` for x [batch, seq, heads, dim]; cos
    narrower than the heads rotates their first ``cos.shape[-1]`` dims (Step 3.5's partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([rotary_reference(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin, *, weight_offset: float = 0.0,
                            round_before_weight: bool = False) -> tuple:
    """Torch version: the CPU path and the test oracle (the eager ops of transformers' Gemma 4 attention; with
    ``round_before_weight``, of its Qwen3 norms)."""
    def norm(x, i):
        if round_before_weight and weights[i] is not None:
            return rms_norm_reference(x, None, eps[i], then_mul=weights[i])
        return rms_norm_reference(x, weights[i], eps[i], weight_offset=weight_offset if weights[i] is not None else 0)

    q_out = rotary_reference(norm(q, 0), cos, sin)
    if k is None:
        return q_out, None, None
    return q_out, rotary_reference(norm(k, 1), cos, sin), None if v is None else norm(v, 2)
