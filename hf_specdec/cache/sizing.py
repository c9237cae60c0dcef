"""How many blocks a request's KV cache gets, and whether it fits.

:func:`cache_for_request` sizes a :class:`PagedKVCache` so that the request never runs out of blocks: each
row gets ``prompt + max_new_tokens + lookahead`` positions in full-attention groups and about a window in
sliding ones. A request that does not fit what :class:`CacheConfig` allows raises
:class:`CacheCapacityError` before anything is allocated or run.
"""

from __future__ import annotations

import torch

from hf_specdec.cache.kv_layout import KVLayout
from hf_specdec.cache.paged_cache import PagedKVCache, allocate_storage
from hf_specdec.config import CacheConfig


class CacheCapacityError(ValueError):
    """A request needs more KV cache than CacheConfig allows."""


def cache_for_request(layout: KVLayout, cache_config: CacheConfig, prompt_lens: list[int], max_new_tokens: int,
                      lookahead: int, *, dtype: torch.dtype, device, storage_pool=None,
                      storage_owner: str = "target") -> PagedKVCache:
    """A cache sized so the request never runs out of blocks; raises :class:`CacheCapacityError` before
    allocating anything when the request does not fit what ``cache_config`` allows. ``storage_pool`` (a
    GraphStore) lends pooled storage kept under ``storage_owner`` between requests (CUDA graphs write into
    fixed addresses)."""
    bs = cache_config.block_size
    need = blocks_needed(layout, cache_config, prompt_lens, max_new_tokens, lookahead)
    storage = None
    if storage_pool is not None:
        def allocate(blocks):
            if cache_config.max_cache_tokens is None:
                check_memory(layout, blocks, bs, dtype, torch.device(device), cache_config.gpu_memory_fraction)
            return allocate_storage(layout, blocks, bs, dtype, torch.device(device))

        # with num_blocks the pool holds at least that many blocks (exactly that many when it allocates), and
        # the request uses num_blocks of them: graphs captured over the pooled storage stay valid
        fixed = cache_config.num_blocks is not None
        *storage, have = storage_pool.take_storage(layout, need, bs, dtype, device, allocate, storage_owner,
                                                   round_up=not fixed)
        need = need if fixed else have
    elif cache_config.max_cache_tokens is None:
        check_memory(layout, need, bs, dtype, torch.device(device), cache_config.gpu_memory_fraction)
    return PagedKVCache(layout, need, len(prompt_lens), block_size=bs, dtype=dtype, device=device, storage=storage)


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
    return sum(2 * len(g.layers) * n * block_size * g.num_kv_heads * g.head_dim * itemsize
               for g, n in zip(layout.groups, num_blocks))


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take on a CUDA device: free memory plus what PyTorch's allocator holds
    cached but unused (a previous request's cache lands there). None on other devices."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_memory(layout: KVLayout, num_blocks: list[int], block_size: int, dtype: torch.dtype, device: torch.device,
                 fraction: float) -> None:
    """Raise :class:`CacheCapacityError` when the storage would take more than ``fraction`` of the device's free
    memory (CUDA only)."""
    free = free_device_memory(device)
    if free is None:
        return
    need = kv_bytes(layout, num_blocks, block_size, dtype)
    if need > fraction * free:
        raise CacheCapacityError(
            f"this batch needs {need / 2**20:.1f} MiB of KV cache but CacheConfig.gpu_memory_fraction={fraction} of "
            f"the {free / 2**20:.1f} MiB free on {device} allows {fraction * free / 2**20:.1f} MiB. Lower the batch "
            "size, the prompt lengths or max_new_tokens, free memory, or raise gpu_memory_fraction."
        )
