"""Configuration dataclasses, validated once in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass

SPEC_MODES = ("mtp", "dflash")
AUTO = "auto"  # num_speculative_tokens chosen per round


@dataclass
class CacheConfig:
    """How the paged KV cache is laid out and sized.

    block_size: tokens per block (page). Every KV group uses the same block size.
    num_blocks: blocks per KV group. ``None`` sizes each group for the request at hand
        (prompt + new tokens + speculative lookahead), which never runs out.
    max_cache_tokens: an upper bound on the tokens a full-attention KV group may hold
        across all rows of a batch; a request needing more raises before touching any state.
        ``None`` means no bound.
    gpu_memory_fraction: on a CUDA device, when neither ``num_blocks`` nor ``max_cache_tokens`` is
        given, each KV cache of a request (the target's, a drafter's own) may take at most this fraction of
        the device memory free when it is allocated (memory PyTorch holds cached but unused counts as free).
        The rest is left for activations and logits.
    cpu_memory_fraction: the same bound on CPU, a fraction of the memory available (Linux; elsewhere no bound).

    With ``num_blocks`` or ``max_cache_tokens``, a request that could outgrow them raises ``CacheCapacityError``
    (a ``ValueError``) before its prefill; nothing is streamed or changed. Without them a request gets blocks as
    its rows grow, from a pool bounded by the memory fraction: only a request whose prompts (and drafts) alone
    do not fit is refused before its prefill; one that outgrows the pool while it runs stops with
    ``CacheExhaustedError`` (a ``CacheCapacityError``) whose ``sequences`` hold the tokens generated so far.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_cache_tokens: int | None = None
    gpu_memory_fraction: float = 0.9
    cpu_memory_fraction: float = 0.5

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"CacheConfig.block_size must be a power of two >= 1, got {self.block_size}.")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"CacheConfig.num_blocks must be >= 1 or None, got {self.num_blocks}.")
        if self.max_cache_tokens is not None and self.max_cache_tokens < self.block_size:
            raise ValueError(
                f"CacheConfig.max_cache_tokens must be >= block_size ({self.block_size}), got {self.max_cache_tokens}."
            )
        for name in ("gpu_memory_fraction", "cpu_memory_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"CacheConfig.{name} must be in (0, 1], got {getattr(self, name)}.")


@dataclass(frozen=True)
class SpecDecodingConfig:
    """What a speculative ``generate`` call asked for: the mode (None: inferred from the assistant) and the number
    of drafts per step, k (None: the drafter's default; ``"auto"``: chosen per round, up to the drafter's
    builder's ``auto_k_max`` or its default). The one place both are validated."""

    spec_mode: str | None = None
    num_speculative_tokens: int | str | None = None

    def __post_init__(self):
        if self.spec_mode is not None and self.spec_mode not in SPEC_MODES:
            raise ValueError(f"unknown spec_mode {self.spec_mode!r}; use one of {SPEC_MODES}.")
        k = self.num_speculative_tokens
        if k is not None and k != AUTO and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"num_speculative_tokens must be a positive integer or {AUTO!r}, got {k!r}.")

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == AUTO
