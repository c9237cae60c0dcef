"""fused_moe_fp8: the reference is fused_moe's on the dequantized weights, the grouped kernels over e4m3 weights
match the reference (block scales whose rows straddle the gate/up seam, per-expert scales, e8m0 scales, bytes
converted by integer ops), a token's output does not depend on the others of its forward, and transformers'
FP8Experts take the grouped kernels where their gate is one the kernels compute."""

import pytest
import torch

from hf_specdec.generation.quantization import fp8_quantize_model
from hf_specdec.kernels import fp8_moe
from hf_specdec.kernels.fp8_gemm import E8M0_DTYPE, dequantize_fp8, quantize_fp8
from hf_specdec.kernels.fp8_w8a8 import w8a8_linear_reference
from hf_specdec.kernels.fp8_moe import (
    fp8_experts_forward,
    fused_moe_fp8,
    fused_moe_fp8_eligible,
    fused_moe_fp8_reference,
    grouped_activation,
)
from hf_specdec.kernels.fused_moe import MoeConfig, fused_moe_reference

from ..tiny_models import gemma4_26b_style
from .conftest import run_file_cases_in_interpreter

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}
SMALL = MoeConfig(block_m=16, gate_up=(16, 16, 4, 2), down=(16, 16, 4, 2))  # several N and K tiles at test sizes


def quantized_experts(weights: torch.Tensor, block_size, gen: torch.Generator):
    """(e4m3 [E, N, K], fp32 scales [E, sn, sk]) of dense ``weights``, scales spread over powers of two (a wrong
    scale index shows); block_size None: one scale per expert's weight, two rows of it (as transformers allocates
    for a stacked gate/up)."""
    fp8, scales = [], []
    for w in weights:
        q, s = quantize_fp8(w, block_size or tuple(w.shape))
        s = s * torch.exp2(torch.randint(-3, 4, s.shape, generator=gen).float())
        fp8.append(q)
        scales.append(s.expand(2, -1) if block_size is None else s)
    return torch.stack(fp8), torch.stack(scales)


