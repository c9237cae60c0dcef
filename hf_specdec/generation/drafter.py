"""What the speculative loop asks of a drafter (the :class:`Drafter` base), and how draft tokens are chosen.

The loop never imports a specific model: a drafter (Gemma 4 MTP assistant, DFlash, Step 3.5 MTP) subclasses
:class:`Drafter`, and its model package registers a builder for it (``generation/registry.py``). Every method
the loop calls is declared here; the optional ones have defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_specdec.generation.sampling import PositionScorer, same_on_every_rank
from hf_specdec.kernels.argmax import argmax
from hf_specdec.runtime import RequestContext


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [batch, k]
    probs: torch.Tensor | None  # [batch, k, vocab]: q after the logits processors (sampling only)


@dataclass(frozen=True)
class DraftsInVerify:
    """The next round's greedy drafts as part of the verify forward (:meth:`Drafter.drafts_in_verify`)."""

    key: tuple  # what fixes ``fn``'s work besides the forward's shapes (the drafter, its weights, its k)
    # (next_tokens [batch], num_accepted [batch]) -> (drafts [batch, k], *state): run right after the greedy
    # acceptance, inside the verify's CUDA graph where one replays; device tensors only, no host sync
    fn: Callable
    take: Callable  # (*state) after the forward (state valid until the next verify): the drafter keeps what it needs


class Drafter:
    """A drafter as the speculative loop drives it, for one ``generate`` call at a time.

    Per request: :meth:`capture` is opened around the whole request, :meth:`begin` follows the prefill; each
    step calls :meth:`propose` (or takes what :meth:`propose_ahead` queued the step before), the target
    verifies, and :meth:`commit` follows the target cache's commit.
    """

    spec_mode: str  # "mtp" or "dflash"
    num_speculative_tokens: int  # k: the drafts of the next round
    # whether the loop may change num_speculative_tokens between rounds (up to its value at the start of the
    # request: caches and graphs are sized for that many); a drafter whose state is shaped by k says False
    adaptive_k: bool = False
    # whether num_speculative_tokens may rise again within a request once it fell (False: a drafter whose state
    # for the drafts it stopped making goes stale, e.g. MTP layers that stopped seeing the new positions; it may
    # fall within a request and starts each request at up to its value again)
    k_grows: bool = True
    # whether the loop may drop rows that stopped from the batch (:meth:`keep_rows`) so that later rounds draft
    # and verify only the rows still running
    drops_rows: bool = False
    # whether the loop may run one round ahead (greedy calls without logits processors, on the GPU): it queues
    # round r+1's verify before it waits for round r's result, so the target's commit and this drafter's
    # :meth:`commit` of round r come after round r+1's verify was queued. Then :meth:`propose_ahead` is called after
    # that commit, with round r+1's acceptance (the caches hold round r+1's verify beside the committed tokens,
    # ``context.committed_lens`` says where it starts), and :meth:`commit` must not read what :meth:`capture`
    # recorded once :meth:`propose_ahead` took it (a later verify has overwritten it). Only rounds drafted by
    # :meth:`propose_ahead` are queued ahead: a None from it (or a round without drafts) makes the loop wait for the
    # round in flight and commit it before the next one
    runs_ahead: bool = False
    # whether greedy rounds of eager forwards on the CPU (where nothing overlaps the host) may draft after the round's
    # commit, by :meth:`propose` at the next step, instead of by :meth:`propose_ahead` before the round is read back
    drafts_after_commit: bool = True

    def weight_modules(self) -> list[torch.nn.Module]:
        """The modules whose weights this drafter's forwards read besides the target's (CUDA graphs kept between
        calls are dropped when one of them moved). Default: its attributes that are modules."""
        return [value for value in getattr(self, "__dict__", {}).values() if isinstance(value, torch.nn.Module)]

    def draft_cost(self, k: int) -> float:
        """The cost of drafting k tokens, in target decode steps (for choosing k per round). Default: k draft
        steps of a tenth of a target step each."""
        return 0.1 * k

    @property
    def capture_key(self) -> tuple:
        """What :meth:`capture`'s hooks record (e.g. which target layers): target graphs captured while other
        hooks recorded are not replayed for this drafter."""
        return (type(self).__qualname__,)

    @contextlib.contextmanager
    def capture(self, target):
        """While open, record what the drafter needs from each target forward (e.g. hidden states of chosen
        layers, through forward hooks); yields the holder the loop hands back to :meth:`begin` and
        :meth:`commit`. Default: records nothing."""
        yield None

    def begin(self, context: RequestContext, captured) -> None:
        """After the prefill forward (``context.prompt_lens`` tokens per row in the target's cache)."""
        raise NotImplementedError

    def propose(self, last_tokens: torch.Tensor, context: RequestContext, selector: "DraftSelector") -> DraftProposal:
        """k drafts per row after ``last_tokens`` [batch] (each row's last committed token, not yet in the
        target's cache), through ``selector`` (greedy or sampled, after the logits processors)."""
        raise NotImplementedError

    def propose_ahead(self, next_tokens: torch.Tensor, num_accepted: torch.Tensor, context: RequestContext,
                      captured, selector: "DraftSelector") -> DraftProposal | None:
        """The next round's drafts, launched right after the acceptance and before the step's host sync, from
        device tensors only (the target's cache not yet committed): the device drafts while the host emits and
        commits. Must equal what :meth:`propose` would give after the commit, for every row that keeps running
        (``kept[b] == num_accepted[b] + 1``). Default None: the loop calls :meth:`propose` next step."""
        return None

    def drafts_in_verify(self, context: RequestContext, captured) -> DraftsInVerify | None:
        """Where :meth:`propose_ahead` can be a function of the verify forward's own outputs (its metadata, what
        :meth:`capture` recorded during it, the greedy acceptance), that function, for the loop to run inside the
        verify's forward (one CUDA graph replay for verify, acceptance and the next round's drafts, instead of a
        verify and a drafter's call). Asked before a greedy verify of a call that runs ahead, with
        :attr:`num_speculative_tokens` the next round's k; its drafts must equal :meth:`propose_ahead`'s, and
        ``take`` counts as :meth:`propose_ahead` having taken what :meth:`capture` recorded, but ahead of the
        :meth:`commit` of the round before (so a drafter counts such takes). Default None: :meth:`propose_ahead`."""
        return None

    def commit(self, context: RequestContext, captured, num_accepted: torch.Tensor, kept: list[int]) -> None:
        """After the verify forward and the target cache's commit: ``kept[b]`` tokens of row b's verify were kept
        (accepted + 1, fewer where the row stopped inside its chunk, 0 for a row that had stopped)."""
        raise NotImplementedError

    def keep_rows(self, rows: list[int]) -> None:
        """After :meth:`commit` and the target cache's ``keep_rows(rows)``: keep only the per-row state of ``rows``
        (indices into the batch, in that order; row ``i`` after is row ``rows[i]`` before). Only called on a
        drafter whose :attr:`drops_rows` is True."""
        raise NotImplementedError


