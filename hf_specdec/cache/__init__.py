"""Paged KV cache: block bookkeeping (pure Python), KV groups, the transformers Cache subclass, and sizing."""

from hf_specdec.cache.block_manager import BlockManager, BlockPool, OutOfBlocksError
from hf_specdec.cache.kv_layout import KVGroup, KVLayout, kv_layout_from_config, split_by_device
from hf_specdec.cache.paged_cache import ForwardMeta, ForwardPlan, PagedKVCache, to_device_async
from hf_specdec.cache.sizing import CacheCapacityError, CacheExhaustedError, cache_for_request

__all__ = [
    "BlockManager", "BlockPool", "CacheCapacityError", "CacheExhaustedError", "ForwardMeta", "ForwardPlan", "KVGroup",
    "KVLayout", "OutOfBlocksError",
    "PagedKVCache", "cache_for_request", "kv_layout_from_config", "split_by_device", "to_device_async",
]
