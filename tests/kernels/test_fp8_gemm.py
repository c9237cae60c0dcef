"""fp8_linear: FP8 weight-only GEMMs for a few rows. The reference equals dequantize-then-matmul written out per
block; the kernel matches the reference to a rounding of the activation dtype (every layout of scales, odd
shapes, 1 and 16 rows, bf16 and fp16, native fp8 loads and the integer conversion of the bytes); the experts'
forwards serve transformers' ``FP8Experts`` (its linears: ``test_fp8_w8a8.py``).

transformers refuses to quantize on a CPU and dequantizes pre-quantized FP8 checkpoints to bf16 there, so
:func:`fp8_quantized_model` builds the loaded layout by hand: transformers' own ``replace_with_fp8_linear`` swaps
the layers, then each takes the quantized weight and block scales of the layer it replaced.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

from hf_specdec.generation.quantization import fp8_quantize_model
from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV
from hf_specdec.kernels import fp8_gemm
from hf_specdec.kernels.fp8_gemm import (
    E8M0_DTYPE,
    MAX_KERNEL_ROWS,
    MAX_ROWS,
    dequantize_fp8,
    fp8_eligible,
    fp8_expert_eligible,
    fp8_expert_linear,
    fp8_expert_linear_reference,
    fp8_expert_matmul,
    fp8_linear,
    fp8_linear_reference,
    fp8_matmul,
    quantize_fp8,
    split_k_for,
)

from hf_specdec.kernels.fp8_moe import experts_w8a8, fp8_experts_forward, fused_moe_fp8_reference

from ..tiny_models import gemma4_26b_style
from .conftest import run_file_cases_in_interpreter
from .test_fp8_moe import assert_w8a8_close

SMALL = (16, 32, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs and K tiles at test sizes
# one rounding of the activation dtype apart (only the summation order differs)
TOLERANCE = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5), torch.float16: dict(rtol=2 ** -10, atol=1e-5)}


# ---------------------------------------------------------------- helpers


def make_fp8(n, k, block_size, seed=0, device="cpu"):
    """(fp8 weight [n, k], fp32 scale) for block_size (bn, bk), "channel" or "tensor". Scales are spread over
    powers of two so that a wrong block index shows as a large error."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if block_size == "tensor":
        weight, scale = quantize_fp8(w, (n, k))
        scale = scale.reshape(())
    else:
        weight, scale = quantize_fp8(w, None if block_size == "channel" else block_size)
    scale = scale * torch.exp2(torch.randint(-3, 4, scale.shape, generator=gen).float())
    return weight.to(device), scale.to(device)


def fp8_layer(in_features, out_features, block_size=(16, 16), bias=False, seed=0) -> FP8Linear:
    """A transformers fine-grained ``FP8Linear`` on the CPU holding a quantized random weight: ``weight``
    float8_e4m3fn [out, in], ``weight_scale_inv`` fp32 [ceil(out/bn), ceil(in/bk)] (a 0-dim scalar with
    ``block_size=None``), ``bias`` [out] or None."""
    layer = FP8Linear(in_features, out_features, block_size=block_size, has_bias=bias)
    gen = torch.Generator().manual_seed(seed)
    dense = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        dense.weight.normal_(0, 0.3, generator=gen)
    _load_quantized(layer, dense)
    return layer


def fp8_quantized_model(model: nn.Module, block_size=(16, 16)) -> nn.Module:
    """``model`` (in place) as transformers' fine-grained FP8 quantizer leaves it after loading on a GPU: every
    ``nn.Linear`` but the LM head an ``FP8Linear``, every experts module an ``FP8Experts``, holding the quantized
    weights and block scales of the layers they replaced."""
    return fp8_quantize_model(model, block_size)


def _load_quantized(layer: FP8Linear, dense: nn.Linear) -> None:
    block_size = layer.block_size or tuple(dense.weight.shape)  # None: one scale for the tensor
    weight, scale = quantize_fp8(dense.weight.detach(), block_size)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale_inv.copy_(scale.reshape(layer.weight_scale_inv.shape))
        if dense.bias is not None:
            layer.bias.copy_(dense.bias)


