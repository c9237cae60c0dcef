"""rms_norm: the torch reference is transformers' Gemma4RMSNorm bit for bit; Triton matches it; enable swaps
the forward of a model's Gemma 4 norms and disable restores it."""

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

import hf_specdec
from hf_specdec.generation.fusion import FORCE_TRITON_ENV, fuse_modules, unfuse_modules
from hf_specdec.kernels import rms_norm as rms_norm_module
from hf_specdec.kernels.rms_norm import (
    add_rms_norm,
    dual_norm_add,
    dual_norm_add_reference,
    norm_add,
    norm_add_reference,
    rms_norm,
    rms_norm_reference,
)
from tests.tiny_models import gemma4_e2b_style


@pytest.mark.parametrize("composite", [True, False])  # the CPU's F.rms_norm, and the seven calls it replaces
@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_norm_exactly(with_scale, dtype, composite, monkeypatch):
    """Gemma 4's norm, the zero-centred one of Gemma and Step 3.5 (``weight_offset=1``) and Qwen3's (the rows rounded,
    then times the weight: ``then_mul``), bit for bit, at widths of heads and of hidden states, rows of small and
    large magnitude."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    monkeypatch.setattr(rms_norm_module, "CPU_COMPOSITE", composite)
    gen = torch.Generator().manual_seed(0)
    for dim in (48, 256, 2816):
        norm, centred, qwen = Gemma4RMSNorm(dim, eps=1e-6, with_scale=with_scale), GemmaRMSNorm(dim), Qwen3RMSNorm(dim)
        for module in (norm, centred, qwen):
            if getattr(module, "weight", None) is not None:
                module.weight.data = torch.randn(dim, generator=gen)
        qwen = qwen.to(dtype)  # its weight multiplies the rounded rows in their dtype
        x = (torch.randn(3, 5, dim, generator=gen) * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
        assert torch.equal(rms_norm_reference(x, norm.weight if with_scale else None, 1e-6), norm(x))
        assert torch.equal(rms_norm_reference(x, centred.weight, centred.eps, weight_offset=1.0), centred(x))
        assert torch.equal(rms_norm_reference(x, None, qwen.variance_epsilon, then_mul=qwen.weight), qwen(x))


def test_the_reference_under_autograd_keeps_the_modules_gradients():
    """Where autograd tracks the rows, the reference runs the module's ops (F.rms_norm's rsqrt differentiates
    otherwise than pow): the gradients keep the module's bits."""
    norm = Gemma4RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    norm(x).square().sum().backward()
    rms_norm_reference(y, norm.weight, 1e-6).square().sum().backward()
    assert torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("dim,with_scale,dtype", [(48, True, torch.float32), (256, False, torch.float32),
                                                   (100, True, torch.bfloat16)])
