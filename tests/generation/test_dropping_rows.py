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


@pytest.mark.parametrize("mode", bundled.SPEC_MODES)
def test_a_row_that_moves_up_keeps_its_own_processor_state(mode, monkeypatch):
    """Rows of very different prompt lengths (the repetition penalty skips each row's own left padding) that stop at
    different rounds: after a row leaves the batch, the rows below it move up and keep their own padding, and a
    prefix_allowed_tokens_fn is still asked about their own batch ids. Greedy, so transformers' tokens."""
    model, extra, reference = bundled.mode(mode)
    tok = bundled.tokenizer()
    tok.padding_side = "left"
    texts = [bundled.prompts(1, 200)[0], "x", "# a comment\nfor i in range(10):\n    print(i)\n    if i"]
    enc = tok(texts, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    eos = bundled.fresh_token(reference, ids, mask, row=0, at=3, new_tokens=NEW_TOKENS)
    asked = set()

    def allowed(batch_id, prefix):  # every token but one per row: the rows see different constraints
        asked.add(batch_id)
        return [t for t in range(tok.vocab_size) if t != 5 + batch_id]

    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0,
                  repetition_penalty=1.5)
    expected = reference.generate(ids, **kwargs)
    sizes = []  # the batch after each drop: row 0 stops first and leaves, the others move up
    monkeypatch.setattr(SpeculativeLoop, "_drop_stopped",
                        lambda self, token, _drop=SpeculativeLoop._drop_stopped: (
                            _drop(self, token), sizes.append(self.context.cache.batch_size))[0])
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)
    assert sizes and sizes[0] < 3
    kwargs["prefix_allowed_tokens_fn"] = allowed
    expected = reference.generate(ids, **kwargs)
    asked.clear()
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)
    assert asked == {0, 1, 2}
