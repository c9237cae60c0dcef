"""num_speculative_tokens="auto" runs a whole call as plain decoding where no k pays for its drafting (on the GPU by
default; these tests put the CPU in ``PLAIN_CALL_DEVICES``): the choice, its probe and its exploration, and the
calls it runs so (lossless, timed, reporting their mode)."""

import functools

import pytest
import torch

import hf_specdec
from hf_specdec.generation import adaptive_k, decode
from hf_specdec.generation.adaptive_k import (EXPLORE_CALLS, MIN_TIMED, PROBE_PLAIN_BELOW, AcceptanceRates,
                                              RoundCosts, candidate_ks, plain_call)
from tests import bundled
from tests.generation.test_adaptive_k import GREEDY, fixed_round_times


def _costs(alpha: float, seconds_of, k_max: int = 3, without_drafts: float | None = None) -> RoundCosts:
    """Costs after one speculative call: the candidates timed at ``seconds_of(k)``, an acceptance of ``alpha`` at
    every position (many rows), and the loop's rounds without drafts at ``without_drafts`` if given."""
    costs = RoundCosts()
    for k in candidate_ks(k_max) + ([0] if without_drafts is not None else []):
        for _ in range(MIN_TIMED):
            costs.add(k, without_drafts if k == 0 else seconds_of(k))
    costs.acceptance = AcceptanceRates(k_max)
    costs.acceptance.reached = [1e4] * k_max  # many rows reached each position, a share alpha accepted it
    costs.acceptance.passed = [1e4 * alpha] * k_max
    costs.calls = 1
    return costs


def _time_plain(costs: RoundCosts, seconds: float) -> None:
    for _ in range(MIN_TIMED):
        costs.add_plain(seconds)


def test_a_call_decodes_plainly_only_where_plain_steps_beat_every_k_and_the_losing_mode_runs_now_and_then():
    """Rounds of ~4 ms at an acceptance of 0.3 against plain steps of 1 ms: plain decoding pays, so calls run it,
    but for one speculative call after EXPLORE_CALLS[0] plain ones, then after twice as many while drafting still
    loses. Once drafting pays again (the acceptance came back) calls draft, and where its gain is under
    PROBE_PLAIN_BELOW one call in EXPLORE_CALLS[0] times plain decoding again (the counts start over); where drafting
    gains more than that, every call drafts."""
    costs = _costs(0.3, lambda k: 4e-3 + 1e-4 * k)
    _time_plain(costs, 1e-3)
    first = EXPLORE_CALLS[0]
    calls = [plain_call(costs, 3, 64) for _ in range(first + 1 + 2 * first + 1)]
    assert calls[:first] == [True] * first and calls[first] is False, calls
    assert calls[first + 1:-1] == [True] * (2 * first) and calls[-1] is False, calls
    assert costs.plain_won and costs.explore_every == 4 * first
    costs.acceptance = _costs(0.95, lambda k: 1.0).acceptance  # the text became easy to draft: ~3.7 tokens a round
    costs.plain_seconds.clear()
    _time_plain(costs, 2e-3)  # and plain steps were timed slower: 2 ms against ~1.2 ms a token drafted (1.7x)
    calls = [plain_call(costs, 3, 64) for _ in range(first + 1 + 2 * first + 1)]
    assert calls[:first] == [False] * first and calls[first] is True, calls
    assert calls[first + 1:-1] == [False] * (2 * first) and calls[-1] is True, calls
    assert not costs.plain_won
    costs.plain_seconds.clear()
    _time_plain(costs, 1e-2)  # plain steps of 10 ms: drafting gains > PROBE_PLAIN_BELOW, plain never runs again
    assert not any(plain_call(costs, 3, 64) for _ in range(8 * first))


