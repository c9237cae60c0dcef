"""Drafters and an acceptance that exist only to measure; passed to ``generate`` like the real ones.

- ``FixedDrafter``: proposes the last token k times at no cost, so a speculative step costs one verify
  forward of k+1 tokens per row plus the loop's own work (verify_cost).
- ``TimedDrafter``: wraps a real drafter and times each ``propose`` (device work included) (draft_cost).
- ``SyntheticAcceptance``: an acceptance strategy (``generate(acceptance=...)``) that accepts each draft with
  a fixed probability alpha. The committed tokens are then NOT the target's greedy tokens (the call's stats
  and the records say ``lossless: false``); what it measures is system throughput at a given tau, as vLLM's
  synthetic acceptance mode does (e2e_synthetic).
"""

from __future__ import annotations

import itertools
import time

import torch

from hf_specdec.generation.acceptance import Acceptance
from hf_specdec.kernels.argmax import argmax
from hf_specdec.runtime import Select
from hf_specdec.generation.drafter import Drafter, DraftProposal


class FixedDrafter(Drafter):
    """Proposes each row's last token k times at no cost. ``ahead`` (default): its greedy rounds run one round ahead
    of the host where the loop allows it (on the GPU), as the bundled drafters' greedy rounds do
    (:attr:`Drafter.runs_ahead`: the next round is queued before the host reads the last one, so the host's emission
    and commit overlap the device), and a step is timed as their verify steps run; False: every round waits for the
    host to read the round before (the loop's work between two verifies is then on the device's critical path)."""

    spec_mode = "mtp"

    def __init__(self, num_speculative_tokens: int, ahead: bool = True):
        self.num_speculative_tokens = num_speculative_tokens
        self.runs_ahead = ahead

    def begin(self, context, captured):
        pass

    def propose(self, last_tokens, context, selector) -> DraftProposal:
        return DraftProposal(last_tokens[:, None].expand(-1, self.num_speculative_tokens).contiguous(), None)

    def propose_ahead(self, next_tokens, num_accepted, context, captured, selector) -> DraftProposal | None:
        # a row that keeps running commits up to next_tokens, its last token after the commit: propose's drafts.
        # Not ahead: None, so that every round drafts by propose after the commit (the method before ``ahead``)
        return self.propose(next_tokens, context, selector) if self.runs_ahead else None

    def commit(self, context, captured, num_accepted, kept):
        pass


class TimedDrafter(Drafter):
    """Delegates to ``inner`` and records the seconds of each ``propose`` call (synchronising the device around
    it); never drafts ahead, so every round's drafting is timed."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.spec_mode = inner.spec_mode
        self.num_speculative_tokens = inner.num_speculative_tokens
        self.propose_seconds: list[float] = []

    @property
    def capture_key(self) -> tuple:
        return self.inner.capture_key

    def capture(self, target):
        return self.inner.capture(target)

    def begin(self, context, captured):
        self.inner.begin(context, captured)

    def propose(self, last_tokens, context, selector):
        _sync(last_tokens.device)
        start = time.perf_counter()
        proposal = self.inner.propose(last_tokens, context, selector)
        _sync(last_tokens.device)
        self.propose_seconds.append(time.perf_counter() - start)
        return proposal

    def commit(self, context, captured, num_accepted, kept):
        self.inner.commit(context, captured, num_accepted, kept)


class SyntheticAcceptance(Acceptance):
    """Each draft is accepted with probability ``alpha`` (independently; a row accepts the prefix up to its
    first rejection), whatever the target says; the token after the accepted drafts is the target's
    greedy token there. On device, no host sync.

    The draws are common random numbers: one uniform per (row, position of the draft in the row's new tokens),
    the same for every k and, after :meth:`restart`, for every call. A draft at position p is accepted iff its
    uniform is below ``alpha``; so rows that differ only in k (or an "auto" k) see the same luck, and a comparison
    between them is not decided by which numbers each happened to draw.

    Its decisions are a function of the verify's ids and logits and of its own state (the uniforms, each row's
    position), so a greedy call runs as users' greedy calls do: the decision is taken with the verify forward, inside
    its CUDA graph (``with_forward``), and rounds run ahead. The state's tensors stay where a graph captured them:
    :meth:`restart` rewinds the positions in place."""

    lossless = False
    draws_random = False  # fixed uniforms: every rank of a tensor-parallel model draws the same from the same seed
    SPAN = 1 << 14  # positions per row before the draws repeat
    ROWS = 64  # rows the uniforms are drawn for at least
    _serials = itertools.count()  # names each instance's graphs (an id may be reused once an instance is freed)

    def __init__(self, alpha: float, seed: int = 0):
        self.alpha = alpha
        self.seed = seed
        self._uniform: torch.Tensor | None = None  # [capacity, SPAN]
        self._position: torch.Tensor | None = None  # [capacity]: the next new token's position in each row
        self._drawn = 0  # how many times the state was drawn anew (names the graphs that captured it)
        self._serial = next(self._serials)

    def restart(self, seed: int | None = None) -> None:
        """The next call starts at position 0 of every row (call before each generate being compared); with
        ``seed``, on the draws of that seed (redrawn in place: graphs that captured the state read the new ones)."""
        with torch.inference_mode():  # (drawn inside generate's inference mode)
            if seed is not None and seed != self.seed:
                self.seed = seed
                if self._uniform is not None:
                    self._uniform.copy_(self._draw(self._uniform.shape[0], self._uniform.device))
            if self._position is not None:
                self._position.zero_()

    def _draw(self, capacity: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(self.seed)
        return torch.rand(capacity, self.SPAN, device=device, generator=generator)

    def _state(self, rows: int, device: torch.device) -> None:
        """Uniforms and positions for ``rows`` rows on ``device``: drawn once (for twice the rows: a graph of this
        batch's bucket captures its padding rows too), anew only for more rows or another device."""
        if self._uniform is None or self._uniform.device != device or self._uniform.shape[0] < rows:
            self._uniform = self._draw(max(self.ROWS, 2 * rows), device)
            self._position = torch.zeros(self._uniform.shape[0], dtype=torch.int64, device=device)
            self._drawn += 1

    def _decide(self, draft_tokens: torch.Tensor, target_tokens: torch.Tensor):
        rows, k = draft_tokens.shape
        position = self._position[:rows]
        at = (position[:, None] + torch.arange(k, device=draft_tokens.device)) % self.SPAN
        accept = self._uniform[:rows].gather(1, at) < self.alpha
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        position += num_accepted + 1
        next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
        return num_accepted, next_token

    def __call__(self, draft_tokens, draft_probs, scores):
        """draft_tokens [batch, k], scores [batch, k+1, vocab] -> (num_accepted [batch], next_token [batch])."""
        self._state(draft_tokens.shape[0], draft_tokens.device)
        return self._decide(draft_tokens, scores.argmax(dim=-1))

    @property
    def with_forward(self) -> Select:
        # (read by the loop before each verify: the state is drawn by then, outside any graph capture)
        return Select(f"synthetic_accept:{self._serial}:{self._drawn}", self._verified)

    def _verified(self, verify_ids: torch.Tensor, logits: torch.Tensor):
        self._state(verify_ids.shape[0], verify_ids.device)
        return self._decide(verify_ids[:, 1:], argmax(logits))


def expected_tau(alpha: float, k: int) -> float:
    """Tokens per target forward when each of k drafts is accepted with probability alpha: sum_{i<=k} alpha^i."""
    return sum(alpha ** i for i in range(k + 1))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
