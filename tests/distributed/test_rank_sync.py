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
def test_speculative_rounds_broadcast_the_drafts_and_random_decisions(do_sample):
    target, assistant, _ = bundled.gemma()
    with recorded(target) as ranks:
        _generate(target, do_sample, assistant_model=assistant, num_speculative_tokens=K)
    rounds = hf_specdec.last_generation_stats(target).num_target_forwards - 1  # the prefill drafts nothing
    per_round = [(2, K)]  # the round's drafts, rank 0's on every rank
    first = []
    if do_sample:
        first = [(2,)]  # the prefill's sampled token
        per_round = [(2,)] * K + [(2, K), (2, 2)]  # each sampled draft step, the drafts, (accepted, next token)
    assert ranks.broadcasts == first + per_round * rounds
