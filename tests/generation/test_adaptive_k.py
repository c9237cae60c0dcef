"""num_speculative_tokens="auto": k chosen per round, lossless in every mode, settling at k=1 when no draft is
ever accepted and growing when most are."""

import pytest
import torch

import hf_specdec
from hf_specdec.generation.adaptive_k import (EXPLORE_EVERY, MAX_KEPT_COSTS, MIN_TIMED, PROBE_ROUNDS, PSEUDO_TRIALS,
                                              AcceptanceRates, AdaptiveK, RoundCosts, candidate_ks, cost_on, costs_for,
                                              expected_tokens)
from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
EIGHTY = [0.8] * 7  # every draft accepted with probability 0.8


def test_the_controller_settles_at_the_smallest_k_without_acceptances_and_grows_with_them():
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=1)
    for _ in range(20):
        controller.update([0, 0, 0], controller.k)
    assert controller.k == 1
    for _ in range(30):
        controller.update([controller.k] * 3, controller.k)
    assert controller.k >= 5
    wide = AdaptiveK(7, lambda k: 0.1 * k, batch=32)  # verify tokens cost more at large batches: fewer drafts
    assert wide.tokens_per_cost(3, EIGHTY) > wide.tokens_per_cost(7, EIGHTY)


def test_a_rounds_counts_and_choice_are_those_of_their_definitions():
    """The per-round bookkeeping, written for speed (one pass over the rows; each k's cost and tokens computed once
    per curve and per estimate), gives what the definitions give: the decayed counts of the rows that reached and
    passed each position, and expected_tokens over the cost read off the timed curve."""
    gen = torch.Generator().manual_seed(0)
    rates = AcceptanceRates(7, prior_alpha=0.6, decay=0.9)
    reached, passed = [4.0] + [0.0] * 6, [2.4] + [0.0] * 6
    costs = RoundCosts()
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=8, costs=costs)
    ks = torch.randint(1, 8, (40,), generator=gen).tolist()
    for round_ in range(160):
        k = ks[round_ // 4]  # each k a few rounds in a row: the later ones are timed
        accepted = torch.randint(0, k + 1, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen).tolist()
        rates.update(accepted, k)
        for j in range(k):
            reached[j] = 0.9 * reached[j] + sum(a >= j for a in accepted)
            passed[j] = 0.9 * passed[j] + sum(a > j for a in accepted)
        assert rates.reached == reached and rates.passed == passed
        controller.observe(k, 1e-3 * (1 + 0.1 * k + 0.05 * float(torch.rand((), generator=gen))), k)
        controller.update(accepted, k)
        estimate = controller.rates()
        for j in candidate_ks(7):
            expected = expected_tokens(estimate, j) / (cost_on(controller.curve, j) if controller.curve
                                                       else controller.cost(j))
            assert controller.tokens_per_cost(j, estimate) == expected
    assert controller.curve is not None and len(controller.curve) >= 5


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
    best = max(range(1, 8), key=lambda k: controller.tokens_per_cost(k, EIGHTY))
    assert controller.tokens_per_cost(settled, EIGHTY) >= 0.97 * controller.tokens_per_cost(best, EIGHTY)


def test_round_costs_are_a_rising_curve_through_the_median_times_of_the_timed_k():
    costs = RoundCosts()
    for _ in range(2):
        costs.add(3, 5.0)
    assert costs.curve() is None and costs.timed() == {}  # too few rounds
    costs.add(3, 0.5)  # a stray fast round: the median holds
    assert costs.timed() == {3: 5.0} and costs.curve() is None  # one k: no curve
    for t in (9.0, 9.0, 300.0):  # a round that captured graphs: the median holds
        costs.add(7, t)
    curve = costs.curve()
    assert curve == [(3, 5.0), (7, 9.0)]
    assert [cost_on(curve, k) for k in (1, 3, 5, 7, 9)] == pytest.approx([3.0, 5.0, 7.0, 9.0, 11.0])
    for _ in range(3):  # a third k: each stretch of k follows its own slope (verify turns compute-bound)
        costs.add(1, 4.5)
    curve = costs.curve()
    assert [cost_on(curve, k) for k in (0, 2, 5, 8)] == pytest.approx([4.25, 4.75, 7.0, 10.0])
    flat = RoundCosts()
    for k, t in [(2, 4.0), (2, 4.0), (2, 4.0), (6, 3.9), (6, 3.9), (6, 3.9)]:
        flat.add(k, t)
    assert cost_on(flat.curve(), 6) > cost_on(flat.curve(), 2)  # noise that makes drafts look free never makes them pay


def test_a_model_keeps_timings_for_a_bounded_number_of_drafter_and_batch_pairs():
    kept = {}
    first = costs_for(kept, ("drafter", 1, 1))
    assert costs_for(kept, ("drafter", 1, 1)) is first
    for batch in range(2, MAX_KEPT_COSTS + 2):
        costs_for(kept, ("drafter", 1, batch))
    assert len(kept) == MAX_KEPT_COSTS and ("drafter", 1, 1) not in kept  # the oldest went first


def _simulate(controller, alpha, seconds_of, rounds, rng, batch=8):
    """Rounds at the controller's k: each row accepts each draft with probability alpha (a list: per position, given
    the ones before); the loop's order (observe the round's time, then update with its acceptances). Returns the k
    of every round."""
    rates = alpha if isinstance(alpha, list) else [alpha] * controller.k_max
    chosen = []
    for _ in range(rounds):
        k = controller.k
        chosen.append(k)
        controller.observe(k, seconds_of(k))
        controller.update([next((i for i in range(k) if rng.random() > rates[i]), k) for _ in range(batch)], k)
    return chosen


def test_acceptance_is_measured_per_draft_position():
    """Rows that accepted 0, 1, 2 and 2 of 2 drafts: the first draft was reached by 4 rows and accepted by 3, the
    second reached by 3 and accepted by 2 (the second shrunk a little towards the rate before it: the decayed counts
    of 200 such rounds are 10 rounds' worth); positions never drafted take the rate of the one before them."""
    rates = AcceptanceRates(4, prior_alpha=0.6, decay=0.9)
    assert rates.rates(4) == pytest.approx([0.6] * 4)
    for _ in range(200):
        rates.update([0, 1, 2, 2], 2)
    measured = rates.rates(4)
    assert measured[:2] == pytest.approx([3 / 4, (20 + PSEUDO_TRIALS * 3 / 4) / (30 + PSEUDO_TRIALS)])
    assert abs(measured[1] - 2 / 3) < 0.01
    assert measured[2:] == pytest.approx([measured[1]] * 2)
    assert expected_tokens(measured, 2) == pytest.approx(1 + measured[0] + measured[0] * measured[1])
    assert expected_tokens([0.5] * 3, 3) == pytest.approx(1.875)  # (1 - 0.5 ** 4) / (1 - 0.5)


def test_rates_that_fall_along_the_block_keep_k_where_the_early_drafts_are_accepted():
    """A drafter whose first two drafts are accepted 95% of the time and later ones half of it (the bundled tiny MTP
    assistant is near this), rounds costing 1 + 0.4 k: two drafts are best. A pooled rate measured at k=2 (0.95)
    would promise blocks of 5-7 (its tau 6.7 at k=7, not 3.7); measured per position the controller settles within
    5% of the best k."""
    import random

    rng = random.Random(2)
    falling = [0.95, 0.95, 0.5, 0.5, 0.5, 0.5, 0.5]

    def tokens_per_second(k):
        return expected_tokens(falling, k) / (1 + 0.4 * k)

    assert max(range(1, 8), key=tokens_per_second) == 2
    assert max(range(1, 8), key=lambda k: expected_tokens([0.95] * 7, k) / (1 + 0.4 * k)) >= 5
    costs = RoundCosts()
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=4, costs=costs)
    chosen = _simulate(controller, falling, lambda k: 1e-3 * (1 + 0.4 * k) * (1 + 0.01 * rng.random()), 120, rng,
                       batch=4)
    assert all(tokens_per_second(k) >= 0.95 * tokens_per_second(2) for k in chosen[-40:]), chosen


