"""w8a8_linear: FP8 weights times activations quantized to FP8 per row and group, in the kernel. The reference is
quantize, dequantize, matmul; the kernel matches it to a rounding of the activation dtype (block, channel and
tensor scales, dynamic and static activations, odd shapes, 1 to 40 rows, both dot orientations), its e4m3 codes
are torch's (an identity weight shows each quantized activation), and a row's result does not depend on the
batch or the weight's split-K parts' neighbours.
"""

import pytest
import torch

from hf_specdec.kernels import fp8_w8a8
from hf_specdec.kernels.fp8_gemm import FP8_DTYPE, MAX_ROWS, dequantize_fp8
from hf_specdec.kernels.fp8_w8a8 import (
    E4M3_MAX,
    quantize_activations,
    w8a8_eligible,
    w8a8_linear,
    w8a8_linear_reference,
    w8a8_matmul,
)

from .conftest import run_file_cases_in_interpreter
from .test_fp8_gemm import TOLERANCE, make_fp8

SMALL = (16, 128, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs, one group per K tile
WIDE = (64, 256, 4, 2)  # two groups per K tile


def _rows(rows, k, dtype, device, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) * scale).to(dtype).to(device)


def _check(device, dtype, rows, weight, scale, block_size, activation_scale=None, config=SMALL, swap=None, seed=0,
           prequantize=None):
    x = _rows(rows, weight.shape[1], dtype, device, seed)
    got = w8a8_matmul(x, weight, scale, block_size, activation_scale, config=config, swap=swap,
                      prequantize=prequantize)
    expected = w8a8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), block_size,
                                     None if activation_scale is None else activation_scale.cpu())
    assert got.shape == (rows, weight.shape[0]) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------- the kernel (TRITON_INTERPRET=1 child on CPU)


@pytest.mark.parametrize("config", [SMALL, WIDE])
@pytest.mark.parametrize("prequantize", [True, False])
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("rows", [1, MAX_ROWS, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_w8a8_block_scales(triton_device, dtype, rows, swap, prequantize, config):
    weight, scale = make_fp8(80, 384, (32, 128), seed=1, device=triton_device)
    _check(triton_device, dtype, rows, weight, scale, (32, 128), swap=swap, prequantize=prequantize, config=config)


@pytest.mark.parametrize("prequantize", [True, False])
@pytest.mark.parametrize("block_size", ["channel", "tensor", (48, 64)])
def test_triton_w8a8_other_scales_and_odd_shapes(triton_device, block_size, prequantize):
    """Per-channel and per-tensor weight scales (activation groups of 128), K blocks of 64 (groups of 64), K and N
    not multiples of the tiles."""
    weight, scale = make_fp8(70, 200, block_size, seed=2, device=triton_device)
    _check(triton_device, torch.bfloat16, 5, weight, scale, None if block_size in ("channel", "tensor")
           else block_size, prequantize=prequantize)


@pytest.mark.parametrize("prequantize", [True, False])
def test_triton_w8a8_static_activation_scale(triton_device, prequantize):
    weight, scale = make_fp8(64, 256, (32, 128), seed=3, device=triton_device)
    _check(triton_device, torch.bfloat16, 3, weight, scale, (32, 128),
           activation_scale=torch.tensor(0.01, device=triton_device), prequantize=prequantize)


@pytest.mark.parametrize("prequantize", [True, False])
def test_triton_w8a8_codes_are_torchs(triton_device, prequantize):
    """An identity weight (e4m3 1.0, scale 1) returns each row's quantized values times their scales: the kernel's
    e4m3 codes equal torch's round-to-nearest-even conversion, values at ties, near the top of a binade (where the
    rounding carries into the exponent), subnormal and saturated included."""
    k = 256
    weight = torch.eye(k).to(FP8_DTYPE).to(triton_device)
    scale = torch.ones(1, device=triton_device)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, k, generator=gen) * 4
    x[1] = torch.linspace(-448, 448, k)  # a group's amax 448: its scale 1, x itself rounded
    x[2, :8] = torch.tensor([1.0625, 1.1875, 1.9688, 7.9, -15.5, 0.0029, -0.0012, 448.0])
    x[3, :128] = 0.0  # an all-zero group
    x = x.to(torch.bfloat16).to(triton_device)
    got = w8a8_matmul(x, weight, scale, None, config=WIDE, prequantize=prequantize)
    codes, s = quantize_activations(x.cpu())
    expected = (codes.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    assert torch.equal(got.cpu(), expected)


def test_triton_w8a8_rows_do_not_depend_on_the_batch(triton_device):
    weight, scale = make_fp8(48, 256, (16, 128), seed=5, device=triton_device)
    x = _rows(2 * MAX_ROWS + 3, 256, torch.bfloat16, triton_device, seed=5)
    x[4] *= 1000  # a row of another magnitude does not move the others' scales
    full = w8a8_matmul(x, weight, scale, (16, 128), config=SMALL)
    for r in (0, 4, 7, MAX_ROWS, 2 * MAX_ROWS + 2):
        assert torch.equal(w8a8_matmul(x[r:r + 1], weight, scale, (16, 128), config=SMALL), full[r:r + 1])


@pytest.mark.parametrize("split_k", [2, 3])
def test_triton_w8a8_split_k(triton_device, split_k):
    weight, scale = make_fp8(32, 640, (32, 128), seed=6, device=triton_device)
    x = _rows(3, 640, torch.bfloat16, triton_device, seed=6)
    got = w8a8_matmul(x, weight, scale, (32, 128), config=SMALL, split_k=split_k)
    torch.testing.assert_close(got.float().cpu(), w8a8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(),
                                                                        (32, 128)).float(),
                               **TOLERANCE[torch.bfloat16])


def test_w8a8_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=15)


