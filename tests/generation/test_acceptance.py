"""Acceptance rules: greedy prefix matching and the distribution of rejection sampling (invariant 4)."""

import torch

from hf_specdec.generation.acceptance import greedy_accept_no_sync, rejection_sample_no_sync


def test_greedy_accepts_the_longest_matching_prefix_per_row():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 2, 8]])
    accepted, nxt = greedy_accept_no_sync(drafts, target)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert nxt.tolist() == [8, 6, 5, 2]  # bonus, recovered, recovered, recovered


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _first_token_counts(p, q_draft_dist, n, seed, greedy_draft=False):
    """Commit one token per trial with k=2 drafts drawn from q (or its argmax); count the first token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    q = q_draft_dist.expand(n, 2, vocab)
    if greedy_draft:
        drafts = q.argmax(-1)
        q_used = torch.nn.functional.one_hot(drafts, vocab).float()
    else:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(n, 2)
        q_used = q
    accepted, nxt = rejection_sample_no_sync(drafts, q_used, p.expand(n, 3, vocab), generator=gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    return torch.bincount(first, minlength=vocab).float()


def test_rejection_sampling_commits_tokens_from_the_target_distribution():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])
    for seed in range(2):
        counts = _first_token_counts(p, q, 40000, seed)
        assert counts[5] == 0  # p(x) = 0 is never committed
        assert _chi2(counts, p) < 20.5  # 5 dof, p-value 0.001


def test_one_hot_argmax_drafts_are_exact_but_raw_draft_probs_would_bias():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.7, 0.1])  # the drafter prefers token 1
    counts = _first_token_counts(p, q, 40000, 0, greedy_draft=True)
    assert _chi2(counts, p) < 13.8  # 2 dof
    # the biased scheme: argmax drafts judged against the raw draft distribution
    gen = torch.Generator().manual_seed(0)
    n = 40000
    drafts = torch.ones(n, 2, dtype=torch.long)
    accepted, nxt = rejection_sample_no_sync(drafts, q.expand(n, 2, 3), p.expand(n, 3, 3), generator=gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    assert _chi2(torch.bincount(first, minlength=3).float(), p) > 100


def test_equal_distributions_accept_everything_and_bonus_follows_p():
    p = torch.tensor([0.6, 0.4])
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(p.expand(20000, 2), 2, replacement=True, generator=gen)
    accepted, nxt = rejection_sample_no_sync(drafts, p.expand(20000, 2, 2), p.expand(20000, 3, 2), generator=gen)
    assert (accepted == 2).all()
    assert abs(nxt.float().mean().item() - 0.4) < 0.02
