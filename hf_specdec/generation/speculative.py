"""The batched draft → verify → accept → commit loop, shared by every speculative mode.

Like ``paged_decode`` it is handed to ``GenerationMixin.generate(custom_generate=...)``, so transformers
prepares the generation config, logits processors and stopping criteria. One step:

1. the drafter proposes k tokens per row (and q when sampling);
2. the target verifies ``[last token, k drafts]`` of every row in one forward through the paged cache;
3. acceptance on device gives each row its accepted count and one recovered/bonus token;
4. one host sync brings the counts over (the drafter may queue the next round's drafts before it);
5. rows emit their tokens one by one so EOS, max length, stop strings and custom criteria cut inside the
   accepted chunk; the cache keeps ``len + accepted + 1`` tokens per row (rollback of the rest is only a
   shorter length) and the drafter commits.

Greedy output equals plain greedy decoding token for token; sampled output follows the target
distribution (rejection sampling), whatever the drafter proposes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.generation.acceptance import Acceptance, acceptance_for
from hf_specdec.generation.adaptive_k import AdaptiveK, costs_for
from hf_specdec.generation.drafter import Drafter, DraftProposal, DraftSelector, take_rows
from hf_specdec.generation.sampling import PositionScorer, same_on_every_rank, select_tokens
from hf_specdec.generation.stats import SpecStats
from hf_specdec.cache import OutOfBlocksError
from hf_specdec.runtime import Readback, exhausted, real_token_counts


class RowStopper:
    """Decides, token by token, when a row stops: the stopping criteria of ``generate`` applied to that row."""

    def __init__(self, stopping_criteria, generation_config):
        self.criteria = stopping_criteria
        self.max_length = generation_config.max_length
        eos = [c for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.eos = set(eos[0].eos_token_id.tolist()) if eos else set()
        # max length and EOS are checked here directly; anything else goes through the criteria
        self.only_builtin = all(isinstance(c, (EosTokenCriteria, MaxLengthCriteria)) for c in stopping_criteria)

    def stops(self, row_ids: list[int], scores=None) -> bool:
        """``scores``: a callable giving the row's scores [1, vocab] at its last token (built only when a
        criterion other than max length and EOS needs them)."""
        if len(row_ids) >= self.max_length or row_ids[-1] in self.eos:
            return True
        if self.only_builtin:
            return False
        ids = torch.tensor(row_ids)[None, :]
        return bool(self.criteria(ids, None if scores is None else scores())[0])


def speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, *, drafter: Drafter, acceptance: Acceptance | None = None, adaptive: bool = False,
                       draft_model: torch.nn.Module | None = None, **model_kwargs):
    """Speculative decoding of ``input_ids`` [batch, prompt_len] (left-padded) with ``drafter``; ``adaptive``: k
    chosen per round (up to the drafter's k) where the drafter allows it; ``draft_model``: the model whose attention
    writes the drafter's own caches (its assistant, or the target)."""
    loop = SpeculativeLoop(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                           streamer, acceptance or acceptance_for(generation_config.do_sample), adaptive, draft_model)
    sequences = loop.run(input_ids, model_kwargs)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


class SpeculativeLoop:
    """One speculative ``generate`` call: the request's state lives here, a step is :meth:`step`."""

    def __init__(self, model, drafter: Drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                 streamer, acceptance: Acceptance, adaptive: bool = False, draft_model: torch.nn.Module | None = None):
        state = model._hf_specdec
        self.model, self.drafter, self.acceptance, self.streamer = model, drafter, acceptance, streamer
        self.k = drafter.num_speculative_tokens  # the most drafts a round may have: caches are sized for them
        self.adaptive_k = None
        if adaptive and drafter.adaptive_k:
            # round timings are kept per model, drafter and batch size; under tensor parallelism every rank must
            # choose the same k, so the acceptance alone decides there (the prior cost model)
            costs = None if state.ranks is not None else costs_for(
                state.round_costs, (type(drafter).__qualname__, id(draft_model or model), input_ids.shape[0]))
            # k = 0 is a candidate too where k may rise again (a round with drafts now and then measures the
            # acceptance): a round without drafts, a plain step of this loop whose commit still lets the drafter
            # catch up, for where no k pays for its drafting
            self.adaptive_k = AdaptiveK(self.k, drafter.draft_cost, input_ids.shape[0], costs=costs,
                                        grows=drafter.k_grows, plain=drafter.k_grows)
        self.synced_at = 0.0  # when the host last waited for the device (rounds are timed between such waits)
        self.config = generation_config
        self.logits_processor = logits_processor
        self.scorer = PositionScorer(logits_processor)
        self.stopper = RowStopper(stopping_criteria, generation_config)
        self.stats = SpecStats(spec_mode=drafter.spec_mode, num_speculative_tokens=self.k,
                               lossless=acceptance.lossless)
        batch = input_ids.shape[0]
        self.rows = [input_ids[b].tolist() for b in range(batch)]
        self.row_ids = RowIds(input_ids, generation_config.max_length + self.k + 1)
        self.running = [True] * batch
        self.runner = state.runner(model)
        self.ranks = state.ranks  # tensor parallel: what a rank draws, every rank uses (runtime/distributed.py)
        self.draft_model = model if draft_model is None else draft_model
        # the request's rows still in the batch (their index in input_ids), and the rows that left it, by that index
        self.order, self.left = list(range(batch)), {}
        self.drops_rows = False  # whether stopped rows leave the batch (decided in run, once the runner started)
        self.readback = Readback(input_ids.device)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.context = self.captured = None
        self.ahead: DraftProposal | None = None  # this round's drafts, queued by the last step

    def run(self, input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        """Decode until every row stops; returns the rows padded to one width [batch, length]."""
        prompt_lens = real_token_counts(input_ids, model_kwargs.get("attention_mask"))
        self.context = self.runner.start(prompt_lens, self.config.max_length - input_ids.shape[1],
                                         lookahead=self.k + 1, draft_model=self.draft_model)
        # eager forwards cost what their rows cost (on CPU a round's compute grows with its rows): a row that
        # stopped leaves the batch. A CUDA graph replays its whole batch bucket whatever rows are real, so with
        # graphs a stopped row stays (its drafts and verify slots are padding of the bucket). So do the rows of a
        # call that draws random numbers: a draw over fewer rows takes other numbers, and a seed gives the same
        # tokens with and without graphs
        self.drops_rows = (self.drafter.drops_rows and self.runner.graphs is None and not self.config.do_sample
                           and not self.acceptance.draws_random)
        try:
            with self.drafter.capture(self.model) as self.captured:
                # graphs captured while other hooks recorded into another kind of holder are not replayed here
                self.runner.record_hooks_of(self.captured, (self.drafter.capture_key,
                                                            type(self.captured).__qualname__))
                last_tokens = self.prefill(input_ids, prompt_lens, model_kwargs)
                while any(self.running):
                    if self.adaptive_k is not None:
                        self.drafter.num_speculative_tokens = self.adaptive_k.k
                    last_tokens = self.step(last_tokens)
        except OutOfBlocksError as error:  # the rows outgrew the cache's memory budget: keep what they generated
            self.model._hf_specdec.last_stats = self.stats.finish()
            pad = self.config._pad_token_tensor
            raise exhausted(error, _pad_rows(self._all_rows(), torch.tensor(0) if pad is None else pad,
                                             input_ids.device)) from None
        finally:
            self.drafter.num_speculative_tokens = self.k
            self.runner.finish()
        if self.streamer is not None:
            self.streamer.end()
        self.model._hf_specdec.last_stats = self.stats.finish()
        return _pad_rows(self._all_rows(), self.config._pad_token_tensor, input_ids.device)

    def _all_rows(self) -> list[list[int]]:
        """Every row of the request, in the order of input_ids, whether still in the batch or not."""
        rows = dict(self.left)
        rows.update(zip(self.order, self.rows))
        return [rows[i] for i in range(len(rows))]

    def prefill(self, input_ids, prompt_lens, model_kwargs) -> torch.Tensor:
        """The prompt, its last logits, and the first token (a plain step); returns each row's first token."""
        outputs = self.runner.forward(input_ids, prompt_lens, keep_logits=1, prefill=True, **model_kwargs)
        self.runner.commit(prompt_lens)
        self.drafter.begin(self.context, self.captured)
        logits = outputs.logits[:, -1].to(dtype=torch.float32)
        scores = self.logits_processor(input_ids, logits)
        next_tokens = select_tokens(scores, self.config.do_sample, self.ranks)
        emitted = self._emit(next_tokens.tolist(), [[]] * len(self.rows), scores[:, None])
        self.stats.record_step(emitted)
        self.synced_at = time.perf_counter()
        return next_tokens

    def step(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """One draft -> verify -> accept -> commit round from each row's last token (on the device; a stopped
        row's is never used); returns each row's next token."""
        # the rows' ids go to the device only if a drafter or logits processor reads them this step
        selector = DraftSelector(self.config.do_sample, self.scorer, self.vocab_size,
                                 LazyPrefixes(self.row_ids, self.rows), ranks=self.ranks)
        # 1. draft (unless the previous step queued this round's drafts before its host sync); under tensor
        #    parallelism every rank verifies rank 0's drafts (in place: a drafter that keeps them sees the same)
        if self.ahead is not None:
            proposal = self.ahead
        elif self.drafter.num_speculative_tokens == 0:  # "auto" chose a round without drafts
            proposal = self._no_drafts(last_tokens)
        else:
            proposal = self.drafter.propose(last_tokens, self.context, selector)
        same_on_every_rank(proposal.tokens, self.ranks)
        # 2. verify [last token, drafts] in one target forward
        k = proposal.tokens.shape[1]  # this round's (the drafter's k when the round was drafted)
        verify_ids = torch.cat([last_tokens[:, None], proposal.tokens], dim=1)
        logits = self.runner.forward(verify_ids, [k + 1] * len(self.rows), keep_logits=0).logits
        if self.config.do_sample or self.scorer.processors:
            scores = self.scorer.score(selector.prefixes, proposal.tokens, logits.float())
        else:
            # greedy, no processors: only argmax reads the scores, and it is the same on the model's dtype (the
            # cast to fp32 is exact and keeps the order), so the [batch, k+1, vocab] fp32 copy is skipped
            scores = logits
        # 3. accept on device (a random decision: rank 0's, on every rank)
        num_accepted, next_token = self.acceptance(proposal.tokens, proposal.probs, scores)
        if self.ranks is not None and self.acceptance.draws_random:
            decision = same_on_every_rank(torch.stack([num_accepted, next_token.to(num_accepted.dtype)]), self.ranks)
            num_accepted, next_token = decision[0], decision[1].to(next_token.dtype)
        # 4. the one host sync of the step, with the next round's drafts queued before it where the drafter can
        accepted, nxt, drafts = self._read_back(proposal, num_accepted, next_token, selector)
        if self.adaptive_k is not None:
            synced, self.synced_at = self.synced_at, time.perf_counter()
            self.adaptive_k.observe(k, self.synced_at - synced,
                                    None if self.ahead is None else self.ahead.tokens.shape[1])
        # 5. emit (stopping inside the chunk), commit, let the drafter catch up
        was_running = list(self.running)
        chunks = [drafts[b][:accepted[b]] + [nxt[b]] for b in range(len(self.rows))]
        emitted = self._emit([c[-1] for c in chunks], [c[:-1] for c in chunks], scores)
        accepted_running = [a for a, r in zip(accepted, was_running) if r]
        self.stats.record_step([e for e, r in zip(emitted, was_running) if r], accepted_running, k)
        if self.adaptive_k is not None:
            self.adaptive_k.update(accepted_running, k)
        # a running row keeps its input token and the drafts it emitted (all accepted ones unless it stopped
        # inside the chunk), so the cache always holds one token less than the row; a stopped row stops growing
        kept = [e if r else 0 for e, r in zip(emitted, was_running)]
        self.runner.commit([n - (k + 1) + keep for n, keep in zip(self.context.cache.seq_lens, kept)])
        self.drafter.commit(self.context, self.captured, num_accepted, kept)
        if self.drops_rows and any(self.running) and not all(self.running):
            next_token = self._drop_stopped(next_token)
        return next_token

    def _drop_stopped(self, next_token: torch.Tensor) -> torch.Tensor:
        """Take the rows that stopped out of the batch: the target's cache, the drafter's per-row state, the rows'
        ids and the drafts queued for the next round keep the running rows only; returns their next tokens."""
        keep = [b for b, running in enumerate(self.running) if running]
        self.left.update((self.order[b], row) for b, row in enumerate(self.rows) if not self.running[b])
        self.context.cache.keep_rows(keep)
        self.drafter.keep_rows(keep)
        self.rows, self.order = [self.rows[b] for b in keep], [self.order[b] for b in keep]
        self.running = [True] * len(keep)
        self.row_ids.keep_rows(keep)
        if self.ahead is not None:
            self.ahead = DraftProposal(take_rows(self.ahead.tokens, keep), take_rows(self.ahead.probs, keep))
        if self.adaptive_k is not None:
            self.adaptive_k.shrink(len(keep))
        return take_rows(next_token, keep)

    def _read_back(self, proposal, num_accepted, next_token, selector):
        """(accepted, next token, drafts) per row on the host. Unless every running row is about to reach its
        max length, the drafter may queue the next round's drafts first (they depend only on device tensors):
        the device then drafts while the host emits and commits (a row that stops now wastes its drafts)."""
        tokens = proposal.tokens
        host = torch.cat([num_accepted[:, None].to(tokens.dtype), next_token[:, None].to(tokens.dtype), tokens],
                         dim=1)  # one copy to the host instead of three
        pending = self.readback.start(host)
        self.ahead = None
        if self.drafter.num_speculative_tokens and not all(
                len(row) + 1 >= self.stopper.max_length for row, run in zip(self.rows, self.running) if run):
            self.ahead = self.drafter.propose_ahead(next_token, num_accepted, self.context, self.captured, selector)
        host = self.readback.wait(pending)[0].tolist()
        return [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]

    def _no_drafts(self, last_tokens: torch.Tensor) -> DraftProposal:
        """A round with no drafts: the verify is a plain decoding step (sampled: its draw from the target's
        distribution, with no draft to accept)."""
        tokens = last_tokens.new_zeros(last_tokens.shape[0], 0)
        probs = None
        if self.config.do_sample or self.acceptance.draws_random:
            probs = torch.zeros(last_tokens.shape[0], 0, self.vocab_size, device=last_tokens.device)
        return DraftProposal(tokens, probs)

    def _emit(self, last: list[int], accepted_drafts: list[list[int]], scores: torch.Tensor) -> list[int]:
        """Append each running row's accepted drafts then its next token, stopping inside the chunk; returns the
        tokens each row emitted. ``scores`` [batch, chunk, vocab]: the target's scores that chose each token of the
        chunk, for stopping criteria that read them (as plain decoding hands them the step's scores)."""
        emitted = []
        for b, row in enumerate(self.rows):
            count = 0
            if self.running[b]:
                for j, token in enumerate(accepted_drafts[b] + [last[b]]):
                    row.append(token)
                    count += 1
                    if self.stopper.stops(row, lambda b=b, j=j: scores[b, j][None].float()):
                        self.running[b] = False
                        break
            emitted.append(count)
            if self.streamer is not None and count:
                self.streamer.put(torch.tensor(row[-count:])[None, :])
        return emitted


class RowIds:
    """Each row's ids on the device — its prompt as given (left padding first), then what it emitted — grown
    in place after every step, so drafters and history processors get them without a per-step copy of whole
    rows to the device."""

    def __init__(self, input_ids: torch.Tensor, capacity: int):
        batch, width = input_ids.shape
        self.buffer = input_ids.new_zeros(batch, max(capacity, width))
        self.buffer[:, :width] = input_ids
        self.lens = [width] * batch

    def extend(self, rows: list[list[int]]) -> None:
        """Append what each row emitted since the last call (one scatter for the batch)."""
        index_rows, index_cols, values = [], [], []
        for b, row in enumerate(rows):
            for col in range(self.lens[b], len(row)):
                index_rows.append(b)
                index_cols.append(col)
                values.append(row[col])
            self.lens[b] = len(row)
        if values:
            device = self.buffer.device
            self.buffer[torch.tensor(index_rows, device=device), torch.tensor(index_cols, device=device)] = \
                torch.tensor(values, dtype=self.buffer.dtype, device=device)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep the rows ``rows`` only, in that order (the batch dropped the others)."""
        self.buffer = take_rows(self.buffer, rows)
        self.lens = [self.lens[b] for b in rows]

    def views(self) -> list[torch.Tensor]:
        return [self.buffer[b, :n] for b, n in enumerate(self.lens)]


class LazyPrefixes(Sequence):
    """Each row's ids on the device (``RowIds.views()``), brought up to date with ``rows`` at the first access.

    Greedy MTP drafting without logits processors never reads them: the step then skips the per-row host loop
    and copies of ``RowIds.extend``, which run after the step's host sync while the device waits."""

    def __init__(self, row_ids: RowIds, rows: list[list[int]]):
        self._row_ids, self._rows, self._views = row_ids, rows, None

    def _get(self) -> list[torch.Tensor]:
        if self._views is None:
            self._row_ids.extend(self._rows)
            self._views = self._row_ids.views()
        return self._views

    def __getitem__(self, index):
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._rows)

    def lengths(self) -> list[int]:
        """Each row's number of ids, without bringing the ids to the device."""
        return [len(r) for r in self._rows]


def _pad_rows(rows: list[list[int]], pad_token: torch.Tensor | None, device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    if any(len(r) < width for r in rows) and pad_token is None:
        raise ValueError("rows ended at different lengths and no pad_token_id is set; pass pad_token_id= to generate.")
    pad = int(pad_token) if pad_token is not None else 0
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
