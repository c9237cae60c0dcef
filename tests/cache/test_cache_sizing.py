"""How a request's cache is sized and refused: num_blocks, max_cache_tokens and gpu_memory_fraction all raise
CacheCapacityError before anything is allocated; the used-block counts read back zero after free()."""

import pytest
import torch

from hf_specdec.cache import CacheCapacityError, KVLayout, sizing
from hf_specdec.config import CacheConfig

# one full group (2 layers, 2 kv heads x 8) and one sliding group (window 6, 1 layer, 1 kv head x 16)
LAYOUT = KVLayout.from_layers([(2, 8, None), (1, 16, 6), (2, 8, None)], producer={0: 0, 1: 1, 2: 2})


def _request(config, prompt_lens=(20, 9), max_new_tokens=30, lookahead=4):
    return sizing.cache_for_request(LAYOUT, config, list(prompt_lens), max_new_tokens, lookahead,
                                    dtype=torch.float32, device="cpu")


def test_default_sizing_fits_the_request_and_frees_to_zero():
    cache = _request(CacheConfig(block_size=4))
    full, sliding = cache.manager.pools[0].num_blocks, cache.manager.pools[1].num_blocks
    assert full == (-(-54 // 4) + 1) + (-(-43 // 4) + 1)
    assert sliding < full  # the sliding group holds a window, not the sequence
    cache.begin_forward([20, 9], 20)
    cache.commit([20, 9])
    assert cache.num_used_blocks[0] == 5 + 3
    cache.free()
    assert cache.num_used_blocks == [0, 0]


def test_num_blocks_too_small_is_refused_up_front():
    with pytest.raises(CacheCapacityError, match=r"needs up to 27 blocks per KV group but CacheConfig.num_blocks=20. "
                                                 r"Raise num_blocks"):
        _request(CacheConfig(block_size=4, num_blocks=20))
    assert _request(CacheConfig(block_size=4, num_blocks=27)).manager.pools[0].num_blocks == 27


def test_a_pooled_storage_serves_requests_with_a_fixed_num_blocks():
    """CUDA graphs write into the storage they were captured over, so requests of a model with graphs take
    their K/V storage from its pool; with num_blocks set the pool allocates exactly that many blocks (no
    power-of-two rounding past the user's bound) and every request uses num_blocks of them."""
    from hf_specdec.runtime.cuda_graphs import GraphStore

    store = GraphStore()
    config = CacheConfig(block_size=4, num_blocks=27)
    first = sizing.cache_for_request(LAYOUT, config, [20, 9], 30, 4, dtype=torch.float32, device="cpu",
                                     storage_pool=store)
    assert [k.shape[1] for k in first.k_storage] == [27, 27] and first.manager.pools[0].num_blocks == 27
    first.free()
    second = sizing.cache_for_request(LAYOUT, config, [5], 10, 4, dtype=torch.float32, device="cpu",
                                      storage_pool=store)
    assert all(a is b for a, b in zip(second.k_storage, first.k_storage))  # the same tensors: graphs stay valid
    assert second.manager.pools[0].num_blocks == 27
    unfixed = sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4), [5], 10, 4, dtype=torch.float32,
                                       device="cpu", storage_pool=store)
    assert all(a is b for a, b in zip(unfixed.k_storage, first.k_storage))  # fits: reused, all 27 blocks usable
    assert unfixed.manager.pools[0].num_blocks == 27


