"""Plain (non-speculative) decoding through the paged cache.

``paged_decode`` has the signature of transformers' ``GenerationMixin._sample`` and is handed to
``GenerationMixin.generate(custom_generate=...)``, so transformers prepares everything a user's
``generate`` call means (generation config, logits processors, stopping criteria, special tokens,
max length, streamer prompt) and this loop only runs the model: one forward per token, one host sync
per step (the "is any row still running" check).

On CUDA the next token's forward is queued before that check is read back: the host waits only for the
check (an event recorded before the forward), then prepares the step after while the forward runs, so
the device does not idle during the host's per-step work. When every row stops at EOS, the one forward
queued ahead is discarded (the tokens are the same; it costs one step per call).
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_specdec.generation import sampling
from hf_specdec.generation.sampling import GREEDY_NEXT, mask_finished, select_tokens
from hf_specdec.generation.stats import SpecStats
from hf_specdec.cache import OutOfBlocksError
from hf_specdec.runtime import Readback, ReadbackClock, exhausted, real_token_counts

UNTIMED_STEPS = 2  # steps a call's step_times leaves out (a graph captured for the bucket, the first replays)


def take_criteria_max_length(stopping_criteria, generation_config) -> None:
    """The call's max length is its stopping criteria's: a ``MaxLengthCriteria`` the user passes takes the place of
    the one ``generate`` builds from ``max_length`` / ``max_new_tokens`` (transformers' merge of the two lists), and
    transformers' loop then stops there, before or after that length. The loops and the cache read
    ``generation_config.max_length`` (the call's own copy), so it is set to the criteria's."""
    lengths = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    if lengths:
        generation_config.max_length = min(lengths)


def paged_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, *, stats: SpecStats | None = None, step_times=None, **model_kwargs):
    """Decode ``input_ids`` [batch, prompt_len] (left-padded) token by token; returns what ``_sample`` returns.
    ``stats``: the call's counters to fill (a speculative call that "auto" ran as plain decoding reports its mode);
    ``step_times``: called with the seconds of each steady step (all but the first :data:`UNTIMED_STEPS`, which may
    capture graphs), between consecutive read-backs (:class:`ReadbackClock`)."""
    state = model._hf_specdec
    stats = SpecStats() if stats is None else stats
    take_criteria_max_length(stopping_criteria, generation_config)
    prompt_lens = real_token_counts(input_ids, model_kwargs.get("attention_mask"))
    batch = input_ids.shape[0]
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out, logits_out = [], []
    # greedy with nothing that reads the scores (stopping criteria get them only where they are kept, as in
    # transformers' loop): each forward takes its rows' argmax itself (in its CUDA graph)
    select = None
    if sampling.SELECT_WITH_FORWARD and not (generation_config.do_sample or logits_processor or keep_scores
                                             or keep_logits):
        select = GREEDY_NEXT
    runner = state.runner(model)
    runner.start(prompt_lens, generation_config.max_length - input_ids.shape[1])
    try:
        # 1. prefill: every prompt token of every row, logits of the last one
        outputs = runner.forward(input_ids, prompt_lens, keep_logits=1, prefill=True, select=select, **model_kwargs)
        lens = list(prompt_lens)
        runner.commit(lens)
        unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
        active = batch
        readback = Readback(input_ids.device)
        clock = ReadbackClock(readback) if step_times is not None else None
        steps = 0  # read-backs waited for
        while True:
            # 2. pick the next token of each row from the processed scores (or the forward picked it)
            if select is not None:
                scores = None  # not kept
                next_tokens = outputs.selected[0].to(input_ids.device)
            else:
                logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
                scores = logits_processor(input_ids, logits)
                next_tokens = select_tokens(scores, generation_config.do_sample, state.ranks)
            if has_eos:
                next_tokens = mask_finished(next_tokens, unfinished, generation_config._pad_token_tensor)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if keep_scores:
                scores_out.append(scores)
            if keep_logits:
                logits_out.append(logits)
            # 3. stop check, read back after the next forward is queued (the one host sync of the step); the criteria
            #    get what transformers' loop hands them: every step's scores so far where they are kept, else None
            unfinished = unfinished & ~stopping_criteria(input_ids, tuple(scores_out) if keep_scores else None)
            pending = readback.start(unfinished.sum(), next_tokens if streamer is not None else None,
                                     timed=clock is not None)
            at_max = input_ids.shape[1] >= generation_config.max_length
            exhausted_by = None
            if not at_max:
                # 4. one decode forward for every row (a stopped row's forward is never read)
                try:
                    outputs = runner.forward(next_tokens[:, None], [1] * batch, keep_logits=1, select=select)
                except OutOfBlocksError as error:  # an error only if a row still needs this forward
                    exhausted_by = error
                lens = [n + 1 for n in lens]
                if exhausted_by is None:
                    runner.commit(lens)
            count, streamed = readback.wait(pending)
            if clock is not None:
                seconds = clock.since_last(pending)
                if steps >= UNTIMED_STEPS:
                    step_times(seconds)
            steps += 1
            if streamer is not None:
                streamer.put(streamed.clone())  # (the read-back's pinned buffer is reused)
            stats.record_step([1] * active)
            active = int(count)
            if active == 0 or at_max:
                break
            if exhausted_by is not None:
                raise exhausted_by
    except OutOfBlocksError as error:  # the rows outgrew the cache's memory budget: keep what they generated
        state.last_stats = stats.finish()
        raise exhausted(error, input_ids) from None
    finally:
        runner.finish()
    if streamer is not None:
        streamer.end()
    state.last_stats = stats.finish()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids, scores=tuple(scores_out) if keep_scores else None,
            logits=tuple(logits_out) if keep_logits else None,
        )
    return input_ids
