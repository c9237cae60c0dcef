"""rms_norm: the torch reference is transformers' Gemma4RMSNorm bit for bit; Triton matches it; enable swaps
the forward of a model's Gemma 4 norms and disable restores it."""

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

import hf_specdec
from hf_specdec.generation.fusion import fuse_modules, unfuse_modules
from hf_specdec.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.tiny_models import gemma4_e2b_style


@pytest.mark.parametrize("with_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_norm_exactly(with_scale, dtype):
    torch.manual_seed(0)
    norm = Gemma4RMSNorm(48, eps=1e-6, with_scale=with_scale)
    if with_scale:
        torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 48).to(dtype)
    expected = norm(x)
    assert torch.equal(rms_norm_reference(x, norm.weight if with_scale else None, 1e-6), expected)


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


def test_enable_fuses_gemma_norms_and_disable_restores_them():
    model = gemma4_e2b_style()
    norms = [m for m in model.modules() if isinstance(m, Gemma4RMSNorm)]
    assert norms
    hf_specdec.enable(model)
    assert all("forward" in vars(m) for m in norms)
    x = torch.randn(2, 3, norms[0].weight.shape[0]) if norms[0].with_scale else None
    if x is not None:
        assert torch.equal(norms[0](x), Gemma4RMSNorm.forward(norms[0], x))
    hf_specdec.disable(model)
    assert not any("forward" in vars(m) for m in norms)
    assert fuse_modules(model) == len(norms)
    unfuse_modules(model)
    assert not any("forward" in vars(m) for m in norms)