def test_triton_rms_norm(triton_device, dim, with_scale, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, dim, generator=gen).to(dtype).to(triton_device)
    weight = torch.randn(dim, generator=gen).to(triton_device) if with_scale else None
    out = rms_norm(x[:, :], weight, 1e-6)
    expected = rms_norm_reference(x, weight, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_zero_centred_norm_is_step3p5s(triton_device, dtype):
    """``weight_offset=1``: rows scaled by ``1 + weight`` (Step 3.5's GemmaRMSNorm, zero-centred weights), as its
    fused forward runs it; the reference with the offset is the norm of the shifted weight."""
    from hf_specdec.models.step3p5.fusion import _step3p5_rms_norm_forward
    from hf_specdec.models.step3p5.layers import Step3p5RMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = Step3p5RMSNorm(72).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(72, generator=gen) * 0.3)
    norm = norm.to(triton_device)
    x = torch.randn(2, 3, 4, 72, generator=gen).to(dtype).to(triton_device)  # per-head rows, as q_norm's
    fused = _step3p5_rms_norm_forward(norm, x)
    expected = Step3p5RMSNorm.forward(norm, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert fused.dtype == dtype and fused.shape == x.shape
    torch.testing.assert_close(fused.float(), expected.float(), atol=tol, rtol=tol)
    shifted = rms_norm_reference(x.float(), 1 + norm.weight.float(), 1e-5)
    torch.testing.assert_close(rms_norm_reference(x.float(), norm.weight.float(), 1e-5, weight_offset=1.0), shifted,
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match="pass the weight"):
        rms_norm(x, None, 1e-5, weight_offset=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_add_rms_norm(triton_device, dtype, offset, monkeypatch):
    """``(residual + x, norm(residual + x))`` in one launch: the sum rounded as eager torch's add, bit for bit, and
    the norm of that rounded sum; on strided rows too (a column slice)."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2, 2 * 72, generator=gen) * 2).to(dtype)[..., :72]
    residual = torch.randn(3, 2, 72, generator=gen).to(dtype)
    weight = (torch.randn(72, generator=gen) * 0.3).to(dtype)
    total, normed = add_rms_norm(x.to(triton_device), residual.to(triton_device), weight.to(triton_device), 1e-6,
                                 weight_offset=offset)
    assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == (3, 2, 72)
    if triton_device == "cuda" or dtype == torch.float32:
        assert torch.equal(total.cpu(), residual + x)
    else:  # Triton's CPU interpreter truncates fp32 -> bf16 casts where GPUs round them
        torch.testing.assert_close(total.float(), (residual + x).float(), atol=0, rtol=2 ** -7)
    expected = rms_norm_reference(residual + x, weight, 1e-6, weight_offset=offset)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(normed.float().cpu(), expected.float(), atol=tol, rtol=tol)
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")  # the torch path: the same ops, exactly
    ref_total, ref_normed = add_rms_norm(x, residual, weight, 1e-6, weight_offset=offset)
    assert torch.equal(ref_total, residual + x) and torch.equal(ref_normed, expected)


def test_add_rms_norm_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="residual must be x's shape"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 9), None, 1e-6)
    with pytest.raises(ValueError, match="pass the weight"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), None, 1e-6, weight_offset=1.0)


def test_enable_fuses_gemma_norms_where_the_kernels_run_and_disable_restores_them(monkeypatch):
    model = gemma4_e2b_style()
    norms = [m for m in model.modules() if isinstance(m, Gemma4RMSNorm)]
    assert norms
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # the kernels run for every tensor, as for a model on a GPU
    hf_specdec.enable(model)
    assert all("forward" in vars(m) for m in norms)
    hf_specdec.disable(model)
    assert not any("forward" in vars(m) for m in norms)
    monkeypatch.delenv(FORCE_TRITON_ENV)
    hf_specdec.enable(model)  # on the CPU every fused forward would call the module's own: none is installed
    assert not any("forward" in vars(m) for m in norms)
    hf_specdec.disable(model)
    fused_attentions = [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"]  # KV-shared too
    layers_and_mlps = [m for m in model.modules() if type(m).__name__ in ("Gemma4TextDecoderLayer", "Gemma4TextMLP")]
    # attentions, layers and MLPs: tests/kernels/test_norm_rope.py
    assert fuse_modules(model) == len(norms) + len(fused_attentions) + len(layers_and_mlps)
    x = torch.randn(2, 3, norms[0].weight.shape[0]) if norms[0].with_scale else None
    if x is not None:  # off the kernels' device a fused forward is the module's own
        assert torch.equal(norms[0](x), Gemma4RMSNorm.forward(norms[0], x))
    unfuse_modules(model)
    assert not any("forward" in vars(m) for m in norms)


def _block_seam_case(dtype, device="cpu", dim=40):
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(2, 3, dim, generator=gen).to(dtype).to(device) for _ in range(2))
    w, w2 = (torch.randn(dim, generator=gen).to(dtype).to(device) for _ in range(2))
    return x, residual, w, w2, torch.tensor([0.7], dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_add_reference_is_the_gemma4_block_seams_exactly(dtype):
    x, residual, w, w2, scale = _block_seam_case(dtype)
    post, pre = Gemma4RMSNorm(x.shape[-1], eps=1e-6), Gemma4RMSNorm(x.shape[-1], eps=1e-5)
    post.weight.data, pre.weight.data = w.float(), w2.float()
    post, pre = post.to(dtype), pre.to(dtype)
    hidden = residual + post(x)  # Gemma4TextDecoderLayer: post-attention norm, residual, pre-feedforward norm
    total, nxt = norm_add_reference(x, residual, w, 1e-6, next_weight=w2, next_eps=1e-5)
    assert torch.equal(total, hidden) and torch.equal(nxt, pre(hidden))
    hidden = residual + post(x)  # post-feedforward norm, residual, layer scalar (in place)
    hidden *= scale
    total, nxt = norm_add_reference(x, residual, w, 1e-6, scale=scale)
    assert torch.equal(total, hidden) and nxt is None


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 40), (torch.bfloat16, 64)])
def test_triton_norm_add(triton_device, dtype, dim):
    x, residual, w, w2, scale = _block_seam_case(dtype, triton_device, dim)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    for kwargs in (dict(next_weight=w2, next_eps=1e-5), dict(next_weight=None, next_eps=1e-5), dict(scale=scale)):
        got = norm_add(x, residual, w, 1e-6, **kwargs)
        expected = norm_add_reference(x, residual, w, 1e-6, **kwargs)
        for g, e in zip(got, expected):
            if e is None:
                assert g is None
            else:
                torch.testing.assert_close(g.float().cpu(), e.float().cpu(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_references_are_transformers_ops_exactly(dtype):
    """The router's input (norm without scale, times its scale, times hidden**-0.5), the second next norm of
    norm_add (the experts' pre-norm beside the dense MLP's) and dual_norm_add (two post-normed branches summed,
    the block's post-norm, residual, layer scalar): transformers' Gemma 4 MoE block ops, bit for bit."""
    x, residual, w, w2, scale = _block_seam_case(dtype)
    dim = x.shape[-1]
    plain = Gemma4RMSNorm(dim, eps=1e-6, with_scale=False)
    router_scale = torch.randn(dim).to(dtype)
    assert torch.equal(rms_norm_reference(x, None, 1e-6, then_mul=router_scale, then_scalar=dim ** -0.5),
                       plain(x) * router_scale * dim ** -0.5)
    norms = [Gemma4RMSNorm(dim, eps=1e-6) for _ in range(4)]
    for norm, weight in zip(norms, (w, w2, w * 0.5, w2 + 1)):
        norm.weight.data = weight.float()
    norms = [n.to(dtype) for n in norms]
    total, nxt, nxt2 = norm_add_reference(x, residual, w, 1e-6, next_weight=w2, next_eps=1e-6,
                                          next2_weight=norms[2].weight, next2_eps=1e-6)
    hidden = residual + norms[0](x)
    assert torch.equal(total, hidden) and torch.equal(nxt, norms[1](hidden)) and torch.equal(nxt2, norms[2](hidden))
    # the router's input as the seam's third output
    *_, routed_in = norm_add_reference(x, residual, w, 1e-6, next_weight=w2, next_eps=1e-6,
                                       next2_weight=norms[2].weight, next2_eps=1e-6, next3_eps=1e-6,
                                       next3_mul=router_scale, next3_scalar=dim ** -0.5)
    assert torch.equal(routed_in, plain(hidden) * router_scale * dim ** -0.5)
    dense, routed = x, x.flip(0) * 3
    expected = residual + norms[3](norms[0](dense) + norms[1](routed))
    expected *= scale
    got, none = dual_norm_add_reference(dense, w, 1e-6, routed, w2, 1e-6, residual, norms[3].weight, 1e-6, scale=scale)
    assert torch.equal(got, expected) and none is None
    # the next layer's input norm of the sum
    got, nxt = dual_norm_add_reference(dense, w, 1e-6, routed, w2, 1e-6, residual, norms[3].weight, 1e-6, scale=scale,
                                       next_weight=norms[2].weight, next_eps=1e-6)
    assert torch.equal(got, expected) and torch.equal(nxt, norms[2](expected))


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 40), (torch.bfloat16, 64)])
def test_triton_moe_block_norms(triton_device, dtype, dim):
    x, residual, w, w2, scale = _block_seam_case(dtype, triton_device, dim)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    router_scale = (w2 * 0.3).contiguous()
    got = rms_norm(x, None, 1e-6, then_mul=router_scale, then_scalar=dim ** -0.5)
    expected = rms_norm_reference(x, None, 1e-6, then_mul=router_scale, then_scalar=dim ** -0.5)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **tol)
    kwargs = dict(next_weight=w2, next_eps=1e-5, next2_weight=w * 2, next2_eps=1e-6)
    for g, e in zip(norm_add(x, residual, w, 1e-6, **kwargs), norm_add_reference(x, residual, w, 1e-6, **kwargs)):
        torch.testing.assert_close(g.float().cpu(), e.float().cpu(), **tol)
    # the router's input as a third output: the bits of its own norm launch over the sum, the others unchanged
    third = dict(next3_eps=0.5, next3_mul=router_scale, next3_scalar=dim ** -0.5)  # an eps unlike the others'
    got = norm_add(x, residual, w, 1e-6, **kwargs, **third)
    assert len(got) == 4 and all(torch.equal(g, p) for g, p in zip(got, norm_add(x, residual, w, 1e-6, **kwargs)))
    assert torch.equal(got[3], rms_norm(got[0], None, 0.5, then_mul=router_scale, then_scalar=dim ** -0.5))
    expected = norm_add_reference(x, residual, w, 1e-6, **kwargs, **third)[3]
    torch.testing.assert_close(got[3].float().cpu(), expected.float().cpu(), **tol)
    routed = x.flip(0) * 3
    for s, following in ((None, {}), (scale, {}), (scale, dict(next_weight=w * 3, next_eps=1e-5)),
                         (None, dict(next_eps=1e-6))):
        got = dual_norm_add(x, w, 1e-6, routed, w2, 1e-5, residual, w * 0.5, 1e-6, scale=s, **following)
        expected = dual_norm_add_reference(x, w, 1e-6, routed, w2, 1e-5, residual, w * 0.5, 1e-6, scale=s,
                                           **following)
        assert (got[1] is None) == (not following)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g if g is None else g.float().cpu(), e if e is None else e.float().cpu(), **tol)


def _assert_codes_of(out, group):
    """``out`` carries the codes and scales that the W8A8 products' own launch computes from its rows (the same
    values bit for bit), and they are torch's quantization of those rows."""
    from hf_specdec.kernels.fp8_w8a8 import quantize_activations, quantize_rows, row_codes

    rows = out.reshape(-1, out.shape[-1])
    got_group, codes, scales = row_codes(out)
    assert got_group == group
    want_codes, want_scales = quantize_rows(rows, group, emulate=codes.dtype == torch.float32)
    assert torch.equal(codes.float(), want_codes.float()) and torch.equal(scales, want_scales)
    torch_codes, torch_scales = quantize_activations(rows.cpu(), group)
    assert torch.equal(codes.float().cpu(), torch_codes.float()) and torch.equal(scales.cpu(), torch_scales)


@pytest.mark.parametrize("dim,group", [(2816, 128), (2112, 128), (96, 32)])  # 2112: the last group half full
def test_triton_norms_quantize_their_rows_for_w8a8_products(triton_device, dim, group):
    """``quantize_group``: the norm kernels write their output rows' e4m3 codes and scales beside them (per row and
    group of K values), what ``quantize_rows`` gives for the stored rows; the outputs are unchanged."""
    x, residual, w, w2, scale = _block_seam_case(torch.bfloat16, triton_device, dim)
    x = x * torch.linspace(0.1, 20, dim, device=triton_device).to(x.dtype)  # groups of different amax
    x[1, 0, :group] = 0  # an all-zero group in a row of nonzero ones (its scale: 1), in norm_add's sums too
    residual[1, 0, :group] = 0
    plain = rms_norm(x, w, 1e-6)
    got = rms_norm(x, w, 1e-6, quantize_group=group)
    assert torch.equal(got, plain)
    _assert_codes_of(got, group)
    from hf_specdec.kernels.fp8_w8a8 import row_codes

    assert row_codes(plain) is None
    kwargs = dict(next_weight=w2, next_eps=1e-5, next2_weight=w * 2, next2_eps=1e-6)
    plain = norm_add(x, residual, w, 1e-6, **kwargs)
    for which in ("next", "next2", "both"):
        groups = dict(next_quantize_group=group if which != "next2" else None,
                      next2_quantize_group=group if which != "next" else None)
        got = norm_add(x, residual, w, 1e-6, **kwargs, **groups)
        assert all(torch.equal(g, p) for g, p in zip(got, plain))
        assert row_codes(got[0]) is None
        for out, wanted in zip(got[1:], groups.values()):
            if wanted is None:
                assert row_codes(out) is None
            else:
                _assert_codes_of(out, group)
    # the router's input as a third output beside the quantized ones (the tiles of the codes): its own launch's bits
    third = dict(next3_eps=0.5, next3_mul=(w2 * 0.3).contiguous(), next3_scalar=dim ** -0.5)  # its own eps
    for dtype in (torch.bfloat16, torch.float32):  # fp32: where another eps would show in the bits
        cast = dict(third, next3_mul=third["next3_mul"].to(dtype))
        args = [t.to(dtype) for t in (x, residual, w)]
        wanted = norm_add(*args, 1e-6, **kwargs)
        got = norm_add(*args, 1e-6, **kwargs, **cast, next_quantize_group=group, next2_quantize_group=group)
        own, other_eps = (rms_norm(got[0], None, eps, then_mul=cast["next3_mul"], then_scalar=dim ** -0.5)
                          for eps in (0.5, 1e-6))
        if dtype == torch.bfloat16 or x.device.type == "cpu":  # (the interpreter fuses no multiply-adds)
            assert all(torch.equal(g, p) for g, p in zip(got, (*wanted, own), strict=True))
        else:  # fp32 on the GPU keeps what rounding to bf16 hides: the compiler's fused multiply-adds, which differ
            # between the codes' tiles and a whole row, and between kernels (an ulp); the eps shows far beyond it
            for g, p in zip(got, (*wanted, own), strict=True):
                torch.testing.assert_close(g, p, rtol=4e-6, atol=4e-6)  # ~30 ulps
            assert not torch.allclose(got[3], other_eps, rtol=4e-6, atol=4e-6)
    # one tile shape for both outputs: a second group unlike the first is left to its products
    got = norm_add(x, residual, w, 1e-6, **kwargs, next_quantize_group=group, next2_quantize_group=group // 2)
    assert all(torch.equal(g, p) for g, p in zip(got, plain))
    _assert_codes_of(got[1], group)
    assert row_codes(got[2]) is None


def test_norm_codes_are_dropped_once_the_output_is_written():
    from hf_specdec.kernels.fp8_w8a8 import attach_row_codes, row_codes

    x = torch.randn(2, 64)
    attach_row_codes(x, 32, torch.zeros(2, 64), torch.ones(2, 2))
    assert row_codes(x)[0] == 32 and row_codes(x.view(2, 64)) is None  # a view carries none
    x.mul_(2)
    assert row_codes(x) is None


def test_moe_block_norms_bad_arguments_name_the_fix():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"then_mul must be \[dim=8\]"):
        rms_norm(x, None, 1e-6, then_mul=torch.ones(7))
    with pytest.raises(ValueError, match="then_mul must be in x's dtype"):
        rms_norm(x, None, 1e-6, then_mul=torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="next2_eps needs next_eps"):
        norm_add(x, x, torch.ones(8), 1e-6, next2_eps=1e-6)
    with pytest.raises(ValueError, match="a third next norm"):
        norm_add(x, x, torch.ones(8), 1e-6, next_eps=1e-6, next3_eps=1e-6, next3_mul=torch.ones(8), next3_scalar=1.0)
    with pytest.raises(ValueError, match=r"a third next norm .* got next2_eps=1e-06, next3_mul \(\(7,\)"):
        norm_add(x, x, torch.ones(8), 1e-6, next_eps=1e-6, next2_eps=1e-6, next3_eps=1e-6, next3_mul=torch.ones(7),
                 next3_scalar=1.0)
    with pytest.raises(ValueError, match="pass its next3_eps too"):
        norm_add(x, x, torch.ones(8), 1e-6, next_eps=1e-6, next2_eps=1e-6, next3_mul=torch.ones(8))
    with pytest.raises(ValueError, match="quantize_group must be None or a power of two up to 8"):
        rms_norm(x, None, 1e-6, quantize_group=3)
    with pytest.raises(ValueError, match="quantize_group must be None or a power of two"):
        rms_norm(torch.randn(2, 12), None, 1e-6, quantize_group=12)
    with pytest.raises(ValueError, match="pass its eps too"):
        norm_add(x, x, torch.ones(8), 1e-6, next_quantize_group=8)
    with pytest.raises(ValueError, match=r"must be a's shape"):
        dual_norm_add(x, torch.ones(8), 1e-6, x[:1], torch.ones(8), 1e-6, x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"next_weight must be \[dim=8\] and come with next_eps"):
        dual_norm_add(x, torch.ones(8), 1e-6, x, torch.ones(8), 1e-6, x, torch.ones(8), 1e-6, next_weight=torch.ones(8))