def test_plain_decoding_is_timed_once_the_rounds_promise_little_over_the_cheapest_round():
    """Before plain decoding is timed: a call runs it (to time it) where the best timed k's tokens per second, against
    the cheapest timed round (one without drafts where it was timed: a plain step costs no more), gain less than
    PROBE_PLAIN_BELOW; not before a speculative call measured the acceptance and timed a k, and not where drafting
    gains more. Only timed k count: the curve extended below its lowest timed k can reach negative costs."""
    assert not plain_call(RoundCosts(), 3, 64)  # nothing measured yet: the first call drafts
    losing = _costs(0.5, lambda k: 2e-3 + 5e-4 * k, without_drafts=1.5e-3)
    assert plain_call(losing, 3, 64)
    no_plain_round = _costs(0.5, lambda k: 2e-3 + 5e-4 * k)  # the cheapest round drafts one: 2.5 ms, 1.5x
    assert plain_call(no_plain_round, 3, 64)
    paying = _costs(0.95, lambda k: 1e-3 + 2e-5 * k, k_max=7, without_drafts=1.1e-3)
    best = max(adaptive_k.expected_tokens(paying.acceptance.rates(7), k) / seconds
               for k, seconds in paying.curve() if k)
    assert best * min(paying.medians.values()) > PROBE_PLAIN_BELOW and not plain_call(paying, 7, 64)
    assert plain_call(RoundCosts(), 3, 1) and plain_call(paying, 7, 1)  # one new token: no round to draft for
    steep = RoundCosts()  # k = 2 and 3 timed only (a Step 3.5 call's sweep going down): the line through them
    for _ in range(MIN_TIMED):  # puts k = 1 at 0.05 ms, a round that was never run
        steep.add(2, 1e-3)
        steep.add(3, 1.95e-3)
    steep.acceptance, steep.calls = _costs(0.9, lambda k: 1.0).acceptance, 1
    assert adaptive_k.cost_on(steep.curve(), 1) < 1e-4
    rates = steep.acceptance.rates(3)
    gain = max(adaptive_k.expected_tokens(rates, k) / seconds for k, seconds in steep.curve()) * 1e-3
    assert 2.5 < gain < PROBE_PLAIN_BELOW and plain_call(steep, 3, 64)  # k = 2's ~2.7 tokens a ms: probe plain
    _time_plain(steep, 0.5e-3)  # timed: k = 2 gains 1.36x over plain steps of 0.5 ms, under PROBE_PLAIN_BELOW
    assert not plain_call(steep, 3, 64) and steep.streak == 1
    assert plain_call(steep, 3, 1) and steep.streak == 1  # a call of one new token does not count


def test_the_plain_loop_times_its_steady_steps(monkeypatch):
    """paged_decode's step timer: every step after the first SKIP, between consecutive read-backs (the host's clock off
    CUDA); the tokens are plain decoding's."""
    from hf_specdec.generation import generate as generate_module

    model, _, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, **GREEDY)
    expected = model.generate(ids, **kwargs)
    seconds = []
    monkeypatch.setattr(generate_module, "paged_decode",
                        functools.partial(decode.paged_decode, step_times=seconds.append))
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert len(seconds) == 12 - decode.UNTIMED_STEPS and all(s > 0 for s in seconds), seconds