def dequantize_by_blocks(weight, scale, bn, bk):
    """The layout spelled out: weight[i, j] * scale[i // bn, j // bk]."""
    out = torch.empty(weight.shape)
    for i in range(weight.shape[0]):
        for j in range(weight.shape[1]):
            out[i, j] = weight[i, j].float() * scale[i // bn, j // bk].float()
    return out


def _check_kernel(device, dtype, rows, weight, scale, block_size, native_fp8=None, config=SMALL, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype).to(device)
    got = fp8_matmul(x, weight, scale, block_size, config, native_fp8=native_fp8)
    expected = fp8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), block_size)
    assert got.shape == (rows, weight.shape[0]) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------- the kernel (TRITON_INTERPRET=1 child on CPU)


@pytest.mark.parametrize("native_fp8", [True, False])
@pytest.mark.parametrize("rows", [1, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_block_scales(triton_device, dtype, rows, native_fp8):
    """N and K not multiples of the block (partial edge blocks) nor of the tiles."""
    weight, scale = make_fp8(70, 100, (32, 32), seed=rows, device=triton_device)
    _check_kernel(triton_device, dtype, rows, weight, scale, (32, 32), native_fp8)


@pytest.mark.parametrize("block_k", [64, 128])
def test_triton_fp8_k_tiles_spanning_scale_blocks(triton_device, block_k):
    """A K tile of 64 or 128 over 16-wide blocks of scales: 4 or 8 dots per tile, each with its own scales (the
    tile's scales read in one load), 16-row blocks narrower than the 32-column programs, a partial last tile."""
    weight, scale = make_fp8(70, 100, (16, 16), seed=6, device=triton_device)
    _check_kernel(triton_device, torch.bfloat16, 5, weight, scale, (16, 16), config=(32, block_k, 4, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_blocks_of_any_size(triton_device, dtype):
    """bn = 24, bk = 48 (not powers of two): K tiles of 16 stay inside a block of scales."""
    weight, scale = make_fp8(50, 100, (24, 48), seed=1, device=triton_device)
    _check_kernel(triton_device, dtype, 5, weight, scale, (24, 48))


@pytest.mark.parametrize("e8m0", [False, True])
def test_triton_fp8_transformers_blocks_of_128(triton_device, e8m0):
    """The fine-grained format's 128 x 128 blocks at odd N and K, fp32 or UE8M0 (power-of-two) scales; the
    launcher's own tile choice."""
    weight, scale = make_fp8(130, 260, (128, 128), seed=2, device=triton_device)
    if e8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale))).to(E8M0_DTYPE)
    _check_kernel(triton_device, torch.bfloat16, 3, weight, scale, (128, 128), config=None)


@pytest.mark.parametrize("layout", ["[N]", "[N, 1]", "[1, N]"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_per_channel_scales(triton_device, dtype, layout):
    """compressed-tensors' channel strategy: [N, 1] in checkpoints (bf16 there), [1, N] fp32 in transformers'
    CompressedTensorsFP8Linear."""
    weight, scale = make_fp8(70, 100, "channel", seed=3, device=triton_device)
    scale = {"[N]": scale.reshape(-1), "[N, 1]": scale.to(torch.bfloat16), "[1, N]": scale.reshape(1, -1)}[layout]
    _check_kernel(triton_device, dtype, 7, weight, scale, None)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_per_tensor_scale(triton_device, dtype, shape):
    weight, scale = make_fp8(70, 100, "tensor", seed=4, device=triton_device)
    _check_kernel(triton_device, dtype, MAX_ROWS, weight, scale.reshape(shape), None)


@pytest.mark.parametrize("native_fp8", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_every_code_converts_exactly(triton_device, dtype, native_fp8):
    """Identity rows read the weight back: all 254 finite e4m3 codes (subnormals included) come out exact, by the
    native conversion and by the integer one."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN codes
    weight = codes.view(torch.float8_e4m3fn).reshape(16, 16).to(triton_device)
    x = torch.eye(16, dtype=dtype, device=triton_device)
    got = fp8_matmul(x, weight, torch.ones((), device=triton_device), None, SMALL, native_fp8=native_fp8)
    assert torch.equal(got.float().cpu(), weight.float().T.cpu())


def test_triton_fp8_rows_do_not_depend_on_the_batch(triton_device):
    """A verify step's rows equal the decode step's row, bit for bit: the kernel pads to 16 rows either way."""
    weight, scale = make_fp8(48, 96, (32, 32), seed=5, device=triton_device)
    x = torch.randn(MAX_ROWS, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(triton_device)
    full = fp8_matmul(x, weight, scale, (32, 32), SMALL)
    for r in (0, 7, MAX_ROWS - 1):
        assert torch.equal(fp8_matmul(x[r:r + 1], weight, scale, (32, 32), SMALL), full[r:r + 1])
    assert torch.equal(fp8_matmul(x[:3], weight, scale, (32, 32), SMALL), full[:3])


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e5])
def test_triton_fp8_fp16_dots_equal_bf16_dots(triton_device, magnitude):
    """bf16 rows multiplied as fp16 (each scaled by its power of two) give the bf16 dots' result: rows far outside
    fp16's range (3e5) or deep in its subnormals (1e-6) included, one row of each kind in a batch."""
    weight, scale = make_fp8(40, 96, (32, 32), seed=9, device=triton_device)
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 96, generator=gen) * torch.tensor([[magnitude], [1.0], [magnitude * 7]])).to(torch.bfloat16)
    x = x.to(triton_device)
    as_fp16 = fp8_matmul(x, weight, scale, (32, 32), SMALL, fp16_dots=True)
    as_bf16 = fp8_matmul(x, weight, scale, (32, 32), SMALL, fp16_dots=False)
    assert torch.isfinite(as_fp16.float()).all()
    torch.testing.assert_close(as_fp16.float(), as_bf16.float(), rtol=2 ** -8, atol=0.0)
    expected = fp8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), (32, 32))
    torch.testing.assert_close(as_fp16.float().cpu(), expected.float(), **TOLERANCE[torch.bfloat16])


