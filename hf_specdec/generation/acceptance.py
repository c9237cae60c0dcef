"""Lossless acceptance of drafts over a batch of rows, on device and without host syncs.

Greedy: a row accepts the longest prefix of drafts equal to the target's argmax and appends the
target's argmax after it (the **recovered** token at the first mismatch, the **bonus** token after k
accepted drafts).

Sampling (Leviathan et al. 2023, arXiv 2211.17192): draft ``x`` at position j is accepted with
probability ``min(1, p_j(x) / q_j(x))``; at the first rejection the next token is drawn from
``normalize(max(p_j - q_j, 0))``; after k acceptances the bonus is drawn from ``p_k``. ``p`` and ``q``
are the target and draft distributions after the same logits processors. The committed tokens then
follow ``p`` exactly, whatever the drafter proposes.

The loop takes its acceptance as a strategy (:class:`Acceptance`): :func:`acceptance_for` gives the
lossless one of a call; a benchmark may pass another (e.g. a fixed acceptance rate) to
``generate(acceptance=...)``, and the call's stats then say it was not lossless.
"""

from __future__ import annotations

import torch

from hf_specdec.kernels.argmax import argmax
from hf_specdec.runtime import Select


def greedy_accept_no_sync(draft_tokens: torch.Tensor, target_tokens: torch.Tensor):
    """draft_tokens [batch, k], target_tokens [batch, k+1] (target argmax at each verified position)
    -> (num_accepted [batch], next_token [batch])."""
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :k]).to(torch.int64)
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def rejection_sample_no_sync(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                             generator: torch.Generator | None = None):
    """draft_tokens [batch, k]; draft_probs q [batch, k, vocab]; target_probs p [batch, k+1, vocab]
    -> (num_accepted [batch], next_token [batch])."""
    batch, k = draft_tokens.shape
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    uniform = torch.rand(batch, k, device=draft_tokens.device, generator=generator)
    accepted = (uniform * q_draft <= p_draft).to(torch.int64)  # u < p/q without dividing by a zero q
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    index = num_accepted[:, None, None].expand(batch, 1, target_probs.shape[-1])
    p_next = target_probs.gather(1, index).squeeze(1)
    # q = 0 at the bonus slot (the only slot of a round without drafts)
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)
    residual = (p_next - q_padded.gather(1, index).squeeze(1)).clamp_(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q leaves no residual mass; any token of p is then exact (rejection had probability 0).
    next_dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    next_token = torch.multinomial(next_dist, num_samples=1, generator=generator).squeeze(1)
    return num_accepted, next_token


class Acceptance:
    """How a verify step's drafts are accepted: ``(draft_tokens [batch, k], draft_probs [batch, k, vocab] or None,
    scores [batch, k+1, vocab]) -> (num_accepted [batch], next_token [batch])`` on device, no host sync.
    ``scores`` are the target's after the logits processors (its raw logits when greedy without processors)."""

    lossless = True
    # whether its decisions depend on random draws (under tensor parallelism they are then broadcast from rank 0)
    draws_random = True
    # the same decision as a function of the verify forward's ids ([last token, drafts]) and raw logits, for calls
    # whose scores are those logits (greedy, no logits processors): the runner takes it with the forward, inside its
    # CUDA graph. None: the loop calls the acceptance after the forward
    with_forward: Select | None = None

    def __call__(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, scores: torch.Tensor):
        raise NotImplementedError


def _greedy_verified(verify_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return greedy_accept_no_sync(verify_ids[:, 1:], argmax(logits))


_GREEDY_VERIFIED = Select("greedy_accept", _greedy_verified)


class GreedyAcceptance(Acceptance):
    """The longest prefix of drafts equal to the target's argmax, then the target's argmax."""

    draws_random = False

    @property
    def with_forward(self) -> Select | None:
        # (a subclass that decides otherwise, in a __call__ of its own, is called after the forward)
        return _GREEDY_VERIFIED if type(self).__call__ is GreedyAcceptance.__call__ else None

    def __call__(self, draft_tokens, draft_probs, scores):
        return greedy_accept_no_sync(draft_tokens, argmax(scores))


class RejectionSampling(Acceptance):
    """Rejection sampling with the drafter's q: the committed tokens follow the target's distribution."""

    def __call__(self, draft_tokens, draft_probs, scores):
        return rejection_sample_no_sync(draft_tokens, draft_probs, torch.softmax(scores, dim=-1))


def acceptance_for(do_sample: bool) -> Acceptance:
    """The lossless acceptance of a greedy or sampled call."""
    return RejectionSampling() if do_sample else GreedyAcceptance()
