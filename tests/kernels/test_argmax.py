"""argmax: the two-launch kernel returns torch.argmax's index on every row, ties, NaNs and infinities included."""

import pytest
import torch

from hf_specdec.kernels.argmax import CHUNK, argmax, argmax_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * CHUNK), (3, 5 * CHUNK + 17), (2, 2, 3 * CHUNK - 1)])
def test_triton_argmax_matches_torch(triton_device, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    got = argmax(x.to(triton_device))
    assert got.dtype == torch.int64 and got.shape == shape[:-1]
    assert torch.equal(got.cpu(), torch.argmax(x, dim=-1))


def test_triton_argmax_ties_pick_the_first_index(triton_device):
    """Equal maxima within a chunk, across chunks, and a row of one repeated value (bf16 rounds many to one)."""
    width = 4 * CHUNK + 3
    x = torch.zeros(4, width)
    x[0, [7, 9, CHUNK + 1]] = 5.0  # within the first chunk, and in a later one
    x[1, [3 * CHUNK + 2, 2 * CHUNK + 5, width - 1]] = 5.0  # only later chunks
    x[2] = -1.0  # all equal: index 0
    x[3, width - 1] = 1.0  # the last column
    got = argmax(x.to(triton_device)).cpu()
    assert got.tolist() == [7, 2 * CHUNK + 5, 0, width - 1]
    assert torch.equal(got, torch.argmax(x, dim=-1))


def test_triton_argmax_nan_and_infinities_as_torch(triton_device):
    width = 3 * CHUNK
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(4))
    x[0, 100] = float("inf")
    x[1, 2 * CHUNK + 4] = float("nan")  # a NaN beats everything, +inf included
    x[1, 10] = float("inf")
    x[2, [CHUNK + 9, 2 * CHUNK + 1]] = float("nan")  # the first NaN
    x[3] = float("-inf")  # no finite value: index 0
    x[4, :] = float("-inf")
    x[4, 2 * CHUNK + 7] = -1e30
    got = argmax(x.to(triton_device)).cpu()
    assert got.tolist() == torch.argmax(x, dim=-1).tolist() == [100, 2 * CHUNK + 4, CHUNK + 9, 0, 2 * CHUNK + 7]


def test_triton_argmax_of_a_column_slice(triton_device):
    """Rows with a stride (the last position of [batch, seq, vocab] logits)."""
    x = torch.randn(2, 3, 2 * CHUNK + 5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(argmax(x.to(triton_device)[:, -1]).cpu(), torch.argmax(x[:, -1], dim=-1))


def test_narrow_rows_and_fp64_rows_take_torch_where_the_kernels_run(monkeypatch):
    """With the kernels on (forced), rows narrower than two chunks and fp64 rows (the kernel compares in fp32) never
    reach the kernels, and get torch's index."""
    from hf_specdec.kernels import argmax as argmax_module
    from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the kernel was launched")

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    monkeypatch.setattr(argmax_module, "_chunk_max_kernel", NoLaunch())
    narrow = torch.randn(3, 2 * CHUNK - 1, generator=torch.Generator().manual_seed(6))
    assert torch.equal(argmax(narrow), torch.argmax(narrow, dim=-1))
    wide = torch.zeros(1, 2 * CHUNK, dtype=torch.float64)
    wide[0, 5], wide[0, 9] = 1.0, 1.0 + 1e-12  # one fp32 value: a kernel would tie them at 5
    assert argmax(wide).item() == 9
    assert torch.equal(argmax_reference(narrow), torch.argmax(narrow, dim=-1))


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="floating-point"):
        argmax(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-empty last dim"):
        argmax(torch.zeros(2, 0))