@pytest.mark.parametrize("per_draft,best", [(0.02, 7), (0.6, 1)])
def test_measured_round_times_move_k_where_the_prior_would_not(per_draft, best):
    """The prior puts batch 8 at alpha 0.8 near k=4; rounds that cost 1 + per_draft * k move it to the k that
    maximises tokens per second for those costs: drafts nearly free -> the most drafts, dear -> few."""
    import random

    rng = random.Random(1)

    def seconds_of(k):
        return 1e-3 * (1 + per_draft * k) * (1 + 0.01 * rng.random())

    def tokens_per_second(k):
        return (1 - 0.8 ** (k + 1)) / 0.2 / (1 + per_draft * k)

    assert max(range(1, 8), key=tokens_per_second) == best
    prior = AdaptiveK(7, lambda k: 0.1 * k, batch=8)
    _simulate(prior, 0.8, seconds_of, 60, rng)
    assert tokens_per_second(prior.k) < 0.9 * tokens_per_second(best)  # what the constants alone choose
    costs = RoundCosts()
    _simulate(AdaptiveK(7, lambda k: 0.1 * k, batch=8, costs=costs), 0.8, seconds_of, 20, rng)  # a first call
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=8, costs=costs)  # the second times every candidate k
    chosen = _simulate(controller, 0.8, seconds_of, 80, rng)
    # within the 5% the issue asks of "auto" (the controller moves for a 3% gain, its alpha estimate is noisy)
    assert len(costs.timed()) >= 2 and tokens_per_second(controller.k) >= 0.95 * tokens_per_second(best), chosen
    # a later call with the same timings starts from them: no probe, the measured choice at once
    later = AdaptiveK(7, lambda k: 0.1 * k, batch=8, costs=costs)
    again = _simulate(later, 0.8, seconds_of, 10, rng)
    assert later.probe is None and all(tokens_per_second(k) >= 0.95 * tokens_per_second(best) for k in again), again


