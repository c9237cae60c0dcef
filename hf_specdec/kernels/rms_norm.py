"""rms_norm: Gemma-style RMSNorm in one kernel.

``y = x * (mean(x^2) + eps) ** -0.5 [* weight]`` computed in fp32 and cast back to x's dtype — the
arithmetic of transformers' ``Gemma4RMSNorm`` (fp32 upcast, scale multiplied in fp32); with ``weight_offset=1`` the
scale is ``1 + weight`` (norms that store their weights zero-centred: ``GemmaRMSNorm``, Step 3.5's). Eager torch runs
it as ~8 kernels (cast, pow, mean, add, pow, mul, cast, mul, cast); on a decode step those launches, not
the bytes, are its cost, even inside a CUDA graph. One program per row.

A norm whose output feeds FP8 products that quantize their rows in groups (W8A8: ``fp8_w8a8``) can quantize it too
(``quantize_group``): the kernel writes the rows' e4m3 codes and scales beside them, as the products' own
quantizing launch would (``fp8_w8a8.quantize_rows``, the same values bit for bit), and attaches them to the output
(``fp8_w8a8.attach_row_codes``), so the products skip that launch. Such a launch spreads each row over programs of
:data:`CODES_CHUNK` values, every one computing the row's statistics over the whole row as the one-program kernel
does (so the outputs are those without codes, bit for bit in bf16 and fp16): in one program the row's quantization
took longer than the products' launch (H200, ``benchmarks/results/norm_codes_probe_h200.log``).

In fp32 the same arithmetic in another layout (the codes' tiles against a whole row, a seam against a norm alone) may
differ by an ulp on the GPU: the compiler fuses products and sums into multiply-adds per layout, and nothing rounds
the fp32 results to hide it (the fp32 tests on the CPU are the exact ones: the torch references and the interpreter
contract no product and sum into one multiply-add).
"""

import torch
import torch.nn.functional as F

