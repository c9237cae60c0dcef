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


def second_tokens_of_sampled_mtp(target, assistant, prompt: torch.Tensor, rows: int = 3000, k: int = 2) -> torch.Tensor:
    """The 2nd generated token of ``rows`` copies of ``prompt`` [1, length] sampled with ``assistant`` drafting ``k``
    tokens (seed 0), after checking some but not all drafts were accepted: the 2nd token is then decided by
    rejection sampling in some rows and by the target alone in others."""
    import hf_specdec

    length = prompt.shape[1]
    torch.manual_seed(0)
    out = target.generate(prompt.expand(rows, length), attention_mask=torch.ones(rows, length, dtype=torch.long),
                          assistant_model=assistant, num_speculative_tokens=k, max_new_tokens=2, do_sample=True,
                          eos_token_id=None, pad_token_id=0)
    assert 0 < hf_specdec.last_generation_stats(target).num_accepted_tokens < rows * k
    return out[:, length + 1]