def test_triton_f16_rows_scale_each_row_by_a_power_of_two(triton_device):
    """Each row's largest magnitude lands in [2**14, 2**15); scaled back, every value is the bf16 input exactly (a
    zero row included)."""
    from hf_specdec.kernels.fp8_gemm import f16_rows

    x = torch.randn(4, 1500, generator=torch.Generator().manual_seed(3)) * torch.tensor([[1e-4], [1.0], [5e4], [0.0]])
    x = x.to(torch.bfloat16).to(triton_device)
    y, inverse = f16_rows(x)
    assert y.dtype == torch.float16 and inverse.dtype == torch.float32
    top = y[:3].float().abs().amax(dim=1)
    assert ((top >= 2 ** 14) & (top < 2 ** 15)).all()
    assert torch.equal((y.float() * inverse[:, None]).cpu(), x.float().cpu())
    assert torch.equal(torch.log2(inverse.cpu()), torch.log2(inverse.cpu()).round())  # powers of two


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("scales", ["block", "channel"])
def test_triton_fp8_split_k(triton_device, split_k, scales):
    """K in 2 or 3 parts (3 asked of 4 K tiles gives 2 of 2 tiles), fp32 partials summed in order: the reference
    within a rounding, and each row equal to its own result computed alone (the split depends on the shapes)."""
    block = (32, 32) if scales == "block" else None
    weight, scale = make_fp8(70, 100, block or "channel", seed=25, device=triton_device)
    x = torch.randn(20, 100, generator=torch.Generator().manual_seed(25)).to(torch.bfloat16).to(triton_device)
    full = fp8_matmul(x, weight, scale, block, SMALL, split_k=split_k)
    expected = fp8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), block)
    torch.testing.assert_close(full.float().cpu(), expected.float(), **TOLERANCE[torch.bfloat16])
    for r in (0, 19):
        assert torch.equal(fp8_matmul(x[r:r + 1], weight, scale, block, SMALL, split_k=split_k), full[r:r + 1])