@pytest.mark.parametrize("per_draft", [-0.01, 0.0, 0.02])
def test_no_acceptances_settle_at_one_draft_when_timing_noise_hides_the_cost_of_a_draft(per_draft):
    """A drafter never accepted, on a machine where a draft's cost is lost in timing noise (a round with more drafts
    may even time faster): after every candidate k was timed the rounds go back to one draft and stay there, since
    two drafts commit no more tokens than one and a draft never makes a round cheaper."""
    import random

    rng = random.Random(0)
    costs = RoundCosts()
    chosen = []
    for _ in range(2):  # the second call times every candidate k
        chosen += _simulate(AdaptiveK(7, lambda k: 0.1 * k, batch=2, costs=costs), 0.0,
                            lambda k: 1e-3 * (1 + per_draft * k) * (1 + 0.01 * rng.random()), 50, rng, batch=2)
    assert set(chosen) == set(candidate_ks(7)) and chosen[-20:] == [1] * 20, chosen


def test_a_second_call_times_every_candidate_k_and_later_calls_run_only_timed_ones():
    """The sweep: the first call of a model, drafter and batch size runs what the prior and the acceptance choose (a
    one-shot script captures no graph it will not use); the second runs each candidate k not timed yet
    PROBE_ROUNDS rounds in a row, the nearest to the running k next, before it chooses; a later call never runs a
    k it has not timed (a new k would capture its graphs inside that call), whatever the acceptance does."""
    import random

    assert candidate_ks(7) == [1, 2, 3, 4, 5, 7] and candidate_ks(15) == [1, 2, 3, 4, 5, 7, 10, 15]
    assert candidate_ks(1) == [1] and candidate_ks(3) == [1, 2, 3]
    rng = random.Random(3)
    costs = RoundCosts()

    def seconds_of(k):
        return 1e-3 * (1 + 0.1 * k)

    AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)  # a call that ran no round (one new token) does not count
    first = AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)
    _simulate(first, 0.8, seconds_of, 10, rng, batch=1)
    assert not first.sweep and first.probe is None and costs.calls == 1
    untimed = [k for k in candidate_ks(7) if k not in costs.medians]
    assert len(untimed) >= 4
    second = AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)
    chosen = _simulate(second, 0.8, seconds_of, 1 + len(untimed) * PROBE_ROUNDS, rng, batch=1)
    runs = [chosen[i] for i in range(1, len(chosen), PROBE_ROUNDS)]  # after the round that starts the call
    assert chosen[0] == first.k and chosen[1:] == [k for k in runs for _ in range(PROBE_ROUNDS)], chosen
    assert sorted(runs) == untimed and sorted(costs.timed()) == candidate_ks(7), runs
    previous = [chosen[0]] + runs
    for i, k in enumerate(runs):  # each the untimed candidate nearest the one before (the lower one of two)
        assert k == min(set(runs[i:]), key=lambda c: (abs(c - previous[i]), c)), runs
    for alpha in (0.0, 0.95, 0.5):  # the acceptance moves: only timed k are run
        later = AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)
        again = _simulate(later, alpha, seconds_of, 30, rng, batch=1)
        assert later.probe is None and set(again) <= set(costs.timed()), again


