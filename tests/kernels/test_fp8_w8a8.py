"""w8a8_linear: FP8 weights times activations quantized to FP8 per row and group (or per row). The reference is
quantize, dequantize, matmul; the kernels match it to a rounding of the activation dtype (block, channel and
tensor scales, dynamic, per-row and static activations, odd shapes, 1 to 40 rows), their e4m3 codes are torch's (an
identity weight shows each quantized activation), and a row's result does not depend on the batch.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear
from transformers.integrations.finegrained_fp8 import FP8Linear

import hf_specdec
from hf_specdec.kernels import fp8_w8a8
from hf_specdec.kernels.fp8_gemm import E8M0_DTYPE, FP8_DTYPE, MAX_ROWS, dequantize_fp8
from hf_specdec.kernels.fp8_w8a8 import (
    E4M3_MAX,
    compressed_fp8_linear_forward,
    fp8_linear_forward,
    quantize_activations,
    w8a8_eligible,
    w8a8_linear,
    w8a8_linear_reference,
    w8a8_matmul,
)

from ..tiny_models import gemma4_31b_style
from .conftest import run_file_cases_in_interpreter
from .test_fp8_gemm import TOLERANCE, dequantize_by_blocks, fp8_layer, fp8_quantized_model, make_fp8

SMALL = (16, 128, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs, one group per K tile
WIDE = (64, 256, 4, 2)  # 64-column programs (the K step is always one group)


def _rows(rows, k, dtype, device, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) * scale).to(dtype).to(device)


def _check(device, dtype, rows, weight, scale, block_size, activation_scale=None, config=SMALL, seed=0,
           per_row=False):
    x = _rows(rows, weight.shape[1], dtype, device, seed)
    got = w8a8_matmul(x, weight, scale, block_size, activation_scale, per_row, config=config)
    expected = w8a8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), block_size,
                                     None if activation_scale is None else activation_scale.cpu(), per_row)
    assert got.shape == (rows, weight.shape[0]) and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float(), **_tolerance(dtype, device, expected))


def _tolerance(dtype, device, expected):
    """A rounding of the activation dtype; on a GPU also the FP8 tensor cores' own accumulation (Hopper's warpgroup
    MMA aligns an instruction's 32 e4m3 products to fewer bits than fp32 before adding them: up to ~2**-10 of the
    outputs' magnitude on these shapes, measured on an H200)."""
    tolerance = dict(TOLERANCE[dtype])
    if device == "cuda":
        tolerance["atol"] = 2 ** -9 * expected.abs().max().item()
    return tolerance


# ---------------------------------------------------------------- the kernel (TRITON_INTERPRET=1 child on CPU)


@pytest.mark.parametrize("config", [SMALL, WIDE])
@pytest.mark.parametrize("rows", [1, MAX_ROWS, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_w8a8_block_scales(triton_device, dtype, rows, config):
    weight, scale = make_fp8(80, 384, (32, 128), seed=1, device=triton_device)
    _check(triton_device, dtype, rows, weight, scale, (32, 128), config=config)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("block_size", ["channel", "tensor", (48, 64)])
def test_triton_w8a8_other_scales_and_odd_shapes(triton_device, block_size, per_row):
    """Per-channel and per-tensor weight scales (activation groups of 128), K blocks of 64 (groups of 64), K and N
    not multiples of the tiles."""
    weight, scale = make_fp8(70, 200, block_size, seed=2, device=triton_device)
    _check(triton_device, torch.bfloat16, 5, weight, scale, None if block_size in ("channel", "tensor")
           else block_size, per_row=per_row)


def test_triton_w8a8_static_activation_scale(triton_device):
    weight, scale = make_fp8(64, 256, (32, 128), seed=3, device=triton_device)
    _check(triton_device, torch.bfloat16, 3, weight, scale, (32, 128),
           activation_scale=torch.tensor(0.01, device=triton_device))


@pytest.mark.parametrize("per_row", [False, True])
def test_triton_w8a8_codes_are_torchs(triton_device, per_row):
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
    got = w8a8_matmul(x, weight, scale, None, per_row=per_row, config=WIDE)
    codes, s = quantize_activations(x.cpu(), per_row=per_row)
    expected = (codes.float() * s.repeat_interleave(k if per_row else 128, dim=-1)).to(torch.bfloat16)
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
    expected = w8a8_linear_reference(x.cpu(), weight.cpu(), scale.cpu(), (32, 128)).float()
    torch.testing.assert_close(got.float().cpu(), expected, **_tolerance(torch.bfloat16, triton_device, expected))


def test_triton_fp8_linear_forward_takes_the_kernel(triton_device, monkeypatch):
    if triton_device == "cpu":  # the interpreter: the kernels on CPU tensors, as on a GPU with FP8 tensor cores
        monkeypatch.setattr(fp8_w8a8, "activations_quantized", lambda x: True)
    elif torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no e4m3 dots before sm_89: the layers compute the weight-only product there")
    layer = fp8_layer(256, 48, block_size=(16, 128), bias=True, seed=7).to(triton_device)
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).to(triton_device)
    with torch.no_grad():
        assert w8a8_eligible(x, layer.weight, layer.weight_scale_inv, layer.block_size)
        got = fp8_linear_forward(layer, x)
    expected = w8a8_linear_reference(x.cpu(), layer.weight.cpu(), layer.weight_scale_inv.cpu(), (16, 128))
    torch.testing.assert_close(got.float().cpu(), expected.float() + layer.bias.detach().cpu().bfloat16().float(),
                               rtol=2e-2, atol=2e-2)


def test_w8a8_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=20)


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
    per_row = w8a8_linear(x, weight, scale, (8, 24), per_row=True)
    codes, s = quantize_activations(x, per_row=True)
    assert s.shape == (2, 5, 1)
    expected = (codes.float() * s) @ dequantize_fp8(weight, scale, (8, 24)).T
    assert torch.equal(per_row, expected.to(torch.bfloat16))