def test_triton_fp8_default_split_k_does_not_depend_on_the_rows(triton_device, monkeypatch):
    """The split is chosen from the weight's shape alone: 1, 17 and 40 rows (one, two, three row tiles) split K
    alike, so every row equals its own result computed alone, bit for bit (a split chosen from the launch's
    programs would cut a 40-row verify into fewer parts than a 1-row decode)."""
    # at test sizes: a short K splits too, and 5 column blocks split while 3 row tiles x 5 would not
    monkeypatch.setattr(fp8_gemm, "MIN_TILES_PER_SPLIT", 1)
    monkeypatch.setattr(fp8_gemm, "SPLIT_K_BELOW_PROGRAMS", 6)
    weight, scale = make_fp8(70, 128, (32, 32), seed=26, device=triton_device)
    assert split_k_for(70, 128, *SMALL[:2]) == 4 and split_k_for(15 * 32, 128, *SMALL[:2]) == 1
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(26)).to(torch.bfloat16).to(triton_device)
    splits = []  # the parts each launch chose (bf16 outputs alone rarely show an fp32 summation order)
    monkeypatch.setattr(fp8_gemm, "split_k_for", lambda *a: splits.append(split_k_for(*a)) or splits[-1])
    full = fp8_matmul(x, weight, scale, (32, 32), SMALL)
    torch.testing.assert_close(full.float().cpu(), fp8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), (32, 32))
                               .float(), **TOLERANCE[torch.bfloat16])
    for r in (0, 16, 39):
        assert torch.equal(fp8_matmul(x[r:r + 1], weight, scale, (32, 32), SMALL), full[r:r + 1])
    assert torch.equal(fp8_matmul(x[:17], weight, scale, (32, 32), SMALL), full[:17])
    assert splits == [4] * 5


def test_split_k_only_for_few_programs_and_long_k():
    from hf_specdec.kernels.fp8_gemm import NARROW_CONFIG, config_for

    assert config_for(5376, 21504, True) == NARROW_CONFIG  # the 31B down projection: 168 blocks of 32 columns
    assert config_for(16384, 5376, True) != NARROW_CONFIG  # q/k/v: 512 blocks of 32 columns, enough programs
    assert split_k_for(5376, 21504, 64, 128) == 6  # down: 84 programs of 64 columns x 6 parts, ~504
    assert split_k_for(5376, 8192, 64, 128) == 6  # o
    assert split_k_for(2816, 2112, 64, 128) == 8  # the 26B-A4B's o: at most MAX_SPLIT_K parts
    assert split_k_for(2816, 384, 64, 128) == 1  # parts of at least 2 K tiles
    assert split_k_for(16384, 5376, 64, 128) == 1  # q/k/v: 512 blocks of 32 columns, whatever the programs' width


def test_triton_fp8_many_rows_take_row_tiles(triton_device):
    """40 rows (a verify step of a batch): three row tiles; each row equals the reference and its own result
    computed alone."""
    weight, scale = make_fp8(48, 96, (32, 32), seed=24, device=triton_device)
    _check_kernel(triton_device, torch.bfloat16, 40, weight, scale, (32, 32), seed=24)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(24)).to(torch.bfloat16).to(triton_device)
    full = fp8_matmul(x, weight, scale, (32, 32), SMALL)
    for r in (0, 17, 39):
        assert torch.equal(fp8_matmul(x[r:r + 1], weight, scale, (32, 32), SMALL), full[r:r + 1])


def test_triton_fp8_linear_on_strided_rows(triton_device):
    """The dispatcher takes the kernel for the last position of each sequence (a strided [2, 1, K] view)."""
    weight, scale = make_fp8(40, 64, (16, 32), seed=6, device=triton_device)
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6)).to(torch.float16).to(triton_device)
    x = hidden[:, -1:]
    assert fp8_eligible(x, weight, scale, (16, 32))
    got = fp8_linear(x, weight, scale, (16, 32))
    assert got.shape == (2, 1, 40)
    torch.testing.assert_close(got.float().cpu(), fp8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), (16, 32))
                               .float(), **TOLERANCE[torch.float16])


