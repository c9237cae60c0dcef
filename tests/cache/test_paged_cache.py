"""Invariant 3 (rollback purity) at the cache level: after any sequence of appends, rollbacks and
window slides, each row's pages hold exactly the K/V of the tokens it kept."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hf_specdec.cache import CacheCapacityError, KVLayout, PagedKVCache, sizing
from hf_specdec.cache.block_manager import OutOfBlocksError
from hf_specdec.config import CacheConfig

WINDOW = 5
LAYOUT = KVLayout.from_layers([(2, 8, None), (1, 16, WINDOW), (1, 16, WINDOW)], {0: 0, 1: 1, 2: 1})


def _store(cache, num_new, q_len, gen):
    """One forward's worth of K/V for every layer; returns what each row appended, per layer."""
    cache.begin_forward(num_new, q_len)
    added = {}
    for layer in (0, 1):
        grp = LAYOUT.group_of(layer)
        k = torch.randn(cache.batch_size, grp.num_kv_heads, q_len, grp.head_dim, generator=gen)
        v = torch.randn(k.shape, generator=gen)
        cache.update(k, v, layer)
        added[layer] = [(k[b, :, q_len - n:], v[b, :, q_len - n:]) for b, n in enumerate(num_new)]
    return added


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=3, max_size=3), st.lists(st.integers(0, 6),
                                                                                       min_size=3, max_size=3)),
                min_size=1, max_size=12))
def test_pages_match_a_dense_reference_after_appends_and_rollbacks(steps):
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(LAYOUT, [64, 64], 3, block_size=4, dtype=torch.float32, device="cpu")
    dense = {layer: [(torch.zeros(LAYOUT.group_of(layer).num_kv_heads, 0, LAYOUT.group_of(layer).head_dim),) * 2
                     for _ in range(3)] for layer in (0, 1)}
    for num_new, rejected in steps:
        q_len = max(num_new)
        added = _store(cache, num_new, q_len, gen)
        keep = [n - min(r, n) for n, r in zip(num_new, rejected)]  # a verify that rejects some of its tokens
        cache.commit([before + k for before, k in zip([d[0].shape[1] for d in dense[0]], keep)])
        for layer in (0, 1):
            for b in range(3):
                k_new, v_new = added[layer][b]
                k_old, v_old = dense[layer][b]
                dense[layer][b] = (torch.cat([k_old, k_new[:, :keep[b]]], 1), torch.cat([v_old, v_new[:, :keep[b]]], 1))
        for layer in (0, 1, 2):
            producer = LAYOUT.producer[layer]
            for b in range(3):
                k, v, start = cache.gather(b, layer)
                k_ref, v_ref = dense[producer][b]
                length = k_ref.shape[1]
                assert torch.equal(k, k_ref[:, start:]) and torch.equal(v, v_ref[:, start:])
                if LAYOUT.group_of(layer).is_sliding:
                    assert start <= max(0, length - WINDOW + 1)  # everything the next query can see is kept
                else:
                    assert start == 0
    cache.free()
    assert all(p.num_free == 64 for p in cache.manager.pools)


def test_sliding_group_memory_stays_bounded():
    cache = PagedKVCache(LAYOUT, [64, 4], 1, block_size=4, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        _store(cache, [1], 1, gen)
        cache.commit([step + 1])
        assert cache.manager.num_live_blocks(cache.seq_ids[0], 1) <= 3


def test_a_forward_at_device_positions_describes_what_a_host_plan_at_them_would():
    """plan_at: a forward at positions only the device knows (each at most the row's length) stores and reads as a
    forward planned on the host after rolling each row back to that position; room is kept for the longest case and
    the commit sets the lengths."""
    caches = [PagedKVCache(LAYOUT, [64, 64], 2, block_size=4, dtype=torch.float32, device="cpu") for _ in range(2)]
    for cache in caches:
        _store(cache, [9, 5], 9, torch.Generator().manual_seed(1))
        cache.commit([9, 5])
    ahead = caches[0].plan_at(torch.tensor([6, 5], dtype=torch.int32), 3).meta()
    assert caches[0].seq_lens == [12, 8]  # room for 3 past every row's length
    caches[1].commit([6, 5])
    host = caches[1].plan_forward([3, 3], 3).meta()
    for field in ("kv_lens", "q_pos0", "q_lens", "position_ids"):
        assert torch.equal(getattr(ahead, field), getattr(host, field)), field
    for cache, meta in zip(caches, (ahead, host)):  # the slots hold the same positions of each row
        with cache.forward_with(meta):
            k = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(2))
            cache.update(k, k, 0)
        cache.commit([9, 8])
    for row in range(2):
        torch.testing.assert_close(caches[0].gather(row, 0)[0], caches[1].gather(row, 0)[0])
    assert caches[0].seq_lens == [9, 8]


