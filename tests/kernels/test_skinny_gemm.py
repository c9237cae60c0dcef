"""skinny_linear: ``x @ weight.T`` for a few rows; the kernel matches torch, a row's result does not depend
on how many rows come with it, and the dispatch keeps torch wherever the kernel does not apply."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_specdec.kernels import skinny_gemm
from hf_specdec.kernels.skinny_gemm import (MAX_KERNEL_ROWS, MAX_ROWS, SPLIT_CONFIG, config_for, launch_plan,
                                           linear_forward, skinny_eligible, skinny_linear, skinny_matmul, split_k_for)

SMALL = (16, 32, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs and K tiles at test sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS, 29])
def test_triton_skinny_matmul(triton_device, dtype, rows):
    _check_skinny_matmul(triton_device, dtype, rows)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Triton's interpreter does not multiply bf16 tiles as GPUs do")
@pytest.mark.parametrize("rows", [1, 8, 24, MAX_KERNEL_ROWS])
def test_skinny_matmul_bf16_on_the_gpu(rows):
    _check_skinny_matmul("cuda", torch.bfloat16, rows)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("rows", [1, 29])
def test_triton_skinny_matmul_split_k(triton_device, rows, split):
    """K in parts (4 tiles of 32 over K=100: 2 parts of 2 tiles, or 4 of 1, the last one short), summed in order."""
    _check_skinny_matmul(triton_device, torch.float32, rows, split)


@pytest.mark.parametrize("split", [1, 3])
def test_triton_skinny_matmul_fp32_out_of_half_operands(triton_device, split):
    """``out_dtype=float32``: the fp32 sums of half-precision products, unrounded (``F.linear`` of the operands cast
    to fp32, as a router computes its logits), with and without split-K."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 100, generator=gen).to(torch.float16).to(triton_device)
    w = (torch.randn(70, 100, generator=gen) * 0.1).to(torch.float16).to(triton_device)
    got = skinny_matmul(x, w, SMALL, split, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (3, 70)
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
    assert not torch.equal(got.half().float(), got)  # not rounded to the operands' dtype


def _check_skinny_matmul(device, dtype, rows, split=None):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 100, generator=gen).to(dtype).to(device)  # K not a multiple of BLOCK_K
    w = (torch.randn(70, 100, generator=gen) * 0.1).to(dtype).to(device)  # N not a multiple of BLOCK_N
    got = skinny_matmul(x, w, SMALL, split)
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


def test_triton_split_rows_do_not_depend_on_the_batch(triton_device, monkeypatch):
    """A narrow weight splits K by its shape alone, with one config at every row count: a verify row (17-32 rows)
    is summed in the same parts and tiles as a decode row, bit for bit."""
    n, k = 24, 8 * SPLIT_CONFIG[1]
    splits = split_k_for(n, k)
    assert splits == 2  # 8 tiles, at least 4 a part
    assert {config_for(n, k, rows) for rows in (1, MAX_ROWS, MAX_ROWS + 1, MAX_KERNEL_ROWS)} == {SPLIT_CONFIG}
    summed = []
    monkeypatch.setattr(skinny_gemm, "sum_splits", lambda parts, dtype, bias=None: summed.append(parts.shape[0])
                        or parts.sum(0).to(dtype))  # the parts summed in order, as the kernel does
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(MAX_KERNEL_ROWS, k, generator=gen).to(torch.float16).to(triton_device)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.float16).to(triton_device)
    full = skinny_matmul(x, w)
    torch.testing.assert_close(full.double().cpu(), (x.double() @ w.double().T).cpu(), atol=2e-2, rtol=2e-2)
    assert summed == [2]
    for r in (0, MAX_ROWS - 1, MAX_KERNEL_ROWS - 1):
        assert torch.equal(skinny_matmul(x[r:r + 1], w), full[r:r + 1])
    assert torch.equal(skinny_matmul(x[:MAX_ROWS + 3], w), full[:MAX_ROWS + 3])
    assert summed == [2] * 5


