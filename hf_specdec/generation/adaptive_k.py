"""``num_speculative_tokens="auto"``: k chosen per round from the acceptance measured so far and what a round costs.

A round with k drafts commits, per row, on average ``tau(k) = 1 + sum_{j<=k} a_1 a_2 ... a_j`` tokens, where ``a_j``
is the chance that draft j is accepted once drafts 1..j-1 were. The controller picks the k in 0..k_max with the most
tokens per unit of cost. Each ``a_j`` is measured: of the rows whose round drafted j and accepted the j-1 before
it, the share that accepted draft j, weighted towards recent rounds (a position's counts decay only when a round
drafts it). Rates are not assumed equal along the block: a drafter's later drafts read its own earlier ones, and on
the bundled tiny models the first two drafts are accepted ~95% of the time and the later ones far less, so one
pooled rate measured at k=2 promised long blocks that never paid (docs/perf_log.md, session 26). A position with
few trials leans on the one before it (a few pseudo-trials at its rate), the first on a prior; a run whose drafts
are never accepted settles at the smallest k (0 where the loop allows rounds without drafts, else 1); the
output is lossless whatever k is.

What a round costs is measured where it can be: the loop reports the time between its rounds' read-backs, on the device
clock on CUDA (a round queued ahead of the host's wait runs while the host may be held up elsewhere), else between the
host's waits (:meth:`AdaptiveK.observe`), and the cost of a k is the median of its timed rounds, read off the curve
through them (piecewise linear, never flatter than :data:`MIN_DRAFT_SHARE` per draft). The k a controller may run are
the candidates of :func:`candidate_ks` (every k up to 5, then ~1.4x apart, and k_max): near its optimum the curve is
flat (at alpha 0.8 and a 0.17 cost per draft, k = 3, 4, 5 lie within 2%), and each k run keeps graphs of its own. The
first call of a model, drafter and batch size (a one-shot script's only one) runs the k that the prior and the
acceptance choose, capturing graphs for those only. From the second call on, before it chooses, a controller that times
rounds runs every candidate not timed yet for a few rounds (:data:`PROBE_ROUNDS`; the nearest to the k it runs first),
capturing their CUDA graphs there (50-300 ms each on a 12-layer 31B cut against a 5 ms round): later calls choose among
timed k and never capture inside a call. After the sweep the controller goes back to the k it started from, timed over
more rounds, and leaves it only for a clear gain (a candidate's few rounds are noisier). A probe that the estimate alone
led to, in a later call, had captured there (docs/perf_log.md, session 26: a batch-8 call at 0.55 of the best fixed k).
While fewer than two k are timed, and under tensor parallelism (every rank must choose the same k, and each would time
its own rounds), the cost is the prior: ``1 + v * k`` target steps of verify (the k extra tokens per row of the verify
forward: ``v`` grows with the batch, as the forward turns from memory-bound to compute-bound) plus the drafter's
``draft_cost(k)``, after the H100 measurements in docs/perf_log.md (verify with k=7 at 1.14x a decode step at batch 1;
at batch 32 k=3 beat k=7). The prior's constants missed by up to 8% on another card (docs/perf_log.md, session 14),
hence the measurement. A round is timed only when it is steady: the round before it ran the same k (a new k captures its
graphs in its first round), and the drafts it queued for the next round, which run inside its interval, are of its k too
(a change of k captures the new k's draft graphs there). Medians, not means, so that a stray slow round (a graph
captured for a longer context, a page fault) does not move the curve. Timings and the acceptance estimate are kept per
model, drafter and batch size (:class:`RoundCosts`), so later calls start from them rather than from the prior, and at
the k the last round ran (a call that started from the estimate instead could start at a neighbouring k the estimate's
noise put ahead). Once a call's batch drops rows that stopped (eager forwards), its rounds are no longer of the timed
batch size: the rest of the call is neither timed nor probed (:meth:`AdaptiveK.shrink`). A drafter whose k cannot rise
again within a call (``grows=False``: Step 3.5 MTP, whose layers left out of a round miss its positions) runs its probes
from the largest untimed candidate down, and each of its calls starts at the best k of the estimate instead of the last
round's (the lowest of its call). With ``plain`` (the loop's controllers), k = 0 is a candidate: a round without drafts
commits one token per row at the cost of a plain step of the loop, so "auto" stops drafting where no k pays for it; such
rounds measure no acceptance, so a call always starts at a k >= 1 and every :data:`EXPLORE_EVERY` rounds at 0 one round
drafts again. Where k does not grow within a call (Step 3.5 MTP), k = 0 ends the call's drafting: the rest of the call
runs plain rounds (each call starts with drafts again), and the loop queues each of them before the host reads the one
before, as plain decoding does. There 0 is the sweep's last probe, once every k with drafts is timed (the rest of that
call runs without drafts); until then its cost is read off the curve of the timed k, extended below the lowest. On the
GPU that extension misjudges a plain round: a round carries fixed host work that a round running ahead hides.

Whole calls of plain decoding (:func:`plain_call`, on the GPU: ``PLAIN_CALL_DEVICES``). On a small model the host sets
the pace, and the loop's rounds, even without drafts, cost more than plain decoding's steps, which run ahead of the
host from CUDA graphs with no per-round bookkeeping (the bundled tiny models on an H200: DFlash's and Step 3.5 MTP's
rounds at 0.55-0.65x plain decoding's tokens per second). So a call may run as plain decoding (``paged_decode``: the
same tokens), where plain decoding's steps, timed at this batch size in such calls, commit more tokens per second
than the best timed k is expected to. Plain decoding is timed by running it, once the timed rounds promise less than
:data:`PROBE_PLAIN_BELOW` over the cheapest timed round (a plain step costs no more than a round, so where drafting
gains more that call would be wasted; where it gains less, one call at plain speed is the price); it takes a call of
more than ``decode.UNTIMED_STEPS`` + :data:`MIN_TIMED` new tokens (shorter ones run plainly until one comes). Either
mode's timings go stale while the other runs (the acceptance moves with the text, a lent machine's speed between
calls), so after :data:`EXPLORE_CALLS` calls in the winning mode (doubling up to its second value while the same mode
keeps winning) one call runs the losing one again, unless drafting wins by :data:`PROBE_PLAIN_BELOW` or more; a
call of one new token has nothing to draft and always runs plainly. Such a call's stats keep its mode and k, with no
draft and a tau of 1.
"""