def make_fp8_experts(num_experts, n, k, block_size, seed=0, device="cpu"):
    """(fp8 weights [E, n, k], fp32 scales [E, sn, sk]) quantized expert by expert, scales spread over powers of
    two; block_size None: one scale per expert."""
    pairs = [make_fp8(n, k, block_size or "tensor", seed=seed + e) for e in range(num_experts)]
    weight = torch.stack([w for w, _ in pairs])
    scale = torch.stack([s.reshape(1, 1) if block_size is None else s for _, s in pairs])
    return weight.to(device), scale.to(device)


@pytest.mark.parametrize("native_fp8", [True, False])
@pytest.mark.parametrize("block_size", [(32, 32), None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fp8_experts_gemv(triton_device, dtype, block_size, native_fp8):
    """Pairs of a decode step (repeated experts, odd N and K): each pair's row equals its expert's reference."""
    weight, scale = make_fp8_experts(5, 70, 100, block_size, seed=20, device=triton_device)
    ids = torch.tensor([3, 0, 3, 4, 1, 1, 2], device=triton_device)
    x = torch.randn(len(ids), 100, generator=torch.Generator().manual_seed(20)).to(dtype).to(triton_device)
    got = fp8_expert_matmul(x, weight, scale, ids, block_size, block_n=16, block_k=32, native_fp8=native_fp8)
    expected = fp8_expert_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), ids.cpu(), block_size)
    assert got.shape == (len(ids), 70) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[dtype])
    assert torch.equal(fp8_expert_matmul(x[2:3], weight, scale, ids[2:3], block_size, block_n=16, block_k=32,
                                         native_fp8=native_fp8), got[2:3])  # a pair alone: the same bits


def test_triton_fp8_experts_forward(triton_device):
    """transformers' FP8Experts of a 26B-A4B-style model (gelu-tanh gate, 8 experts, top-2), 128 x 128 blocks over
    its small projections: the kernel's forward equals the reference of the product it computes, to a rounding:
    W8A8 where the GPU has FP8 tensor cores (transformers' own arithmetic: the rows quantized), else weight-only
    (the module's forward on CPU)."""
    model = fp8_quantized_model(gemma4_26b_style(), block_size=(128, 128))
    experts = model.model.layers[0].experts.to(triton_device)
    assert isinstance(experts, FP8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(3, 32, generator=gen).bfloat16().to(triton_device)
    index = torch.tensor([[0, 5], [5, 7], [2, 0]], device=triton_device)
    weights = torch.rand(3, 2, generator=gen).to(triton_device)
    with torch.no_grad():
        assert fp8_expert_eligible(hidden, experts.gate_up_proj, experts.gate_up_proj_scale_inv, index.reshape(-1),
                                   experts.block_size)
        got = fp8_experts_forward(experts, hidden, index, weights)
        w8a8 = experts_w8a8(experts, hidden)
        experts_cpu = experts.cpu()
        with pytest.MonkeyPatch.context() as patch:  # the reference, then the session's setting back as it was
            patch.setenv(FORCE_TRITON_ENV, "0")
            expected = fp8_experts_forward(experts_cpu, hidden.cpu(), index.cpu(), weights.cpu())
        if w8a8:  # the rows quantized per group of the K block, as transformers' FP8Experts on such a GPU
            expected = fused_moe_fp8_reference(
                hidden.cpu(), experts_cpu.gate_up_proj, experts_cpu.gate_up_proj_scale_inv, experts_cpu.down_proj,
                experts_cpu.down_proj_scale_inv, index.cpu(), weights.cpu(), activation="gelu_tanh",
                block_size=experts.block_size, w8a8=True)
    if w8a8:
        assert_w8a8_close(got, expected, torch.bfloat16, default_tiles=True)
    else:
        torch.testing.assert_close(got.float().cpu(), expected.float(), rtol=2e-2, atol=1e-2)


def test_fp8_gemm_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=49)


# ---------------------------------------------------------------- reference, dispatch, launcher checks (CPU)


