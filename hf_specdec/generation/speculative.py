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

On the GPU a greedy call (no logits processors, no stopping criteria that read the scores: EOS, max length, stop
strings and a time limit are fine) whose drafter can draft ahead runs one round ahead: round r+1's verify is queued
(its positions from round r's acceptance, on the device) before the host waits for round r, so the device verifies
and drafts while the host emits and commits the round before. So do the rounds without drafts that end a call's
drafting ("auto" at k = 0 for a drafter whose k does not rise again within a call, Step 3.5 MTP): from there the
call decodes as plain decoding does, one token a round, each round queued before the last is read. Blocks are
reserved for both rounds, a row the host saw stop stops advancing on the device from the next round on, and the
round in flight when every row stopped is dropped. Where the drafter can draft from the verify's own outputs (Gemma 4
MTP), the next round's drafts are part of the verify forward: one graph replay for verify, acceptance and drafts.

Greedy output equals plain greedy decoding token for token; sampled output follows the target
distribution (rejection sampling), whatever the drafter proposes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.generation.acceptance import Acceptance, acceptance_for
from hf_specdec.generation import adaptive_k
from hf_specdec.generation.adaptive_k import AdaptiveK, costs_for
from hf_specdec.generation.decode import paged_decode, take_criteria_max_length
from hf_specdec.generation.drafter import Drafter, DraftProposal, DraftSelector, DraftsInVerify, take_rows
from hf_specdec.generation import sampling
from hf_specdec.generation.sampling import (AtRow, PositionScorer, check_speculative_processors, is_transformers_own,
                                           same_on_every_rank, select_tokens)
from hf_specdec.generation.stats import SpecStats
from hf_specdec.cache import OutOfBlocksError
from hf_specdec.cache.paged_cache import to_device_async
from hf_specdec.runtime import Readback, ReadbackClock, Select, exhausted, real_token_counts

# where a call may run one round ahead: on the GPU the host's work of a round overlaps the device's next one; on the
# CPU the two are one thread and nothing overlaps (tests add "cpu" to run that path there). HF_SPECDEC_RUN_AHEAD=0
# (read at import) turns it off, e.g. to compare the two
RUN_AHEAD_DEVICES = ("cuda",) if os.environ.get("HF_SPECDEC_RUN_AHEAD", "1") != "0" else ()
# running ahead, the next round's drafts inside the verify forward where the drafter offers it
# (``Drafter.drafts_in_verify``); HF_SPECDEC_DRAFTS_IN_VERIFY=0 (read at import) keeps them a call of their own
DRAFTS_IN_VERIFY = os.environ.get("HF_SPECDEC_DRAFTS_IN_VERIFY", "1") != "0"
# Greedy rounds of eager forwards on the CPU draft after the round's commit, not before its read-back: nothing runs
# beside the host there, and the rows that stopped are gone by then (their drafts are not made). False drafts
# before the read-back as on a GPU (set at run time; the tests of drafting ahead run it on the CPU so).
CPU_DRAFTS_AFTER_COMMIT = True
# Greedy rounds of eager forwards drafted after the commit of the round before (a drafter whose k may change between
# rounds) draft no more than the running rows can still take before their max length: a round emits at most k + 1
# tokens a row. False drafts k every round (set at run time; tests that compare such rounds with rounds run ahead,
# which keep k, turn it off).
CAPS_K = True


@dataclass
class _Round:
    """A verified round whose result the host has not read yet."""

    k: int  # its drafts per row
    pending: object  # its Readback: per row the accepted count, the next token, its first position, the drafts
    num_accepted: torch.Tensor  # [batch] on the device (for the drafter's commit)
    advance: list[int] | None = None  # running ahead: per row 1 where the next round's verify sits past this one
    first: list[int] | None = None  # running ahead: each row's first position as the host derived it