from __future__ import annotations

import collections
import statistics

SWITCH_GAIN = 1.03  # k changes when another k promises this many more tokens per unit of cost
STEADY_ROUNDS = 1  # a round is timed only after this many rounds at the same k (its graphs captured)
MIN_TIMED = 3  # rounds a k needs before its timing counts
# rounds a call spends at a candidate k to get it timed (the first of them still verifies drafts queued at the old k)
PROBE_ROUNDS = 1 + STEADY_ROUNDS + MIN_TIMED
SWEEP = (1, 2, 3, 4, 5, 7, 10, 15, 22, 31, 44, 63)  # the candidate k below k_max (candidate_ks)
KEEP = 50  # a k's round time is the median of its last KEEP timed rounds
MIN_DRAFT_SHARE = 0.01  # the least a draft is taken to add to a round, as a share of the mean timed round
MAX_KEPT_COSTS = 64  # timings kept per model (drafter x draft model x batch size), the oldest dropped first
PRIOR_TRIALS = 4.0  # pseudo-trials of the prior rate at the first draft position (they decay as rounds come in)
PSEUDO_TRIALS = 2.0  # pseudo-trials, at each later position, of the rate of the position before it
MAX_RATE = 0.999  # an acceptance rate is never taken as certain
EXPLORE_EVERY = 8  # after this many rounds without drafts in a row, one round with drafts measures the acceptance
# whole calls of plain decoding where no k pays (:func:`plain_call`): on these devices only (tests add "cpu"). On the
# CPU a round without drafts is already a plain step (eager forwards either way); on the GPU plain decoding runs
# ahead of the host with graphs and no per-round bookkeeping, which the loop's rounds cannot match on a small model
PLAIN_CALL_DEVICES = ("cuda",)
# a call times plain decoding once the best timed k, against the cheapest timed round (often one without drafts),
# promises less than this gain: such a round costs at least a plain step, and up to ~4x one where the host sets the
# pace (the tiny family on an H200: 356-1150 us against 210-324), so only a larger gain is sure to beat plain
# decoding (a 31B target at an acceptance of 0.8 gains ~3.5x)
PROBE_PLAIN_BELOW = 4.0
# calls in the mode that wins (plain decoding or drafting) before one call in the other times it again: doubling
# while the same mode keeps winning, back to the first once the other wins
EXPLORE_CALLS = (4, 64)


