"""Drafting ahead: a drafter's ``propose_ahead`` (the next round queued before the step's host sync, from device
tensors only) proposes exactly what its ``propose`` gives after the commit, at every round of a batch whose rows
accept different numbers of drafts (bundled trained family, so most drafts are accepted and a wrong position,
hidden state or context entry would change them)."""

import pytest
import torch

import hf_specdec
from hf_specdec.assets import held_out_snippets
from hf_specdec.generation import acceptance
from hf_specdec.generation.speculative import SpeculativeLoop
from hf_specdec.models.dflash import DFlashDraftRunner
from hf_specdec.models.gemma4 import Gemma4MTPDraftRunner
from hf_specdec.models.step3p5.mtp_drafter import Step3p5MTPDraftRunner
from tests import bundled

RUNNERS = {"gemma_mtp": Gemma4MTPDraftRunner, "gemma_dflash": DFlashDraftRunner, "step_mtp": Step3p5MTPDraftRunner}

# rounds drafted ahead are compared with rounds drafted after the commit, round by round
pytestmark = pytest.mark.usefixtures("cpu_drafts_ahead")


def _batch():
    """Three held-out snippet openings of different lengths, left-padded."""
    tokenizer = bundled.tokenizer()
    rows = [tokenizer(s["text"][:n]).input_ids for s, n in zip(held_out_snippets()[:3], (160, 90, 130))]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_drafts_queued_before_the_sync_are_the_drafts_after_the_commit(name, monkeypatch):
    target, extra, _ = bundled.mode(name)
    runner = RUNNERS[name]
    ids, mask = _batch()
    accept, step = acceptance.greedy_accept_no_sync, SpeculativeLoop.step
    runs = {}
    for ahead in (True, False):
        calls = {"queued": 0}
        original = runner.propose_ahead if ahead else (lambda self, *args: None)

        def counted(self, *args, _original=original, _calls=calls):
            proposal = _original(self, *args)
            _calls["queued"] += proposal is not None
            return proposal

        monkeypatch.setattr(runner, "propose_ahead", counted)
        drafts, running = [], []  # per round: the drafts, and which rows were still running
        # (greedy acceptance, after the verify forward or taken with it: the drafts it compares)
        monkeypatch.setattr(acceptance, "greedy_accept_no_sync",
                            lambda d, target_tokens: (drafts.append(d.clone()), accept(d, target_tokens))[1])
        monkeypatch.setattr(SpeculativeLoop, "step",
                            lambda self, last, _running=running: (_running.append(list(self.running)),
                                                                   step(self, last))[1])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                              **extra)
        runs[ahead] = (out, drafts, running, calls["queued"], hf_specdec.last_generation_stats(target))
    (out_a, drafts_a, running, queued, stats), (out_b, drafts_b, _, not_queued, _) = runs[True], runs[False]
    # the first run drafted ahead at every round but the first and the last, its drafts were mostly accepted,
    # and the rows accepted differently
    assert queued >= len(drafts_a) - 2 and not_queued == 0
    assert stats.mean_accepted_length > 1.5 and sum(c > 0 for c in stats.acceptance_histogram) >= 3
    assert torch.equal(out_a, out_b)
    # rows stopped at different rounds and left the batch (eager forwards: runs on the CPU); a row that stopped but
    # stays in a batch (CUDA graphs) drafts from wherever it was left (its drafts are dropped): the running rows'
    # are compared
    assert len(drafts_a) == len(drafts_b) == len(running) and len(running[-1]) < len(running[0])
    assert all(torch.equal(a[rows], b[rows]) for a, b, rows in zip(drafts_a, drafts_b, map(torch.tensor, running)))


def test_dflash_drafts_after_the_commit_in_a_round_that_changed_k(monkeypatch):
    """Under "auto" a round whose k changed verifies the old k's drafts: DFlash queues nothing ahead there (one
    graph per (old, new) pair would be captured inside whichever call first switches that way) and drafts after
    the commit instead, on its graphs per k; rounds that keep their k draft ahead. The output is plain greedy's."""
    from hf_specdec.generation.adaptive_k import AdaptiveK

    target, extra, reference = bundled.mode("gemma_dflash")
    ids, mask = _batch()
    schedule = iter([2, 5, 5, 5, 3, 3, 7, 7, 7, 1, 1] + [4] * 40)
    monkeypatch.setattr(AdaptiveK, "update", lambda self, accepted, k: setattr(self, "k", next(schedule)))
    queued = []  # (verified positions, this round's k, drafts queued)
    original = DFlashDraftRunner.propose_ahead

    def recorded(self, next_tokens, num_accepted, context, captured, selector):
        proposal = original(self, next_tokens, num_accepted, context, captured, selector)
        queued.append((captured[0].shape[1], self.num_speculative_tokens, proposal is not None))
        return proposal

    monkeypatch.setattr(DFlashDraftRunner, "propose_ahead", recorded)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = target.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"})
    assert torch.equal(out, reference.generate(ids, **kwargs))
    changed = [q for q in queued if q[0] != q[1] + 1]
    kept = [q for q in queued if q[0] == q[1] + 1]
    assert len(changed) >= 4 and not any(ahead for _, _, ahead in changed), queued
    assert sum(ahead for _, _, ahead in kept) >= len(kept) - 2, queued  # all but the last rounds queue ahead
