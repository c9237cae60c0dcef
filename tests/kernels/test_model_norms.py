"""The RMSNorms of transformers' Llama-family and gpt-oss models in one kernel (``models/rms_norms.py``): the
module's own output where the kernels run, its own forward elsewhere, and an enabled model's norms take it."""

import pytest
import torch

from hf_specdec.models import rms_norms
from hf_specdec.models.rms_norms import GPT_OSS_FORM, LLAMA_FORM, norm_classes

from .conftest import run_file_cases_in_interpreter

CLASSES = norm_classes(LLAMA_FORM) + norm_classes(GPT_OSS_FORM)
FORWARD = {cls: rms_norms.gpt_oss_rms_norm_forward if (cls.__module__.split(".")[-1], cls.__name__) in
           {(f"modeling_{m}", n) for m, n in GPT_OSS_FORM} else rms_norms.llama_rms_norm_forward for cls in CLASSES}


def _norm(cls, hidden, dtype, device):
    norm = cls(hidden, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    return norm


def test_every_listed_class_exists_in_this_version():
    assert len(CLASSES) == len(LLAMA_FORM) + len(GPT_OSS_FORM)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_model_norms_give_the_modules_output(triton_device, cls, dtype):
    norm = _norm(cls, 40, dtype, triton_device)
    x = (torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2)) * 3).to(triton_device, dtype)
    calls = []
    original = rms_norms.rms_norm
    rms_norms.rms_norm = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.no_grad():
            got = FORWARD[cls](norm, x)
    finally:
        rms_norms.rms_norm = original
    expected = type(norm).forward(norm, x)
    assert calls and got.dtype == expected.dtype == dtype
    if dtype == torch.bfloat16 and x.is_cuda:
        assert torch.equal(got, expected)
    elif dtype == torch.bfloat16:  # Triton's CPU interpreter truncates fp32 -> bf16 casts where GPUs round them
        torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 ** -6)
    else:  # fp32: the kernel sums the squares in another order
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("cls", CLASSES[:1] + CLASSES[-1:], ids=lambda c: c.__name__)
def test_model_norms_run_the_modules_own_forward_where_the_kernels_do_not(cls, monkeypatch):
    """The CPU, autograd, and (Llama's form) a weight of another dtype than the rows: the module's own ops."""
    monkeypatch.setattr(rms_norms, "rms_norm", lambda *a, **k: pytest.fail("the kernel ran"))
    norm = _norm(cls, 16, torch.float32, "cpu")
    x = torch.randn(2, 16)
    torch.testing.assert_close(FORWARD[cls](norm, x), type(norm).forward(norm, x), atol=0, rtol=0)
    monkeypatch.setattr(rms_norms, "use_triton", lambda tensor: True)
    x.requires_grad_(True)
    assert FORWARD[cls](norm, x).requires_grad
    if FORWARD[cls] is rms_norms.llama_rms_norm_forward:
        FORWARD[cls](norm, x.detach().bfloat16())  # an fp32 weight: the module promotes its output, so its own ops


def test_an_enabled_model_gives_its_norms_the_fused_forward():
    import hf_specdec
    from tests.tiny_models import gpt_oss, llama

    for build, name in ((llama, "LlamaRMSNorm"), (gpt_oss, "GptOssRMSNorm")):
        model = hf_specdec.enable(build(), cuda_graphs=False)
        norms = [m for m in model.modules() if type(m).__name__ == name]
        hf_specdec.generation.fusion.fuse_modules(model)
        assert norms and all("forward" in vars(n) for n in norms), name
        hf_specdec.disable(model)
        assert not any("forward" in vars(n) for n in norms)


def test_model_norm_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=len(CLASSES) * 2)