def test_a_forward_of_device_counts_describes_what_a_host_plan_of_them_would():
    """plan_counts: each row's start and number of new tokens only the device knows (fewer than the query slots for
    some rows, right-aligned): the same metadata as the host's plan after rolling each row back to its start."""
    caches = [PagedKVCache(LAYOUT, [64, 64], 2, block_size=4, dtype=torch.float32, device="cpu") for _ in range(2)]
    for cache in caches:
        _store(cache, [9, 5], 9, torch.Generator().manual_seed(1))
        cache.commit([9, 5])
    ahead = caches[0].plan_counts(torch.tensor([[6, 5], [2, 3]], dtype=torch.int32), 3).meta()
    assert caches[0].seq_lens == [12, 8]  # room for 3 past every row's length
    caches[1].commit([6, 5])
    host = caches[1].plan_forward([2, 3], 3).meta()
    for field in ("kv_lens", "q_pos0", "q_lens", "position_ids"):
        assert torch.equal(getattr(ahead, field), getattr(host, field)), field
    assert all(torch.equal(a, b) for a, b in zip(ahead.slot_mapping, host.slot_mapping))
    with pytest.raises(ValueError, match=r"counts must be \[2, 2\] int32"):
        caches[0].plan_counts(torch.tensor([[6, 5], [2, 3]]), 3)


def test_out_of_blocks_raises_before_touching_state():
    cache = PagedKVCache(LAYOUT, [2, 2], 2, block_size=4, dtype=torch.float32, device="cpu")
    cache.begin_forward([4, 4], 4)
    cache.commit([4, 4])
    with pytest.raises(OutOfBlocksError, match="num_blocks"):
        cache.begin_forward([1, 1], 1)
    assert cache.seq_lens == [4, 4]


def test_request_over_max_cache_tokens_names_the_knob():
    config = CacheConfig(block_size=4, max_cache_tokens=32)
    with pytest.raises(CacheCapacityError, match="max_cache_tokens"):
        sizing.cache_for_request(LAYOUT, config, [20, 20], 10, 0, dtype=torch.float32, device="cpu")


def test_update_outside_a_paged_forward_says_what_to_use():
    cache = PagedKVCache(LAYOUT, [4, 4], 1, block_size=4, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="DynamicCache"):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)


def test_keeping_rows_frees_the_others_and_the_kept_rows_read_and_grow_as_before():
    """keep_rows (a batch dropping its stopped rows): the dropped rows' blocks go back to the pools; each kept row,
    in its new place, holds what it held and keeps growing (its next forward's slots and tables are its own)."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(LAYOUT, [64, 64], 3, block_size=4, dtype=torch.float32, device="cpu")
    _store(cache, [9, 5, 7], 9, gen)
    cache.commit([9, 5, 7])
    before = {b: [cache.gather(b, layer)[:2] for layer in (0, 1)] for b in range(3)}
    used = cache.num_used_blocks
    cache.keep_rows([2, 0])
    assert cache.batch_size == 2 and cache.seq_lens == [7, 9]
    assert cache.num_used_blocks[0] == used[0] - 2  # row 1's 5 tokens held two blocks of the full group
    for new, old in enumerate([2, 0]):
        for layer in (0, 1):
            k, v = cache.gather(new, layer)[:2]
            assert torch.equal(k, before[old][layer][0]) and torch.equal(v, before[old][layer][1])
    added = _store(cache, [2, 1], 2, gen)  # the next forward appends at each kept row's own length
    cache.commit([9, 10])
    for new in range(2):
        k = cache.gather(new, 0)[0]
        assert torch.equal(k[:, -added[0][new][0].shape[1]:], added[0][new][0])
    with pytest.raises(ValueError, match="distinct row indices"):
        cache.keep_rows([1, 1])
    with pytest.raises(ValueError, match="distinct row indices"):
        cache.keep_rows([2])
    cache.free()
    assert all(p.num_free == 64 for p in cache.manager.pools)


def test_a_forward_description_copied_in_one_piece_views_the_same_values():
    """From one GPU to another the description's tensors (int32, int64 and bool, any length) go over as one packed
    copy, each viewed back at an aligned offset: the same values, dtypes and shapes (here CPU to CPU)."""
    from hf_specdec.cache.paged_cache import copy_packed

    tensors = [torch.arange(3, dtype=torch.int32), torch.tensor([[5, -1]], dtype=torch.int64),
               torch.tensor([True, False, True]), torch.arange(7, dtype=torch.int32).view(1, 7)[:, 1:],
               torch.empty(0, dtype=torch.int64)]
    moved = copy_packed(tensors, torch.device("cpu"))
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one buffer
    for got, want in zip(moved, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.storage_offset() * got.element_size() % 16 == 0


def test_a_layer_the_layout_does_not_describe_is_refused_by_name():
    """A model that runs its layers more than once stores K/V under indices past its config's layers: a clear
    error, not a KeyError from the layout."""
    cache = PagedKVCache(LAYOUT, [64, 64], 1, block_size=4, dtype=torch.float32, device="cpu")
    cache.begin_forward([2], 2)
    k = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="stores K/V for layer 3, which its config does not describe"):
        cache.update(k, k, 3)