def make_fp8_moe(tokens, experts, top_k, hidden=32, inter=24, block_size=(16, 16), dtype=torch.bfloat16, seed=0,
                 device="cpu"):
    """(x, gate_up, gate_up_scale, down, down_scale, index, weights); inter 24 with 16-row scale blocks puts the
    up half's first rows in the gate's last block of scales (the 26B-A4B: 704 rows, 128-row blocks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, gate_up_scale = quantized_experts(torch.randn(experts, 2 * inter, hidden, generator=gen), block_size, gen)
    down, down_scale = quantized_experts(torch.randn(experts, hidden, inter, generator=gen), block_size, gen)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    return tuple(t.to(device) for t in (x.to(dtype), gate_up, gate_up_scale, down, down_scale, index, weights))


def assert_w8a8_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                      default_tiles: bool = False) -> None:
    """W8A8 kernels against the W8A8 reference. The kernels' gate/up sums differ from the reference's in the last
    bits (summation order; on Hopper the FP8 MMA's own accumulation), so an intermediate value can round to the
    neighbouring value of the dtype, and where that sits at an e4m3 rounding boundary its code moves by one e4m3 step
    (1/8 to 1/16 of the value): a few outputs move by up to ~2% of the outputs' scale. So: none off by more than 5% of
    the largest (a wrong scale or row moves most of them), and nearly every output within the dtype's tolerance: 95%,
    or 90% where the call ran the default tiles (``default_tiles``) with the stacked gate/up
    (``fp8_moe.W8A8_STACKED_GATE_UP``): its warpgroup MMA adds its products with Hopper's FP8 accumulation
    (``fp8_w8a8.MAX_IMPRECISE_ACC``), which moves more of those codes (5.6-7.2% of the outputs on these shapes on an
    H200, against under 5% with the warp-level MMA's fp32 sums of the other tiles). In the interpreter (CPU tensors)
    the kernels multiply in exact fp32: every output within the dtype's tolerance."""
    if got.device.type == "cpu":
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
        return
    got, expected = got.float().cpu(), expected.float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())
    tolerance = TOLERANCE[dtype]
    close = (got - expected).abs() <= tolerance["atol"] + tolerance["rtol"] * expected.abs()
    least = 0.90 if default_tiles and fp8_moe.W8A8_STACKED_GATE_UP else 0.95
    assert close.float().mean() >= least, f"{(~close).sum().item()} of {close.numel()} outputs off"


def dequantized(weight, scale, block_size):
    n, k = weight.shape[1:]
    bn, bk = block_size or (-(-n // scale.shape[1]), k)
    return torch.stack([dequantize_fp8(w, s[:-(-n // bn), :-(-k // bk)], (bn, bk)) for w, s in zip(weight, scale)])


# ---------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("block_size", [(16, 16), None])
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
def test_reference_is_fused_moe_on_the_dequantized_weights(block_size, activation):
    """In fp32 every rounding of either reference is exact to fp32: the two agree to the summation order."""
    x, gate_up, gate_up_scale, down, down_scale, index, weights = make_fp8_moe(5, 8, 2, block_size=block_size,
                                                                               dtype=torch.float32)
    got = fused_moe_fp8_reference(x, gate_up, gate_up_scale, down, down_scale, index, weights,
                                  activation=activation, block_size=block_size)
    dense_gate_up = dequantized(gate_up, gate_up_scale, block_size)
    expected = fused_moe_reference(x, dense_gate_up[:, :24], dense_gate_up[:, 24:],
                                   dequantized(down, down_scale, block_size), index, weights, activation=activation)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("block_size", [(16, 32), None])
def test_w8a8_reference_is_the_dense_w8a8_reference_per_expert(block_size):
    """W8A8: each (token, expert) pair's projections are the dense layers' W8A8 contract
    (``fp8_w8a8.w8a8_linear_reference`` of the expert's weight: its rows quantized per group of the K block, or per
    row without K blocks), the outputs weighted and summed in fp32; and the rows' quantization shows (the
    weight-only product differs)."""
    x, gate_up, gate_up_scale, down, down_scale, index, weights = make_fp8_moe(
        5, 8, 2, hidden=64, inter=48, block_size=block_size, seed=2)
    got = fused_moe_fp8_reference(x, gate_up, gate_up_scale, down, down_scale, index, weights,
                                  activation="gelu_tanh", block_size=block_size, w8a8=True)
    expected = torch.zeros(x.shape)
    for t in range(5):
        for slot in range(2):
            e = index[t, slot].item()
            per_row = block_size is None

            def linear(v, w, s):
                n, k = w.shape
                grid = s[:-(-n // block_size[0])] if block_size else s[:1].expand(1, 1)
                return w8a8_linear_reference(v, w, grid, block_size, per_row=per_row)

            gu = linear(x[t:t + 1], gate_up[e], gate_up_scale[e])
            if block_size is None:  # one scale for each half of the stacked gate/up
                gu = torch.cat([linear(x[t:t + 1], gate_up[e, :48], gate_up_scale[e, :1]),
                                linear(x[t:t + 1], gate_up[e, 48:], gate_up_scale[e, 1:])], dim=-1)
            h = torch.nn.functional.gelu(gu[:, :48], approximate="tanh") * gu[:, 48:]
            expected[t] += linear(h, down[e], down_scale[e])[0].float() * weights[t, slot]
    torch.testing.assert_close(got, expected.to(x.dtype), rtol=0, atol=0)
    weight_only = fused_moe_fp8_reference(x, gate_up, gate_up_scale, down, down_scale, index, weights,
                                          activation="gelu_tanh", block_size=block_size)
    assert not torch.equal(got, weight_only)


def test_bad_arguments_name_the_fix():
    x, gate_up, gate_up_scale, down, down_scale, index, weights = make_fp8_moe(2, 4, 2)
    with pytest.raises(ValueError, match=r"gate_up must be \[num_experts, 2 \* inter, hidden=32\] float8_e4m3fn"):
        fused_moe_fp8(x, gate_up.float(), gate_up_scale, down, down_scale, index, weights, activation="silu")
    with pytest.raises(ValueError, match=r"down must be \[num_experts=4, hidden=32, inter=24\]"):
        fused_moe_fp8(x, gate_up, gate_up_scale, down[:, :, :16], down_scale, index, weights, activation="silu")
    with pytest.raises(ValueError, match=r"down_scale must be \[num_experts=4, sn, sk\]"):
        fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale[0], index, weights, activation="silu")
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, index, weights, activation="relu")
    with pytest.raises(ValueError, match=r"must be \[E, ceil\(48/16\), ceil\(32/8\)\]"):
        fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, index, weights, activation="silu",
                      block_size=(16, 8))


def test_cpu_tensors_take_the_reference(monkeypatch):
    args = make_fp8_moe(3, 8, 2)
    monkeypatch.setattr(fp8_moe, "launch", lambda *a, **k: pytest.fail("the kernels were launched"))
    assert not fused_moe_fp8_eligible(*args, block_size=(16, 16))
    torch.testing.assert_close(fused_moe_fp8(*args, activation="gelu_tanh", block_size=(16, 16)),
                               fused_moe_fp8_reference(*args, activation="gelu_tanh", block_size=(16, 16)),
                               rtol=0, atol=0)


def test_grouped_activation_only_for_gates_the_kernels_compute():
    experts = fp8_quantize_model(gemma4_26b_style(), (16, 16)).model.layers[0].experts
    assert grouped_activation(experts) == "gelu_tanh"
    experts.swiglu_limit = experts.limit = 7.0  # a clamped gate: the module's own _apply_gate
    assert grouped_activation(experts) is None
    experts.swiglu_limit = experts.limit = None
    experts.act_fn = torch.nn.ReLU()
    assert grouped_activation(experts) is None


# ---------------------------------------------------------------- kernels (GPU, or the interpreter)


@pytest.mark.parametrize("path", ["fp16_dots", "native", "bytes"])
@pytest.mark.parametrize("block_size,scale_dtype", [((16, 16), torch.float32), ((16, 32), E8M0_DTYPE),
                                                    (None, torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fused_moe_fp8(triton_device, monkeypatch, dtype, block_size, scale_dtype, path):
    """path: bf16 rows as fp16 for the gate/up dots (the default with native e4m3 loads), e4m3 loaded natively and
    converted to the rows' dtype, or loaded as bytes and converted by integer ops."""
    monkeypatch.setattr(fp8_moe, "has_native_fp8", lambda device: path != "bytes")
    monkeypatch.setattr(fp8_moe, "FP16_DOTS", path == "fp16_dots")
    x, gate_up, gate_up_scale, down, down_scale, index, weights = make_fp8_moe(3, 8, 2, block_size=block_size,
                                                                               dtype=dtype, seed=len(str(block_size)))
    if scale_dtype == E8M0_DTYPE:  # powers of two
        gate_up_scale, down_scale = (torch.exp2(s.log2().round()).to(E8M0_DTYPE) for s in (gate_up_scale, down_scale))
    args = tuple(t.to(triton_device) for t in (x, gate_up, gate_up_scale.to(scale_dtype), down,
                                                down_scale.to(scale_dtype), index, weights))
    activation = "gelu_tanh" if dtype == torch.bfloat16 else "silu"
    got = fused_moe_fp8(*args, activation=activation, block_size=block_size, config=SMALL)
    expected = fused_moe_fp8_reference(*(t.cpu() for t in args), activation=activation, block_size=block_size)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_triton_fused_moe_fp8_default_config(triton_device, tokens):
    """Decode (one token), verify (grouped in 16-row blocks) and a prefill (40 tokens: an expert's pairs over several
    16-row blocks) with the default tiles."""
    args = make_fp8_moe(tokens, 4, 2, hidden=64, inter=48, block_size=(16, 32), seed=tokens, device=triton_device)
    got = fused_moe_fp8(*args, activation="gelu_tanh", block_size=(16, 32))
    expected = fused_moe_fp8_reference(*(t.cpu() for t in args), activation="gelu_tanh", block_size=(16, 32))
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[torch.bfloat16])


def test_triton_fused_moe_fp8_token_alone_gives_the_same_bits(triton_device):
    """A verify forward's token and a decode step of the same token round alike (batch invariance)."""
    x, *rest, index, weights = make_fp8_moe(6, 8, 2, seed=3, device=triton_device)
    together = fused_moe_fp8(x, *rest, index, weights, activation="gelu_tanh", block_size=(16, 16))
    for t in (0, 4):
        alone = fused_moe_fp8(x[t:t + 1], *rest, index[t:t + 1], weights[t:t + 1], activation="gelu_tanh",
                              block_size=(16, 16))
        assert torch.equal(alone[0], together[t])


def run_experts(experts, device, seed: int):
    """(``fp8_experts_forward`` of 4 bf16 tokens routed to 2 experts each, the call's arguments for
    ``fused_moe_fp8_reference`` on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 32, generator=gen).bfloat16().to(device)
    index = torch.tensor([[0, 5], [5, 7], [2, 0], [5, 1]], device=device)
    weights = torch.rand(4, 2, generator=gen).to(device)
    with torch.no_grad():
        got = fp8_experts_forward(experts, hidden, index, weights)
    return got, [t.cpu() for t in (hidden, experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
                                   experts.down_proj_scale_inv, index, weights)]


def test_triton_fp8_experts_forward_takes_the_grouped_kernels(triton_device, monkeypatch):
    """transformers' FP8Experts of a 26B-A4B-style model (8 experts, top-2, inter 16 in 16 x 16 blocks): the forward
    runs the grouped kernels (never the per-pair one) and equals the grouped reference."""
    experts = fp8_quantize_model(gemma4_26b_style(), (16, 16)).model.layers[0].experts.to(triton_device)
    monkeypatch.setattr(fp8_moe, "fp8_expert_linear", lambda *a, **k: pytest.fail("the per-pair path ran"))
    got, args = run_experts(experts, triton_device, seed=5)
    expected = fused_moe_fp8_reference(*args, activation="gelu_tanh", block_size=(16, 16))
    torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("block_size,scale_dtype", [((16, 32), torch.float32), ((32, 64), E8M0_DTYPE),
                                                    (None, torch.float32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_fused_moe_w8a8(triton_device, dtype, block_size, scale_dtype, tokens):
    """W8A8 kernels against the W8A8 reference: block scales (groups of 32 and 64; rows of the stacked gate/up
    straddling the seam), e8m0 scales, per-row activations without K blocks; decode (one token: no grouping),
    verify and a prefill (40 tokens: an expert's pairs over several 16-row blocks)."""
    x, gate_up, gate_up_scale, down, down_scale, index, weights = make_fp8_moe(
        tokens, 8, 2, hidden=64, inter=48, block_size=block_size, dtype=dtype, seed=tokens)
    if scale_dtype == E8M0_DTYPE:
        gate_up_scale, down_scale = (torch.exp2(s.log2().round()).to(E8M0_DTYPE) for s in (gate_up_scale, down_scale))
    args = tuple(t.to(triton_device) for t in (x, gate_up, gate_up_scale, down, down_scale, index, weights))
    assert fused_moe_fp8_eligible(*args, block_size=block_size, w8a8=True)
    activation = "gelu_tanh" if dtype == torch.bfloat16 else "silu"
    got = fused_moe_fp8(*args, activation=activation, block_size=block_size, config=SMALL, w8a8=True)
    expected = fused_moe_fp8_reference(*(t.cpu() for t in args), activation=activation, block_size=block_size,
                                       w8a8=True)
    assert got.shape == x.shape and got.dtype == dtype
    assert_w8a8_close(got, expected, dtype)
    if tokens == 5:  # the default tiles
        assert_w8a8_close(fused_moe_fp8(*args, activation=activation, block_size=block_size, w8a8=True), expected,
                          dtype, default_tiles=True)


@pytest.mark.parametrize("block_size", [None, (32, 256)])
def test_triton_fused_moe_w8a8_wide_k(triton_device, block_size):
    """K past one 128-wide step: per-row activations over several steps (no K blocks: one scale per row, read at
    every step), and a 256-wide K block (activation groups of 128, two per block of weight scales)."""
    args = make_fp8_moe(5, 8, 2, hidden=320, inter=200, block_size=block_size, seed=7, device=triton_device)
    assert fused_moe_fp8_eligible(*args, block_size=block_size, w8a8=True)  # the kernels, not the reference
    got = fused_moe_fp8(*args, activation="silu", block_size=block_size, w8a8=True)
    expected = fused_moe_fp8_reference(*(t.cpu() for t in args), activation="silu", block_size=block_size,
                                       w8a8=True)
    assert_w8a8_close(got, expected, torch.bfloat16, default_tiles=True)


def test_triton_fused_moe_w8a8_token_alone_gives_the_same_bits(triton_device):
    """W8A8: a verify forward's token and a decode step of the same token round alike (batch invariance)."""
    x, *rest, index, weights = make_fp8_moe(6, 8, 2, hidden=64, block_size=(16, 32), seed=4, device=triton_device)
    together = fused_moe_fp8(x, *rest, index, weights, activation="gelu_tanh", block_size=(16, 32), w8a8=True)
    for t in (0, 4):
        alone = fused_moe_fp8(x[t:t + 1], *rest, index[t:t + 1], weights[t:t + 1], activation="gelu_tanh",
                              block_size=(16, 32), w8a8=True)
        assert torch.equal(alone[0], together[t])


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("block_size", [(32, 64), (16, 32), None])
def test_triton_fused_moe_w8a8_gate_up_stacked_or_apart(triton_device, monkeypatch, block_size, stacked):
    """The gate/up kernel's two ways (one tile of the gate's rows over the up's, or two tiles) against the W8A8
    reference: block scales whose rows straddle the seam between the halves, a column block past the intermediate
    size (inter 40 in blocks of 32), per-row activations."""
    monkeypatch.setattr(fp8_moe, "W8A8_STACKED_GATE_UP", stacked)
    args = make_fp8_moe(5, 8, 2, hidden=320, inter=40, block_size=block_size, seed=10, device=triton_device)
    got = fused_moe_fp8(*args, activation="gelu_tanh", block_size=block_size, w8a8=True)
    expected = fused_moe_fp8_reference(*(t.cpu() for t in args), activation="gelu_tanh", block_size=block_size,
                                       w8a8=True)
    assert_w8a8_close(got, expected, torch.bfloat16, default_tiles=True)


def test_triton_w8a8_needs_groups_of_32(triton_device):
    """Groups of 16 values (a 16-wide K block) are below an e4m3 dot's smallest K: the reference, not a launch
    (where the weight-only kernels run)."""
    args = make_fp8_moe(3, 8, 2, block_size=(16, 16), device=triton_device)
    assert fused_moe_fp8_eligible(*args, block_size=(16, 16))
    assert not fused_moe_fp8_eligible(*args, block_size=(16, 16), w8a8=True)
    assert fused_moe_fp8_eligible(*make_fp8_moe(3, 8, 2, block_size=(16, 32), device=triton_device),
                                  block_size=(16, 32), w8a8=True)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_triton_fp8_experts_forward_quantizes_rows_where_transformers_does(triton_device, monkeypatch, scheme):
    """Where the activations are quantized (bf16 / fp16 on a GPU with FP8 tensor cores: forced here), FP8Experts
    with dynamic activations take the W8A8 kernels and equal the W8A8 reference; static activation scales keep the
    weight-only kernels."""
    experts = fp8_quantize_model(gemma4_26b_style(), (16, 32)).model.layers[0].experts.to(triton_device)
    experts.activation_scheme = scheme
    monkeypatch.setattr(fp8_moe, "activations_quantized", lambda x: True)
    launched = []
    for name in ("fused_moe_w8a8_kernels", "_kernels"):
        monkeypatch.setattr(fp8_moe, name, (lambda f, n: lambda *a, **k: launched.append(n) or f(*a, **k))(
            getattr(fp8_moe, name), name))
    got, args = run_experts(experts, triton_device, seed=6)
    w8a8 = scheme == "dynamic"
    assert launched == ["fused_moe_w8a8_kernels" if w8a8 else "_kernels"]
    expected = fused_moe_fp8_reference(*args, activation="gelu_tanh", block_size=(16, 32), w8a8=w8a8)
    if w8a8:
        assert_w8a8_close(got, expected, torch.bfloat16, default_tiles=True)
    else:
        torch.testing.assert_close(got.float().cpu(), expected.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_moe_fp8_captures_in_a_cuda_graph():
    """No host sync inside: the layer captures, and a replay on a new routing equals the eager call on it."""
    args = make_fp8_moe(4, 8, 2, hidden=256, inter=192, block_size=(128, 128), device="cuda")
    index, weights = args[-2], args[-1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_fp8(*args, activation="gelu_tanh", block_size=(128, 128))
        out_w8a8 = fused_moe_fp8(*args, activation="gelu_tanh", block_size=(128, 128), w8a8=True)
    index.copy_(torch.stack([torch.randperm(8, device="cuda")[:2] for _ in range(4)]))
    weights.copy_(torch.rand(4, 2, device="cuda"))
    graph.replay()
    for got, w8a8 in ((out, False), (out_w8a8, True)):
        expected = fused_moe_fp8(*args, activation="gelu_tanh", block_size=(128, 128), w8a8=w8a8)
        assert torch.equal(got, expected)
        reference = fused_moe_fp8_reference(*(t.cpu() for t in args), activation="gelu_tanh", block_size=(128, 128),
                                            w8a8=w8a8)
        if w8a8:
            assert_w8a8_close(got, reference, torch.bfloat16, default_tiles=True)
        else:
            torch.testing.assert_close(got.float().cpu(), reference.float(), **TOLERANCE[torch.bfloat16])


def test_fp8_moe_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=38)
