"""SpecStats: what one generate call did, for ``hf_specdec.last_generation_stats(model)``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of one generate call.

    mean_accepted_length (tau) is tokens committed per target forward per row, bonus included: 1.0 for
    plain decoding, up to k+1 for speculative decoding with k drafts.
    acceptance_histogram[i] counts (row, step) pairs that accepted exactly i drafts.
    lossless is False only when the call ran a non-lossless acceptance (a benchmark's fixed acceptance rate).
    num_speculative_tokens is the call's k; where k was chosen per round ("auto", the default of greedy calls), the
    most drafts a round could have (num_draft_tokens / the row-rounds gives the rounds' mean k).
    """

    num_target_forwards: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_length: float = 0.0
    acceptance_histogram: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    spec_mode: str | None = None
    num_speculative_tokens: int = 0
    lossless: bool = True
    _row_forwards: int = field(default=0, repr=False)
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def record_step(self, committed_per_row: list[int], accepted_per_row: list[int] | None = None,
                    drafts_per_row: int = 0) -> None:
        """One target forward that committed ``committed_per_row[b]`` tokens to each active row."""
        self.num_target_forwards += 1
        self._row_forwards += len(committed_per_row)
        self.num_generated_tokens += sum(committed_per_row)
        if accepted_per_row is not None:
            self.num_draft_tokens += drafts_per_row * len(accepted_per_row)
            self.num_accepted_tokens += sum(accepted_per_row)
            if len(self.acceptance_histogram) < drafts_per_row + 1:
                self.acceptance_histogram += [0] * (drafts_per_row + 1 - len(self.acceptance_histogram))
            for a in accepted_per_row:
                self.acceptance_histogram[a] += 1

    def finish(self) -> "SpecStats":
        self.wall_time_s = time.perf_counter() - self._t0
        self.mean_accepted_length = self.num_generated_tokens / max(1, self._row_forwards)
        self.tokens_per_s = self.num_generated_tokens / max(self.wall_time_s, 1e-9)
        return self