def test_where_k_does_not_grow_within_a_call_it_only_falls_the_sweep_goes_down_and_a_call_starts_at_the_best():
    """A drafter whose k may fall but not rise within a call (Step 3.5 MTP, k_max 3): no call ever runs a larger k
    after a smaller one; the second call times the untimed candidates from the largest down, PROBE_ROUNDS each;
    a later call starts at the best timed k (not at where the last call ended) and runs it."""
    import random

    rng = random.Random(5)
    costs = RoundCosts()

    def seconds_of(k):  # at alpha 0.8, k = 2 commits the most tokens per second
        return 1e-3 * (1 + 0.45 * k)

    def rises(chosen):
        return any(b > a for a, b in zip(chosen, chosen[1:]))

    first = AdaptiveK(3, lambda k: 0.1 * k, batch=4, costs=costs, grows=False)
    start = first.k
    chosen = _simulate(first, 0.8, seconds_of, 12, rng, batch=4)
    assert not rises(chosen) and chosen[0] == start
    untimed = sorted((k for k in candidate_ks(3) if k not in costs.medians), reverse=True)
    assert untimed
    second = AdaptiveK(3, lambda k: 0.1 * k, batch=4, costs=costs, grows=False)
    chosen = _simulate(second, 0.8, seconds_of, 1 + len(untimed) * PROBE_ROUNDS + 10, rng, batch=4)
    assert not rises(chosen) and sorted(costs.timed()) == [1, 2, 3], chosen
    assert [k for i, k in enumerate(chosen) if i == 0 or k != chosen[i - 1]][-len(untimed):] == untimed, chosen
    for _ in range(3):
        later = AdaptiveK(3, lambda k: 0.1 * k, batch=4, costs=costs, grows=False)
        assert later.k == 2
        chosen = _simulate(later, 0.8, seconds_of, 20, rng, batch=4)
        assert not rises(chosen) and later.probe is None and chosen.count(2) >= 15, chosen


def test_with_plain_rounds_k_falls_to_zero_where_no_k_pays_and_a_call_starts_with_drafts():
    """k = 0 as a candidate (``plain=True``: a round without drafts, one committed token per row): where every
    round with drafts costs more than the tokens it adds (a drafter as slow as the target, acceptance 0.5), the
    controller times k = 0 in its sweep and runs it; the next call still starts at a k >= 1 (rounds without drafts
    measure no acceptance) and falls back to 0. Where drafting pays, 0 is timed but not run."""
    import random

    rng = random.Random(7)

    def run_calls(seconds_of, alpha):
        costs, calls = RoundCosts(), []
        for _ in range(4):
            controller = AdaptiveK(3, lambda k: 0.1 * k, batch=1, costs=costs, plain=True)
            calls.append(_simulate(controller, alpha, seconds_of, 30, rng, batch=1))
        return costs, calls

    costs, calls = run_calls(lambda k: 1e-3 * (1 + 1.0 * k), 0.5)
    assert 0 in costs.timed() and all(c[0] >= 1 for c in calls), calls
    # at 0, one round in EXPLORE_EVERY + 1 drafts (rounds without drafts measure no acceptance)
    tail = calls[-1][-2 * (EXPLORE_EVERY + 1):]
    assert tail.count(0) == 2 * EXPLORE_EVERY, calls[-1]
    costs, calls = run_calls(lambda k: 1e-3 * (1 + 0.05 * k), 0.8)
    assert 0 in costs.timed() and 0 not in calls[-1] and 0 not in calls[-2], calls[-2:]


def test_where_k_does_not_grow_rounds_without_drafts_end_the_calls_drafting_and_0_is_the_last_probe():
    """``grows=False`` with ``plain=True`` (Step 3.5 MTP): where no k pays (each draft costs as much as a target
    step, acceptance 0.3), a call falls to k = 0 and stays there (k never rises within a call; no exploring round),
    each call starts with drafts again. The sweep probes 0 last, once every k with drafts is timed (the rest of that
    call runs without drafts), so later calls choose 0 from its timed cost. Where drafting pays, only that probe runs
    0: no later call does."""
    import random

    rng = random.Random(11)

    probes = []

    class Watched(AdaptiveK):
        def _probing(self):
            probing = super()._probing()
            probes.append(self.probe if probing else None)
            return probing

    def run_calls(seconds_of, alpha, calls=5, rounds=40):
        probes.clear()
        costs, chosen = RoundCosts(), []
        for _ in range(calls):
            controller = Watched(3, lambda k: 0.1 * k, batch=1, costs=costs, grows=False, plain=True)
            chosen.append(_simulate(controller, alpha, seconds_of, rounds, rng, batch=1))
        return costs, chosen

    def probed_in_turn():
        turns = [p for p in probes if p is not None]
        return [p for i, p in enumerate(turns) if i == 0 or p != turns[i - 1]]

    costs, calls = run_calls(lambda k: 1e-3 * (1 + 1.0 * k), 0.3)
    # the sweep times the k the first call did not run, from the largest down, then 0
    assert {0, 1, 2, 3} <= set(costs.timed()) and probed_in_turn()[-1] == 0 and probed_in_turn().count(0) == 1
    assert all(c[0] >= 1 and not any(b > a for a, b in zip(c, c[1:])) for c in calls), calls
    assert all(c[-1] == 0 for c in calls[1:]) and calls[-1].count(0) >= len(calls[-1]) // 2, calls
    costs, calls = run_calls(lambda k: 1e-3 * (1 + 0.1 * k), 0.9)
    assert 0 in costs.timed() and probed_in_turn()[-1] == 0, probes
    assert 0 not in calls[0] and not any(0 in c for c in calls[2:]), calls  # only the sweep's call runs 0


