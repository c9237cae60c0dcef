"""gelu_tanh_mul and silu_mul: the references are transformers' Gemma 4 MLP gate (``act_fn(gate) * up``) and Step
3.5's clamped SwiGLU bit for bit; the Triton kernels match them."""

import pytest
import torch
from transformers.activations import ACT2FN

from hf_specdec.kernels.gelu_mul import gelu_tanh_mul, gelu_tanh_mul_reference, silu_mul, silu_mul_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_gate_exactly(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(3, 5, 70, generator=gen).mul(3).to(dtype) for _ in range(2))
    assert torch.equal(gelu_tanh_mul_reference(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gelu_tanh_mul(triton_device, dtype):
    gen = torch.Generator().manual_seed(1)
    # wide range: tanh saturates both ways
    gate = torch.cat([torch.randn(2, 1500, generator=gen) * 4, torch.tensor([[-80.0, -9.0, 0.0, 1e-6, 9.0, 80.0]] * 2)],
                     dim=1)
    up = torch.randn(gate.shape, generator=gen)
    gate, up = gate.to(dtype).to(triton_device), up.to(dtype).to(triton_device)
    got = gelu_tanh_mul(gate, up)
    expected = gelu_tanh_mul_reference(gate, up)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **tol)


def test_mismatched_inputs_name_the_fix():
    with pytest.raises(ValueError, match="gate and up must match"):
        gelu_tanh_mul(torch.zeros(2, 3), torch.zeros(2, 4))


def test_triton_gelu_tanh_mul_on_the_halves_of_one_stacked_projection(triton_device):
    """The inputs may be column slices of one [.., 2 x width] tensor (a stacked gate/up GEMM's output)."""
    gen = torch.Generator().manual_seed(2)
    stacked = (torch.randn(3, 4, 2 * 1100, generator=gen) * 3).to(triton_device)
    gate, up = stacked.split(1100, dim=-1)
    assert not gate.is_contiguous()
    got = gelu_tanh_mul(gate, up)
    assert got.shape == (3, 4, 1100) and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), gelu_tanh_mul_reference(gate.contiguous(), up.contiguous()).cpu(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width,group", [(2112, 128), (96, 32)])  # the 26B-A4B's 16.5 groups; a small row
def test_triton_gelu_tanh_mul_quantizes_its_rows_for_a_w8a8_product(triton_device, width, group):
    """``quantize_group``: the kernel writes its output rows' e4m3 codes and scales beside them, what the W8A8
    product's own launch (``quantize_rows``) gives for the stored rows; the output is unchanged."""
    from .test_rms_norm import _assert_codes_of

    gen = torch.Generator().manual_seed(3)
    stacked = (torch.randn(3, 2 * width, generator=gen) * 3).bfloat16().to(triton_device)
    stacked[1, :group] = 0  # an all-zero group
    gate, up = stacked.split(width, dim=-1)
    got = gelu_tanh_mul(gate, up, quantize_group=group)
    assert torch.equal(got, gelu_tanh_mul(gate, up))
    _assert_codes_of(got, group)
    with pytest.raises(ValueError, match="quantize_group must be None or a power of two up to 1024"):
        gelu_tanh_mul(gate, up, quantize_group=48)


@pytest.mark.parametrize("limit", [None, 0.7])
def test_silu_mul_reference_is_step3p5s_clamped_swiglu_exactly(limit):
    from hf_specdec.models.step3p5.layers import clamped_swiglu

    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(3, 5, 70, generator=gen).mul(3).to(torch.bfloat16) for _ in range(2))
    expected = torch.nn.functional.silu(gate) * up if limit is None else (
        torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(-limit, limit))
    assert torch.equal(silu_mul_reference(gate, up, limit), expected)
    assert torch.equal(clamped_swiglu(gate, up, limit), expected)


@pytest.mark.parametrize("dtype,limit", [(torch.float32, None), (torch.float32, 0.7), (torch.bfloat16, 0.7),
                                         (torch.bfloat16, None)])
def test_triton_silu_mul(triton_device, dtype, limit):
    """The halves of one stacked gate/up output; values on both sides of the clamps, and past exp's range."""
    gen = torch.Generator().manual_seed(4)
    stacked = torch.cat([torch.randn(2, 2 * 1300, generator=gen) * 3,
                         torch.tensor([[-100.0, -5.0, 0.0, 0.7, 0.71, 100.0] * 2] * 2)], dim=1)
    gate, up = stacked.to(dtype).to(triton_device).split(stacked.shape[1] // 2, dim=-1)
    got = silu_mul(gate, up, limit)
    expected = silu_mul_reference(gate.contiguous(), up.contiguous(), limit)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    if limit is not None:
        assert got.float().abs().max() <= limit * limit * 1.01
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **tol)


def test_silu_mul_bad_limit_names_the_fix():
    with pytest.raises(ValueError, match="None for no clamp"):
        silu_mul(torch.zeros(2, 3), torch.zeros(2, 3), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_head_gate_mul(triton_device, dtype):
    """Each head's rows times its sigmoid gate, as Step 3.5's attention computes it; the gate a column slice of a
    stacked projection's output, x with strided rows (a view of a wider tensor)."""
    from hf_specdec.kernels.gelu_mul import head_gate_mul, head_gate_mul_reference

    gen = torch.Generator().manual_seed(9)
    stacked = (torch.randn(2, 3, 40 + 6, generator=gen) * 4).to(dtype)
    gate = stacked[..., 40:]  # [batch, seq, heads=6]
    wide = torch.randn(2, 3, 6, 2 * 20, generator=gen).to(dtype)
    x = wide[..., :20]  # head_dim 20, not a power of two
    got = head_gate_mul(x.to(triton_device), gate.to(triton_device))
    expected = x * torch.sigmoid(gate).unsqueeze(-1).to(dtype)
    assert torch.equal(head_gate_mul_reference(x, gate), expected)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float().cpu(), expected.float(), **tol)
    with pytest.raises(ValueError, match="gate must be x's shape"):
        head_gate_mul(x, gate[..., :5])
