"""gather_matvec: the reference is the centroid head's embedding lookup + bmm; the Triton kernel matches it."""

import pytest
import torch

from hf_specdec.kernels.gather_matvec import (
    centroid_candidates,
    centroid_candidates_reference,
    gather_matvec,
    gather_matvec_reference,
)


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


@pytest.mark.parametrize("cap", [30.0, 0.5])
def test_triton_gather_matvec_softcap(triton_device, cap):
    """The fused soft-cap is transformers' ``cap * tanh(logits / cap)`` of the fp32 sums, saturating at +-cap."""
    weight, ids, hidden = _case(torch.float32, triton_device)
    hidden = hidden * 4  # logits of +-40 or so: both the linear part and the saturated ends of tanh
    got = gather_matvec(weight, ids, hidden, softcap=cap)
    expected = gather_matvec_reference(weight, ids, hidden, softcap=cap)
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=2e-5 * cap, rtol=1e-5)
    assert got.abs().max() <= cap and got.abs().max() > 0.99 * cap


def test_softcap_reference_is_gemma_softcap():
    from hf_specdec.models.gemma4.centroid_head import softcap

    weight, ids, hidden = _case(torch.float64, "cpu")
    torch.testing.assert_close(gather_matvec_reference(weight, ids, hidden, softcap=3.0),
                               softcap(gather_matvec_reference(weight, ids, hidden), 3.0))


def _scores(batch, num_centroids, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, num_centroids, generator=gen).to(device)


@pytest.mark.parametrize("num_centroids,per,top_k,dtype", [(64, 8, 8, torch.float32), (96, 4, 5, torch.bfloat16),
                                                           (2048, 2, 32, torch.bfloat16)])
def test_triton_centroid_candidates_are_the_top_centroids_tokens(triton_device, num_centroids, per, top_k, dtype):
    gen = torch.Generator().manual_seed(1)
    ordering = torch.randperm(num_centroids * per, generator=gen).to(triton_device)
    scores = torch.randn(3, num_centroids, generator=gen).to(dtype)
    scores[1] = scores[1].abs()  # distinct values, only non-negative ones: the sign handling of the int keys
    scores[2] = -scores[2].abs()
    scores = scores.to(triton_device)
    got = centroid_candidates(scores, ordering, top_k).cpu()
    assert got.dtype == ordering.dtype and got.shape == (3, top_k * per)
    ordering, scores = ordering.cpu(), scores.cpu()
    picked = ordering.argsort()[got.view(3, top_k, per)[:, :, 0]] // per  # the centroid owning each block
    assert torch.equal(got.view(3, top_k, per), ordering.view(num_centroids, per)[picked])  # all of its ids
    assert all(len(set(row.tolist())) == top_k for row in picked)
    # the best scores, best first (a bf16 tie may pick the other of two equal centroids than torch.topk does)
    assert torch.equal(scores.gather(1, picked), scores.topk(top_k, dim=-1).values)
    if dtype == torch.float32:
        assert torch.equal(got, centroid_candidates_reference(scores, ordering, top_k))


def test_triton_centroid_candidates_ties_nan_and_inf_give_distinct_centroids(triton_device):
    ordering = torch.arange(16 * 4).to(triton_device)
    scores = torch.zeros(3, 16)
    scores[0, 3], scores[0, 9] = float("inf"), float("nan")  # NaN ranks first, as torch.topk ranks it
    scores[1] = float("-inf")
    scores[2, 5] = torch.tensor([-4194304], dtype=torch.int32).view(torch.float32)  # a NaN with the sign bit set
    scores[2, 7] = float("-inf")
    got = centroid_candidates(scores.to(triton_device), ordering, 4).cpu()
    picked = got.view(3, 4, 4)[:, :, 0] // 4  # the centroid of each block of 4 ids
    assert picked[0].tolist() == [9, 3, 0, 1]  # then the zeros, ties to the lower index
    assert picked[1].tolist() == [0, 1, 2, 3]
    assert picked[2].tolist() == [5, 0, 1, 2]
    assert torch.equal(got.view(3, 4, 4), (picked[:, :, None] * 4 + torch.arange(4)))


def test_centroid_candidates_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="top_k <= num_centroids"):
        centroid_candidates(_scores(2, 8, "cpu"), torch.arange(32), 9)
    with pytest.raises(ValueError, match="token_ordering"):
        centroid_candidates(_scores(2, 8, "cpu"), torch.arange(30), 2)