def test_split_k_follows_the_weights_shape(monkeypatch):
    """Narrow outputs split K until the launch has about SPLIT_PROGRAMS programs, in parts of at least two tiles;
    wide outputs, short K and SPLIT_K off do not split; a bad split_k is named."""
    block_k = SPLIT_CONFIG[1]
    assert split_k_for(2816, 4096) == 3  # 88 column blocks: 264 programs
    assert split_k_for(1536, 6144) == 4  # 48 column blocks: 192 programs
    assert split_k_for(2560, 10240) == 3  # 80 column blocks: 240 programs
    assert split_k_for(128, 2816) == 5  # a router: 4 column blocks, 22 tiles: parts of 4+ tiles
    assert split_k_for(2816, 2112) == 1  # short K on 88 column blocks: not worth a second launch
    assert split_k_for(16, 7 * block_k) == 1  # 7 tiles: no two parts of 4
    assert split_k_for(8192, 2816) == 1 and split_k_for(16384, 5376) == 1  # 256+ column blocks stream on their own
    # long K on 168 column blocks (84 programs of the unsplit config): the 31B's o and down, and their TP shards
    assert split_k_for(5376, 8192) == 2 and split_k_for(5376, 21504) == 2 and split_k_for(5376, 4096) == 2
    monkeypatch.setattr(skinny_gemm, "SPLIT_K", False)
    assert split_k_for(2816, 4096) == 1
    assert config_for(2816, 4096) != SPLIT_CONFIG
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        skinny_matmul(torch.zeros(1, 8), torch.zeros(4, 8), SMALL, 0)


@pytest.mark.parametrize("n, k", [(5376, 8192), (5376, 21504), (2816, 8192), (2816, 4096), (2048, 5376),
                                  (4224, 2816), (2560, 10240), (1536, 6144), (128, 2816), (262144, 5376)])
def test_launch_plans_do_not_depend_on_the_rows(n, k):
    """Every row count of a launch on one weight takes the same parts of K, and a split weight one config (the
    31B's o and down projections, 84 programs of 64 columns, once split at one row and not at 24 rows: a verify
    row then rounded unlike a decode row on the GPU)."""
    plans = {rows: launch_plan(n, k, rows) for rows in range(1, MAX_KERNEL_ROWS + 1)}
    assert len({(split, k_per_split if split > 1 else k) for _, split, k_per_split in plans.values()}) == 1
    assert plans[1][1] == split_k_for(n, k)
    if plans[1][1] > 1:
        assert {config for config, _, _ in plans.values()} == {SPLIT_CONFIG}


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32 few-row products are taken on CUDA only")
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 8, 16, 17])
def test_fp32_rows_give_f_linear_through_either_product(rows, kernel, monkeypatch):
    """fp32 rows of 1-16 take the fp32 rows kernel (FP32_ROWS); without it, 7-16 take ``weight @ rows.T``
    (FP32_TRANSPOSED_ROWS); the result is F.linear's to the order of the sums, contiguous. A wide weight (an LM
    head) keeps cuBLAS."""
    monkeypatch.setattr(skinny_gemm, "FP32_ROWS_KERNEL", kernel)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 256, generator=gen).cuda()
    w = torch.randn(128, 256, generator=gen).cuda()
    assert skinny_gemm._fp32_rows(x, w) == (kernel and rows <= 16)
    assert not skinny_gemm._fp32_rows(x, torch.zeros(4096, 256, device="cuda"))
    assert skinny_gemm._fp32_transposed(x, w) == (7 <= rows <= 16)
    got = skinny_linear(x, w)
    assert got.shape == (1, rows, 128) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_the_transposed_fp32_product_is_for_cuda_fp32_rows_only():
    w = torch.zeros(8, 32)
    for taken in (skinny_gemm._fp32_transposed, skinny_gemm._fp32_rows):
        assert not taken(torch.zeros(8, 32), w)  # CPU
        assert not taken(torch.zeros(8, 32, dtype=torch.bfloat16), w.bfloat16())


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k,config", [(40, 100, None), (7, 33, (8, 32, 2)), (130, 256, (16, 128, 4))])
def test_triton_fp32_rows_matmul(triton_device, rows, n, k, config):
    """The fp32 rows kernel: odd N and K (masked tiles), 1-16 rows, against ``x @ w.T`` in fp32."""
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen).to(triton_device)
    w = torch.randn(n, k, generator=gen).to(triton_device)
    got = skinny_gemm.fp32_rows_matmul(x, w, config)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), x.cpu() @ w.cpu().T, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="fp32_rows_matmul takes"):
        skinny_gemm.fp32_rows_matmul(x.bfloat16(), w.bfloat16())