def test_rounds_without_drafts_draft_again_now_and_then_and_leave_zero_when_the_acceptance_came_back():
    """At k = 0 the acceptance is not measured: after EXPLORE_EVERY rounds at 0 one round drafts (at the best k
    with drafts); if its drafts were accepted, the estimate rises and the controller stays with drafts."""
    costs = RoundCosts()
    for k, seconds in [(0, 1.0), (1, 1.3), (2, 1.6), (3, 1.9)]:
        for _ in range(MIN_TIMED):
            costs.add(k, 1e-3 * seconds)
    costs.calls = 5  # nothing left to sweep
    controller = AdaptiveK(3, lambda k: 0.1 * k, batch=1, costs=costs, plain=True)
    assert controller.k >= 1
    for _ in range(20):  # nothing accepted: down to 0
        controller.update([0], controller.k)
        if controller.k == 0:
            break
    assert controller.k == 0
    zeros = 0
    while controller.k == 0:
        zeros += 1
        controller.update([0], 0)
    assert zeros == EXPLORE_EVERY and controller.k >= 1
    for _ in range(20):  # now every draft is accepted: the rounds keep drafting
        k = controller.k
        controller.update([k], k)
    assert controller.k >= 2


@pytest.mark.parametrize("gain,settles", [(1.01, 3), (1.10, 4)])
def test_after_the_sweep_the_k_it_started_from_stays_unless_another_is_clearly_better(gain, settles):
    """A candidate's few timed rounds from the sweep are noisier than those of the k the first call ran: the
    controller goes back to that k, and moves only where another promises more than SWITCH_GAIN (k=4 1% ahead of
    k=3: stays; 10% ahead: moves)."""
    costs = RoundCosts()
    costs.calls, costs.last_k = 1, 3  # a first call ran k=3 and timed it
    for _ in range(MIN_TIMED):
        costs.add(3, 1.0)

    class Swept(AdaptiveK):
        def tokens_per_cost(self, k, rates=None):
            return {3: 1.0, 4: gain}.get(k, 0.5)

    controller = Swept(7, lambda k: 0.1 * k, batch=32, costs=costs)
    assert controller.sweep and controller.k == 3
    chosen = []
    for _ in range(10 * PROBE_ROUNDS):
        k = controller.k
        chosen.append(k)
        controller.observe(k, 1.0)
        controller.update([0] * 32, k)
        if controller.probe is None:
            break
    assert sorted(costs.timed()) == candidate_ks(7) and set(chosen) == set(candidate_ks(7)), chosen
    assert controller.k == settles and controller.incumbent is None


def test_rounds_after_a_change_of_k_or_that_queue_drafts_of_another_k_are_not_timed_and_no_costs_means_no_probe():
    costs = RoundCosts()
    controller = AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)
    # (k, drafts queued for the next round): timed are the rounds after one at the same k whose queued drafts are
    # of their k or none (a drafter that drafts at the start of its round)
    for k, ahead in [(3, 3), (3, 3), (3, 5), (5, 5), (5, 5), (3, None), (3, None)]:
        controller.observe(k, float(k), ahead)
    assert {k: list(t) for k, t in costs.seconds.items()} == {3: [3.0, 3.0], 5: [5.0]}
    untimed = AdaptiveK(7, lambda k: 0.1 * k, batch=1)  # tensor parallelism: the prior alone, the same on every rank
    start = untimed.k
    for _ in range(10):
        untimed.observe(start, 1.0)
        untimed.update([start], start)
    assert untimed.probe is None and untimed.costs is None