from ._dispatch import check, needs_grad, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton
from .fp8_w8a8 import attach_row_codes, check_quantize_group, codes_emulated, row_code_args, store_row_codes


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr,  # x, out: [rows, dim] with row strides; weight: [dim]
    stride_x, stride_out, dim, eps, then_mul_ptr, then_scalar, res_ptr, sum_ptr, stride_res, stride_sum,
    q_ptr, qs_ptr, groups,  # the output's e4m3 codes [rows, dim] and scales [rows, groups] where QGROUP
    HAS_WEIGHT: tl.constexpr, HAS_THEN_MUL: tl.constexpr, HAS_THEN_SCALAR: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr, WEIGHT_OFFSET: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QGROUP: tl.constexpr,
    CHUNK: tl.constexpr, EMULATE: tl.constexpr,
):
    # program (row, c) computes the row's statistics and writes its chunk c of CHUNK values (QGROUP: with their
    # codes); without codes one program writes the whole row (CHUNK = BLOCK)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # normalise residual + x, rounded to the dtype as eager torch's add rounds it, and keep it
        x = (tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32) + x).to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        x = x.to(tl.float32)
    r = _rstd(x, dim, eps)  # the seams' arithmetic (norm_add): in bf16 / fp16 the same bits in a seam or alone
    if QGROUP == 0:
        y = _scaled(x * r, weight_ptr, then_mul_ptr, then_scalar, cols, mask, dtype, HAS_WEIGHT, WEIGHT_OFFSET,
                    HAS_THEN_MUL, HAS_THEN_SCALAR)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    else:  # this program's groups of the row, as a [groups, QGROUP] tile
        g = tl.program_id(1) * (CHUNK // QGROUP) + tl.arange(0, CHUNK // QGROUP)
        ks = g[:, None] * QGROUP + tl.arange(0, QGROUP)[None, :]
        ok = ks < dim
        xc = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
        y = _scaled(xc * r, weight_ptr, then_mul_ptr, then_scalar, ks, ok, dtype, HAS_WEIGHT, WEIGHT_OFFSET,
                    HAS_THEN_MUL, HAS_THEN_SCALAR)
        tl.store(out_ptr + row * stride_out + ks, y, mask=ok)
        store_row_codes(y, row, ks, g, q_ptr, qs_ptr, dim, groups, EMULATE)


@triton.jit
def _scaled(y, weight_ptr, then_mul_ptr, then_scalar, cols, mask, dtype, HAS_WEIGHT: tl.constexpr,
            WEIGHT_OFFSET: tl.constexpr, HAS_THEN_MUL: tl.constexpr, HAS_THEN_SCALAR: tl.constexpr):
    """Normalised values times the norm's weight, then ``then_mul`` and ``then_scalar``, rounded to ``dtype``."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHT_OFFSET != 0.0:
            w = WEIGHT_OFFSET + w
        y = y * w
    if HAS_THEN_MUL:  # each product rounded to the dtype, as eager torch rounds it
        y = y.to(dtype).to(tl.float32) * tl.load(then_mul_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_THEN_SCALAR:
        y = y.to(dtype).to(tl.float32) * then_scalar
    return y.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, then_mul: torch.Tensor | None = None,
             then_scalar: float | None = None, weight_offset: float = 0.0,
             quantize_group: int | None = None) -> torch.Tensor:
    """x [..., dim] -> same shape and dtype; ``weight`` [dim] or None (no scale). ``then_mul`` [dim] and
    ``then_scalar``: the normalised rows times a vector, then times a number, each product rounded to x's
    dtype (``norm(x) * then_mul * then_scalar`` in eager torch, e.g. a router's input scaling).
    ``weight_offset``: the rows are scaled by ``weight_offset + weight`` in fp32 (1 for zero-centred weights).
    ``quantize_group``: the kernel also quantizes the output rows for W8A8 products, ``quantize_group`` values (a
    power of two) per scale, and attaches the codes to it (module docstring); the torch path attaches none."""
    check(weight_offset == 0.0 or weight is not None,
          f"weight_offset={weight_offset} scales by offset + weight: pass the weight, or weight_offset=0 for none")
    check_quantize_group(quantize_group, x.shape[-1])
    for name, vector in (("weight", weight), ("then_mul", then_mul)):
        check(vector is None or vector.shape == (x.shape[-1],),
              f"{name} must be [dim={x.shape[-1]}], got {None if vector is None else tuple(vector.shape)}")
    check(then_mul is None or then_mul.dtype == x.dtype,
          f"then_mul must be in x's dtype {x.dtype} (the product is rounded to it), got "
          f"{None if then_mul is None else then_mul.dtype}")
    if not use_triton(x) or x.numel() == 0 or x.shape[-1] > 65536:
        return rms_norm_reference(x, weight, eps, then_mul=then_mul, then_scalar=then_scalar,
                                  weight_offset=weight_offset)
    return _launch(x, weight, eps, then_mul=then_mul, then_scalar=then_scalar, weight_offset=weight_offset,
                   quantize_group=quantize_group)[0]


CODES_CHUNK = 256  # values a program writes where a norm quantizes its rows (several programs a row)


def _tiles(dim: int, group: int | None) -> tuple[int, int]:
    """(QGROUP, CHUNK) of a norm kernel's launch: without codes (0, the row); with codes the group and the values a
    program writes, whole groups."""
    return (0, next_power_of_2(dim)) if group is None else (group, max(group, CODES_CHUNK))



def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                 weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` (rounded to x's dtype) and ``rms_norm(s, weight, eps, weight_offset=...)`` in one launch:
    a pre-norm block's residual add and the norm of the sublayer after it -> ``(s, norm(s))``, both like x."""
    check(residual.shape == x.shape and residual.dtype == x.dtype,
          f"residual must be x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(residual.shape)} "
          f"{residual.dtype}")
    check(weight is None or weight.shape == (x.shape[-1],),
          f"weight must be [dim={x.shape[-1]}], got {None if weight is None else tuple(weight.shape)}")
    check(weight_offset == 0.0 or weight is not None,
          f"weight_offset={weight_offset} scales by offset + weight: pass the weight, or weight_offset=0 for none")
    if not use_triton(x) or x.numel() == 0 or x.shape[-1] > 65536:
        total = residual + x
        return total, rms_norm_reference(total, weight, eps, weight_offset=weight_offset)
    out, total = _launch(x, weight, eps, residual=residual, weight_offset=weight_offset)
    return total, out


def _launch(x, weight, eps, *, then_mul=None, then_scalar=None, residual=None, weight_offset=0.0,
            quantize_group=None):
    """-> (the norm, the sum residual + x or None) in x's shape."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = total = rows
    if residual is not None:
        res = residual.reshape(-1, dim)
        res = res if res.stride(-1) == 1 else res.contiguous()
        total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(dim)
    check(quantize_group is None or residual is None, "quantize_group takes a norm without a residual add")
    codes = row_code_args(out, quantize_group)
    group, chunk = _tiles(dim, quantize_group)
    _rms_norm_kernel[(rows.shape[0], triton.cdiv(dim, chunk))](
        rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), dim, eps,
        then_mul if then_mul is not None else rows, float(then_scalar or 0.0), res, total, res.stride(0),
        total.stride(0), *codes, HAS_WEIGHT=weight is not None, HAS_THEN_MUL=then_mul is not None,
        HAS_THEN_SCALAR=then_scalar is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
        WEIGHT_OFFSET=float(weight_offset), HAS_RESIDUAL=residual is not None, QGROUP=group, CHUNK=chunk,
        EMULATE=codes_emulated(x.device), **pdl_args(out),
    )
    return (attach_row_codes(out.view(x.shape), quantize_group, *codes[:2]),
            None if residual is None else total.view(x.shape))


CPU_COMPOSITE = True  # the CPU reference through F.rms_norm (False: the seven calls, for A/B)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                       then_mul: torch.Tensor | None = None, then_scalar: float | None = None,
                       weight_offset: float = 0.0) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (transformers' Gemma4RMSNorm arithmetic).

    On the CPU, ``F.rms_norm`` of the fp32 rows: torch composes it of the same kernels in the same order (``pow``,
    ``mean``, ``add``, ``rsqrt``, which is what ``pow(., -0.5)`` runs, then the two products), so the same bits
    (``tests/kernels/test_rms_norm.py`` holds it to the module's), in one call instead of seven; fp32 rows and
    scale take no casts around it. Not where autograd tracks ``x``: rsqrt's backward is not pow's, and a module's
    gradients keep their bits."""
    scale = weight
    if weight is not None and (weight_offset or weight.dtype != torch.float32):
        scale = weight_offset + weight.float() if weight_offset else weight.float()
    if x.device.type == "cpu" and CPU_COMPOSITE and not needs_grad(x):
        y = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), scale, eps)
    else:  # CUDA's F.rms_norm is one fused kernel of its own rounding
        h = x.float()
        y = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        if scale is not None:
            y = y * scale
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if then_mul is not None:
        y = y * then_mul
    if then_scalar is not None:
        y = y * then_scalar
    return y


