"""num_speculative_tokens="auto": k chosen per round, lossless in every mode, settling at k=1 when no draft is
ever accepted and growing when most are."""

import pytest
import torch

import hf_specdec
from hf_specdec.generation.adaptive_k import AdaptiveK
from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def test_the_controller_settles_at_the_smallest_k_without_acceptances_and_grows_with_them():
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=1)
    for _ in range(20):
        controller.update([0, 0, 0], controller.k)
    assert controller.k == 1
    for _ in range(30):
        controller.update([controller.k] * 3, controller.k)
    assert controller.k >= 5
    wide = AdaptiveK(7, lambda k: 0.1 * k, batch=32)  # verify tokens cost more at large batches: fewer drafts
    assert wide.tokens_per_cost(0.8, 3) > wide.tokens_per_cost(0.8, 7)


def test_the_controller_does_not_switch_k_on_noise_around_a_flat_optimum():
    """Rows accepting about 80% of their drafts, k drafted per round by the controller: once settled it keeps one
    k (or moves once), where following each round's estimate would flip between neighbouring k."""
    import random

    rng = random.Random(0)
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=8)

    def round_of(k):
        return [next((i for i in range(k) if rng.random() > 0.8), k) for _ in range(8)]

    for _ in range(40):
        controller.update(round_of(controller.k), controller.k)
    settled, chosen = controller.k, []
    for _ in range(200):
        controller.update(round_of(controller.k), controller.k)
        chosen.append(controller.k)
    assert sum(a != b for a, b in zip(chosen, chosen[1:])) <= 4, chosen
    best = max(range(1, 8), key=lambda k: controller.tokens_per_cost(0.8, k))
    assert controller.tokens_per_cost(0.8, settled) >= 0.97 * controller.tokens_per_cost(0.8, best)


@pytest.mark.parametrize("mode", bundled.SPEC_MODES)
def test_auto_k_is_lossless_and_chooses_per_round(mode, monkeypatch):
    model, extra, _ = bundled.mode(mode)
    extra = {**extra, "num_speculative_tokens": "auto"}
    ids, mask = bundled.batch(3)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, **GREEDY)
    expected = model.generate(ids, **kwargs)
    rounds = []
    original = AdaptiveK.update
    monkeypatch.setattr(AdaptiveK, "update", lambda self, accepted, k: (rounds.append(k), original(self, accepted, k)))
    assert torch.equal(model.generate(ids, **kwargs, **extra), expected)
    if mode == "step_mtp":  # its MTP state is shaped by k: it keeps its k
        assert not rounds
    else:  # the controller saw every verify round (one target forward each, after the prefill)
        stats = hf_specdec.last_generation_stats(model)
        assert len(rounds) == stats.num_target_forwards - 1 and 0 < stats.num_draft_tokens <= 3 * sum(rounds), rounds


def test_auto_k_settles_at_one_when_no_draft_is_accepted(monkeypatch):
    """A drafter whose drafts are always wrong (an acceptance that rejects everything still commits the
    target's token): the rounds shrink to one draft; the output is plain greedy's."""
    from hf_specdec.generation.acceptance import GreedyAcceptance

    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, **GREEDY)
    expected = model.generate(ids, **kwargs)

    class RejectAll(GreedyAcceptance):
        def __call__(self, draft_tokens, draft_probs, scores):
            num_accepted, _ = super().__call__(draft_tokens, draft_probs, scores)
            return num_accepted * 0, scores.argmax(dim=-1)[:, 0]

    rounds = []
    original = AdaptiveK.update
    monkeypatch.setattr(AdaptiveK, "update", lambda self, accepted, k: (rounds.append(k), original(self, accepted, k)))
    got = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}, acceptance=RejectAll())
    assert torch.equal(got, expected)
    assert rounds[-10:] == [1] * 10


def test_auto_is_the_only_word_num_speculative_tokens_takes():
    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(1)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **{**extra, "num_speculative_tokens": "fast"})