class RoundCosts:
    """Steady round times at each k, and the acceptance estimate, for one model, drafter and batch size."""

    def __init__(self):
        self.seconds: dict[int, collections.deque] = {}  # k -> its last KEEP timed rounds
        self.medians: dict[int, float] = {}  # k -> the median of those, for the k with MIN_TIMED rounds or more
        self.acceptance: AcceptanceRates | None = None  # the per-position acceptance measured so far
        self.last_k: int | None = None  # the k the last round ran: the next call starts there
        self.calls = 0  # calls that ran rounds with these timings (the second one on times every candidate k)
        # plain decoding's steps at this batch size, timed in the calls that "auto" ran as plain decoding
        self.plain_seconds: collections.deque = collections.deque(maxlen=KEEP)
        self.plain_median: float | None = None
        self.plain_won = False  # whether plain decoding won the last choice between the two
        self.streak = 0  # calls in the winning mode since the other one last ran
        self.explore_every = EXPLORE_CALLS[0]  # calls in the winning mode before the other one runs again

    def add_plain(self, seconds: float) -> None:
        """One timed step of plain decoding (of this batch size)."""
        self.plain_seconds.append(seconds)
        if len(self.plain_seconds) >= MIN_TIMED:
            self.plain_median = statistics.median(self.plain_seconds)

    def add(self, k: int, seconds: float) -> None:
        """One timed round of ``k`` drafts (only its k's median is recomputed: this runs every round)."""
        times = self.seconds.setdefault(k, collections.deque(maxlen=KEEP))
        times.append(seconds)
        if len(times) >= MIN_TIMED:
            self.medians[k] = statistics.median(times)

    def timed(self) -> dict[int, float]:
        """{k: median seconds} of the k with enough rounds, k ascending."""
        return dict(sorted(self.medians.items()))

    def curve(self) -> list[tuple[int, float]] | None:
        """The timed (k, seconds), k ascending, made to rise by at least :data:`MIN_DRAFT_SHARE` of the mean timed
        round per draft (a draft never makes a round cheaper, and timing noise that makes drafts look free must not
        buy drafts that are never accepted); None below two timed k."""
        timed = self.timed()
        if len(timed) < 2:
            return None
        least = MIN_DRAFT_SHARE * sum(timed.values()) / len(timed)
        points: list[tuple[int, float]] = []
        for k, t in timed.items():
            points.append((k, t if not points else max(t, points[-1][1] + least * (k - points[-1][0]))))
        return points


