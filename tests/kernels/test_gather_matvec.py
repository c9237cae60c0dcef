"""gather_matvec: the reference is the centroid head's embedding lookup + bmm; the Triton kernel matches it."""

import pytest
import torch

from hf_specdec.kernels.gather_matvec import gather_matvec, gather_matvec_reference


def _case(dtype, device, batch=3, n=70, vocab=300, dim=100):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype).to(device)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(batch)]).to(device)
    hidden = torch.randn(batch, dim, generator=gen).to(dtype).to(device)
    return weight, ids, hidden


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 100), (torch.bfloat16, 300)])
def test_triton_gather_matvec(triton_device, dtype, dim):
    weight, ids, hidden = _case(dtype, triton_device, dim=dim)
    got = gather_matvec(weight, ids, hidden)
    expected = gather_matvec_reference(weight, ids, hidden)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **tol)


def test_reference_is_the_row_lookup_and_dot():
    weight, ids, hidden = _case(torch.float64, "cpu")
    expected = torch.stack([weight[ids[b]] @ hidden[b] for b in range(ids.shape[0])])
    torch.testing.assert_close(gather_matvec_reference(weight, ids, hidden), expected)


def test_bad_shapes_name_the_fix():
    weight, ids, hidden = _case(torch.float32, "cpu")
    with pytest.raises(ValueError, match="need weight"):
        gather_matvec(weight, ids, hidden[:, :-1])