def test_the_memory_budget_caps_the_pool_and_refuses_only_prompts_that_cannot_fit(monkeypatch):
    """Without num_blocks / max_cache_tokens the pool is cut to the memory budget (faked here): every group keeps
    room for its prompts and a step of drafts; only a budget below that is refused up front."""
    sized = _request(CacheConfig(block_size=4))
    need = sizing.kv_bytes(LAYOUT, [p.num_blocks for p in sized.manager.pools], 4, torch.float32)
    monkeypatch.setattr(sizing, "available_host_memory", lambda: need)
    assert [p.num_blocks for p in _request(CacheConfig(block_size=4, cpu_memory_fraction=1.0)).manager.pools] == \
        [p.num_blocks for p in sized.manager.pools]
    capped = _request(CacheConfig(block_size=4, cpu_memory_fraction=0.7))
    assert capped.manager.pools[0].num_blocks < sized.manager.pools[0].num_blocks
    assert sizing.kv_bytes(LAYOUT, [p.num_blocks for p in capped.manager.pools], 4, torch.float32) <= 0.7 * need
    best = sizing.blocks_needed(LAYOUT, CacheConfig(block_size=4), [20, 9], 1, 4)
    assert all(p.num_blocks >= b for p, b in zip(capped.manager.pools, best))
    with pytest.raises(CacheCapacityError, match=r"prompts alone need .* CacheConfig.cpu_memory_fraction=0.01 .* "
                                                 r"raise cpu_memory_fraction"):
        _request(CacheConfig(block_size=4, cpu_memory_fraction=0.01))
    # explicit sizes are the user's choice and bypass the memory budget
    _request(CacheConfig(block_size=4, cpu_memory_fraction=0.01, max_cache_tokens=4096))


def test_own_storage_starts_small_and_grows_with_the_rows():
    """A cache without pooled storage allocates for the prompts first and grows (keeping every page) as the
    rows do, up to its pool."""
    cache = _request(CacheConfig(block_size=4), prompt_lens=(5,), max_new_tokens=1000, lookahead=0)
    assert cache.k_storage[0].shape[1] < cache.manager.pools[0].num_blocks
    cache.begin_forward([5], 5)
    cache.k_storage[0][:, :2] = 1.0
    cache.commit([5])
    for _ in range(40):
        cache.begin_forward([1], 1)
        cache.commit(cache.seq_lens)
    assert cache.k_storage[0].shape[1] >= cache.manager.pools[0].high_water
    assert (cache.k_storage[0][:, :2] == 1.0).all()


def test_free_device_memory_is_for_cuda_devices():
    assert sizing.free_device_memory(torch.device("cpu")) is None


def test_kv_bytes_counts_k_and_v_of_every_layer():
    assert sizing.kv_bytes(LAYOUT, [3, 2], 4, torch.bfloat16) == 2 * 2 * (2 * 3 * 4 * 2 * 8 + 1 * 2 * 4 * 1 * 16)


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_gpu_memory_fraction_is_validated(fraction):
    with pytest.raises(ValueError, match=r"gpu_memory_fraction must be in \(0, 1\]"):
        CacheConfig(gpu_memory_fraction=fraction)


def test_a_pooled_storage_the_request_replaces_counts_as_free_memory(monkeypatch):
    """A request larger than its owner's pooled storage frees that storage before allocating: the budget counts
    its bytes as free (else a device filled by the old pool would refuse the request)."""
    from hf_specdec.runtime.cuda_graphs import GraphStore

    store = GraphStore()
    small = sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4), [5], 4, 0, dtype=torch.float32, device="cpu",
                                     storage_pool=store)
    small.free()
    held = sum(t.numel() * t.element_size() for t in (*small.k_storage, *small.v_storage))
    best = sizing.kv_bytes(LAYOUT, sizing.blocks_needed(LAYOUT, CacheConfig(block_size=4), [20, 9], 1, 4), 4,
                           torch.float32)
    monkeypatch.setattr(sizing, "available_host_memory", lambda: best - held // 2)  # fits only with `held`
    larger = sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4, cpu_memory_fraction=1.0), [20, 9], 30, 4,
                                      dtype=torch.float32, device="cpu", storage_pool=store)
    assert larger.manager.pools[0].num_blocks >= sizing.blocks_needed(LAYOUT, CacheConfig(block_size=4), [20, 9], 1,
                                                                       4)[0]
    with pytest.raises(CacheCapacityError, match="prompts alone"):
        sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4, cpu_memory_fraction=1.0), [20, 9], 30, 4,
                                 dtype=torch.float32, device="cpu")