def cost_on(points: list[tuple[int, float]], k: int) -> float:
    """Seconds of a round of ``k`` drafts on the piecewise-linear curve through ``points`` (:meth:`RoundCosts.curve`),
    extended past its ends by its first and last segments."""
    i = next((i for i in range(1, len(points) - 1) if k <= points[i][0]), len(points) - 1)
    (k0, t0), (k1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (k - k0) / (k1 - k0)


def plain_call(costs: RoundCosts, k_max: int, new_tokens: int) -> bool:
    """Whether an "auto" call of ``new_tokens`` per row should run as plain decoding: where no timed k with drafts
    is expected to commit more tokens per second than plain decoding's steps, timed at this batch size, do (by
    :data:`SWITCH_GAIN`). A call of one new token has no round to draft for. Until plain decoding is timed, a call
    runs it to time it once the timed k promise less than :data:`PROBE_PLAIN_BELOW` over the cheapest timed round (a
    plain step costs no more than that); a speculative call must have measured the acceptance and timed a k first.
    Either mode's timings go stale while the other runs (a text becomes easier to draft, a lent machine's speed moves
    between calls): after :data:`EXPLORE_CALLS` calls in the winning mode (doubling while the same mode keeps
    winning) one runs the losing mode again, unless drafting wins by :data:`PROBE_PLAIN_BELOW` or more."""
    if new_tokens <= 1:
        return True
    curve = costs.curve()
    timed = [(k, seconds) for k, seconds in curve or () if 1 <= k <= k_max]
    if costs.acceptance is None or costs.calls == 0 or not timed:
        return False
    rates = costs.acceptance.rates(k_max)
    best = max(expected_tokens(rates, k) / seconds for k, seconds in timed)  # tokens per second of a timed k
    if costs.plain_median is None:
        # a plain step costs no more than the cheapest timed round (one without drafts, where it was timed)
        return best * min(costs.medians.values()) < PROBE_PLAIN_BELOW
    gain = best * costs.plain_median
    plain = gain <= SWITCH_GAIN
    if plain != costs.plain_won:  # the other mode wins now: its count starts over
        costs.plain_won, costs.streak, costs.explore_every = plain, 0, EXPLORE_CALLS[0]
    if not plain and gain >= PROBE_PLAIN_BELOW:  # drafting wins by more than the timings' noise could hide
        return False
    costs.streak += 1
    if costs.streak > costs.explore_every:  # the losing mode, once, to time it again
        costs.streak, costs.explore_every = 0, min(2 * costs.explore_every, EXPLORE_CALLS[1])
        return not plain
    return plain


def costs_for(kept: dict, key) -> RoundCosts:
    """The timings under ``key`` in ``kept`` (a model's), new if there are none; at most :data:`MAX_KEPT_COSTS`."""
    if key not in kept:
        while len(kept) >= MAX_KEPT_COSTS:
            kept.pop(next(iter(kept)))
        kept[key] = RoundCosts()
    return kept[key]


class AcceptanceRates:
    """Decayed counts, per draft position, of the rows that reached it (drafted it, every draft before it accepted)
    and of those that accepted it."""

    def __init__(self, k_max: int, prior_alpha: float = 0.6, decay: float = 0.9):
        # the prior: PRIOR_TRIALS pseudo-trials at the first position, decaying as measured rounds come in
        self.reached = [PRIOR_TRIALS] + [0.0] * (k_max - 1)
        self.passed = [prior_alpha * PRIOR_TRIALS] + [0.0] * (k_max - 1)
        self.decay = decay

    def update(self, accepted: list[int], k: int) -> None:
        """After a round of ``k`` drafts per row: ``accepted[b]`` drafts row b accepted."""
        self._grow(k)
        counts = [0] * (k + 1)  # rows by drafts accepted (at most k)
        for a in accepted:
            counts[min(a, k)] += 1
        reached = len(accepted)  # position j + 1: reached by the rows that accepted j drafts or more
        for j in range(k):
            passed = reached - counts[j]  # ... and passed by those that accepted more than j
            self.reached[j] = self.decay * self.reached[j] + reached
            self.passed[j] = self.decay * self.passed[j] + passed
            reached = passed

    def rates(self, k_max: int) -> list[float]:
        """The acceptance rate of each draft position 1..k_max given the ones before it were accepted: the measured
        share, each after the first shrunk towards the rate of the position before it by :data:`PSEUDO_TRIALS`, so
        that a position with few trials does not swing the choice of k."""
        self._grow(k_max)
        rates = [min(self.passed[0] / self.reached[0], MAX_RATE)]
        for j in range(1, k_max):
            rates.append(min((self.passed[j] + PSEUDO_TRIALS * rates[-1]) / (self.reached[j] + PSEUDO_TRIALS),
                             MAX_RATE))
        return rates

    def _grow(self, k: int) -> None:
        while len(self.reached) < k:
            self.reached.append(0.0)
            self.passed.append(0.0)


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens a row commits in a round of ``k`` drafts: its bonus token and each draft with the chance that it
    and every draft before it are accepted (``rates``: per position, given the ones before)."""
    return tokens_by_k(rates[:k])[-1]


def tokens_by_k(rates: list[float]) -> list[float]:
    """:func:`expected_tokens` at every k from 0 to ``len(rates)``, in one pass (the same sums in the same order)."""
    tokens, chain = [1.0], 1.0
    for rate in rates:
        chain *= rate
        tokens.append(tokens[-1] + chain)
    return tokens


def _prior_verify_per_token(batch: int) -> float:
    """The prior's cost of one more verified token per row, in target decode steps, at ``batch`` rows."""
    return 0.02 + 0.006 * batch


def candidate_ks(k_max: int) -> list[int]:
    """The k an "auto" controller may run, up to ``k_max``: every k up to 5, then about 1.4x apart, and k_max."""
    return [k for k in SWEEP if k < k_max] + [k_max]


class AdaptiveK:
    def __init__(self, k_max: int, draft_cost, batch: int, prior_alpha: float = 0.6, decay: float = 0.9,
                 costs: RoundCosts | None = None, grows: bool = True, plain: bool = False):
        """``costs``: the timings to use and extend (None: the prior cost model only, e.g. under tensor
        parallelism). ``grows``: whether k may rise again within the call once it fell (False for a drafter whose
        state at a larger k would be stale after rounds at a smaller one: it runs at most the k of its last round,
        up to ``k_max`` again at the next call). ``plain``: k = 0 is a candidate too, a round with no drafts (a plain
        decoding step of the loop), for where no k pays for its drafting."""
        self._costed, self._cost_of = None, {}  # the curve last read and each k's cost on it (cost)
        self._tokens_of = None  # (rates, expected tokens at each k) last computed (tokens_per_cost)
        self.k_max = k_max
        self.grows = grows
        self.ceiling = k_max  # the most drafts the next rounds may have (falls with k where k does not grow)
        self.candidates = [0] * plain + candidate_ks(k_max)
        self.draft_cost = draft_cost  # (k) -> cost in target steps
        self.verify_per_token = _prior_verify_per_token(batch)
        # what the last calls measured, else a weak prior
        self.acceptance = AcceptanceRates(k_max, prior_alpha, decay)
        if costs is not None and costs.acceptance is not None:
            self.acceptance = costs.acceptance
        self.costs = costs
        self.curve = costs.curve() if costs is not None else None  # the timed costs, refreshed as rounds are timed
        self.timing = costs is not None  # whether rounds are timed into ``costs`` (off once the batch shrank)
        # whether candidates not timed yet are run to time them: from the second call that runs rounds on (a call of
        # one new token runs none)
        self.sweep = costs is not None and costs.calls > 0
        self.counted = False  # whether this call was counted in ``costs.calls`` (at its first round)
        self.recent: list[int] = []  # the k of the last rounds, newest last
        self.probe: int | None = None  # the candidate k this call is getting timed, while it does
        self.probe_left = 0
        self.incumbent: int | None = None  # the k before the sweep of untimed candidates, while it runs
        self.without_drafts = 0  # rounds at k = 0 in a row since the last one with drafts
        last = costs.last_k if costs is not None else None
        # a call starts at the k its last round ran where k may grow again (a start from the estimate could take a
        # neighbouring k that its noise put ahead); else at the estimate's best: the last round ran the lowest k of
        # its call, and this call can only go down from where it starts. Always with drafts (k >= 1): rounds without
        # any measure no acceptance, and this call's text may be easier to draft
        start = last if last in self.candidates and last and grows else self._best(least=1)
        if not grows and self.sweep:  # its sweep goes down from the largest candidate not timed yet
            start = max([start] + [k for k in self.candidates if k not in costs.medians])
        self._set_k(start)

    def _set_k(self, k: int) -> None:
        self.k = min(k, self.ceiling)
        if not self.grows:
            self.ceiling = self.k

    def shrink(self, batch: int) -> None:
        """The batch dropped rows that stopped and now has ``batch`` rows. Its rounds are no longer those of the
        batch size whose costs were timed: from here they are not timed (nor probed), and k keeps being chosen on
        the curve timed so far (a call's last rounds, which end as its slowest rows finish)."""
        self.verify_per_token = _prior_verify_per_token(batch)
        self.timing = False
        self.probe, self.probe_left = None, 0
        if self.incumbent is not None:
            self._set_k(self.incumbent)
            self.incumbent = None

    def rates(self) -> list[float]:
        """The measured acceptance rate of each draft position (given the ones before it)."""
        return self.acceptance.rates(self.k_max)

    def observe(self, k: int, seconds: float, ahead_k: int | None = None) -> None:
        """A round of ``k`` drafts took ``seconds`` (from the previous round's read-back to its own); ``ahead_k``: the
        drafts it queued for the next round before its sync (None: none). Counted only when steady: the rounds
        before it ran the same k (the first round at a new k captures its graphs), and what it queued is of its k
        too (queued drafts of another k capture their graphs inside this round's time)."""
        if not self.timing:
            return
        steady = (len(self.recent) >= STEADY_ROUNDS and all(r == k for r in self.recent[-STEADY_ROUNDS:])
                  and ahead_k in (None, k))
        self.recent = (self.recent + [k])[-STEADY_ROUNDS:]
        if steady:
            self.costs.add(k, seconds)
            self.curve = self.costs.curve()

    def update(self, accepted: list[int], k: int) -> None:
        """After a round of ``k`` drafts per row: ``accepted[b]`` drafts row b accepted."""
        if not accepted:
            return
        self.acceptance.update(accepted, k)
        if self.costs is not None:
            self.costs.acceptance = self.acceptance
            if not self.counted:
                self.costs.calls, self.counted = self.costs.calls + 1, True
        self._choose()
        self.without_drafts = self.without_drafts + 1 if k == 0 else 0
        if self.k == 0 and self.grows and self.without_drafts >= EXPLORE_EVERY:
            # rounds without drafts measure no acceptance: one round with drafts now and then, so that a call whose
            # text became easier to draft (or whose estimate fell on a few unlucky rounds) leaves k = 0 again
            self.without_drafts = 0
            self._set_k(self._best(least=1))
        if self.costs is not None:
            self.costs.last_k = self.k

    def _choose(self) -> None:
        if self._probing():
            return
        if self.incumbent is not None:  # the sweep is over: back to the k it started from, timed over more rounds
            self._set_k(self.incumbent)  # (where k does not grow: the lowest probe, the best below it next)
            self.incumbent = None
        rates = self.rates()
        best = self._best(rates=rates)
        # move only for a clear gain, so that noise in the estimate (or in a candidate's few timed rounds) does not
        # make each round run another k
        if self.tokens_per_cost(best, rates) > SWITCH_GAIN * self.tokens_per_cost(self.k, rates):
            self._set_k(best)

    def _probing(self) -> bool:
        """Whether this round's k is a probe: while timing, from a model's second call on, every candidate k not
        timed yet is run for :data:`PROBE_ROUNDS` rounds, the one nearest the k running first (a probe whose rounds
        were not steady enough to be timed is run again)."""
        if self.probe is not None:
            self.probe_left -= 1
            if self.probe_left > 0:
                return True
            self.probe = None
        if not (self.timing and self.sweep):
            return False
        # where k does not grow, a round without drafts ends the call's drafting: k = 0 is probed there only once
        # every k with drafts is timed (the last probe: the rest of that call runs without drafts)
        timed_drafts = all(k in self.costs.medians for k in self.candidates if k)
        untimed = [k for k in self.candidates if k not in self.costs.medians and k <= self.ceiling
                   and (k or self.grows or timed_drafts)]
        if not untimed:
            return False
        if self.incumbent is None:
            self.incumbent = self.k
        # where k does not grow within a call, the probes go down from the largest (the rest of the call runs at
        # the best k up to the last one; the next call starts at the best of all)
        self.probe = min(untimed, key=lambda k: (abs(k - self.k), k)) if self.grows else max(untimed)
        self.probe_left = PROBE_ROUNDS
        self._set_k(self.probe)
        return True

    def _best(self, least: int = 0, rates: list[float] | None = None) -> int:
        rates = self.rates() if rates is None else rates
        return max((k for k in self.candidates if least <= k <= self.ceiling),
                   key=lambda k: self.tokens_per_cost(k, rates))

    def cost(self, k: int) -> float:
        """A round of k drafts: measured seconds on the timed curve, else the prior's target steps."""
        if self.curve is not None:
            if self._costed is not self.curve:  # each k read off a curve once (the curve changes as rounds are timed)
                self._costed, self._cost_of = self.curve, {}
            if k not in self._cost_of:
                self._cost_of[k] = cost_on(self.curve, k)
            return self._cost_of[k]
        return 1 + self.verify_per_token * k + (self.draft_cost(k) if k else 0.0)

    def tokens_per_cost(self, k: int, rates: list[float] | None = None) -> float:
        """Expected tokens per row of a round of ``k`` drafts over its cost (``rates``: per position, default the
        measured ones; the tokens of a ``rates`` list are kept while it is the last one given, so a list changed in
        place must not be given again)."""
        rates = self.rates() if rates is None else rates
        if self._tokens_of is None or self._tokens_of[0] is not rates:  # every k's tokens from one pass over rates
            self._tokens_of = (rates, tokens_by_k(rates))
        tokens = self._tokens_of[1]
        return tokens[min(k, len(tokens) - 1)] / self.cost(k)  # (past the rates, no more drafts count)