def test_a_later_call_starts_from_the_acceptance_the_last_calls_measured():
    """Calls of the same model, drafter and batch size share their acceptance estimate: a call after rounds that
    accepted every draft starts at the k those rounds chose, not at the prior's."""
    costs = _timed(lambda k: 1 + 0.02 * k)
    first = AdaptiveK(7, lambda k: 0.02 * k, batch=1, costs=costs)
    start = first.k
    for _ in range(30):
        first.update([first.k], first.k)
    assert first.k > start
    later = AdaptiveK(7, lambda k: 0.02 * k, batch=1, costs=costs)
    assert later.rates() == pytest.approx(first.rates()) and later.k == first.k
    assert AdaptiveK(7, lambda k: 0.02 * k, batch=1, costs=_timed(lambda k: 1 + 0.02 * k)).k == start


def test_a_call_starts_at_the_k_the_last_round_ran():
    """Not at a neighbour its estimate now puts 1% ahead (under SWITCH_GAIN): a timed k 1% ahead is not worth a
    move. A candidate not timed yet is run (the sweep) before any choice; with no last round, the estimate's best."""
    costs = _timed(lambda k: 1 + 0.1 * k)
    first = AdaptiveK(7, lambda k: 0.1 * k, batch=1, costs=costs)
    for _ in range(5):
        first.update([first.k], first.k)
    assert costs.last_k == first.k
    last = first.k
    below = candidate_ks(7)[candidate_ks(7).index(last) - 1]  # the candidate k next to it
    near = {last: 1.0, below: 1.01}

    class Later(AdaptiveK):
        def tokens_per_cost(self, k, rates=None):
            return near.get(k, 0.5)

    later = Later(7, lambda k: 0.1 * k, batch=1, costs=costs)
    assert later._best() == below and later.k == last
    later.update([1], later.k)
    assert later.k == last  # timed: the estimate's 1% is within SWITCH_GAIN
    del costs.medians[below]  # not timed: swept before any choice
    later.update([1], later.k)
    assert later.k == below and later.probe == below
    assert Later(7, lambda k: 0.1 * k, batch=1, costs=RoundCosts()).k == below  # no last round: the estimate


def fixed_round_times(monkeypatch, model) -> None:
    """``model``'s "auto" rounds timed by a fixed model (a draft a tenth of a round) from no earlier timings: on a
    loaded machine (two test processes on two cores) measured times can make a round with one draft look cheaper
    than one without, noise that tests of the controller's choices must not ride on."""
    monkeypatch.setattr(model._hf_specdec, "round_costs", {})
    observe = AdaptiveK.observe
    monkeypatch.setattr(AdaptiveK, "observe",
                        lambda self, k, seconds, ahead_k=None: observe(self, k, 1e-3 * (1 + 0.1 * k), ahead_k))


def _timed(seconds_of, k_max=7) -> RoundCosts:
    """Round costs with every candidate k up to ``k_max`` timed at ``seconds_of(k)``."""
    costs = RoundCosts()
    for k in candidate_ks(k_max):
        for _ in range(MIN_TIMED):
            costs.add(k, seconds_of(k))
    return costs


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
    # the controller saw every verify round (one target forward each, after the prefill)
    stats = hf_specdec.last_generation_stats(model)
    assert len(rounds) == stats.num_target_forwards - 1 and 0 < stats.num_draft_tokens <= 3 * sum(rounds), rounds
    if mode == "step_mtp":  # a Step 3.5 MTP layer left out of a round is stale: k never rises within a call
        assert all(a >= b for a, b in zip(rounds, rounds[1:])), rounds


def test_step_mtp_rounds_whose_k_falls_within_a_call_are_lossless(monkeypatch):
    """Step 3.5 MTP with k falling 3 -> 2 -> 1 within a greedy call (each round runs MTP layers 0..k-1; the layers
    left out go stale): the output is plain greedy's; a k that rises again within the call is refused. (Sampled
    rounds at a falling k: their drafts and q against the per-row drafter, tests/models/step3p5/
    test_step3p5_fixed_width.py.)"""
    model, extra, _ = bundled.mode("step_mtp")
    ids, mask = bundled.batch(3)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, **GREEDY)
    rounds, schedule = [], []
    scripted(monkeypatch, rounds, schedule)
    schedule[:] = [3, 3, 2, 2, 2, 1]
    got = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"})
    # (each round is drafted before the host read the one before it: a k chosen from a round applies a round later)
    assert rounds[:6] == [3, 3, 3, 3, 2, 2] and rounds[-1] == 1, rounds
    assert torch.equal(got, model.generate(ids, **kwargs))
    schedule[:] = [2, 3]
    with pytest.raises(ValueError, match="rose from 2 to 3 within a request"):
        model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"})