def test_short_k_weights_take_128_deep_tiles_in_programs_that_stay_resident(monkeypatch):
    """Wide weights of a short K stream 128-deep tiles: 32-column programs until 64-column ones make two an SM, the
    same config at every decode row count; LM heads stream 256-deep tiles; longer K and narrow weights keep their
    configs; the switches off give the general configs back."""
    from hf_specdec.kernels.skinny_gemm import (LM_HEAD_CONFIG, SHORT_K, SHORT_K_NARROW, SHORT_K_WIDE,
                                                SHORT_K_WIDE_PROGRAMS)

    assert {config_for(12288, 1536, rows) for rows in range(1, MAX_ROWS + 1)} == {SHORT_K_NARROW}  # E2B gate/up
    assert config_for(20480, 2560) == SHORT_K_WIDE  # E4B gate/up
    assert config_for(SHORT_K_WIDE[0] * SHORT_K_WIDE_PROGRAMS, SHORT_K) == SHORT_K_WIDE
    assert config_for(SHORT_K_WIDE[0] * (SHORT_K_WIDE_PROGRAMS - 1), SHORT_K) == SHORT_K_NARROW
    general = config_for(8192, 2816)  # the 26B-A4B's q/k/v: K past SHORT_K
    assert general not in (SHORT_K_NARROW, SHORT_K_WIDE) and general[1] == 256
    assert config_for(2560, 1536)[1] == 512  # E2B's q/k/v: narrow
    assert {config_for(262144, k) for k in (1536, 2816, 5376)} == {LM_HEAD_CONFIG}  # LM heads, whatever their K
    assert config_for(12288, 1536, MAX_ROWS + 1) == (32, 256, 4, 4)  # verify rows past 16 keep theirs
    monkeypatch.setattr(skinny_gemm, "SHORT_K_TILES", False)
    monkeypatch.setattr(skinny_gemm, "LM_HEAD_TILES", False)
    assert config_for(12288, 1536) == config_for(8192, 2816) == general
    assert config_for(262144, 1536) == (32, 512, 4, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the shapes that take these configs are too large for "
                    "Triton's interpreter")
@pytest.mark.parametrize("n,k", [(12288, 1536), (20480, 2560), (65536, 1536)])  # narrow and wide short K, an LM head
def test_short_k_and_lm_head_configs_match_torch_and_keep_rows_batch_invariant(n, k):
    """The default launch at the shapes that take the short-K and LM-head configs: torch's product within bf16
    rounding, and each row's bits whatever rows come with it (1-16)."""
    assert config_for(n, k) in (skinny_gemm.SHORT_K_NARROW, skinny_gemm.SHORT_K_WIDE, skinny_gemm.LM_HEAD_CONFIG)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(MAX_ROWS, k, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16).cuda()
    full = skinny_matmul(x, w)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
    for r in (0, 7, MAX_ROWS - 1):
        assert torch.equal(skinny_matmul(x[r:r + 1], w), full[r:r + 1])
    assert torch.equal(skinny_matmul(x[:5], w), full[:5])


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_triton_skinny_linear_adds_a_bias_before_rounding(triton_device, monkeypatch, rows, split):
    """A bias joins the fp32 sums before they are rounded: in the kernel's own store (one part of K), or in the sum
    of the parts; a biased nn.Linear's fused forward takes the kernel (gpt-oss's and Qwen2's projections)."""
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 0)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 100, generator=gen).to(torch.float16).to(triton_device)
    w = (torch.randn(70, 100, generator=gen) * 0.1).to(torch.float16).to(triton_device)
    bias = (torch.randn(70, generator=gen) * 4).to(torch.float16).to(triton_device)
    got = skinny_matmul(x, w, SMALL, split, bias=bias)
    expected = (x.double() @ w.double().T + bias.double()).to(torch.float16)
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=2e-2, rtol=2e-3)
    unbiased = skinny_matmul(x, w, SMALL, split)
    assert (got.float() - unbiased.float() - bias.float()).abs().max() < 2e-2  # the bias is there, once
    layer = nn.Linear(100, 70, bias=True).to(triton_device, torch.float16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(bias)
    calls = []
    original = skinny_gemm.skinny_matmul
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", lambda *a, **k: calls.append(k.get("bias")) or original(*a, **k))
    with torch.no_grad():
        out = linear_forward(layer, x[None])
    assert calls and calls[0] is layer.bias
    torch.testing.assert_close(out[0].float().cpu(), expected.float().cpu(), atol=2e-2, rtol=2e-3)


def test_a_bias_the_kernel_does_not_take_goes_to_torch(monkeypatch):
    """A bias of another layout or dtype than the kernel adds: F.linear computes the layer (and raises what it
    raises for a dtype the layer cannot add)."""
    monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "1")
    monkeypatch.setattr(skinny_gemm, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", lambda *a, **k: pytest.fail("the kernel ran"))
    x, w = torch.randn(2, 16).to(torch.bfloat16), torch.randn(8, 16).to(torch.bfloat16)
    strided = torch.randn(16).to(torch.bfloat16)[::2]
    assert torch.equal(skinny_linear(x, w, strided), F.linear(x, w, strided))
    with pytest.raises(RuntimeError):
        skinny_linear(x, w, torch.randn(8))
