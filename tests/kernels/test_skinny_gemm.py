"""skinny_linear: ``x @ weight.T`` for a few rows; the kernel matches torch, a row's result does not depend
on how many rows come with it, and the dispatch keeps torch wherever the kernel does not apply."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_specdec.kernels import skinny_gemm
from hf_specdec.kernels.skinny_gemm import (MAX_KERNEL_ROWS, MAX_ROWS, linear_forward, skinny_eligible, skinny_linear,
                                           skinny_matmul)

SMALL = (16, 32, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs and K tiles at test sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS, 29])
def test_triton_skinny_matmul(triton_device, dtype, rows):
    _check_skinny_matmul(triton_device, dtype, rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter does not multiply bf16 tiles as GPUs do")
@pytest.mark.parametrize("rows", [1, 8, 24, MAX_KERNEL_ROWS])
def test_skinny_matmul_bf16_on_the_gpu(rows):
    _check_skinny_matmul("cuda", torch.bfloat16, rows)


def _check_skinny_matmul(device, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(dtype).to(device)  # K not a multiple of BLOCK_K
    w = (torch.randn(70, 100, generator=gen) * 0.1).to(dtype).to(device)  # N not a multiple of BLOCK_N
    got = skinny_matmul(x, w, SMALL)
    expected = (x.double() @ w.double().T)
    assert got.shape == (rows, 70) and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double().cpu(), expected.cpu(), **tol)


def test_triton_skinny_rows_do_not_depend_on_the_batch(triton_device):
    """A verify step's rows equal the decode step's row, bit for bit: the kernel pads to 16 rows, or 32 past 16,
    with the same dot either way."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(MAX_KERNEL_ROWS, 96, generator=gen).to(torch.float16).to(triton_device)
    w = (torch.randn(48, 96, generator=gen) * 0.1).to(torch.float16).to(triton_device)
    full = skinny_matmul(x, w, SMALL)
    for r in (0, 7, MAX_ROWS - 1, MAX_ROWS, MAX_KERNEL_ROWS - 1):
        assert torch.equal(skinny_matmul(x[r:r + 1], w, SMALL), full[r:r + 1])
    assert torch.equal(skinny_matmul(x[:3], w, SMALL), full[:3])
    assert torch.equal(skinny_matmul(x[MAX_ROWS - 2:MAX_ROWS + 3], w, SMALL), full[MAX_ROWS - 2:MAX_ROWS + 3])


def test_triton_skinny_linear_on_strided_rows(triton_device, monkeypatch):
    """Rows may be a slice of a wider tensor (the last position of a sequence); the weight a row slice of a
    stacked one."""
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 0)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 64, generator=gen).to(torch.float16).to(triton_device)
    stacked = (torch.randn(80, 64, generator=gen) * 0.1).to(torch.float16).to(triton_device)
    x, w = hidden[:, -1:], stacked[16:56]
    assert skinny_eligible(x, w)
    got = skinny_linear(x, w)
    assert got.shape == (2, 1, 40)
    torch.testing.assert_close(got.float().cpu(), F.linear(x.float(), w.float()).cpu(), atol=2e-2, rtol=2e-2)


def test_dispatch_keeps_torch_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "1")
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 0)
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16), w)
    assert not skinny_eligible(torch.zeros(3, 32), w.float())  # fp32: cuBLAS (full-fp32 tiles are slow here)
    assert skinny_eligible(torch.zeros(MAX_KERNEL_ROWS, 32, dtype=torch.bfloat16), w)  # a verify of 4 x 8 rows
    assert not skinny_eligible(torch.zeros(MAX_KERNEL_ROWS + 1, 32, dtype=torch.bfloat16), w)  # prefill width
    assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.float16), w)  # mixed dtypes
    assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16), w.T.contiguous().T[:, :32])
    assert not skinny_eligible(torch.zeros(0, 32, dtype=torch.bfloat16), w)

    class WrappedWeight(torch.Tensor):  # e.g. a quantised or sharded weight: F.linear dispatches it
        pass

    assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16), w.as_subclass(WrappedWeight))
    with torch.enable_grad():
        assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16, requires_grad=True), w)
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 1 << 30)
    assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16), w)  # small weights keep cuBLAS
    monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "0")
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 0)
    assert not skinny_eligible(torch.zeros(3, 32, dtype=torch.bfloat16), w)


def test_skinny_matmul_names_its_limits():
    with pytest.raises(ValueError, match="rows and a"):
        skinny_matmul(torch.zeros(MAX_KERNEL_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="rows and a"):
        skinny_matmul(torch.zeros(0, 8), torch.zeros(4, 8))


def test_linear_forward_is_nn_linear_on_the_cpu():
    gen = torch.Generator().manual_seed(5)
    for bias in (False, True):
        layer = nn.Linear(12, 7, bias=bias)
        x = torch.randn(2, 3, 12, generator=gen)
        assert torch.equal(linear_forward(layer, x), layer(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the transposed fp32 product is taken on CUDA only")
@pytest.mark.parametrize("rows", [1, 6, 7, 8, 16, 17])
def test_fp32_rows_give_f_linear_through_either_product(rows):
    """fp32 rows of 7-16 take ``weight @ rows.T`` (FP32_TRANSPOSED_ROWS); the result is F.linear's, contiguous."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 256, generator=gen).cuda()
    w = torch.randn(128, 256, generator=gen).cuda()
    assert skinny_gemm._fp32_transposed(x, w) == (7 <= rows <= 16)
    got = skinny_linear(x, w)
    assert got.shape == (1, rows, 128) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_the_transposed_fp32_product_is_for_cuda_fp32_rows_only():
    w = torch.zeros(8, 32)
    assert not skinny_gemm._fp32_transposed(torch.zeros(8, 32), w)  # CPU
    assert not skinny_gemm._fp32_transposed(torch.zeros(8, 32, dtype=torch.bfloat16), w.bfloat16())
