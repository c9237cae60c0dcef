"""generate() override, the decoding loops, sampling, and stats."""

from hf_specdec.generation.enable import EnabledState, disable, enable, last_generation_stats
from hf_specdec.generation.stats import SpecStats

__all__ = ["EnabledState", "SpecStats", "disable", "enable", "last_generation_stats"]