@pytest.mark.parametrize("mode", ["gemma_mtp", "step_mtp"])
def test_auto_k_settles_at_rounds_without_drafts_when_no_draft_is_accepted(monkeypatch, mode):
    """A drafter whose drafts are always wrong (an acceptance that rejects everything still commits the
    target's token): the rounds shrink to none (k = 0: plain steps of the loop); the output is plain greedy's.
    Step 3.5 MTP, whose k does not rise within a call, then runs plain rounds to the end of the call. The rounds'
    times are a fixed model (a draft costs a tenth of a round): on a loaded machine the measured ones can make a
    round with one draft look cheaper than one without, which is the timing's noise, not what this tests."""
    from hf_specdec.generation.acceptance import GreedyAcceptance

    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, **GREEDY)
    expected = model.generate(ids, **kwargs)
    fixed_round_times(monkeypatch, model)

    class RejectAll(GreedyAcceptance):
        def __call__(self, draft_tokens, draft_probs, scores):
            num_accepted, _ = super().__call__(draft_tokens, draft_probs, scores)
            return num_accepted * 0, scores.argmax(dim=-1)[:, 0]

    rounds = []
    original = AdaptiveK.update
    monkeypatch.setattr(AdaptiveK, "update", lambda self, accepted, k: (rounds.append(k), original(self, accepted, k)))
    got = model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}, acceptance=RejectAll())
    assert torch.equal(got, expected)
    assert rounds[0] >= 1 and rounds.count(0) >= len(rounds) // 2, rounds
    if mode == "step_mtp":  # once at 0, plain rounds to the end of the call
        first = rounds.index(0)
        assert set(rounds[first:]) == {0} and not any(b > a for a, b in zip(rounds, rounds[1:])), rounds
    else:
        tail = rounds[-2 * (EXPLORE_EVERY + 1):]  # at 0, a round with drafts now and then
        assert tail.count(0) >= EXPLORE_EVERY, rounds


@pytest.mark.parametrize("mode", bundled.SPEC_MODES)
def test_rounds_without_drafts_between_rounds_with_drafts_are_lossless(mode, monkeypatch):
    """"auto" may choose k = 0 (a plain step of the loop: no drafts, the drafter catching up at the commit) between
    rounds with drafts; greedy output is plain greedy's in every mode. Step 3.5 MTP goes to 0 last (its k does not
    rise within a call)."""
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(3)
    kwargs = dict(attention_mask=mask, max_new_tokens=36, **GREEDY)
    expected = model.generate(ids, **kwargs)
    rounds = []
    scripted(monkeypatch, rounds, [2, 2, 1, 1, 0, 0] if mode == "step_mtp" else [0, 0, 2, 0, 3, 3, 0, 1, 0, 2])
    assert torch.equal(model.generate(ids, **kwargs, **{**extra, "num_speculative_tokens": "auto"}), expected)
    assert 0 in rounds and rounds.index(0) < len(rounds) - 2, rounds
    stats = hf_specdec.last_generation_stats(model)
    assert stats.acceptance_histogram[0] >= rounds.count(0)


def test_sampled_rounds_without_drafts_follow_the_target_distribution(monkeypatch):
    """A sampled round without drafts draws the next token from the target's distribution (chi-square over many
    rows: the second generated token comes from such a round, the later ones from rounds with drafts)."""
    from tests.distribution import assert_follows, second_token_marginal
    from tests.generation.toy_drafters import CopyDrafter
    from tests.tiny_models import chi_square_pair

    target, other = chi_square_pair()
    ours = hf_specdec.enable(target)
    drafter = CopyDrafter(other, 2)
    drafter.adaptive_k = True
    rounds = []
    scripted(monkeypatch, rounds, [2], start=0)
    rows = 3000
    prompt = torch.tensor([[3, 5, 2, 7]])
    torch.manual_seed(0)
    out = ours.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                        max_new_tokens=4, do_sample=True, eos_token_id=None, pad_token_id=0,
                        assistant_model=drafter, num_speculative_tokens="auto")
    assert rounds[:2] == [0, 2], rounds
    assert_follows(out[:, 5], second_token_marginal(target, prompt, 8))