@triton.jit
def _rstd(x, dim, eps):
    """``rsqrt(mean(x^2) + eps)`` of a row in fp32."""
    return tl.math.rsqrt(tl.sum(x * x, 0) / dim + eps)


@triton.jit
def _apply(x, r, w_ptr, cols, mask, HAS_WEIGHT: tl.constexpr):
    """``x * r [* w]`` in fp32 for values ``x`` of a row at ``cols`` (the caller rounds it)."""
    y = x * r
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _norm(x, dim, eps, w_ptr, cols, mask, HAS_WEIGHT: tl.constexpr):
    """One row in fp32: ``x * rsqrt(mean(x^2) + eps) [* w]`` (the caller rounds it)."""
    return _apply(x, _rstd(x, dim, eps), w_ptr, cols, mask, HAS_WEIGHT)


@triton.jit
def _residual_add(y, res_ptr, offsets, mask, scale_ptr, HAS_SCALE: tl.constexpr):
    """``(residual + y) [* scale]`` for a row ``y`` already rounded to the dtype, each step rounded as torch does."""
    dtype = y.dtype
    s = (tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dtype)
    if HAS_SCALE:
        s = (s.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(dtype)
    return s


@triton.jit
def _norm_add_kernel(
    x_ptr, res_ptr, w_ptr, sum_ptr, scale_ptr, w2_ptr, out2_ptr,  # rows [rows, dim]; w, w2 [dim]; scale [1]
    stride_x, stride_res, stride_sum, stride_out2, dim, eps, eps2, w3_ptr, out3_ptr, stride_out3, eps3,
    q2_ptr, qs2_ptr, groups2, q3_ptr, qs3_ptr, groups3,  # the next norms' codes and scales (CODES2, CODES3)
    mul4_ptr, out4_ptr, stride_out4, eps4, scalar4,  # a third next norm, unscaled, then times mul4, then scalar4
    HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, NEXT_HAS_WEIGHT: tl.constexpr, HAS_NEXT2: tl.constexpr,
    NEXT2_HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, QGROUP: tl.constexpr, CHUNK: tl.constexpr,
    CODES2: tl.constexpr, CODES3: tl.constexpr, EMULATE: tl.constexpr, HAS_NEXT3: tl.constexpr, PDL: tl.constexpr,
):
    # program (row, c) computes the row's statistics and writes chunk c of its outputs as a [groups, QGROUP] tile,
    # with the codes of the next norms' outputs (CODES2, CODES3); without codes one program writes the whole row
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = _rstd(x, dim, eps)
    s = _residual_add(_apply(x, r, w_ptr, cols, mask, True).to(dtype), res_ptr, row * stride_res + cols, mask,
                      scale_ptr, HAS_SCALE)
    r2 = r
    r3 = r
    if HAS_NEXT:
        r2 = _rstd(s.to(tl.float32), dim, eps2)
    if HAS_NEXT2:
        r3 = _rstd(s.to(tl.float32), dim, eps3)
    r4 = r
    if HAS_NEXT3:
        r4 = _rstd(s.to(tl.float32), dim, eps4)
    if QGROUP == 0:
        _seam_outputs(s, r2, r3, row, cols, mask, cols, sum_ptr, stride_sum, w2_ptr, out2_ptr, stride_out2, w3_ptr,
                      out3_ptr, stride_out3, q2_ptr, qs2_ptr, groups2, q3_ptr, qs3_ptr, groups3, dim, HAS_NEXT,
                      NEXT_HAS_WEIGHT, HAS_NEXT2, NEXT2_HAS_WEIGHT, False, False, EMULATE)
        if HAS_NEXT3:
            _third_output(s, r4, row, cols, mask, mul4_ptr, out4_ptr, stride_out4, scalar4)
    else:  # this program's groups of the row: the sum recomputed there from its x and residual values
        g = tl.program_id(1) * (CHUNK // QGROUP) + tl.arange(0, CHUNK // QGROUP)
        ks = g[:, None] * QGROUP + tl.arange(0, QGROUP)[None, :]
        ok = ks < dim
        xc = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
        sc = _residual_add(_apply(xc, r, w_ptr, ks, ok, True).to(dtype), res_ptr, row * stride_res + ks, ok,
                           scale_ptr, HAS_SCALE)
        _seam_outputs(sc, r2, r3, row, ks, ok, g, sum_ptr, stride_sum, w2_ptr, out2_ptr, stride_out2, w3_ptr,
                      out3_ptr, stride_out3, q2_ptr, qs2_ptr, groups2, q3_ptr, qs3_ptr, groups3, dim, HAS_NEXT,
                      NEXT_HAS_WEIGHT, HAS_NEXT2, NEXT2_HAS_WEIGHT, CODES2, CODES3, EMULATE)
        if HAS_NEXT3:
            _third_output(sc, r4, row, ks, ok, mul4_ptr, out4_ptr, stride_out4, scalar4)


@triton.jit
def _third_output(s, r4, row, ks, ok, mul4_ptr, out4_ptr, stride_out4, scalar4):
    """A seam's third next norm at ``ks``: ``s * r4`` rounded, times ``mul4`` rounded, times ``scalar4`` (an unscaled
    norm and the products after it, as :func:`rms_norm`'s ``then_mul`` and ``then_scalar`` round them)."""
    z = _scaled(s.to(tl.float32) * r4, mul4_ptr, mul4_ptr, scalar4, ks, ok, s.dtype, False, 0.0, True, True)
    tl.store(out4_ptr + row * stride_out4 + ks, z, mask=ok)


@triton.jit
def _seam_outputs(s, r2, r3, row, ks, ok, g, sum_ptr, stride_sum, w2_ptr, out2_ptr, stride_out2, w3_ptr, out3_ptr,
                  stride_out3, q2_ptr, qs2_ptr, groups2, q3_ptr, qs3_ptr, groups3, dim, HAS_NEXT: tl.constexpr,
                  NEXT_HAS_WEIGHT: tl.constexpr, HAS_NEXT2: tl.constexpr, NEXT2_HAS_WEIGHT: tl.constexpr,
                  CODES2: tl.constexpr, CODES3: tl.constexpr, EMULATE: tl.constexpr):
    """A seam's outputs at ``ks`` (a row, or a [groups, group] tile of it): the sum ``s``, the next norms
    (``s * r2 [* w2]``, ``s * r3 [* w3]``) and, where CODES2 / CODES3, their codes."""
    tl.store(sum_ptr + row * stride_sum + ks, s, mask=ok)
    if HAS_NEXT:
        z = _apply(s.to(tl.float32), r2, w2_ptr, ks, ok, NEXT_HAS_WEIGHT).to(s.dtype)
        tl.store(out2_ptr + row * stride_out2 + ks, z, mask=ok)
        if CODES2:
            store_row_codes(z, row, ks, g, q2_ptr, qs2_ptr, dim, groups2, EMULATE)
    if HAS_NEXT2:
        z = _apply(s.to(tl.float32), r3, w3_ptr, ks, ok, NEXT2_HAS_WEIGHT).to(s.dtype)
        tl.store(out3_ptr + row * stride_out3 + ks, z, mask=ok)
        if CODES3:
            store_row_codes(z, row, ks, g, q3_ptr, qs3_ptr, dim, groups3, EMULATE)


def norm_add(
    x: torch.Tensor,  # [..., dim]: a sublayer's output
    residual: torch.Tensor,  # like x
    weight: torch.Tensor,  # [dim]: the sublayer's post-norm
    eps: float,
    *,
    scale: torch.Tensor | None = None,  # [1]: multiplies the sum (Gemma 4's layer_scalar)
    next_weight: torch.Tensor | None = None,  # [dim] of the norm that reads the sum next (None: no scale)
    next_eps: float | None = None,  # None: no next norm
    next2_weight: torch.Tensor | None = None,  # [dim] of a second norm that reads the sum (None: no scale)
    next2_eps: float | None = None,  # None: no second norm
    next_quantize_group: int | None = None,  # the next norm's output quantized too (rms_norm's quantize_group)
    next2_quantize_group: int | None = None,  # the second's
    next3_eps: float | None = None,  # a third norm of the sum, unscaled (None: none)
    next3_mul: torch.Tensor | None = None,  # [dim] in x's dtype: multiplies the third (rms_norm's then_mul)
    next3_scalar: float | None = None,  # then multiplies it (rms_norm's then_scalar)
) -> tuple[torch.Tensor, ...]:
    """``s = (residual + rms_norm(x, weight)) [* scale]`` and, with ``next_eps``, ``rms_norm(s, next_weight)``:
    the sandwich-norm seams of a Gemma 4 block (post-norm, residual add, layer scalar, the next pre-norm),
    each result rounded to x's dtype as eager torch rounds it, in one launch instead of up to ~20.
    -> ``(s, next)`` (``next`` None without ``next_eps``); with ``next2_eps`` also a second norm of the sum
    (two branches that read it, e.g. a dense MLP's and the experts' pre-norms): ``(s, next, next2)``.
    ``next_quantize_group`` / ``next2_quantize_group``: those outputs quantized too (:func:`rms_norm`'s
    ``quantize_group``); both in one tile shape, so a second group unlike the first is left to its products.
    ``next3_eps`` (with ``next3_mul`` and ``next3_scalar``): a third output after those, ``rms_norm(s, None,
    next3_eps, then_mul=next3_mul, then_scalar=next3_scalar)`` (e.g. an MoE router's input scaling)."""
    dim = x.shape[-1]
    check(residual.shape == x.shape and weight.shape == (dim,),
          f"residual must be x's shape {tuple(x.shape)} and weight [{dim}], got {tuple(residual.shape)}, "
          f"{tuple(weight.shape)}")
    check(next2_eps is None or next_eps is not None, "next2_eps needs next_eps (the first next norm)")
    check((next_quantize_group is None or next_eps is not None) and (next2_quantize_group is None
                                                                     or next2_eps is not None),
          "next_quantize_group / next2_quantize_group quantize a next norm's output: pass its eps too")
    check_quantize_group(next_quantize_group, dim)
    check_quantize_group(next2_quantize_group, dim)
    check(next3_eps is not None or (next3_mul is None and next3_scalar is None),
          "next3_mul and next3_scalar scale a third next norm: pass its next3_eps too")
    check(next3_eps is None or (next2_eps is not None and next3_mul is not None and next3_mul.shape == (dim,)
                                and next3_mul.dtype == x.dtype and next3_scalar is not None),
          f"a third next norm (next3_eps) comes after the second (next2_eps), with next3_mul [{dim}] in x's dtype "
          f"{x.dtype} and next3_scalar; got next2_eps={next2_eps}, next3_mul "
          f"{None if next3_mul is None else (tuple(next3_mul.shape), next3_mul.dtype)}, next3_scalar={next3_scalar}")
    third = dict(next3_eps=next3_eps, next3_mul=next3_mul, next3_scalar=next3_scalar) if next3_eps is not None else {}
    if not use_triton(x) or x.numel() == 0 or dim > 65536:
        return norm_add_reference(x, residual, weight, eps, scale=scale, next_weight=next_weight, next_eps=next_eps,
                                  next2_weight=next2_weight, next2_eps=next2_eps, **third)
    rows, res = x.reshape(-1, dim), residual.reshape(-1, dim)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    res = res if res.stride(-1) == 1 else res.contiguous()
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    nxt = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if next_eps is not None else None
    nxt2 = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if next2_eps is not None else None
    nxt3 = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if next3_eps is not None else None
    block = next_power_of_2(dim)
    if next_quantize_group is not None and next2_quantize_group not in (None, next_quantize_group):
        next2_quantize_group = None  # one tile shape for both: the second's products quantize their rows themselves
    codes2, codes3 = row_code_args(rows, next_quantize_group), row_code_args(rows, next2_quantize_group)
    group, chunk = _tiles(dim, next_quantize_group or next2_quantize_group)
    _norm_add_kernel[(rows.shape[0], triton.cdiv(dim, chunk))](
        rows, res, weight, total, scale if scale is not None else weight,
        next_weight if next_weight is not None else weight, nxt if nxt is not None else total,
        rows.stride(0), res.stride(0), total.stride(0), (nxt if nxt is not None else total).stride(0), dim,
        float(eps), float(next_eps or 0.0), next2_weight if next2_weight is not None else weight,
        nxt2 if nxt2 is not None else total, (nxt2 if nxt2 is not None else total).stride(0), float(next2_eps or 0.0),
        *codes2, *codes3,
        next3_mul if nxt3 is not None else weight, nxt3 if nxt3 is not None else total,
        (nxt3 if nxt3 is not None else total).stride(0), float(next3_eps or 0.0), float(next3_scalar or 0.0),
        HAS_SCALE=scale is not None, HAS_NEXT=next_eps is not None, NEXT_HAS_WEIGHT=next_weight is not None,
        HAS_NEXT2=next2_eps is not None, NEXT2_HAS_WEIGHT=next2_weight is not None,
        BLOCK=block, QGROUP=group, CHUNK=chunk, CODES2=next_quantize_group is not None,
        CODES3=next2_quantize_group is not None, EMULATE=codes_emulated(x.device), HAS_NEXT3=nxt3 is not None,
        num_warps=max(1, min(16, block // 256)), **pdl_args(total),
    )
    out = total.view(x.shape), None if nxt is None else attach_row_codes(nxt.view(x.shape), next_quantize_group,
                                                                         *codes2[:2])
    if nxt2 is not None:
        out = (*out, attach_row_codes(nxt2.view(x.shape), next2_quantize_group, *codes3[:2]))
    return out if nxt3 is None else (*out, nxt3.view(x.shape))


def norm_add_reference(x, residual, weight, eps, *, scale=None, next_weight=None, next_eps=None, next2_weight=None,
                       next2_eps=None, next3_eps=None, next3_mul=None, next3_scalar=None):
    """Torch version: the CPU path and the test oracle (the eager ops of transformers' Gemma 4 block)."""
    total = residual + rms_norm_reference(x, weight, eps)
    if scale is not None:
        total = (total * scale).to(total.dtype)  # transformers: `hidden_states *= layer_scalar`, in place
    out = total, None if next_eps is None else rms_norm_reference(total, next_weight, next_eps)
    if next2_eps is not None:
        out = (*out, rms_norm_reference(total, next2_weight, next2_eps))
    if next3_eps is not None:
        out = (*out, rms_norm_reference(total, None, next3_eps, then_mul=next3_mul, then_scalar=next3_scalar))
    return out


@triton.jit
def _dual_norm_add_kernel(
    a_ptr, b_ptr, res_ptr, wa_ptr, wb_ptr, w_ptr, scale_ptr, out_ptr,  # rows [rows, dim]; weights [dim]; scale [1]
    stride_a, stride_b, stride_res, stride_out, dim, eps_a, eps_b, eps, w2_ptr, out2_ptr, stride_out2, eps2,
    HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr, NEXT_HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    a = _norm(tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32), dim, eps_a, wa_ptr, cols,
              mask, True).to(dtype)
    b = _norm(tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32), dim, eps_b, wb_ptr, cols,
              mask, True).to(dtype)
    m = (a.to(tl.float32) + b.to(tl.float32)).to(dtype).to(tl.float32)
    z = _norm(m, dim, eps, w_ptr, cols, mask, True).to(dtype)
    s = _residual_add(z, res_ptr, row * stride_res + cols, mask, scale_ptr, HAS_SCALE)
    tl.store(out_ptr + row * stride_out + cols, s, mask=mask)
    if HAS_NEXT:  # the norm that reads the sum next (norm_add's)
        nxt = _norm(s.to(tl.float32), dim, eps2, w2_ptr, cols, mask, NEXT_HAS_WEIGHT).to(dtype)
        tl.store(out2_ptr + row * stride_out2 + cols, nxt, mask=mask)


def dual_norm_add(
    a: torch.Tensor, weight_a: torch.Tensor, eps_a: float,  # [..., dim], [dim]: one branch's output and post-norm
    b: torch.Tensor, weight_b: torch.Tensor, eps_b: float,  # the other branch's
    residual: torch.Tensor, weight: torch.Tensor, eps: float,  # the block's residual and its post-norm
    *, scale: torch.Tensor | None = None,  # [1]: multiplies the sum
    next_weight: torch.Tensor | None = None,  # [dim] of the norm that reads the sum next (None: no scale)
    next_eps: float | None = None,  # None: no next norm
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``s = (residual + rms_norm(rms_norm(a, weight_a) + rms_norm(b, weight_b), weight)) [* scale]``: two parallel
    branches (a dense MLP and the experts) post-normed, summed, post-normed again and added to the residual,
    each result rounded to a's dtype as eager torch rounds it, in one launch instead of three; with ``next_eps`` also
    ``rms_norm(s, next_weight)`` (:func:`norm_add`'s next norm). -> ``(s, next)`` (``next`` None without
    ``next_eps``)."""
    dim = a.shape[-1]
    check(b.shape == a.shape and residual.shape == a.shape,
          f"b and residual must be a's shape {tuple(a.shape)}, got {tuple(b.shape)} and {tuple(residual.shape)}")
    check(all(w.shape == (dim,) for w in (weight_a, weight_b, weight)),
          f"the weights must be [dim={dim}], got {[tuple(w.shape) for w in (weight_a, weight_b, weight)]}")
    check(next_weight is None or (next_eps is not None and next_weight.shape == (dim,)),
          f"next_weight must be [dim={dim}] and come with next_eps, got "
          f"{None if next_weight is None else tuple(next_weight.shape)} and next_eps {next_eps!r}")
    if not use_triton(a) or a.numel() == 0 or dim > 65536:
        return dual_norm_add_reference(a, weight_a, eps_a, b, weight_b, eps_b, residual, weight, eps, scale=scale,
                                       next_weight=next_weight, next_eps=next_eps)
    rows = [t.reshape(-1, dim) for t in (a, b, residual)]
    rows = [t if t.stride(-1) == 1 else t.contiguous() for t in rows]
    out = torch.empty(rows[0].shape, dtype=a.dtype, device=a.device)
    nxt = torch.empty_like(out) if next_eps is not None else out
    block = next_power_of_2(dim)
    _dual_norm_add_kernel[(out.shape[0],)](
        *rows, weight_a, weight_b, weight, scale if scale is not None else weight, out,
        *(t.stride(0) for t in rows), out.stride(0), dim, float(eps_a), float(eps_b), float(eps),
        next_weight if next_weight is not None else weight, nxt, nxt.stride(0), float(next_eps or 0.0),
        HAS_SCALE=scale is not None, HAS_NEXT=next_eps is not None, NEXT_HAS_WEIGHT=next_weight is not None,
        BLOCK=block, num_warps=max(1, min(16, block // 256)), **pdl_args(out),
    )
    return out.view(a.shape), None if next_eps is None else nxt.view(a.shape)


def dual_norm_add_reference(a, weight_a, eps_a, b, weight_b, eps_b, residual, weight, eps, *, scale=None,
                            next_weight=None, next_eps=None):
    """Torch version: the CPU path and the test oracle (transformers' eager ops)."""
    mixed = rms_norm_reference(a, weight_a, eps_a) + rms_norm_reference(b, weight_b, eps_b)
    return norm_add_reference(mixed, residual, weight, eps, scale=scale, next_weight=next_weight, next_eps=next_eps)
