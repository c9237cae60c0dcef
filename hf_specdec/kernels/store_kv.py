"""store_kv: write new keys/values into the paged cache at their slots.

A slot is ``block_id * block_size + offset``: since the cache is contiguous
``[num_blocks, block_size, num_kv_heads, head_dim]``, slot s is row s of its flat
``[num_blocks * block_size, num_kv_heads, head_dim]`` view. Slots < 0 mark padding tokens and are
skipped, so a left-padded batch stores without a host-side filter.
"""

import torch

from ._dispatch import (check, check_paged_cache, check_same_device, next_power_of_2, pdl_args, pdl_wait, tl,
                        triton, use_triton)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens]
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    num_kv_heads, head_dim,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # One program per (token, kv head): head_dim elements of K and of V.
    token = tl.program_id(0)
    head = tl.program_id(1)
    # int64: slot * num_kv_heads * head_dim overflows int32 in a cache of more than 2 GiB elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # padding tokens have no slot
        d = tl.arange(0, BLOCK_D)
        mask = d < head_dim
        cache_offset = (slot * num_kv_heads + head) * head_dim + d
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=mask)
        tl.store(k_cache_ptr + cache_offset, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offset, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; < 0 => skip
    validate: bool = True,
) -> None:
    """Write key/value (cast to the cache dtype) into the caches at `slot_mapping`, in place.

    The Triton path never syncs with the host; the reference (CPU) path filters padding with a mask.
    ``validate=False`` skips the argument checks (for PagedKVCache, whose slot mappings it builds itself).
    """
    if validate:
        _check_store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if use_triton(key):
        _store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif key.device.type == "cpu":
        _store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def store_kv_layers(
    keys: torch.Tensor,  # [layers, num_tokens, num_kv_heads, head_dim]
    values: torch.Tensor,  # [layers, num_tokens, num_kv_heads, head_dim]
    k_storage: torch.Tensor,  # [layers, num_blocks, block_size, num_kv_heads, head_dim]: one KV group's layers
    v_storage: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; < 0 => skip
) -> None:
    """:func:`store_kv` of every layer of one KV group at the same slots: layer i's keys and values into
    ``k_storage[i]`` and ``v_storage[i]``. On the CPU one ``index_copy_`` per storage for all the layers (a group's
    pages are slices of one storage); elsewhere :func:`store_kv` layer by layer."""
    check(keys.shape == values.shape and keys.dim() == 4 and k_storage.dim() == 5
          and keys.shape[0] == k_storage.shape[0] and keys.shape[2:] == k_storage.shape[3:]
          and v_storage.shape == k_storage.shape and slot_mapping.shape == (keys.shape[1],),
          f"store_kv_layers takes keys/values [layers, tokens, kv_heads, head_dim] for storage [layers, blocks, "
          f"block_size, kv_heads, head_dim] and slots [tokens], got {tuple(keys.shape)}, {tuple(values.shape)}, "
          f"{tuple(k_storage.shape)} and {tuple(slot_mapping.shape)}")
    if keys.shape[1] == 0:
        return
    if keys.device.type != "cpu" or use_triton(keys):
        for i in range(keys.shape[0]):
            store_kv(keys[i], values[i], k_storage[i], v_storage[i], slot_mapping, validate=False)
        return
    layers, _, num_kv_heads, head_dim = keys.shape
    if bool((slot_mapping < 0).any()):
        keep = (slot_mapping >= 0).nonzero().squeeze(1)
        keys, values, slot_mapping = keys.index_select(1, keep), values.index_select(1, keep), slot_mapping[keep]
    slots = slot_mapping.long()
    k_storage.view(layers, -1, num_kv_heads, head_dim).index_copy_(1, slots, keys.to(k_storage.dtype))
    v_storage.view(layers, -1, num_kv_heads, head_dim).index_copy_(1, slots, values.to(v_storage.dtype))


def _store_kv_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The CPU path: one ``index_copy_`` per cache, the padding filtered only when a slot is < 0 (a decode or
    verify forward has none; the reference's boolean indexing costs ~5x more per call)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    if bool((slot_mapping < 0).any()):
        keep = (slot_mapping >= 0).nonzero().squeeze(1)
        key, value, slot_mapping = key.index_select(0, keep), value.index_select(0, keep), slot_mapping[keep]
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(),
        num_kv_heads, head_dim,
        BLOCK_D=next_power_of_2(head_dim), **pdl_args(k_cache),
    )


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Torch version of store_kv: the CPU path and the test oracle (the padding mask syncs on GPU)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)


def _check_store_kv_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    check_paged_cache(k_cache, v_cache)
    check(key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    check(key.shape[1:] == k_cache.shape[2:],
          f"key is [num_tokens, num_kv_heads={key.shape[1]}, head_dim={key.shape[2]}] but the cache holds "
          f"num_kv_heads={k_cache.shape[2]}, head_dim={k_cache.shape[3]}: pass keys of this cache's KV group")
    check(value.shape == key.shape, f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    check(key.is_floating_point() and value.is_floating_point(),
          f"key/value must be floating point, got {key.dtype}/{value.dtype}")
    check(slot_mapping.shape == (key.shape[0],),
          f"slot_mapping must be [num_tokens={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.stride(0) == 1,
          f"slot_mapping must be a contiguous int32 or int64 tensor, got {slot_mapping.dtype} with stride "
          f"{slot_mapping.stride()}: pass slot_mapping.contiguous()")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
