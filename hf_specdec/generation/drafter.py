"""What the speculative loop asks of a drafter, and how draft tokens are chosen.

The loop never imports a specific model: a drafter (Gemma 4 MTP assistant, DFlash, Step 3.5 MTP) is
an object with

    capture(target)                 context manager: records what the drafter needs from each target
                                    forward (hidden states of chosen layers) while it is open
    begin(cache, captured, prompt_lens)   after the prefill forward
    propose(last_tokens, cache, selector) -> DraftProposal     k drafts per row
    commit(cache, captured, num_accepted, kept)   after the verify forward and the target cache's commit;
                                    kept[b] = tokens row b kept (accepted + 1, or 0 for a row that stopped)

and the attributes ``num_speculative_tokens`` (k) and ``spec_mode``. Optionally

    propose_ahead(next_tokens, num_accepted, cache, captured, selector) -> DraftProposal | None
                                    the next round's drafts, launched right after the acceptance and
                                    before the step's host sync, from device tensors only (the cache not
                                    yet committed): the device drafts while the host emits and commits.
                                    None when it cannot (the loop then calls ``propose`` next step). Its
                                    drafts must equal what ``propose`` would give after the commit, for
                                    every row that keeps running (``kept[b] == num_accepted[b] + 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hf_specdec.generation.sampling import PositionScorer


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [batch, k]
    probs: torch.Tensor | None  # [batch, k, vocab]: q after the logits processors (sampling only)


class Drafter(Protocol):
    spec_mode: str
    num_speculative_tokens: int

    def capture(self, target): ...

    def begin(self, cache, captured, prompt_lens: list[int]) -> None: ...

    def propose(self, last_tokens: torch.Tensor, cache, selector: "DraftSelector") -> DraftProposal: ...

    def commit(self, cache, captured, num_accepted: torch.Tensor, kept: list[int]) -> None: ...


class DraftSelector:
    """Turns a draft step's head output into a token per row (and q when sampling).

    ``head`` is either dense logits [batch, vocab] or an object with ``argmax()`` and
    ``dense_logits()`` (a sparse head such as Gemma 4's centroid head, kept sparse when greedy)."""

    def __init__(self, do_sample: bool, scorer: PositionScorer, vocab_size: int, prefixes: list[torch.Tensor],
                 generator: torch.Generator | None = None):
        self.do_sample = do_sample
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.prefixes = prefixes
        self.generator = generator

    def select(self, head, drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """drafted [batch, j]: drafts so far this step -> (token [batch], q [batch, vocab] or None)."""
        if not self.do_sample and not self.scorer.processors:
            return (head.argmax(dim=-1) if isinstance(head, torch.Tensor) else head.argmax()), None
        # drafts see the same processors as the target's verify (greedy too: a repetition penalty moves the
        # target's argmax, and a draft that ignores it would be rejected)
        logits = head if isinstance(head, torch.Tensor) else head.dense_logits()
        logits = logits.float()[:, None, :]
        if not self.scorer.history_free:
            # history processors see the prefix plus this step's drafts, as plain decoding would
            logits = self.scorer.score([torch.cat([p, d]) for p, d in zip(self.prefixes, drafted)],
                                       drafted[:, :0], logits)
        else:
            logits = self.scorer.score(self.prefixes, drafted, logits)
        if not self.do_sample:
            return logits[:, 0].argmax(dim=-1), None
        probs = torch.softmax(logits[:, 0], dim=-1)
        token = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return token, probs

    def select_block(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [batch, k] (and q [batch, k, vocab] when sampling) for ``logits`` [batch, k, vocab] of k draft
        positions that one forward gave (a block drafter). Without history-dependent processors no position's
        distribution depends on the drafts before it, so all k are scored, normalised and sampled in one call
        each; a history-dependent processor (e.g. a repetition penalty) sees each draft's prefix, position by
        position, as :meth:`select` does."""
        batch, k, vocab = logits.shape
        if not self.do_sample and not self.scorer.processors:
            return logits.argmax(dim=-1), None
        if not self.scorer.history_free:
            drafted, probs = torch.zeros(batch, 0, dtype=torch.long, device=logits.device), []
            for j in range(k):
                token, q = self.select(logits[:, j], drafted)
                drafted = torch.cat([drafted, token[:, None]], dim=1)
                probs.append(q)
            return drafted, None if probs[0] is None else torch.stack(probs, dim=1)
        scores = self.scorer.score(self.prefixes, torch.zeros(batch, 0, dtype=torch.long, device=logits.device),
                                   logits.float())
        if not self.do_sample:
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=self.generator).view(batch, k)
        return tokens, probs