def test_auto_is_the_only_word_num_speculative_tokens_takes():
    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(1)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, **{**extra, "num_speculative_tokens": "fast"})


def test_auto_rounds_may_draft_up_to_the_builders_cap():
    """"auto" builds the Gemma 4 assistant's drafter for up to 7 drafts (the best fixed k of the 31B shape at batch
    1), not its default 4; DFlash and Step 3.5 keep their defaults (the block's width, the MTP layers)."""
    from hf_specdec.generation.registry import build_drafter
    from hf_specdec.models.gemma4.mtp_drafter import AUTO_K_MAX, DEFAULT_NUM_SPECULATIVE_TOKENS

    model, extra, _ = bundled.mode("gemma_mtp")
    assistant = extra["assistant_model"]
    assert build_drafter(model, assistant, None, "auto").num_speculative_tokens == AUTO_K_MAX == 7
    assert build_drafter(model, assistant, None, None).num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    model, extra, _ = bundled.mode("gemma_dflash")
    assert (build_drafter(model, extra["assistant_model"], None, "auto").num_speculative_tokens
            == build_drafter(model, extra["assistant_model"], None, None).num_speculative_tokens)


def test_rounds_after_the_batch_dropped_rows_are_not_timed_and_not_probed():
    """A batch that dropped its stopped rows runs rounds cheaper than those of the batch size whose costs were
    timed: they are not timed into those costs, nor do they start a probe of another k; k is still chosen."""
    costs = RoundCosts()
    for _ in range(MIN_TIMED):
        costs.add(2, 0.01)  # one timed k: a controller with timing on would probe another
    controller = AdaptiveK(4, lambda k: 0.1 * k, 4, costs=costs)
    controller.shrink(2)
    k = controller.k
    for _ in range(3 * MIN_TIMED):
        controller.observe(k, 1.0)
        controller.update([0, 0], k)
    assert costs.timed() == {2: 0.01} and controller.probe is None and controller.k == 1
    timing = AdaptiveK(4, lambda k: 0.1 * k, 4, costs=costs)  # the same without the shrink: probes
    timing.update([0, 0, 0, 0], timing.k)
    assert timing.probe is not None


@pytest.mark.parametrize("sampling", ["greedy", "do_sample", "config_samples"])
def test_a_call_without_k_chooses_it_per_round_when_greedy_and_keeps_the_drafters_k_when_sampling(sampling,
                                                                                                 monkeypatch):
    """No k given: a greedy call runs "auto" (its output is plain greedy's whatever k); a sampled one, asked by the
    call or by the model's generation config, keeps the drafter's default k (a seed gives the same tokens on every
    run, whatever its rounds took)."""
    from hf_specdec.models.gemma4.mtp_drafter import AUTO_K_MAX, DEFAULT_NUM_SPECULATIVE_TOKENS

    model, extra, reference = bundled.mode("gemma_mtp")
    extra = {key: value for key, value in extra.items() if key != "num_speculative_tokens"}
    ids, mask = bundled.batch(2)
    rounds = []
    original = AdaptiveK.update
    monkeypatch.setattr(AdaptiveK, "update", lambda self, accepted, k: (rounds.append(k), original(self, accepted, k)))
    kwargs = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    if sampling == "config_samples":
        monkeypatch.setattr(model.generation_config, "do_sample", True)
    else:
        kwargs["do_sample"] = sampling == "do_sample"
    torch.manual_seed(0)
    out = model.generate(ids, **kwargs, **extra)
    stats = hf_specdec.last_generation_stats(model)
    if sampling == "greedy":
        assert rounds and stats.num_speculative_tokens == AUTO_K_MAX
        assert torch.equal(out, reference.generate(ids, **kwargs))
    else:
        assert not rounds and stats.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS


def scripted(monkeypatch, rounds: list, schedule: list, start: int | None = None) -> None:
    """The loop's "auto" controller replaced by one that runs ``start`` (default: the largest k) first, then the k of
    ``schedule`` in turn after each round (then the last one's); ``rounds`` gets the k of every round."""
    from hf_specdec.generation import speculative

    class Scripted:
        def __init__(self, k_max, *args, **kwargs):
            self.k = k_max if start is None else start

        def observe(self, *args):
            pass

        def shrink(self, batch):
            pass

        def update(self, accepted, k):
            rounds.append(k)
            self.k = schedule.pop(0) if schedule else self.k

    monkeypatch.setattr(speculative, "AdaptiveK", Scripted)
