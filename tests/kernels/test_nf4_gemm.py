"""nf4_linear: bitsandbytes' packed NF4 weights multiplied for a few rows without writing a dequantized copy. The
kernel matches the reference (dequantize, round to the activation dtype, multiply in fp32) to a rounding of the
activation dtype for odd shapes, 1 to 40 rows, bf16 and fp16; a row's result is bit-identical whatever rows share
its forward; the reference decodes bitsandbytes' layout exactly; bitsandbytes' ``Linear4bit`` takes the kernel only
for what it reads (NF4, fp32 absmax, few rows in the compute dtype) and its own forward otherwise.
"""

import pytest
import torch

from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV
from hf_specdec.kernels.nf4_gemm import (
    MAX_KERNEL_ROWS,
    dequantize_nf4,
    nf4_fusible,
    nf4_layout,
    nf4_linear_forward,
    nf4_linear_reference,
    nf4_matmul,
)

from .conftest import run_file_cases_in_interpreter

SMALL = (16, 64, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs and K tiles at test sizes
TOLERANCE = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-4), torch.float16: dict(rtol=2 ** -10, atol=1e-4)}


def make_nf4(n, k, blocksize=64, seed=0, device="cpu"):
    """(packed uint8 [n * k / 2, 1], absmax fp32, code fp32 [16]) with random codes and absmax spread over powers
    of two (a wrong block index shows as a large error)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n * k // 2, 1), generator=gen, dtype=torch.uint8)
    absmax = 2.0 ** torch.randint(-3, 3, (n * k // blocksize,), generator=gen).float()
    code = torch.sort(torch.rand(CODES, generator=gen) * 2 - 1).values
    code[0], code[-1] = -1.0, 1.0
    return packed.to(device), absmax.to(device), code.to(device)


CODES = 16


def _check_kernel(device, dtype, rows, n, k, blocksize, config=SMALL, seed=0):
    packed, absmax, code = make_nf4(n, k, blocksize, seed=seed, device=device)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    got = nf4_matmul(x, packed, absmax, code, n, blocksize, config=config)
    expected = nf4_linear_reference(x, packed, absmax, code, n, blocksize)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_triton_nf4_matches_the_reference(triton_device, dtype, rows):
    """50 output columns (not a multiple of the 16-column programs), K = 192 (three 64-wide K tiles)."""
    _check_kernel(triton_device, dtype, rows, 50, 192, 64, seed=rows)


@pytest.mark.parametrize("blocksize", [32, 128])
def test_triton_nf4_other_block_sizes_and_k_past_the_last_tile(triton_device, blocksize):
    """K = 384 with 256-deep tiles: the last tile runs past K (masked)."""
    _check_kernel(triton_device, torch.bfloat16, 3, 24, 384, blocksize, config=(16, 256, 4, 2))


def test_triton_nf4_default_config(triton_device):
    _check_kernel(triton_device, torch.bfloat16, 2, 40, 512, 64, config=None)


def test_triton_nf4_rows_do_not_depend_on_the_batch(triton_device):
    """Each row of a 40-row forward (three row tiles) is bit-identical to that row computed alone: a verify step
    rounds each token as a one-token decode step does."""
    packed, absmax, code = make_nf4(40, 128, 64, seed=3, device=triton_device)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).to(triton_device, torch.bfloat16)
    together = nf4_matmul(x, packed, absmax, code, 40, 64, config=SMALL)
    for r in (0, 15, 16, 39):
        assert torch.equal(nf4_matmul(x[r:r + 1], packed, absmax, code, 40, 64, config=SMALL)[0], together[r])


def test_nf4_gemm_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (conftest)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=11)


# ---------------------------------------------------------------- reference, layout, dispatch (CPU)


def test_the_launcher_names_what_is_wrong():
    packed, absmax, code = make_nf4(8, 128)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        nf4_matmul(x.float(), packed, absmax, code, 8, 64)
    with pytest.raises(ValueError, match="multiple of the blocksize"):
        nf4_matmul(torch.randn(2, 96, dtype=torch.bfloat16), packed, absmax, code, 8, 64)
    with pytest.raises(ValueError, match="contiguous uint8"):
        nf4_matmul(x, packed[:-1], absmax, code, 8, 64)
    with pytest.raises(ValueError, match="rows"):
        nf4_matmul(torch.randn(MAX_KERNEL_ROWS + 1, 128, dtype=torch.bfloat16), packed, absmax, code, 8, 64)


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")


def _linear4bit(bnb, n, k, quant_type="nf4", nested=False, dtype=torch.bfloat16, bias=False):
    torch.manual_seed(0)
    dense = torch.nn.Linear(k, n, bias=bias)
    layer = bnb.nn.Linear4bit(k, n, bias=bias, compute_dtype=dtype, compress_statistics=nested, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, compress_statistics=nested,
                                     quant_type=quant_type, blocksize=64).to("cpu")
    if bias:
        layer.bias = torch.nn.Parameter(dense.bias.data.to(dtype), requires_grad=False)
    for module in (layer,):
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False  # no CPU repacking of the bytes at the first forward
    return layer


def test_the_reference_decodes_bitsandbytes_layout_exactly(bnb):
    layer = _linear4bit(bnb, 24, 192)
    packed, absmax, code, n, blocksize = nf4_layout(layer)
    state = layer.weight.quant_state
    expected = bnb.functional.dequantize_4bit(layer.weight.data, state.__class__(
        absmax=state.absmax, shape=state.shape, code=state.code, blocksize=state.blocksize, quant_type="nf4",
        dtype=torch.float32))
    assert torch.equal(dequantize_nf4(packed, absmax, code, (n, 192), blocksize), expected)


def test_layouts_the_kernel_does_not_read_keep_bitsandbytes_forward(bnb, monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    assert nf4_fusible(_linear4bit(bnb, 16, 128))
    assert nf4_layout(_linear4bit(bnb, 16, 128, quant_type="fp4")) is None
    assert nf4_layout(_linear4bit(bnb, 16, 128, nested=True)) is None
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    assert not nf4_fusible(_linear4bit(bnb, 16, 128))


def test_the_forward_falls_back_to_bitsandbytes_outside_the_kernel(bnb, monkeypatch):
    """Kernels off (the CPU), fp32 activations, more rows than the kernel takes: the layer's own output exactly."""
    layer = _linear4bit(bnb, 16, 128, bias=True)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    assert torch.equal(nf4_linear_forward(layer, x), layer(x))
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    calls = []
    monkeypatch.setattr("hf_specdec.kernels.nf4_gemm.nf4_matmul", lambda *a, **k: calls.append(a))
    many = torch.randn(MAX_KERNEL_ROWS + 1, 128, dtype=torch.bfloat16)
    assert torch.equal(nf4_linear_forward(layer, many), layer(many))
    assert torch.equal(nf4_linear_forward(layer, x.float()), layer(x.float()))
    assert not calls


def test_triton_nf4_forward_of_a_bitsandbytes_layer(triton_device, bnb):
    """The instance forward on a real ``Linear4bit`` (bias, [batch, tokens, K] input): the reference on its bytes
    plus the bias, and bitsandbytes' own product to a rounding."""
    layer = _linear4bit(bnb, 40, 192, bias=True).to(triton_device)
    x = torch.randn(2, 3, 192, generator=torch.Generator().manual_seed(5)).to(triton_device, torch.bfloat16)
    got = nf4_linear_forward(layer, x)
    packed, absmax, code, n, blocksize = nf4_layout(layer)
    expected = nf4_linear_reference(x, packed, absmax, code, n, blocksize) + layer.bias
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(got.float(), layer(x).float(), rtol=2 ** -6, atol=2e-3)