# ---------------------------------------------------------------- reference, dispatch, launcher checks (CPU)


def test_quantize_activations_per_row_and_group():
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0, 0.0, 0.0], [448.0 * 3, 1.0, 2.0, 3.0, 5.0, -7.0]])
    codes, s = quantize_activations(x, group=4)
    assert codes.dtype == FP8_DTYPE and codes.shape == x.shape and s.shape == (2, 2)
    torch.testing.assert_close(s, torch.tensor([[4.0 / E4M3_MAX, 1.0], [3.0, 7.0 / E4M3_MAX]]))
    assert codes[0, 3].float() == E4M3_MAX and codes[1, 0].float() == E4M3_MAX  # each group's amax -> 448
    assert codes[0, 4:].float().eq(0).all()  # an all-zero (partial) group takes scale 1
    static, s_static = quantize_activations(x, group=4, activation_scale=torch.tensor(2.0))
    assert s_static.eq(2.0).all() and static[1, 0].float() == E4M3_MAX  # saturated, not inf or NaN


def test_reference_is_quantize_dequantize_matmul():
    weight, scale = make_fp8(24, 256, (8, 128), seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    codes, s = quantize_activations(x, 128)
    dense_x = codes.float() * s.repeat_interleave(128, dim=-1)
    expected = (dense_x @ dequantize_fp8(weight, scale, (8, 128)).T).to(torch.bfloat16)
    assert torch.equal(w8a8_linear_reference(x, weight, scale, (8, 128)), expected)
    # groups follow a narrower K block of the weight's scales
    weight, scale = make_fp8(24, 256, (8, 64), seed=7)
    codes, s = quantize_activations(x, 64)
    expected = ((codes.float() * s.repeat_interleave(64, dim=-1)) @ dequantize_fp8(weight, scale, (8, 64)).T)
    assert torch.equal(w8a8_linear_reference(x, weight, scale, (8, 64)), expected.to(torch.bfloat16))


def test_w8a8_linear_takes_the_reference_on_cpu_and_for_odd_blocks():
    weight, scale = make_fp8(24, 96, (8, 24), seed=8)  # K blocks of 24: groups would straddle them
    x = torch.randn(2, 5, 96).to(torch.bfloat16)
    assert not w8a8_eligible(x, weight, scale, (8, 24))
    got = w8a8_linear(x, weight, scale, (8, 24))
    assert got.shape == (2, 5, 24)
    assert torch.equal(got, w8a8_linear_reference(x, weight, scale, (8, 24)))


def test_w8a8_launcher_names_bad_arguments():
    weight, scale = make_fp8(16, 128, (16, 128), seed=9)
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_matmul(x, weight.float(), scale, (16, 128))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        w8a8_matmul(x.float(), weight, scale, (16, 128))
    with pytest.raises(ValueError, match="activation_scale must be one"):
        w8a8_matmul(x, weight, scale, (16, 128), activation_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"must share K|weight must be \[N, K=64\]"):
        w8a8_matmul(x[:, :64], weight, scale, (16, 128))
    assert fp8_w8a8.GROUP == 128