def test_w8a8_kernels_take_groups_of_32_or_more(monkeypatch):
    """An e4m3 dot's smallest K is 32: a K block of 16 (or 48) leaves the layer on the reference, not a failed
    launch."""
    from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    x = torch.randn(2, 128).to(torch.bfloat16)
    for block, eligible in (((16, 128), True), ((16, 32), True), ((16, 16), False), ((16, 48), False)):
        weight, scale = make_fp8(16, 128, block, seed=9)
        assert w8a8_eligible(x, weight, scale, block) is eligible, block
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8_matmul(x, *make_fp8(16, 128, (16, 16), seed=9), (16, 16))


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
    with pytest.raises(ValueError, match="per_row takes dynamic"):
        w8a8_matmul(x, weight, scale, (16, 128), torch.tensor(1.0), per_row=True)
    # the reference path (CPU) checks the same
    with pytest.raises(ValueError, match="per_row takes dynamic"):
        w8a8_linear(x, weight, scale, (16, 128), torch.tensor(1.0), per_row=True)
    with pytest.raises(ValueError, match="activation_scale must be one"):
        w8a8_linear(x, weight, scale, (16, 128), torch.ones(2))
    with pytest.raises(ValueError, match="contiguous rows"):
        fp8_w8a8.quantize_rows(torch.randn(128, 4).to(torch.bfloat16).T, 128)


# ---------------------------------------------------------------- transformers' FP8 layers (CPU)


@pytest.fixture
def quantized_activations(monkeypatch):
    """The layers' forwards as on a GPU with FP8 tensor cores (their W8A8 arithmetic, by the reference here)."""
    monkeypatch.setattr(fp8_w8a8, "activations_quantized", lambda x: True)


def test_cpu_and_fp32_activations_take_the_weight_only_product():
    layer = fp8_layer(100, 70, block_size=(16, 16), bias=True, seed=10)
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(10))
    assert not fp8_w8a8.activations_quantized(x) and not fp8_w8a8.activations_quantized(x.bfloat16())
    dense = dequantize_fp8(layer.weight, layer.weight_scale_inv, (16, 16))
    with torch.no_grad():
        torch.testing.assert_close(fp8_linear_forward(layer, x), F.linear(x, dense, layer.bias), rtol=1e-5, atol=1e-5)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        assert fp8_w8a8.activations_quantized(x.bfloat16().cuda()) and not fp8_w8a8.activations_quantized(x.cuda())


def _quantized_input(x, group=128, per_row=False, activation_scale=None):
    codes, s = quantize_activations(x, group, activation_scale, per_row)
    return codes.float() * s.repeat_interleave(x.shape[-1] if per_row else group, dim=-1)[..., :x.shape[-1]]


