"""``num_speculative_tokens="auto"``: k chosen per round from the acceptance measured so far and the batch size.

A round with k drafts whose drafts are each accepted with probability alpha commits, per row, on average
``tau(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens, and costs about ``1 + v * k`` target steps of verify (the
k extra tokens per row of the verify forward: ``v`` grows with the batch, as the forward turns from
memory-bound to compute-bound) plus the drafter's ``draft_cost(k)``. The controller picks the k in 1..k_max
with the most tokens per unit of cost. alpha is the maximum-likelihood estimate over the rounds so far (a
row that accepted a of k drafts saw a acceptances and, if a < k, one rejection), weighted towards recent
rounds. A run whose drafts are never accepted settles at k = 1; the output is lossless whatever k is.

The verify cost per token (``v``) follows the H100 measurements in docs/perf_log.md (verify with k=7 at
1.14x a decode step at batch 1; at batch 32 k=3 beat k=7).
"""

from __future__ import annotations


SWITCH_GAIN = 1.03  # k changes when another k promises this many more tokens per unit of cost


class AdaptiveK:
    def __init__(self, k_max: int, draft_cost, batch: int, prior_alpha: float = 0.6, decay: float = 0.9):
        self.k_max = k_max
        self.draft_cost = draft_cost  # (k) -> cost in target steps
        self.verify_per_token = 0.02 + 0.006 * batch
        self.accepted, self.trials = prior_alpha * 4, 4.0  # a weak prior: 4 pseudo-trials
        self.decay = decay
        self.k = self._best()

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def update(self, accepted: list[int], k: int) -> None:
        """After a round of ``k`` drafts per row: ``accepted[b]`` drafts row b accepted."""
        if not accepted:
            return
        self.accepted = self.decay * self.accepted + sum(accepted)
        self.trials = self.decay * self.trials + sum(accepted) + sum(a < k for a in accepted)
        best, alpha = self._best(), min(self.alpha, 0.999)
        # near its optimum the curve is flat (at alpha 0.8 and a 0.17 cost per draft, k = 3, 4, 5 lie within 2%):
        # move only for a clear gain, so that noise in the estimate does not make each round run another k (a k
        # not run before captures its graphs, tens of milliseconds on a large target)
        if self.tokens_per_cost(alpha, best) > SWITCH_GAIN * self.tokens_per_cost(alpha, self.k):
            self.k = best

    def _best(self) -> int:
        alpha = min(self.alpha, 0.999)
        return max(range(1, self.k_max + 1), key=lambda k: self.tokens_per_cost(alpha, k))

    def tokens_per_cost(self, alpha: float, k: int) -> float:
        tau = (1 - alpha ** (k + 1)) / (1 - alpha)
        return tau / (1 + self.verify_per_token * k + self.draft_cost(k))