def test_a_capped_request_can_grow_every_group_as_far_as_the_budget_allows(monkeypatch):
    """The cap is the most new tokens per row whose cache fits (not the same share of every group's worst case,
    which ran a sliding group out long before the full one): one more token per row would not fit."""
    config = CacheConfig(block_size=4, cpu_memory_fraction=1.0)
    full = sizing.kv_bytes(LAYOUT, sizing.blocks_needed(LAYOUT, config, [20, 9], 400, 4), 4, torch.float32)
    monkeypatch.setattr(sizing, "available_host_memory", lambda: full // 3)
    capped = _request(config, max_new_tokens=400)
    pools = [p.num_blocks for p in capped.manager.pools]
    reach = next(m for m in range(1, 401) if sizing.blocks_needed(LAYOUT, config, [20, 9], m, 4) == pools)
    assert sizing.kv_bytes(LAYOUT, pools, 4, torch.float32) <= full // 3
    beyond = sizing.blocks_needed(LAYOUT, config, [20, 9], reach + 4, 4)
    assert sizing.kv_bytes(LAYOUT, beyond, 4, torch.float32) > full // 3 and reach > 100


def test_pooled_storage_is_rounded_up_within_the_budget():
    """Pooled storage (CUDA graphs) takes a power-of-two block count while the budget allows, so a slightly
    larger next request reuses it (and keeps its graphs)."""
    from hf_specdec.runtime.cuda_graphs import GraphStore

    store = GraphStore()
    first = _request(CacheConfig(block_size=4), prompt_lens=(20,), max_new_tokens=30, lookahead=4)
    need = first.manager.pools[0].num_blocks
    pooled = sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4), [20], 30, 4, dtype=torch.float32,
                                      device="cpu", storage_pool=store)
    assert pooled.k_storage[0].shape[1] == 1 << (need - 1).bit_length() > need
    generation = store.generation
    sizing.cache_for_request(LAYOUT, CacheConfig(block_size=4), [20], 33, 4, dtype=torch.float32, device="cpu",
                             storage_pool=store)
    assert store.generation == generation  # reused: no graph dropped


def test_a_fixed_num_blocks_is_still_checked_against_the_memory(monkeypatch):
    monkeypatch.setattr(sizing, "available_host_memory", lambda: 1024)
    with pytest.raises(CacheCapacityError, match=r"CacheConfig.num_blocks makes this cache .* Lower num_blocks"):
        _request(CacheConfig(block_size=4, num_blocks=64))
    _request(CacheConfig(block_size=4, num_blocks=64, max_cache_tokens=4096))  # an explicit token bound: as asked


def test_pages_on_several_devices_are_sized_within_each_devices_own_budget(monkeypatch):
    """A layout split by device (layers placed by a device_map; the meta device stands in for a second one): the
    pool is cut so that each device's pages fit that device's budget -- one device short of memory binds even when
    the whole cache would fit the input device's -- and prompts that do not fit one device are refused naming it."""
    from hf_specdec.cache import split_by_device

    split = split_by_device(LAYOUT, {0: "cpu", 1: "cpu", 2: "meta"})
    config = CacheConfig(block_size=4)
    whole = sizing.cache_for_request(split, config, [20, 9], 30, 4, dtype=torch.float32, device="cpu")
    blocks = [p.num_blocks for p in whole.manager.pools]
    per_device = sizing.kv_bytes_by_device(split, blocks, 4, torch.float32, torch.device("cpu"))
    assert set(per_device) == {torch.device("cpu"), torch.device("meta")}
    assert sum(per_device.values()) == sizing.kv_bytes(split, blocks, 4, torch.float32)
    room = {"cpu": 10 * sum(per_device.values()), "meta": per_device[torch.device("meta")] // 2}
    monkeypatch.setattr(sizing, "memory_budget", lambda device, cfg, held=0: (room[device.type], "cpu_memory_fraction"))
    capped = sizing.cache_for_request(split, config, [20, 9], 30, 4, dtype=torch.float32, device="cpu")
    got = sizing.kv_bytes_by_device(split, [p.num_blocks for p in capped.manager.pools], 4, torch.float32, "cpu")
    assert got[torch.device("meta")] <= room["meta"] < per_device[torch.device("meta")]
    room["meta"] = 1
    with pytest.raises(CacheCapacityError, match="prompts alone need .* on one of its devices"):
        sizing.cache_for_request(split, config, [20, 9], 30, 4, dtype=torch.float32, device="cpu")
    with pytest.raises(CacheCapacityError, match="num_blocks makes this cache .* on one of its devices"):
        sizing.cache_for_request(split, CacheConfig(block_size=4, num_blocks=27), [20, 9], 30, 4,
                                 dtype=torch.float32, device="cpu")