class RowStopper:
    """Decides, token by token, when a row stops: the stopping criteria of ``generate`` applied to that row."""

    def __init__(self, stopping_criteria, generation_config, batch: int = 1):
        """``batch``: the request's rows; a criterion of the user's is called at a row's index of a batch that size
        (:class:`AtRow`), as generate's loop would call it."""
        self.criteria = stopping_criteria
        self.batch = batch
        self.at_row = batch > 1 and not all(is_transformers_own(c) for c in stopping_criteria)
        self.max_length = generation_config.max_length
        eos = [c for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.eos = set(eos[0].eos_token_id.tolist()) if eos else set()
        # max length and EOS are checked here directly; anything else goes through the criteria
        self.only_builtin = all(isinstance(c, (EosTokenCriteria, MaxLengthCriteria)) for c in stopping_criteria)

    def stops(self, row_ids: list[int], row: int = 0) -> bool:
        """Whether the row with ids ``row_ids`` stops at its last token; ``row``: its index in the request. The
        criteria get no scores, as transformers' loop hands them none where the scores are not kept (a speculative
        call keeps none)."""
        if len(row_ids) >= self.max_length or row_ids[-1] in self.eos:
            return True
        if self.only_builtin:
            return False
        ids = torch.tensor(row_ids)[None, :]
        criteria = AtRow(self.criteria, row, self.batch) if self.at_row else self.criteria
        return bool(criteria(ids, None)[0])


def speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, *, drafter: Drafter, acceptance: Acceptance | None = None, adaptive: bool = False,
                       draft_model: torch.nn.Module | None = None, **model_kwargs):
    """Speculative decoding of ``input_ids`` [batch, prompt_len] (left-padded) with ``drafter``; ``adaptive``: k
    chosen per round (up to the drafter's k) where the drafter allows it, and the whole call decoded plainly where no
    k pays for its drafting (:func:`adaptive_k.plain_call`; the output is the same); ``draft_model``: the model whose
    attention writes the drafter's own caches (its assistant, or the target)."""
    check_speculative_processors(logits_processor)
    take_criteria_max_length(stopping_criteria, generation_config)
    costs = _auto_costs(model, drafter, draft_model, input_ids.shape[0]) if adaptive and drafter.adaptive_k else None
    # (a benchmark's acceptance that is not lossless commits other tokens than plain decoding: its calls stay rounds)
    if (costs is not None and input_ids.device.type in adaptive_k.PLAIN_CALL_DEVICES
            and (acceptance is None or acceptance.lossless)
            and adaptive_k.plain_call(costs, drafter.num_speculative_tokens,
                                      generation_config.max_length - input_ids.shape[1])):
        stats = SpecStats(spec_mode=drafter.spec_mode, num_speculative_tokens=drafter.num_speculative_tokens)
        return paged_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, stats=stats, step_times=costs.add_plain, **model_kwargs)
    loop = SpeculativeLoop(model, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                           streamer, acceptance or acceptance_for(generation_config.do_sample), adaptive, draft_model,
                           costs=costs)
    sequences = loop.run(input_ids, model_kwargs)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _auto_costs(model, drafter: Drafter, draft_model, batch: int):
    """The round timings "auto" keeps for ``model``, ``drafter``'s kind, its draft model and ``batch`` rows; None under
    tensor parallelism, where every rank must choose the same k (the acceptance alone decides there, with the prior
    cost model)."""
    state = model._hf_specdec
    if state.ranks is not None:
        return None
    return costs_for(state.round_costs, (type(drafter).__qualname__, id(draft_model or model), batch))


