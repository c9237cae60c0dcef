"""Greedy rounds of eager forwards: k is capped at what the running rows can still take before their max length,
and on the CPU the next round is drafted after the round's commit (its stopped rows gone) instead of before the
read-back. The output stays plain greedy decoding's; the switches off give the rounds of before."""

import pytest
import torch

from hf_specdec.generation import speculative
from hf_specdec.generation.speculative import SpeculativeLoop
from hf_specdec.models.dflash import DFlashDraftRunner
from hf_specdec.models.gemma4 import Gemma4MTPDraftRunner
from tests import bundled

NEW_TOKENS = 21
RUNNERS = {"gemma_mtp": Gemma4MTPDraftRunner, "gemma_dflash": DFlashDraftRunner}


def _rounds(monkeypatch, name, ids, mask):
    """(output, [(room, k) of each round], propose_ahead calls) of a greedy call of ``name``: room is the most
    tokens a running row could still take when the round began, k the drafts its verify checked."""
    target, extra, _ = bundled.mode(name)
    rooms, ks, ahead = [], [], []
    step, finish, propose_ahead = SpeculativeLoop.step, SpeculativeLoop._finish, RUNNERS[name].propose_ahead

    def spy_step(self, last):
        rooms.append(max(self.stopper.max_length - len(row) for row, run in zip(self.rows, self.running) if run))
        return step(self, last)

    def spy_finish(self, verified, in_flight=None):
        ks.append(verified.k)
        return finish(self, verified, in_flight)

    with monkeypatch.context() as patch:  # the spies go with the call
        patch.setattr(SpeculativeLoop, "step", spy_step)
        patch.setattr(SpeculativeLoop, "_finish", spy_finish)
        patch.setattr(RUNNERS[name], "propose_ahead", lambda self, *args: ahead.append(1) or propose_ahead(self, *args))
        out = target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0, **extra)
    return out, list(zip(rooms, ks)), len(ahead)


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_cpu_rounds_draft_after_the_commit_and_no_more_than_the_rows_can_take(name, monkeypatch):
    _, extra, reference = bundled.mode(name)
    ids, mask = bundled.batch(3)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    k = extra["num_speculative_tokens"]
    out, rounds, ahead = _rounds(monkeypatch, name, ids, mask)
    assert torch.equal(out, expected)
    assert ahead == 0  # every round drafted by propose, after the commit of the one before
    # a round's k: the call's, or one less than the most tokens a running row could still take where that is less
    assert all(round_k == min(k, room - 1) for room, round_k in rounds), rounds
    assert rounds[-1][1] < k, rounds  # the last round had less room than k + 1 tokens
    with monkeypatch.context() as patch:
        patch.setattr(speculative, "CAPS_K", False)
        patch.setattr(speculative, "CPU_DRAFTS_AFTER_COMMIT", False)
        out_before, rounds_before, ahead_before = _rounds(monkeypatch, name, ids, mask)
    assert torch.equal(out_before, expected)
    assert all(round_k == k for _, round_k in rounds_before) and ahead_before > 0


@pytest.mark.parametrize("name", ["step_mtp", "gemma_mtp", "gemma_dflash"])
@pytest.mark.parametrize("k", ["fixed", "auto"])
@pytest.mark.parametrize("new_tokens", [2, 3, 4])
def test_calls_shorter_than_a_round_are_plain_greedy(name, k, new_tokens):
    """Calls of a few tokens, whose first rounds already have less room than k + 1 tokens: every mode, fixed and
    "auto" k, gives plain greedy's tokens (under "auto", Step 3.5 MTP, whose k may not rise within a call, keeps its
    rounds uncapped: "auto" would raise k again after a capped round)."""
    model, extra, reference = bundled.mode(name)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    if k == "auto":
        extra = {**extra, "num_speculative_tokens": "auto"}
    assert torch.equal(model.generate(ids, **kwargs, **extra), reference.generate(ids, **kwargs))
