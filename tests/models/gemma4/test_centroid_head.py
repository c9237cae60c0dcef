"""The centroid LM head: exact candidate sets, argmax/sampling/probabilities over candidates only."""

import math

import pytest
import torch

from hf_specdec.models.gemma4 import CandidateLogits, DenseLogits, argmax_no_sync, probs, sample_no_sync
from hf_specdec.models.gemma4.centroid_head import CentroidHead

VOCAB, HIDDEN, CENTROIDS, TOP_K = 48, 16, 6, 2  # 8 tokens per centroid, 16 candidates per row


@pytest.fixture
def head_and_inputs():
    gen = torch.Generator().manual_seed(0)
    head = CentroidHead(HIDDEN, VOCAB, CENTROIDS, TOP_K)
    with torch.no_grad():
        head.centroids.weight.copy_(torch.randn(CENTROIDS, HIDDEN, generator=gen))
        head.token_ordering.copy_(torch.randperm(VOCAB, generator=gen))
    hidden = torch.randn(5, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen)
    return head, hidden, lm_head


def brute_force_masked_logits(head, hidden, lm_head):
    """Full-vocab logits with -inf outside the tokens owned by each row's top-k centroids."""
    top = (hidden @ head.centroids.weight.T).topk(TOP_K, dim=-1).indices
    owned = head.token_ordering.view(CENTROIDS, -1)
    allowed = torch.zeros(hidden.shape[0], VOCAB, dtype=torch.bool)
    for row in range(hidden.shape[0]):
        allowed[row, owned[top[row]].flatten()] = True
    return (hidden @ lm_head.T).masked_fill(~allowed, float("-inf")), allowed


def test_candidates_are_exactly_the_tokens_of_the_top_centroids(head_and_inputs):
    head, hidden, lm_head = head_and_inputs
    cands = head(hidden, lm_head)
    full, allowed = brute_force_masked_logits(head, hidden, lm_head)
    assert cands.token_ids.shape == (5, TOP_K * VOCAB // CENTROIDS)
    for row in range(5):
        assert sorted(cands.token_ids[row].tolist()) == allowed[row].nonzero().flatten().tolist()
    torch.testing.assert_close(cands.logits, full.gather(-1, cands.token_ids))


def test_argmax_equals_brute_force_masked_argmax(head_and_inputs):
    head, hidden, lm_head = head_and_inputs
    cands = head(hidden, lm_head)
    full, _ = brute_force_masked_logits(head, hidden, lm_head)
    assert torch.equal(argmax_no_sync(cands), full.argmax(-1))
    assert torch.equal(cands.argmax(), full.argmax(-1))
    assert not torch.equal(full.argmax(-1), (hidden @ lm_head.T).argmax(-1))  # the mask matters in this fixture


def test_probabilities_are_zero_outside_candidates(head_and_inputs):
    head, hidden, lm_head = head_and_inputs
    cands = head(hidden, lm_head)
    full, allowed = brute_force_masked_logits(head, hidden, lm_head)
    dense = cands.dense_probs(0.8)
    torch.testing.assert_close(dense, torch.softmax(full / 0.8, dim=-1))
    assert torch.all(dense[~allowed] == 0) and torch.all(cands.dense_logits()[~allowed] == float("-inf"))
    torch.testing.assert_close(dense.sum(-1), torch.ones(5))
    outsider = (~allowed).float().argmax(-1)  # one non-candidate token per row
    assert torch.all(cands.token_prob(outsider, 0.8) == 0)
    torch.testing.assert_close(cands.token_prob(cands.token_ids[:, 3], 0.8), probs(cands, 0.8)[:, 3])


def chi_square(counts: torch.Tensor, p: torch.Tensor, n: int) -> float:
    expected = p * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_frequencies_follow_probs():
    gen = torch.Generator().manual_seed(0)
    n, temperature = 40_000, 0.7
    cands = CandidateLogits(
        token_ids=torch.tensor([[40, 3, 17, 25, 8, 31]]).expand(n, -1),
        logits=torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0, -1.2]]).expand(n, -1),
        vocab_size=VOCAB,
    )
    tokens, token_probs = sample_no_sync(cands, temperature, generator=gen)
    p = probs(cands, temperature)[0]
    counts = torch.stack([(tokens == t).sum() for t in cands.token_ids[0]]).float()
    assert counts.sum() == n  # never a non-candidate
    dof = p.numel() - 1
    bound = dof + 6 * math.sqrt(2 * dof)  # ~6 sigma of a chi-square with `dof` degrees of freedom
    assert chi_square(counts, p, n) < bound
    assert chi_square(counts, probs(cands, 1.0)[0], n) > bound  # the test can tell temperatures apart
    torch.testing.assert_close(token_probs, cands.token_prob(tokens, temperature))


def test_sampling_is_seeded():
    cands = CandidateLogits(torch.arange(12).view(2, 6), torch.randn(2, 6), VOCAB)
    first = cands.sample(1.0, torch.Generator().manual_seed(7))[0]
    assert torch.equal(first, cands.sample(1.0, torch.Generator().manual_seed(7))[0])


def test_dense_logits_share_the_interface():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen)
    dense, as_cands = DenseLogits(logits), CandidateLogits(torch.arange(VOCAB).expand(3, -1), logits, VOCAB)
    assert torch.equal(dense.argmax(), as_cands.argmax())
    torch.testing.assert_close(dense.dense_probs(0.5), as_cands.dense_probs(0.5))
    tokens = torch.tensor([4, 0, 47])
    torch.testing.assert_close(dense.token_prob(tokens, 0.5), as_cands.token_prob(tokens, 0.5))
    a, b = dense.sample(0.5, torch.Generator().manual_seed(3)), as_cands.sample(0.5, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_per_row_temperature_and_invalid_temperature():
    cands = CandidateLogits(torch.arange(8).view(2, 4), torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2), VOCAB)
    per_row = probs(cands, torch.tensor([1.0, 0.25]))
    torch.testing.assert_close(per_row[0], probs(cands, 1.0)[0])
    torch.testing.assert_close(per_row[1], probs(cands, 0.25)[1])
    with pytest.raises(ValueError, match="temperature"):
        probs(cands, 0.0)