@pytest.mark.parametrize("block_size,bn,bk", [((32, 48), 32, 48), ("channel", 1, 100), ("tensor", 70, 100)])
def test_reference_is_dequantize_then_matmul(block_size, bn, bk):
    weight, scale = make_fp8(70, 100, block_size, seed=8)
    grid = scale.reshape(-1, 1) if block_size == "channel" else scale.reshape(1, 1) if block_size == "tensor" \
        else scale
    dense = dequantize_by_blocks(weight, grid, bn, bk)
    passed_block_size = block_size if isinstance(block_size, tuple) else None
    assert torch.equal(dequantize_fp8(weight, scale, passed_block_size), dense)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(fp8_linear_reference(x, weight, scale, passed_block_size),
                       F.linear(x.float(), dense).to(torch.bfloat16))


def test_quantize_round_trips_within_e4m3_precision():
    w = torch.randn(70, 100, generator=torch.Generator().manual_seed(9))
    for block_size in ((32, 32), (128, 128), None):
        weight, scale = quantize_fp8(w, block_size)
        grid = (3, 4) if block_size == (32, 32) else (1, 1) if block_size == (128, 128) else (70, 1)
        assert weight.dtype == torch.float8_e4m3fn and scale.shape == grid and scale.dtype == torch.float32
        torch.testing.assert_close(dequantize_fp8(weight, scale, block_size), w, rtol=2 ** -4, atol=1e-2)


def test_dispatch_keeps_the_reference_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    weight, scale = make_fp8(8, 64, (16, 32))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert fp8_eligible(x, weight, scale, (16, 32))
    assert fp8_eligible(x.half(), weight, scale, (16, 32))
    assert not fp8_eligible(x.float(), weight, scale, (16, 32))  # fp32 activations
    assert fp8_eligible(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), weight, scale, (16, 32))  # row tiles
    assert not fp8_eligible(torch.zeros(MAX_KERNEL_ROWS + 1, 64, dtype=torch.bfloat16), weight, scale, (16, 32))
    assert not fp8_eligible(torch.zeros(0, 64, dtype=torch.bfloat16), weight, scale, (16, 32))
    assert not fp8_eligible(x, weight.float(), scale, (16, 32))  # a dense weight
    assert not fp8_eligible(x, weight.T.contiguous().T, scale, (16, 32))  # columns contiguous
    weight_8, scale_8 = make_fp8(8, 64, (8, 8))
    assert not fp8_eligible(x, weight_8, scale_8, (8, 8))  # K blocks of 8: tl.dot needs K tiles of 16
    assert fp8_eligible(x, *make_fp8(8, 64, (8, 64)), (8, 64))  # ... unless the scale does not vary along K
    with torch.enable_grad():
        assert not fp8_eligible(x.clone().requires_grad_(), weight, scale, (16, 32))
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    assert not fp8_eligible(x, weight, scale, (16, 32))


def test_reference_path_serves_what_the_kernel_does_not(monkeypatch):
    """With the kernels forced on, what they do not take (fp32 activations, K blocks of 8) gets the reference's
    answer without a launch."""

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(fp8_gemm, "fp8_matmul", lambda *a, **k: pytest.fail("the kernel was launched"))
    weight, scale = make_fp8(8, 64, (8, 8))
    for x in (torch.randn(3, 64).bfloat16(), torch.randn(2, 4, 64)):
        assert torch.equal(fp8_linear(x, weight, scale, (8, 8)), fp8_linear_reference(x, weight, scale, (8, 8)))


