"""Chi-square checks that sampled speculative outputs follow the target's own distribution (invariant 4)."""

from __future__ import annotations

import math

import torch

Z_0_001 = 3.0902  # standard normal quantile of 1 - 0.001


def second_token_marginal(target, prompt: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """P(second generated token = v) under the target's sampling, summed over the first token: [vocab]."""
    with torch.no_grad():
        first = torch.softmax(target(prompt).logits[0, -1].float(), -1)
        second = torch.stack([
            torch.softmax(target(torch.cat([prompt[0], torch.tensor([a])])[None]).logits[0, -1].float(), -1)
            for a in range(vocab_size)])
    return (first[:, None] * second).sum(0)


def assert_follows(samples: torch.Tensor, marginal: torch.Tensor, min_expected: float = 5.0) -> None:
    """Pearson chi-square of ``samples`` (token ids) against ``marginal`` over the categories expected at least
    ``min_expected`` times; fails at p < 0.001 (critical value by the Wilson-Hilferty approximation)."""
    counts = torch.bincount(samples, minlength=marginal.numel()).float()
    expected = marginal * samples.numel()
    keep = expected >= min_expected
    dof = int(keep.sum()) - 1
    assert dof >= 1, "too few samples for a chi-square test"
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    critical = dof * (1 - 2 / (9 * dof) + Z_0_001 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical:.1f} ({dof} dof, p < 0.001)"