def take_rows(x: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    """Rows ``rows`` of per-row state ``x`` [batch, ...] (None stays None), for :meth:`Drafter.keep_rows`."""
    return None if x is None else x.index_select(0, torch.tensor(rows, dtype=torch.long).to(x.device))


class DraftSelector:
    """Turns a draft step's head output into a token per row (and q when sampling).

    ``head`` is either dense logits [batch, vocab] or an object with ``argmax()`` and
    ``dense_logits()`` (a sparse head such as Gemma 4's centroid head, kept sparse when greedy)."""

    def __init__(self, do_sample: bool, scorer: PositionScorer, vocab_size: int, prefixes: list[torch.Tensor],
                 generator: torch.Generator | None = None, ranks=None):
        """``ranks``: the target's tensor-parallel group; sampled drafts are then rank 0's on every rank (a
        sequential drafter feeds each one to its next step)."""
        self.do_sample = do_sample
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.prefixes = prefixes
        self.generator = generator
        self.ranks = ranks

    def select(self, head, drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """drafted [batch, j]: drafts so far this step -> (token [batch], q [batch, vocab] or None)."""
        if not self.do_sample and not self.scorer.processors:
            return (argmax(head) if isinstance(head, torch.Tensor) else head.argmax()), None
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
            return argmax(logits[:, 0]), None
        probs = torch.softmax(logits[:, 0], dim=-1)
        token = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return same_on_every_rank(token, self.ranks), probs

    def select_block(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [batch, k] (and q [batch, k, vocab] when sampling) for ``logits`` [batch, k, vocab] of k draft
        positions that one forward gave (a block drafter). Without history-dependent processors no position's
        distribution depends on the drafts before it, so all k are scored, normalised and sampled in one call
        each; a history-dependent processor (e.g. a repetition penalty) sees each draft's prefix, position by
        position, as :meth:`select` does."""
        batch, k, vocab = logits.shape
        if not self.do_sample and not self.scorer.processors:
            return argmax(logits), None
        if not self.scorer.batched:
            drafted, probs = torch.zeros(batch, 0, dtype=torch.long, device=logits.device), []
            for j in range(k):
                token, q = self.select(logits[:, j], drafted)
                drafted = torch.cat([drafted, token[:, None]], dim=1)
                probs.append(q)
            return drafted, None if probs[0] is None else torch.stack(probs, dim=1)
        scores = self.scorer.score(self.prefixes, torch.zeros(batch, 0, dtype=torch.long, device=logits.device),
                                   logits.float())
        if not self.do_sample:
            return argmax(scores), None
        probs = torch.softmax(scores, dim=-1)
        tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=self.generator).view(batch, k)
        return same_on_every_rank(tokens, self.ranks), probs