def test_launcher_and_dispatcher_name_bad_arguments():
    weight, scale = make_fp8(70, 100, (32, 32))
    x = torch.zeros(2, 100, dtype=torch.bfloat16)
    cases = [
        (dict(x=torch.zeros(MAX_KERNEL_ROWS + 1, 100, dtype=torch.bfloat16)), r"\[1..8192, K\] rows"),
        (dict(x=torch.zeros(2, 100)), "bfloat16 or float16"),
        (dict(weight=weight.float()), "float8_e4m3fn"),
        (dict(x=torch.zeros(2, 96, dtype=torch.bfloat16)), r"weight must be \[N, K=96\]"),
        (dict(weight=weight.T.contiguous().T), "rows must be contiguous"),
        (dict(scale=scale[:, :3]), r"must be \[ceil\(70/32\), ceil\(100/32\)\] = \[3, 4\]"),
        (dict(scale=scale.to(torch.int32)), "scale must be a tensor of"),
        (dict(block_size=(0, 32)), "two positive ints"),
        (dict(block_size=None), "per tensor .* or per output channel"),
        (dict(block_size=(32, 8), scale=torch.ones(3, 13)), "must be a multiple of 16 for the kernel"),
    ]
    for change, message in cases:
        args = dict(x=x, weight=weight, scale=scale, block_size=(32, 32)) | change
        with pytest.raises(ValueError, match=message):
            fp8_matmul(args["x"], args["weight"], args["scale"], args["block_size"])
    for change, message in cases[5:9]:  # the dispatcher's reference path checks the same
        args = dict(x=x, weight=weight, scale=scale, block_size=(32, 32)) | change
        with pytest.raises(ValueError, match=message):
            fp8_linear(args["x"], args["weight"], args["scale"], args["block_size"])
    with pytest.raises(ValueError, match="must share K"):
        fp8_linear(torch.zeros(2, 96, dtype=torch.bfloat16), weight, scale, (32, 32))


# ---------------------------------------------------------------- mixture-of-experts weights (CPU)


@pytest.mark.parametrize("block_size", [(16, 32), None])
def test_expert_reference_is_each_experts_dequantized_matmul(block_size, monkeypatch):
    weight, scale = make_fp8_experts(4, 40, 64, block_size, seed=22)
    ids = torch.tensor([2, 2, 0, 3])
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(22))
    got = fp8_expert_linear_reference(x, weight, scale, ids, block_size)
    grid = (lambda e: scale[e]) if block_size else (lambda e: scale[e].reshape(()))
    for p, e in enumerate(ids.tolist()):
        expected = F.linear(x[p:p + 1], dequantize_fp8(weight[e], grid(e), block_size))
        torch.testing.assert_close(got[p:p + 1], expected, rtol=1e-5, atol=1e-5)
    # fp32 activations are the reference's even with the kernels forced on: no launch, the same answer
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(fp8_gemm, "fp8_expert_matmul", lambda *a, **k: pytest.fail("the kernel was launched"))
    assert torch.equal(fp8_expert_linear(x, weight, scale, ids, block_size), got)


def test_fp8_experts_forward_is_the_dense_experts_on_dequantized_weights():
    """FP8Experts of a 26B-A4B-style model through fp8_experts_forward: transformers' own experts forward on the
    dequantized weights (the same routing, the same gate)."""
    model = gemma4_26b_style()
    dense = copy.deepcopy(model.model.layers[0].experts)
    experts = fp8_quantized_model(model, block_size=(16, 16)).model.layers[0].experts
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w, s = getattr(experts, name), getattr(experts, f"{name}_scale_inv")
            getattr(dense, name).copy_(torch.stack([dequantize_fp8(w[e], s[e], (16, 16)) for e in range(len(w))]))
    gen = torch.Generator().manual_seed(23)
    hidden, index = torch.randn(5, 32, generator=gen), torch.randint(0, 8, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    with torch.no_grad():
        got = fp8_experts_forward(experts, hidden, index, weights)
        dense.config._experts_implementation = "eager"
        expected = dense(hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_expert_launcher_names_bad_arguments():
    weight, scale = make_fp8_experts(3, 40, 64, (16, 32))
    x, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fp8_expert_matmul(x.float(), weight, scale, ids, (16, 32))
    with pytest.raises(ValueError, match=r"\[E, N, K=64\] float8_e4m3fn"):
        fp8_expert_matmul(x, weight.float(), scale, ids, (16, 32))
    with pytest.raises(ValueError, match=r"expert_ids must be \[pairs=2\] integers"):
        fp8_expert_matmul(x, weight, scale, ids.float(), (16, 32))
    with pytest.raises(ValueError, match=r"must be \[E, ceil\(40/16\), ceil\(64/32\)\]"):
        fp8_expert_matmul(x, weight, scale[:, :, :1], ids, (16, 32))
