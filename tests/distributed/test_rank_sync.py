"""Where the loops keep the ranks of a tensor-parallel group in step, in one process: a recording stand-in for the
group (``EnabledState.ranks``) sees every broadcast. Rank 0's random draws must reach every rank (plain sampled
tokens, each sampled draft step, rejection-sampling decisions) and every round's drafts are rank 0's; greedy
target choices need nothing (the LM head gathers equal logits on every rank)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import hf_specdec
from tests import bundled

K = 3
NEW_TOKENS = 6


class RecordingRanks:
    """Stands in for a RankGroup of one process: values pass unchanged, broadcasts are recorded by shape."""

    def __init__(self):
        self.broadcasts: list[tuple[int, ...]] = []

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.broadcasts.append(tuple(tensor.shape))
        return tensor

    def smallest(self, value):
        return value


@contextlib.contextmanager
def recorded(model):
    ranks, state = RecordingRanks(), model._hf_specdec
    state.ranks = ranks
    try:
        yield ranks
    finally:
        state.ranks = None


def _generate(model, do_sample: bool, **kwargs):
    input_ids, attention_mask = bundled.batch(2, chars=60)
    torch.manual_seed(0)
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=do_sample,
                          min_new_tokens=NEW_TOKENS, **kwargs)


@pytest.mark.parametrize("do_sample", [False, True])
def test_plain_decoding_broadcasts_each_sampled_token(do_sample):
    target, _, _ = bundled.gemma()
    with recorded(target) as ranks:
        _generate(target, do_sample)
    assert ranks.broadcasts == ([(2,)] * NEW_TOKENS if do_sample else [])


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.usefixtures("cpu_drafts_ahead")  # every round broadcasts the call's k drafts
def test_speculative_rounds_broadcast_the_drafts_and_random_decisions(do_sample, monkeypatch):
    from hf_specdec.generation.speculative import SpeculativeLoop

    target, assistant, _ = bundled.gemma()
    rows = []  # the rows of each round's batch (a greedy batch drops its stopped rows on the CPU, on every rank)
    step = SpeculativeLoop.step
    monkeypatch.setattr(SpeculativeLoop, "step", lambda self, last: (rows.append(len(self.rows)), step(self, last))[1])
    with recorded(target) as ranks:
        _generate(target, do_sample, assistant_model=assistant, num_speculative_tokens=K)
    assert len(rows) == hf_specdec.last_generation_stats(target).num_target_forwards - 1  # the prefill drafts nothing
    if do_sample:  # the prefill's sampled token; each round: each sampled draft step, the drafts, (accepted, next)
        assert rows == [2] * len(rows)  # a sampled batch keeps its rows
        assert ranks.broadcasts == [(2,)] + ([(2,)] * K + [(2, K), (2, 2)]) * len(rows)
    else:  # each round's drafts, rank 0's on every rank
        assert min(rows) < 2 and ranks.broadcasts == [(n, K) for n in rows]
