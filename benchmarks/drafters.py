"""Drafters that exist only to measure: they implement the loop's Drafter protocol
(hf_specdec/generation/drafter.py) and are passed to ``generate(assistant_model=...)`` like any drafter.

- ``FixedDrafter``: proposes the last token k times at no cost, so a speculative step costs one verify
  forward of k+1 tokens per row plus the loop's own work (verify_cost).
- ``TimedDrafter``: wraps a real drafter and times each ``propose`` (device work included) (draft_cost).
- ``SyntheticAcceptance``: wraps a real drafter and accepts each draft with a fixed probability alpha
  through the loop's benchmark-only ``synthetic_acceptance`` hook. The committed tokens are then NOT the
  target's greedy tokens (records say ``lossless: false``); what it measures is system throughput at a
  given tau, as vLLM's synthetic acceptance mode does (e2e_synthetic).
"""

from __future__ import annotations

import contextlib
import time

import torch

from hf_specdec.generation.drafter import DraftProposal


class FixedDrafter:
    spec_mode = "mtp"

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens

    @contextlib.contextmanager
    def capture(self, target):
        yield None

    def begin(self, cache, captured, prompt_lens):
        pass

    def propose(self, last_tokens, cache, selector) -> DraftProposal:
        return DraftProposal(last_tokens[:, None].expand(-1, self.num_speculative_tokens).contiguous(), None)

    def commit(self, cache, captured, num_accepted, kept):
        pass


class _Wrapper:
    """Delegates the Drafter protocol to ``inner``."""

    def __init__(self, inner):
        self.inner = inner
        self.spec_mode = inner.spec_mode
        self.num_speculative_tokens = inner.num_speculative_tokens
        self.capture_key = getattr(inner, "capture_key", None)  # which target hooks the inner drafter records

    def capture(self, target):
        return self.inner.capture(target)

    def begin(self, cache, captured, prompt_lens):
        self.inner.begin(cache, captured, prompt_lens)

    def propose(self, last_tokens, cache, selector):
        return self.inner.propose(last_tokens, cache, selector)

    def commit(self, cache, captured, num_accepted, kept):
        self.inner.commit(cache, captured, num_accepted, kept)


class TimedDrafter(_Wrapper):
    """Records the seconds of each ``propose`` call (synchronising the device around it)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.propose_seconds: list[float] = []

    def propose(self, last_tokens, cache, selector):
        _sync(last_tokens.device)
        start = time.perf_counter()
        proposal = self.inner.propose(last_tokens, cache, selector)
        _sync(last_tokens.device)
        self.propose_seconds.append(time.perf_counter() - start)
        return proposal


class SyntheticAcceptance(_Wrapper):
    """Each draft is accepted with probability ``alpha`` (independently; a row accepts the prefix up to its
    first rejection), whatever the target says; the token after the accepted drafts is the target's
    greedy token there. On device, no host sync."""

    def __init__(self, inner, alpha: float, seed: int = 0):
        super().__init__(inner)
        self.alpha = alpha
        self.seed = seed
        self._generator: torch.Generator | None = None

    def propose_ahead(self, next_tokens, num_accepted, cache, captured, selector):
        ahead = getattr(self.inner, "propose_ahead", None)
        return None if ahead is None else ahead(next_tokens, num_accepted, cache, captured, selector)

    def synthetic_acceptance(self, draft_tokens: torch.Tensor, target_tokens: torch.Tensor):
        """draft_tokens [batch, k], target_tokens [batch, k+1] -> (num_accepted [batch], next_token [batch])."""
        if self._generator is None or self._generator.device != draft_tokens.device:
            self._generator = torch.Generator(device=draft_tokens.device).manual_seed(self.seed)
        uniform = torch.rand(draft_tokens.shape, device=draft_tokens.device, generator=self._generator)
        num_accepted = (uniform < self.alpha).to(torch.int64).cumprod(dim=1).sum(dim=1)
        next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
        return num_accepted, next_token


def expected_tau(alpha: float, k: int) -> float:
    """Tokens per target forward when each of k drafts is accepted with probability alpha: sum_{i<=k} alpha^i."""
    return sum(alpha ** i for i in range(k + 1))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
