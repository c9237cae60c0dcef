"""The batched draft → verify → accept → commit loop, shared by every speculative mode.

Like ``paged_decode`` it is handed to ``GenerationMixin.generate(custom_generate=...)``, so transformers
prepares the generation config, logits processors and stopping criteria. One step:

1. the drafter proposes k tokens per row (and q when sampling);
2. the target verifies ``[last token, k drafts]`` of every row in one forward through the paged cache;
3. acceptance on device gives each row its accepted count and one recovered/bonus token;
4. one host sync brings the counts over; rows emit their tokens one by one so EOS, max length, stop
   strings and custom criteria cut inside the accepted chunk; the cache keeps ``len + accepted + 1``
   tokens per row (rollback of the rest is only a shorter length) and the drafter commits.

Greedy output equals plain greedy decoding token for token; sampled output follows the target
distribution (rejection sampling), whatever the drafter proposes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.generation.acceptance import greedy_accept_no_sync, rejection_sample_no_sync
from hf_specdec.generation.drafter import DraftSelector
from hf_specdec.generation.cuda_graphs import graph_store_for
from hf_specdec.generation.model_runner import ModelRunner, real_token_counts
from hf_specdec.generation.sampling import PositionScorer, select_tokens
from hf_specdec.generation.stats import SpecStats


class RowStopper:
    """Decides, token by token, when a row stops: the stopping criteria of ``generate`` applied to that row."""

    def __init__(self, stopping_criteria, generation_config):
        self.criteria = stopping_criteria
        self.max_length = generation_config.max_length
        eos = [c for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
        self.eos = set(eos[0].eos_token_id.tolist()) if eos else set()
        # max length and EOS are checked here directly; anything else goes through the criteria
        self.only_builtin = all(isinstance(c, (EosTokenCriteria, MaxLengthCriteria)) for c in stopping_criteria)

    def stops(self, row_ids: list[int]) -> bool:
        if len(row_ids) >= self.max_length or row_ids[-1] in self.eos:
            return True
        if self.only_builtin:
            return False
        ids = torch.tensor(row_ids)[None, :]
        return bool(self.criteria(ids, None)[0])


def speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                       streamer=None, *, drafter=None, **model_kwargs):
    """Speculative decoding of ``input_ids`` [batch, prompt_len] (left-padded) with ``drafter``."""
    state = model._hf_specdec
    k = drafter.num_speculative_tokens
    stats = SpecStats(spec_mode=drafter.spec_mode, num_speculative_tokens=k)
    prompt_lens = real_token_counts(input_ids, model_kwargs.get("attention_mask"))
    batch, width = input_ids.shape
    device = input_ids.device
    scorer = PositionScorer(logits_processor)
    stopper = RowStopper(stopping_criteria, generation_config)
    rows = [input_ids[b].tolist() for b in range(batch)]
    row_ids = RowIds(input_ids, generation_config.max_length + k + 1)
    running = [True] * batch
    runner = ModelRunner(model, state.layout, state.cache_config, graph_store_for(model))
    cache = runner.start(prompt_lens, generation_config.max_length - width, lookahead=k + 1)
    try:
        with drafter.capture(model) as captured:
            # graphs captured while other hooks recorded into another kind of holder are not replayed for these
            runner.record_hooks_of(captured, (type(drafter).__qualname__, type(captured).__qualname__,
                                              getattr(drafter, "capture_key", None)))
            # 1. prefill: the prompt, its last logits, and the first token (a plain step)
            outputs = runner.forward(input_ids, prompt_lens, keep_logits=1, prefill=True, **model_kwargs)
            runner.commit(prompt_lens)
            drafter.begin(cache, captured, prompt_lens)
            logits = outputs.logits[:, -1].to(dtype=torch.float32)
            next_tokens = select_tokens(logits_processor(input_ids, logits), generation_config.do_sample)
            emitted = _emit(rows, running, next_tokens.tolist(), [[]] * batch, stopper, streamer)
            stats.record_step(emitted)
            ahead = None
            while any(running):
                # each running row's last token, already on the device (a stopped row's input is never used);
                # the rows' ids go to the device only if a drafter or logits processor reads them this step
                next_tokens, ahead = _speculative_step(model, runner, drafter, captured, scorer, stopper,
                                                       generation_config, rows, LazyPrefixes(row_ids, rows),
                                                       running, next_tokens, stats, streamer, ahead)
    finally:
        runner.finish()
    if streamer is not None:
        streamer.end()
    state.last_stats = stats.finish()
    sequences = _pad_rows(rows, generation_config._pad_token_tensor, device)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _speculative_step(model, runner, drafter, captured, scorer, stopper, generation_config, rows, prefixes,
                      running, last_tokens, stats, streamer, ahead=None):
    """One step; returns (each row's next token on the device, the next round's drafts if already launched)."""
    cache = runner.cache
    k = drafter.num_speculative_tokens
    selector = DraftSelector(generation_config.do_sample, scorer, model.config.get_text_config().vocab_size,
                             prefixes)
    # 1. draft (unless the previous step launched this round's drafts before its host sync)
    proposal = ahead if ahead is not None else drafter.propose(last_tokens, cache, selector)
    # 2. verify [last token, drafts] in one target forward
    verify_ids = torch.cat([last_tokens[:, None], proposal.tokens], dim=1)
    logits = runner.forward(verify_ids, [k + 1] * len(rows), keep_logits=0).logits
    if generation_config.do_sample or scorer.processors:
        scores = scorer.score(prefixes, proposal.tokens, logits.float())
    else:
        # greedy, no processors: only argmax reads the scores, and it is the same on the model's dtype (the
        # cast to fp32 is exact and keeps the order), so the [batch, k+1, vocab] fp32 copy is skipped
        scores = logits
    # 3. accept on device
    if getattr(drafter, "synthetic_acceptance", None) is not None:
        # benchmark-only (benchmarks/e2e_synthetic.py): a fixed acceptance rate, output NOT lossless
        num_accepted, next_token = drafter.synthetic_acceptance(proposal.tokens, scores.argmax(dim=-1))
    elif generation_config.do_sample:
        num_accepted, next_token = rejection_sample_no_sync(proposal.tokens, proposal.probs,
                                                            torch.softmax(scores, dim=-1))
    else:
        num_accepted, next_token = greedy_accept_no_sync(proposal.tokens, scores.argmax(dim=-1))
    # 4. the one host sync of the step; emit, commit, let the drafter catch up
    host = torch.cat([num_accepted[:, None].to(proposal.tokens.dtype), next_token[:, None].to(proposal.tokens.dtype),
                      proposal.tokens], dim=1)  # one copy to the host instead of three
    propose_ahead = getattr(drafter, "propose_ahead", None)
    ahead = None
    if propose_ahead is not None and not all(len(row) + 1 >= stopper.max_length
                                             for row, run in zip(rows, running) if run):
        # the next round's drafts depend only on device tensors: queue them behind this copy, so the device
        # drafts while the host emits and commits below (a row that stops now wastes its drafts)
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=host.is_cuda)
        pinned.copy_(host, non_blocking=True)
        copied = torch.cuda.Event() if host.is_cuda else None
        if copied is not None:
            copied.record()
        ahead = propose_ahead(next_token, num_accepted, cache, captured, selector)
        if copied is not None:
            copied.synchronize()
        host = pinned.tolist()
    else:
        host = host.tolist()
    accepted, nxt, drafts = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
    was_running = list(running)
    chunks = [drafts[b][:accepted[b]] + [nxt[b]] for b in range(len(rows))]
    emitted = _emit(rows, running, [c[-1] for c in chunks], [c[:-1] for c in chunks], stopper, streamer)
    stats.record_step([e for e, r in zip(emitted, was_running) if r],
                      [a for a, r in zip(accepted, was_running) if r], k)
    # a running row keeps its input token and the drafts it emitted (all accepted ones unless it stopped
    # inside the chunk), so the cache always holds one token less than the row; a stopped row stops growing
    kept = [e if r else 0 for e, r in zip(emitted, was_running)]
    runner.commit([n - (k + 1) + keep for n, keep in zip(cache.seq_lens, kept)])
    drafter.commit(cache, captured, num_accepted, kept)
    return next_token, ahead


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


def _emit(rows, running, last, accepted_drafts, stopper, streamer) -> list[int]:
    """Append each running row's accepted drafts then its next token, stopping inside the chunk."""
    emitted = []
    for b, row in enumerate(rows):
        count = 0
        if running[b]:
            for token in accepted_drafts[b] + [last[b]]:
                row.append(token)
                count += 1
                if stopper.stops(row):
                    running[b] = False
                    break
        emitted.append(count)
        if streamer is not None and count:
            streamer.put(torch.tensor(row[-count:])[None, :])
    return emitted


def _pad_rows(rows: list[list[int]], pad_token: torch.Tensor | None, device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    if any(len(r) < width for r in rows) and pad_token is None:
        raise ValueError("rows ended at different lengths and no pad_token_id is set; pass pad_token_id= to generate.")
    pad = int(pad_token) if pad_token is not None else 0
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
