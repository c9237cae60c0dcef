"""Paged KV cache: block bookkeeping (pure Python), KV groups, and the transformers Cache subclass."""

from hf_specdec.cache.block_manager import BlockManager, BlockPool, OutOfBlocksError
from hf_specdec.cache.kv_layout import KVGroup, KVLayout, kv_layout_from_config
from hf_specdec.cache.paged_cache import CacheCapacityError, ForwardMeta, PagedKVCache

__all__ = [
    "BlockManager", "BlockPool", "CacheCapacityError", "ForwardMeta", "KVGroup", "KVLayout", "OutOfBlocksError",
    "PagedKVCache", "kv_layout_from_config",
]