@pytest.mark.parametrize("mode", bundled.SPEC_MODES)
def test_auto_calls_whose_drafts_never_pay_decode_plainly_with_the_same_tokens(mode, monkeypatch):
    """Every mode, drafts never accepted: the first "auto" call drafts (k falls), the next ones time the candidates,
    then a call times plain decoding and later calls run it (no draft, one target forward a token), reporting their
    mode; after EXPLORE_CALLS[0] more of them one call drafts again. Every call gives plain greedy's tokens. Rounds are
    timed by a fixed model (a draft a tenth of a 1 ms round) and plain steps at 0.5 ms."""
    from hf_specdec.generation.acceptance import GreedyAcceptance

    monkeypatch.setattr(adaptive_k, "PLAIN_CALL_DEVICES", ("cpu",))
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, **GREEDY)
    expected = model.generate(ids, **kwargs)
    fixed_round_times(monkeypatch, model)
    monkeypatch.setattr(RoundCosts, "add_plain", lambda self, seconds, add=RoundCosts.add_plain: add(self, 5e-4))

    class RejectAll(GreedyAcceptance):
        def __call__(self, draft_tokens, draft_probs, scores):
            num_accepted, _ = super().__call__(draft_tokens, draft_probs, scores)
            return num_accepted * 0, scores.argmax(dim=-1)[:, 0]

    drafted = []
    for _ in range(6 + EXPLORE_CALLS[0] + 1):
        got = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}, acceptance=RejectAll())
        assert torch.equal(got, expected)
        stats = hf_specdec.last_generation_stats(model)
        assert stats.spec_mode == ("mtp" if mode != "gemma_dflash" else "dflash")
        drafted.append(stats.num_draft_tokens > 0)
        if not drafted[-1]:
            assert stats.num_target_forwards == 24 and stats.mean_accepted_length == 1.0
    costs = next(iter(model._hf_specdec.round_costs.values()))
    assert costs.plain_median == 5e-4
    first_plain = drafted.index(False)
    assert all(drafted[:first_plain]) and first_plain <= 5, drafted
    explore = first_plain + 1 + EXPLORE_CALLS[0]  # the call that timed plain decoding, then EXPLORE_CALLS[0] more
    assert not any(drafted[first_plain:explore]) and drafted[explore], drafted


@pytest.mark.parametrize("case", ["eos_and_pad", "return_dict", "streamer", "stop_strings", "one_token"])
def test_a_call_auto_runs_as_plain_decoding_is_plain_decoding_of_the_call(case, monkeypatch):
    """What "auto" hands to plain decoding is the whole call: EOS with padding, return_dict_in_generate, a streamer
    and stop strings give what plain generate gives; the stats keep the mode, with no draft."""
    from transformers import AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from hf_specdec.assets import asset_path
    from hf_specdec.generation import speculative

    monkeypatch.setattr(adaptive_k, "PLAIN_CALL_DEVICES", ("cpu",))
    monkeypatch.setattr(speculative.adaptive_k, "plain_call", lambda costs, k_max, new_tokens: True)
    model, extra, _ = bundled.mode("gemma_dflash")
    ids, mask = bundled.batch(1 if case == "streamer" else 3)
    kwargs = dict(attention_mask=mask, max_new_tokens=1 if case == "one_token" else 20, do_sample=False)
    if case == "eos_and_pad":
        plain = model.generate(ids, **kwargs, eos_token_id=None, pad_token_id=0)
        kwargs.update(eos_token_id=int(plain[0, ids.shape[1] + 3]), pad_token_id=0)  # row 0 stops at its 4th token
    elif case == "return_dict":
        kwargs.update(return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    elif case == "stop_strings":
        kwargs.update(stop_strings=["\n"], tokenizer=AutoTokenizer.from_pretrained(asset_path("tiny-gemma4")),
                      eos_token_id=None, pad_token_id=0)
    else:
        kwargs.update(eos_token_id=None, pad_token_id=0)

    class Collect(BaseStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            pass

    streams = [Collect(), Collect()] if case == "streamer" else [None, None]
    expected = model.generate(ids, **kwargs, streamer=streams[0])
    got = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}, streamer=streams[1])
    stats = hf_specdec.last_generation_stats(model)
    if case == "return_dict":
        expected, got = expected.sequences, got.sequences
    assert torch.equal(got, expected)
    assert stats.spec_mode == "dflash" and stats.num_draft_tokens == 0 and stats.mean_accepted_length == 1.0
    if case == "streamer":
        assert streams[1].tokens == streams[0].tokens and len(streams[1].tokens) == ids.shape[1] + 20
    if case == "eos_and_pad":
        assert (got[0, ids.shape[1] + 4:] == 0).all()