@pytest.mark.parametrize("block_size,bias", [((16, 16), False), ((32, 48), True), (None, True)])
def test_fp8_linear_forward_serves_fine_grained_fp8_linear(block_size, bias, quantized_activations):
    """Block scales at odd shapes (activation groups of the K block: 16; 48 -> 16), and ``block_size=None`` (a 0-dim
    per-tensor ``weight_scale_inv``, one activation scale per row, as transformers quantizes then). The module's own
    forward needs a GPU kernel (on CPU it raises ImportError); this one runs anywhere."""
    layer = fp8_layer(300, 70, block_size=block_size, bias=bias, seed=10)  # K > 128: per row is not one group
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.activation_scheme == "dynamic"
    x = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(10))
    x[..., 200:] *= 30
    dense = dequantize_fp8(layer.weight, layer.weight_scale_inv, block_size)
    quantized = _quantized_input(x, 16) if block_size else _quantized_input(x, per_row=True)
    with torch.no_grad():
        torch.testing.assert_close(fp8_linear_forward(layer, x), F.linear(quantized, dense, layer.bias), rtol=1e-5,
                                   atol=1e-5)
        other = _quantized_input(x, 128) if block_size is None else _quantized_input(x, per_row=True)
        assert not torch.allclose(fp8_linear_forward(layer, x), F.linear(other, dense, layer.bias), atol=1e-3)
        assert not torch.allclose(fp8_linear_forward(layer, x), F.linear(x, dense, layer.bias), atol=1e-3)


def test_fp8_linear_forward_static_activation_scale(quantized_activations):
    layer = FP8Linear(64, 32, block_size=(16, 16), activation_scheme="static")
    weight, scale = make_fp8(32, 64, (16, 16), seed=14)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale_inv.copy_(scale)
        layer.activation_scale.fill_(0.05)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(14)) * 40  # some values past 448 * 0.05: saturated
    expected = F.linear(_quantized_input(x, 16, activation_scale=torch.tensor(0.05)), dequantize_fp8(weight, scale,
                                                                                                    (16, 16)))
    with torch.no_grad():
        torch.testing.assert_close(fp8_linear_forward(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_fp8_linear_forward_keeps_a_dense_weight_dense():
    """transformers leaves FP8Linear layers whose shape does not tile by the block in the checkpoint dtype."""
    layer = FP8Linear(12, 7, block_size=(16, 16))
    layer.weight = nn.Parameter(torch.randn(7, 12))
    x = torch.randn(2, 12)
    assert torch.equal(fp8_linear_forward(layer, x), F.linear(x, layer.weight))


def test_fp8_linear_forward_reads_ue8m0_scales(quantized_activations):
    layer = FP8Linear(64, 32, block_size=(16, 16), scale_fmt="ue8m0")
    weight, scale = make_fp8(32, 64, (16, 16), seed=11)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale_inv.copy_(torch.exp2(torch.ceil(torch.log2(scale))).to(E8M0_DTYPE))
    assert layer.weight_scale_inv.dtype == E8M0_DTYPE
    x = torch.randn(3, 64).bfloat16()
    expected = F.linear(_quantized_input(x, 16), dequantize_by_blocks(weight, layer.weight_scale_inv, 16, 16))
    with torch.no_grad():
        assert torch.equal(fp8_linear_forward(layer, x), expected.bfloat16())


@pytest.mark.parametrize("bias", [False, True])
def test_compressed_fp8_linear_forward(bias, quantized_activations):
    """transformers' compressed-tensors FP8 layer: ``weight_scale`` fp32 [1, N] (a per-tensor scale arrives
    expanded to [1, N] by the loader); the activations take one scale per row, as transformers' forward does."""
    layer = CompressedTensorsFP8Linear(100, 70, has_bias=bias)
    weight, scale = make_fp8(70, 100, "channel", seed=12)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.weight_scale.copy_(scale.reshape(1, -1))
        if bias:
            layer.bias.normal_()
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(12)).bfloat16()
    x[1] *= 100  # one row's scale does not move another's
    with torch.no_grad():
        got = compressed_fp8_linear_forward(layer, x)
    expected = F.linear(_quantized_input(x, per_row=True), weight.float() * scale).bfloat16()
    assert torch.equal(got, expected if not bias else expected + layer.bias.detach().bfloat16())


def test_tiny_fp8_model_matches_its_quantized_dense_twin(quantized_activations):
    """A Gemma-4-31B-style model quantized by :func:`fp8_quantized_model` (FP8Linear everywhere but the LM head),
    its layers given :func:`fp8_linear_forward`: the logits of the same model whose nn.Linear layers hold the
    dequantized weights and quantize their inputs per row and group."""
    model = gemma4_31b_style()
    fp8_model = fp8_quantized_model(copy.deepcopy(model), block_size=(16, 16))
    layers = [m for m in fp8_model.modules() if isinstance(m, FP8Linear)]
    assert len(layers) > 20 and type(fp8_model.lm_head) is nn.Linear
    dense_model = copy.deepcopy(model)
    for name, layer in fp8_model.named_modules():
        if isinstance(layer, FP8Linear):
            layer.forward = fp8_linear_forward.__get__(layer)
            twin = dense_model.get_submodule(name)
            twin.register_forward_pre_hook(lambda _, args: (_quantized_input(args[0], 16),))
            with torch.no_grad():
                twin.weight.copy_(dequantize_fp8(layer.weight, layer.weight_scale_inv, layer.block_size))
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        got, expected = fp8_model(ids).logits, dense_model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, model(ids).logits.detach(), atol=1e-3)  # the weights did change


