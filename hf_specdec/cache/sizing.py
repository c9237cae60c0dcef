"""How many blocks a request's KV cache gets, and whether it fits.

:func:`cache_for_request` sizes a :class:`PagedKVCache` for one request. With ``CacheConfig.num_blocks`` or
``max_cache_tokens`` the cache holds every position the request may reach (``prompt + max_new_tokens +
lookahead`` per row in full-attention groups, about a window in sliding ones), and a request that could
outgrow them is refused before anything runs. Without them the pool is bounded by a memory budget (a
fraction of the free device memory, or of the available RAM on CPU): a request is refused up front only when
its prompts and drafts alone do not fit, and on CPU the storage starts small and grows as the rows do (a call
that stops at EOS after a few tokens allocates for those, not for ``max_new_tokens``). A request that outgrows
its pool while running stops with :class:`CacheExhaustedError` (``generation`` attaches the tokens so far).
A layout whose pages live on several devices (layers placed by a device_map) is sized so that each device's pages
fit that device's own budget (:class:`DeviceBudgets`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from hf_specdec.cache.kv_layout import KVLayout
from hf_specdec.cache.paged_cache import PagedKVCache, allocate_storage
from hf_specdec.config import CacheConfig


class CacheCapacityError(ValueError):
    """A request needs more KV cache than CacheConfig allows."""


class CacheExhaustedError(CacheCapacityError):
    """A running request outgrew its KV cache pool; ``sequences`` [batch, length] holds what it generated so far
    (prompt included, rows padded like ``generate``'s output)."""

    def __init__(self, message: str, sequences: torch.Tensor | None = None):
        super().__init__(message)
        self.sequences = sequences


def cache_for_request(layout: KVLayout, cache_config: CacheConfig, prompt_lens: list[int], max_new_tokens: int,
                      lookahead: int, *, dtype: torch.dtype, device, storage_pool=None,
                      storage_owner: str = "target",
                      shared_budget: Callable[[int | None], int | None] | None = None) -> PagedKVCache:
    """A cache for the request (see the module docstring); raises :class:`CacheCapacityError` before allocating
    anything when it does not fit what ``cache_config`` allows. ``storage_pool`` (a GraphStore) lends pooled
    storage kept under ``storage_owner`` between requests (CUDA graphs write into fixed addresses).
    ``shared_budget`` maps this process's memory budget to the one every process of a tensor-parallel group uses
    (their smallest), so the ranks size their caches alike and refuse or run out together."""
    bs, device = cache_config.block_size, torch.device(device)
    bounded = cache_config.num_blocks is not None or cache_config.max_cache_tokens is not None
    budget = None
    split = len(_devices(layout, device)) > 1  # layers placed on several devices: each one's pages within its own
    if bounded:
        need = blocks_needed(layout, cache_config, prompt_lens, max_new_tokens, lookahead)
        if cache_config.max_cache_tokens is None:  # num_blocks alone: still within the device's memory
            if split:
                limit, knob = DeviceBudgets.of(layout, device, cache_config, None), _knob(device)
            else:
                limit, knob = memory_budget(device, cache_config)
                limit = limit if shared_budget is None else shared_budget(limit)
            _check_fits(layout, need, bs, dtype, limit, knob)
    else:
        # the owner's pooled storage is freed before a larger one is allocated: it counts as free memory
        pooled = storage_pool.storages.get(storage_owner) if storage_pool is not None else None
        if split:
            budget, knob = DeviceBudgets.of(layout, device, cache_config, pooled), _knob(device)
        else:
            held = sum(t.numel() * t.element_size() for t in (*pooled[2], *pooled[3])) if pooled else 0
            budget, knob = memory_budget(device, cache_config, held)
            if shared_budget is not None:
                budget = shared_budget(budget)
        need = within_budget(layout, cache_config, prompt_lens, max_new_tokens, lookahead, dtype, budget, knob)
    if storage_pool is not None:
        # with num_blocks the pool holds at least that many blocks (exactly that many when it allocates), and
        # the request uses num_blocks of them: graphs captured over the pooled storage stay valid
        *storage, have = storage_pool.take_storage(
            layout, need, bs, dtype, device, lambda blocks: _allocate_within(layout, blocks, budget, bs, dtype, device),
            storage_owner, round_up=cache_config.num_blocks is None)
        need = need if cache_config.num_blocks is not None else have
        return PagedKVCache(layout, need, len(prompt_lens), block_size=bs, dtype=dtype, device=device,
                            storage=storage)
    # without pooled storage (no CUDA graphs) the storage grows as the rows do, up to `need` blocks
    initial = need if bounded else [min(n, 2 * b) for n, b in
                                    zip(need, blocks_needed(layout, cache_config, prompt_lens, 1, lookahead))]
    return PagedKVCache(layout, need, len(prompt_lens), block_size=bs, dtype=dtype, device=device,
                        storage_blocks=initial)


def _group_device(group, home) -> torch.device:
    """Where a group's pages live (a group naming no device lives on ``home``)."""
    return torch.device(home if group.device is None else group.device)


def _devices(layout: KVLayout, home) -> set[torch.device]:
    """The devices the layout's pages live on."""
    return {_group_device(g, home) for g in layout.groups}


@dataclass(frozen=True)
class DeviceBudgets:
    """A memory budget per device, for a layout whose pages live on several (layers placed by a device_map): each
    device's pages must fit its own. ``home``: where the groups that name no device live."""

    home: torch.device
    limits: dict  # device -> bytes, or None for no bound

    @classmethod
    def of(cls, layout: KVLayout, home, cache_config: CacheConfig, pooled) -> "DeviceBudgets":
        """Each device's budget, counting its share of the pooled storage (freed before a new one) as free."""
        held: dict[torch.device, int] = {}
        for t in (*pooled[2], *pooled[3]) if pooled else ():
            held[t.device] = held.get(t.device, 0) + t.numel() * t.element_size()
        home = torch.device(home)
        return cls(home, {d: memory_budget(d, cache_config, held.get(d, 0))[0] for d in _devices(layout, home)})


def kv_bytes_by_device(layout: KVLayout, num_blocks: list[int], block_size: int, dtype: torch.dtype,
                       home) -> dict[torch.device, int]:
    """:func:`kv_bytes` per device the pages live on (a group naming none on ``home``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out: dict[torch.device, int] = {}
    for group, n in zip(layout.groups, num_blocks):
        device = _group_device(group, home)
        out[device] = out.get(device, 0) + _group_bytes(group, n, block_size, itemsize)
    return out


def _over_budget(layout: KVLayout, blocks: list[int], block_size: int, dtype, budget) -> tuple[int, int] | None:
    """(bytes needed, bytes allowed) where ``blocks`` do not fit ``budget`` -- bytes for the whole cache, or
    :class:`DeviceBudgets` (then the first device over its own) -- else None."""
    if budget is None:
        return None
    if isinstance(budget, DeviceBudgets):
        for device, need in kv_bytes_by_device(layout, blocks, block_size, dtype, budget.home).items():
            allowed = budget.limits.get(device)
            if allowed is not None and need > allowed:
                return need, allowed
        return None
    need = kv_bytes(layout, blocks, block_size, dtype)
    return (need, budget) if need > budget else None


def _check_fits(layout, blocks: list[int], block_size: int, dtype, budget, knob: str) -> None:
    over = _over_budget(layout, blocks, block_size, dtype, budget)
    if over is not None:
        where = " on one of its devices" if isinstance(budget, DeviceBudgets) else ""
        raise CacheCapacityError(
            f"CacheConfig.num_blocks makes this cache {over[0] / 2**20:.1f} MiB{where} but CacheConfig.{knob} of the "
            f"memory free there allows {over[1] / 2**20:.1f} MiB. Lower num_blocks (or leave it None), free memory, "
            f"or raise {knob}."
        )


def _allocate_within(layout, blocks: list[int], budget, block_size: int, dtype, device):
    """Pooled storage of ``blocks`` per group, refused past the memory ``budget`` (a ValueError: the pool then
    allocates exactly what the request needs instead of a rounded-up size)."""
    if _over_budget(layout, blocks, block_size, dtype, budget) is not None:
        raise CacheCapacityError("rounded up past the request's memory budget")
    return allocate_storage(layout, blocks, block_size, dtype, device)


def within_budget(layout: KVLayout, cache_config: CacheConfig, prompt_lens: list[int], max_new_tokens: int,
                  lookahead: int, dtype, budget: int | None, knob: str = "gpu_memory_fraction") -> list[int]:
    """Blocks per group for the most new tokens per row, up to ``max_new_tokens``, whose cache fits ``budget``
    bytes (None: no bound): the rows can grow that far in every group at once (a sliding group needs about a
    window whatever the length). Raises :class:`CacheCapacityError` when even the prompts and one step of drafts
    do not fit."""
    bs = cache_config.block_size

    def fits(new_tokens: int) -> bool:
        return _over_budget(layout, blocks_needed(layout, cache_config, prompt_lens, new_tokens, lookahead), bs, dtype,
                            budget) is None

    if budget is None or fits(max_new_tokens):
        return blocks_needed(layout, cache_config, prompt_lens, max_new_tokens, lookahead)
    if not fits(1):
        floor, allowed = _over_budget(layout, blocks_needed(layout, cache_config, prompt_lens, 1, lookahead), bs,
                                      dtype, budget)
        where = " on one of its devices" if isinstance(budget, DeviceBudgets) else ""
        raise CacheCapacityError(
            f"this batch's prompts alone need {floor / 2**20:.3f} MiB of KV cache{where} but CacheConfig.{knob}="
            f"{getattr(cache_config, knob)} of the memory free there allows {allowed / 2**20:.3f} MiB. Lower the "
            f"batch size or the prompt lengths, free memory, or raise {knob}."
        )
    low, high = 1, max_new_tokens  # low fits, high does not (blocks grow with the new tokens)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return blocks_needed(layout, cache_config, prompt_lens, low, lookahead)


def memory_budget(device: torch.device, cache_config: CacheConfig, held: int = 0) -> tuple[int | None, str]:
    """(bytes a cache may take on ``device``, or None for no bound; the CacheConfig field that sets it)."""
    knob = _knob(device)
    if device.type == "cuda":
        free = free_device_memory(device)
    else:
        free = available_host_memory()
    return (None if free is None else int(getattr(cache_config, knob) * (free + held))), knob


def _knob(device: torch.device) -> str:
    """The CacheConfig field that bounds a cache on ``device``."""
    return "gpu_memory_fraction" if device.type == "cuda" else "cpu_memory_fraction"


def available_host_memory() -> int | None:
    """Bytes of RAM available to new allocations (Linux), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def blocks_needed(layout: KVLayout, cache_config: CacheConfig, prompt_lens: list[int], max_new_tokens: int,
                  lookahead: int) -> list[int]:
    """Blocks per KV group for the request (``num_blocks`` for every group when the config fixes it); raises
    :class:`CacheCapacityError` when ``max_cache_tokens`` or ``num_blocks`` is too small."""
    bs = cache_config.block_size
    full_need = [-(-(p + max_new_tokens + lookahead) // bs) + 1 for p in prompt_lens]
    if cache_config.max_cache_tokens is not None and sum(full_need) * bs > cache_config.max_cache_tokens:
        raise CacheCapacityError(
            f"this batch needs {sum(full_need) * bs} cached tokens per full-attention KV group but "
            f"CacheConfig.max_cache_tokens={cache_config.max_cache_tokens}. Raise max_cache_tokens, or lower the "
            "batch size, the prompt lengths or max_new_tokens."
        )
    need = []
    for grp in layout.groups:
        if grp.is_sliding:
            span = -(-(grp.sliding_window + 1 + lookahead) // bs) + 2
            need.append(sum(min(f, max(-(-p // bs) + 1, span)) for f, p in zip(full_need, prompt_lens)))
        else:
            need.append(sum(full_need))
    if cache_config.num_blocks is None:
        return need
    if max(need, default=0) > cache_config.num_blocks:
        raise CacheCapacityError(
            f"this batch needs up to {max(need)} blocks per KV group but CacheConfig.num_blocks="
            f"{cache_config.num_blocks}. Raise num_blocks (or leave it None to size the cache per request), "
            "or lower the batch size, the prompt lengths or max_new_tokens."
        )
    return [cache_config.num_blocks] * len(layout.groups)


def kv_bytes(layout: KVLayout, num_blocks: list[int], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V storage of every KV group with ``num_blocks[g]`` blocks each."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(_group_bytes(g, n, block_size, itemsize) for g, n in zip(layout.groups, num_blocks))


def _group_bytes(group, num_blocks: int, block_size: int, itemsize: int) -> int:
    return 2 * len(group.layers) * num_blocks * block_size * group.num_kv_heads * group.head_dim * itemsize


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take on a CUDA device: free memory plus what PyTorch's allocator holds
    cached but unused (a previous request's cache lands there). None on other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