class SpeculativeLoop:
    """One speculative ``generate`` call: the request's state lives here, a step is :meth:`step`."""

    def __init__(self, model, drafter: Drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                 streamer, acceptance: Acceptance, adaptive: bool = False, draft_model: torch.nn.Module | None = None,
                 costs=None):
        """``costs``: where k is chosen per round (``adaptive``), its timings for this model, drafter and batch size
        (:func:`_auto_costs`; None under tensor parallelism, where the prior cost model decides)."""
        state = model._hf_specdec
        self.model, self.drafter, self.acceptance, self.streamer = model, drafter, acceptance, streamer
        self.k = drafter.num_speculative_tokens  # the most drafts a round may have: caches are sized for them
        self.adaptive_k = None
        if adaptive and drafter.adaptive_k:
            # k = 0 is a candidate too: a round without drafts, a plain step of this loop whose commit still lets the
            # drafter catch up, for where no k pays for its drafting (where k may rise again, a round with drafts
            # now and then measures the acceptance; where it may not, the rest of the call runs plain rounds)
            self.adaptive_k = AdaptiveK(self.k, drafter.draft_cost, input_ids.shape[0], costs=costs,
                                        grows=drafter.k_grows, plain=True)
        self.config = generation_config
        self.logits_processor = logits_processor
        self.scorer = PositionScorer(logits_processor, batch=input_ids.shape[0])
        self.stopper = RowStopper(stopping_criteria, generation_config, batch=input_ids.shape[0])
        self.stats = SpecStats(spec_mode=drafter.spec_mode, num_speculative_tokens=self.k,
                               lossless=acceptance.lossless)
        batch = input_ids.shape[0]
        self.rows = [input_ids[b].tolist() for b in range(batch)]
        # a batch of one streams each round's accepted chunk in one put; several rows stream as generate's loop does
        # (:meth:`_stream_steps`), up to ``streamed`` tokens a row
        self.streams_chunks, self.streamed = batch == 1, input_ids.shape[1]
        self.row_ids = RowIds(input_ids, generation_config.max_length + self.k + 1)
        self.running = [True] * batch
        # without an EOS, generate pads no finished row: a row a stopping criterion finished goes on decoding until
        # the batch's last row finishes, and every row ends at that length (``finished``: each row's length when a
        # criterion finished it, by its index in input_ids; ``until``: the batch's end, once every row finished)
        self.pads_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        self.finished: dict[int, int] = {}
        self.until: int | None = None
        self.runner = state.runner(model)
        self.ranks = state.ranks  # tensor parallel: what a rank draws, every rank uses (runtime/distributed.py)
        self.draft_model = model if draft_model is None else draft_model
        # the request's rows still in the batch (their index in input_ids), and the rows that left it, by that index
        self.order, self.left = list(range(batch)), {}
        self.drops_rows = False  # whether stopped rows leave the batch (decided in run, once the runner started)
        self.readback = Readback(input_ids.device)
        self.clock = ReadbackClock(self.readback)  # rounds timed between consecutive rounds' read-backs
        self.vocab_size = model.config.get_text_config().vocab_size
        self.context = self.captured = None
        self.ahead: DraftProposal | None = None  # this round's drafts, queued by the last step
        # one round ahead (module docstring): greedy, no processors, a drafter that drafts ahead, one process, on a
        # device where the host's work overlaps the device's
        ahead = (input_ids.device.type in RUN_AHEAD_DEVICES and not generation_config.do_sample
                 and not acceptance.draws_random and not self.scorer.processors and self.ranks is None)
        self.runs_ahead = drafter.runs_ahead and ahead
        # rounds without drafts run ahead too where they end the call's drafting ("auto" at k = 0 for a drafter whose
        # k does not rise again within a call): the drafter needs nothing of them, so the rest of the call queues each
        # round before the host reads the one before, as plain decoding does
        self.idles_ahead = ahead and self.adaptive_k is not None and not drafter.k_grows
        self.pending: _Round | None = None  # running ahead: the round in flight whose result the host has not read
        self.queue_next = False  # running ahead: whether the next round can be queued before that result is read
        self.next_start: torch.Tensor | None = None  # running ahead: where each row's next verify starts [batch]
        self.advancing: list[int] = [1] * batch  # running ahead: per row 1 while the device moves it on
        self.advancing_device: torch.Tensor | None = None

    def run(self, input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        """Decode until every row stops; returns the rows padded to one width [batch, length]."""
        prompt_lens = real_token_counts(input_ids, model_kwargs.get("attention_mask"))
        # running ahead, a row's length runs up to two rounds past its committed tokens (the round in flight, and
        # the one queued before its result is read), and sliding windows keep a round more behind
        queues = self.runs_ahead or self.idles_ahead
        lookahead = 3 * (self.k + 1) if queues else self.k + 1
        self.context = self.runner.start(prompt_lens, self.config.max_length - input_ids.shape[1],
                                         lookahead=lookahead, draft_model=self.draft_model,
                                         window_slack=self.k + 1 if queues else 0,
                                         draft_modules=self.drafter.weight_modules())
        # eager forwards cost what their rows cost (on CPU a round's compute grows with its rows): a row that
        # stopped leaves the batch. A CUDA graph replays its whole batch bucket whatever rows are real, so with
        # graphs a stopped row stays (its drafts and verify slots are padding of the bucket). So do the rows of a
        # call that draws random numbers: a draw over fewer rows takes other numbers, and a seed gives the same
        # tokens with and without graphs
        eager_greedy = (self.runner.graphs is None and not self.config.do_sample and not self.acceptance.draws_random
                        and not queues)
        self.drops_rows = self.drafter.drops_rows and eager_greedy
        # greedy rounds of eager forwards drafted after the commit also draft no more than the rows can still take (a
        # round emits at most k + 1 tokens a row: a longer block is drafted and verified for nothing; not where "auto"
        # k would raise it again for a drafter whose k may not rise within a call), and on the CPU, where nothing
        # overlaps the host, rounds are drafted after the commit (rows that stopped are gone by then), not before it
        self.caps_k = (eager_greedy and self.drafter.adaptive_k and CAPS_K
                       and (self.drafter.k_grows or self.adaptive_k is None))
        self.drafts_after_commit = (eager_greedy and input_ids.device.type == "cpu" and CPU_DRAFTS_AFTER_COMMIT
                                    and self.drafter.drafts_after_commit)
        try:
            with self.drafter.capture(self.model) as self.captured:
                # graphs captured while other hooks recorded into another kind of holder are not replayed here
                self.runner.record_hooks_of(self.captured, (self.drafter.capture_key,
                                                            type(self.captured).__qualname__))
                last_tokens = self.prefill(input_ids, prompt_lens, model_kwargs)
                # beside the accepted counts (where the LM head runs)
                self.advancing_device = torch.ones(len(self.rows), dtype=torch.int64, device=last_tokens.device)
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
            if not self.streams_chunks:
                self._stream_steps(final=True)
            self.streamer.end()
        self.model._hf_specdec.last_stats = self.stats.finish()
        return _pad_rows(self._all_rows(), self.config._pad_token_tensor, input_ids.device)

    def _all_rows(self) -> list[list[int]]:
        """Every row of the request, in the order of input_ids, whether still in the batch or not (cut at the
        batch's end where rows went on past their finish)."""
        rows = dict(self.left)
        rows.update(zip(self.order, self.rows))
        return [rows[i][:self.until] for i in range(len(rows))]

    def prefill(self, input_ids, prompt_lens, model_kwargs) -> torch.Tensor:
        """The prompt, its last logits, and the first token (a plain step); returns each row's first token."""
        outputs = self.runner.forward(input_ids, prompt_lens, keep_logits=1, prefill=True, **model_kwargs)
        self.runner.commit(prompt_lens)
        self.drafter.begin(self.context, self.captured)
        logits = outputs.logits[:, -1].to(dtype=torch.float32)
        scores = self.logits_processor(input_ids, logits)
        next_tokens = select_tokens(scores, self.config.do_sample, self.ranks)
        emitted = self._emit(next_tokens.tolist(), [[]] * len(self.rows))
        self.stats.record_step(emitted)
        self.clock.mark()
        return next_tokens

    def step(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """One draft -> verify -> accept -> commit round from each row's last token (on the device; a stopped
        row's is never used); returns each row's next token. Running ahead, the round is queued and the round
        before it (in flight until now) is read back and committed instead."""
        if self.pending is not None and not self.queue_next:
            # no drafts were queued ahead (the drafter could not, or the rows are about to end): the round in
            # flight is read and committed first, and this one drafts after it as usual
            self._finish(self.pending)
            self.pending = None
            if not any(self.running):
                return last_tokens
        # the rows' ids go to the device only if a drafter or logits processor reads them this step
        selector = DraftSelector(self.config.do_sample, self.scorer, self.vocab_size,
                                 LazyPrefixes(self.row_ids, self.rows), ranks=self.ranks)
        # 1. draft (unless the previous step queued this round's drafts before its host sync); under tensor
        #    parallelism every rank verifies rank 0's drafts (in place: a drafter that keeps them sees the same)
        if self.caps_k and self.ahead is None:
            self.drafter.num_speculative_tokens = self._capped_k()
        if self.ahead is not None:
            proposal = self.ahead
        elif self.drafter.num_speculative_tokens == 0:  # "auto" chose a round without drafts
            proposal = self._no_drafts(last_tokens)
        else:
            proposal = self.drafter.propose(last_tokens, self.context, selector)
        same_on_every_rank(proposal.tokens, self.ranks)
        # 2. verify [last token, drafts] in one target forward (running ahead: at the positions the device derived
        #    from the round in flight)
        k = proposal.tokens.shape[1]  # this round's (the drafter's k when the round was drafted)
        verify_ids = torch.cat([last_tokens[:, None], proposal.tokens], dim=1)
        raw = not (self.config.do_sample or self.scorer.processors)  # the scores are the raw logits
        # (greedy acceptance on them, step 3, is taken with the forward: inside its graph where one replays)
        select = self.acceptance.with_forward if raw and sampling.SELECT_WITH_FORWARD else None
        # running ahead, the next round's drafts too, where the drafter drafts from the verify's own outputs, while k
        # holds (one graph per k; a round where "auto" changes k drafts the next one by its own call)
        in_verify = None
        if (select is not None and self.runs_ahead and DRAFTS_IN_VERIFY
                and self.drafter.num_speculative_tokens == proposal.tokens.shape[1] > 0):
            in_verify = self.drafter.drafts_in_verify(self.context, self.captured)
            if in_verify is not None:
                select = _with_drafts(select, in_verify)
        try:
            outputs = self.runner.forward(verify_ids, [k + 1] * len(self.rows), keep_logits=0,
                                          starts=None if self.pending is None else self.next_start, select=select)
        except OutOfBlocksError:
            if self.pending is not None:  # the round in flight holds tokens the rows generated: keep them
                self._finish(self.pending)
                self.pending = None
            raise
        logits = outputs.logits
        if raw:
            # greedy, no processors: only argmax reads the scores, and it is the same on the model's dtype (the
            # cast to fp32 is exact and keeps the order), so the [batch, k+1, vocab] fp32 copy is skipped
            scores = logits
        else:
            scores = self.scorer.score(selector.prefixes, proposal.tokens, logits.float())
        # 3. accept on device (a random decision: rank 0's, on every rank)
        if select is not None:
            # (copied out of the graph's memory, which the next verify rewrites: running ahead, this round is read
            # and committed after that)
            num_accepted, next_token = torch.stack(outputs.selected[:2])
            if in_verify is not None:  # (the drafts stay in the graph's memory: the next verify copies them first)
                drafted_ahead = outputs.selected[2]
                in_verify.take(*outputs.selected[3:])
        else:
            num_accepted, next_token = self.acceptance(proposal.tokens, proposal.probs, scores)
        if self.ranks is not None and self.acceptance.draws_random:
            decision = same_on_every_rank(torch.stack([num_accepted, next_token.to(num_accepted.dtype)]), self.ranks)
            num_accepted, next_token = decision[0], decision[1].to(next_token.dtype)
        # 4. the round's result to the host, behind an event (one copy instead of four; the drafts as verified: a
        #    graph's drafts for the next round took the place of this round's)
        tokens = verify_ids[:, 1:]
        first = self.context.forward_meta.q_pos0[:len(self.rows)]
        host = torch.cat([num_accepted[:, None].to(tokens.dtype), next_token[:, None].to(tokens.dtype),
                          first[:, None].to(device=tokens.device, dtype=tokens.dtype), tokens], dim=1)
        verified = _Round(k, self.readback.start(host, timed=self.adaptive_k is not None), num_accepted)
        if self.pending is not None:  # running ahead: the round before this one, while the device runs this one
            self._finish(self.pending, in_flight=verified)
        # 5. the next round's drafts, queued before the host waits (they depend on device tensors only), unless
        #    every running row is about to reach its max length (a row that stops now wastes its drafts) or the
        #    rounds are drafted after the commit (the CPU: the next step drafts them)
        self.ahead = None
        if self.adaptive_k is not None:
            self.drafter.num_speculative_tokens = self.adaptive_k.k
        more = not all(len(row) + 1 >= self.stopper.max_length for row, run in zip(self.rows, self.running) if run)
        if self.drafter.num_speculative_tokens and more and not self.drafts_after_commit:
            if in_verify is not None:  # drafted with the verify (at the k of when it was queued)
                self.ahead = DraftProposal(drafted_ahead, None)
            else:
                self.ahead = self.drafter.propose_ahead(next_token, num_accepted, self.context, self.captured,
                                                        selector)
        elif self.idles_ahead and more:  # k fell to 0 for the rest of the call: the next round verifies its token alone
            self.ahead = self._no_drafts(next_token)
        if self.runs_ahead or (self.idles_ahead and self.ahead is not None):
            # only drafts queued ahead let the next round go before this one is read: a drafter takes what it needs
            # of this verify in propose_ahead, before the next verify overwrites it (a round without drafts waits,
            # but for those that end the call's drafting: the drafter needs nothing of them).
            # The next verify starts past this one's accepted tokens, for the rows the host has not seen stop (a row
            # it saw stop stays where it is: it writes nothing it will read)
            self.queue_next = more and self.ahead is not None
            verified.advance = list(self.advancing)
            # (on the cache's device: the accepted counts live where the LM head ran, another GPU under a device map)
            moved = ((num_accepted.to(torch.int64) + 1) * self.advancing_device).to(first.device)
            self.next_start = (first.to(torch.int64) + moved).to(torch.int32)
            self.pending = verified
            return next_token
        self._finish(verified)
        if self.drops_rows and any(self.running) and not all(self.running):
            next_token = self._drop_stopped(next_token)
        return next_token

    def _finish(self, verified: _Round, in_flight: _Round | None = None) -> None:
        """Read ``verified``'s result back (the step's one host sync), emit its tokens (stopping inside the chunk),
        commit the caches and let the drafter catch up. ``in_flight``: the round queued after it (running ahead),
        whose tokens the target's cache keeps besides the committed ones."""
        host = self.readback.wait(verified.pending)[0].tolist()
        accepted, nxt, first, drafts = ([h[0] for h in host], [h[1] for h in host], [h[2] for h in host],
                                        [h[3:] for h in host])
        if verified.first is not None and first != verified.first:
            raise RuntimeError(f"the device placed a round at {first}, the host's bookkeeping at {verified.first}.")
        k = verified.k
        if self.adaptive_k is not None:
            ahead_k = in_flight.k if in_flight is not None else (
                None if self.ahead is None else self.ahead.tokens.shape[1])
            self.adaptive_k.observe(k, self.clock.since_last(verified.pending), ahead_k)
        was_running = list(self.running)
        chunks = [drafts[b][:accepted[b]] + [nxt[b]] for b in range(len(self.rows))]
        emitted = self._emit([c[-1] for c in chunks], [c[:-1] for c in chunks])
        accepted_running = [a for a, r in zip(accepted, was_running) if r]
        self.stats.record_step([e for e, r in zip(emitted, was_running) if r], accepted_running, k)
        if self.adaptive_k is not None:
            self.adaptive_k.update(accepted_running, k)
        # a running row keeps its input token and the drafts it emitted (all accepted ones unless it stopped
        # inside the chunk), so the cache always holds one token less than the row; a stopped row stops growing
        kept = [e if r else 0 for e, r in zip(emitted, was_running)]
        if in_flight is None:
            self.runner.commit([n - (k + 1) + keep for n, keep in zip(self.context.cache.seq_lens, kept)])
        else:
            # the device placed the round in flight past every accepted token of the rows it moved on (a row that
            # stopped inside its chunk too); the cache keeps that round's positions besides
            committed = [f + (a + 1) * move for f, a, move in zip(first, accepted, verified.advance)]
            self.runner.commit([n + in_flight.k + 1 for n in committed], in_flight=True)
            self.context.committed_lens = in_flight.first = committed
        self.drafter.commit(self.context, self.captured, verified.num_accepted, kept)
        if ((self.runs_ahead or self.idles_ahead)
                and any(move and not run for move, run in zip(self.advancing, self.running))):
            self.advancing = [int(run) for run in self.running]
            self.advancing_device = to_device_async([torch.tensor(self.advancing)], self.advancing_device.device)[0]

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
        self.scorer.keep_rows(keep)
        if self.ahead is not None:
            self.ahead = DraftProposal(take_rows(self.ahead.tokens, keep), take_rows(self.ahead.probs, keep))
        if self.adaptive_k is not None:
            self.adaptive_k.shrink(len(keep))
        return take_rows(next_token, keep)

    def _capped_k(self) -> int:
        """The drafter's k for this round, at most one less than the most tokens a running row can still take
        before its max length (0: the round verifies its last token alone)."""
        room = max(self.stopper.max_length - len(row) for row, run in zip(self.rows, self.running) if run)
        return max(0, min(self.drafter.num_speculative_tokens, room - 1))

    def _no_drafts(self, last_tokens: torch.Tensor) -> DraftProposal:
        """A round with no drafts: the verify is a plain decoding step (sampled: its draw from the target's
        distribution, with no draft to accept)."""
        tokens = last_tokens.new_zeros(last_tokens.shape[0], 0)
        probs = None
        if self.config.do_sample or self.acceptance.draws_random:
            probs = torch.zeros(last_tokens.shape[0], 0, self.vocab_size, device=last_tokens.device)
        return DraftProposal(tokens, probs)

    def _emit(self, last: list[int], accepted_drafts: list[list[int]]) -> list[int]:
        """Append each running row's accepted drafts then its next token, stopping inside the chunk; returns the
        tokens each row emitted."""
        emitted = []
        for b, row in enumerate(self.rows):
            count = 0
            if self.running[b]:
                for token in accepted_drafts[b] + [last[b]]:
                    row.append(token)
                    count += 1
                    if self.order[b] not in self.finished and self.stopper.stops(row, self.order[b]):
                        if self.pads_finished:
                            self.running[b] = False
                            break
                        self.finished[self.order[b]] = len(row)
                    if len(row) >= self.stopper.max_length or (self.until is not None and len(row) >= self.until):
                        self.running[b] = False
                        break
            emitted.append(count)
            if self.streamer is not None and count and self.streams_chunks:
                self.streamer.put(torch.tensor(row[-count:])[None, :])
        if not self.pads_finished and self.until is None and len(self.finished) == len(self.order) + len(self.left):
            # every row finished (a row at its max length too): the batch ends where the last one finished, as
            # generate's batch would; rows past it are cut at the end of the call, rows short of it go on
            self.until = max(self.finished.values())
            self.running = [run and len(row) < self.until for run, row in zip(self.running, self.rows)]
        if self.streamer is not None and not self.streams_chunks:
            self._stream_steps()
        return emitted

    def _stream_steps(self, final: bool = False) -> None:
        """A batch of several rows streams what generate's loop streams: per step one [batch] tensor of each row's
        token there (the pad token for a row that stopped before it), put once every running row has emitted its
        token at that step (rows emit different counts a round); ``final``: the steps left at the call's end."""
        rows = dict(self.left)
        rows.update(zip(self.order, self.rows))
        running = [len(row) for row, run in zip(self.rows, self.running) if run]
        end = min(running) if running and not final else max(len(row) for row in rows.values())
        if self.until is not None:
            end = min(end, self.until)
        pad = self.config._pad_token_tensor
        pad = 0 if pad is None else int(pad)
        for step in range(self.streamed, end):
            self.streamer.put(torch.tensor([rows[i][step] if step < len(rows[i]) else pad for i in range(len(rows))]))
        self.streamed = max(self.streamed, end)


def _with_drafts(select: Select, in_verify: DraftsInVerify) -> Select:
    """``select`` (the greedy acceptance taken with the verify forward) followed by the drafter's next drafts:
    (num_accepted, next_token, drafts, *the drafter's state)."""
    def fn(ids, logits):
        num_accepted, next_token = select.fn(ids, logits)
        return (num_accepted, next_token, *in_verify.fn(next_token, num_accepted))
    return Select(f"{select.name}+drafts{in_verify.key}", fn)


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
