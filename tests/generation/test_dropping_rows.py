"""A batch drops its stopped rows (eager forwards, here on the CPU): the rows still running keep decoding exactly
as plain decoding would, the stopped rows' tokens come back in their places, and every cache block is returned.
Bundled tiny family, so rows accept different numbers of drafts and stop at different rounds."""

import pytest
import torch

import hf_specdec
from hf_specdec.generation.speculative import SpeculativeLoop
from tests import bundled

NEW_TOKENS = 20


@pytest.mark.parametrize("processors", [False, True], ids=["greedy", "repetition_penalty"])
@pytest.mark.parametrize("mode", bundled.SPEC_MODES)
def test_stopped_rows_leave_the_batch_and_the_others_decode_as_plain(mode, processors, monkeypatch):
    model, extra, reference = bundled.mode(mode)
    ids, mask = bundled.batch(4)
    eos = bundled.fresh_token(reference, ids, mask, row=1, at=1, new_tokens=NEW_TOKENS)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    if processors:  # the drafts read each row's ids on the device (kept for the rows that stay)
        kwargs["repetition_penalty"] = 1.3
    sizes = []  # the batch after each drop
    monkeypatch.setattr(SpeculativeLoop, "_drop_stopped",
                        lambda self, token, _drop=SpeculativeLoop._drop_stopped: (
                            _drop(self, token), sizes.append(self.context.cache.batch_size))[0])
    with bundled.recorded_caches(monkeypatch) as caches:
        out = model.generate(ids, **kwargs, **extra)
    dropped = hf_specdec.last_generation_stats(model)
    expected = reference.generate(ids, **kwargs)
    assert torch.equal(out, expected)
    # the drafter kept each running row's own state: its rows drafted and accepted as in a batch that keeps every
    # row to the end (drafts read from another row's state would be accepted less, not give other tokens)
    monkeypatch.setattr(SpeculativeLoop, "_drop_stopped", lambda self, token: token)
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)
    kept = hf_specdec.last_generation_stats(model)
    assert dropped.acceptance_histogram == kept.acceptance_histogram
    assert dropped.num_target_forwards == kept.num_target_forwards
    # row 1 stopped at its EOS and left; the batch shrank step by step as rows stopped at different rounds
    assert sizes and sizes == sorted(sizes, reverse=True) and sizes[0] < 4
    assert (out[1] == eos).any() and out[1, -1] == 0  # padded after its EOS
    assert len(caches) >= 1 and all(sum(c.num_used_blocks) == 0 for c in caches)



@pytest.mark.parametrize("mode", ["gemma_mtp", "gemma_dflash"])
def test_a_sampled_batch_keeps_its_stopped_rows(mode, monkeypatch):
    """Sampling draws over the batch's rows: a seed must give the same tokens whether stopped rows would leave the
    batch (eager) or not (CUDA graphs), so a sampled call keeps them."""
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(3)
    calls = []
    monkeypatch.setattr(SpeculativeLoop, "_drop_stopped", lambda self, token: calls.append(1) or token)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=True, eos_token_id=None,
                         pad_token_id=0, **extra)
    assert out.shape[1] == ids.shape[1] + NEW_TOKENS and not calls
    monkeypatch.undo()
    calls_greedy = []
    monkeypatch.setattr(SpeculativeLoop, "_drop_stopped", lambda self, token: calls_greedy.append(1) or token)
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                   pad_token_id=0, **extra)
    assert calls_greedy  # the same batch, greedy: its rows stop at different rounds and leave