class _Launches:
    """A jitted kernel whose launches are counted."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("hidden", [64, 32])  # groups of 32 values; one K block per row: one scale per row
def test_triton_norms_hand_their_codes_to_the_fp8_products(triton_device, monkeypatch, hidden):
    """A 26B-A4B-style FP8 model with W8A8 products: the input norm, the seam's two next norms, the router's norm and
    the dense MLP's activation quantize their outputs for the q/k/v, gate/up, experts, router and down products,
    which then skip their own quantizing launch (2 of 7 launches a layer are left: o and the experts' intermediate
    rows); the logits
    are those of the products quantizing their rows themselves, bit for bit. Products that quantize whole rows
    keep their own launches."""
    from hf_specdec.generation import quantization
    from hf_specdec.generation.quantization import fp8_quantize_model
    from hf_specdec.kernels import fp8_moe
    from hf_specdec.models.gemma4 import fusion

    from ..tiny_models import gemma4_26b_style

    if triton_device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no e4m3 dots before sm_89: the layers compute the weight-only product there")
    for module in (fp8_w8a8, fp8_moe, quantization):
        monkeypatch.setattr(module, "activations_quantized", lambda x: x.dtype == torch.bfloat16)
    model = gemma4_26b_style(hidden_size=hidden, moe_intermediate_size=32, num_hidden_layers=2,
                             layer_types=["sliding_attention", "full_attention"])
    model = hf_specdec.enable(fp8_quantize_model(model.to(torch.bfloat16), (32, 32)).to(triton_device))
    layer = model.model.layers[0]
    group = 32 if hidden == 64 else None
    x = torch.randn(3, hidden, dtype=torch.bfloat16, device=triton_device)
    assert quantization.w8a8_input_group(x, layer.self_attn.q_proj, layer.self_attn.k_proj) == group
    assert quantization.w8a8_input_group(x, layer.experts, layer.router.proj) == group
    assert quantization.w8a8_input_group(x.float(), layer.self_attn.q_proj) is None
    assert quantization.w8a8_input_group(x, layer.self_attn.q_proj, nn.Linear(hidden, 4)) is None
    ids = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(3)).to(triton_device)
    counted = {}
    for name in ("_quantize_groups_kernel", "_quantize_row_kernel"):
        counted[name] = _Launches(getattr(fp8_w8a8, name))
        monkeypatch.setattr(fp8_w8a8, name, counted[name])
    with torch.no_grad():
        fused = model(ids).logits
    launches = sum(c.count for c in counted.values())
    monkeypatch.setattr(fusion, "w8a8_input_group", lambda *args: None)
    with torch.no_grad():
        unfused = model(ids).logits
    # hidden 32: the products of the hidden rows quantize whole rows (their own launches), the down projection's
    # intermediate rows (64 values) still come in groups of 32
    assert (launches, sum(c.count for c in counted.values()) - launches) == (2 * (2 if group else 6), 2 * 7)
    assert torch.equal(fused, unfused)


def test_triton_quantize_rows_takes_attached_codes_only_where_they_match(triton_device):
    """Attached codes replace the quantizing launch only for dynamic scales in the same group, for these rows, in
    the codes' dtype of this device; anything else is quantized anew."""
    from hf_specdec.kernels.fp8_w8a8 import codes_emulated, quantize_rows

    x = _rows(3, 256, torch.bfloat16, triton_device)
    emulate = codes_emulated(x.device)
    codes, scales = quantize_rows(x, 128, emulate=emulate)
    attached = (128, codes, scales)
    assert quantize_rows(x, 128, emulate=emulate, attached=attached)[0] is codes
    for kwargs in (dict(group=64), dict(per_row=True), dict(activation_scale=torch.ones(1, device=triton_device))):
        group = kwargs.pop("group", 128)
        assert quantize_rows(x, group, emulate=emulate, attached=attached, **kwargs)[0] is not codes
    assert quantize_rows(x[:2], 128, emulate=emulate, attached=attached)[0] is not codes
    other_dtype = (128, codes.float() if codes.dtype != torch.float32 else codes.to(FP8_DTYPE), scales)
    assert quantize_rows(x, 128, emulate=emulate, attached=other_dtype)[0] is not other_dtype[1]
