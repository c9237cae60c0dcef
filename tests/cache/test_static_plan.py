"""StaticPlan: a CUDA graph's static copy of its forward's counts and block tables, from which the graph derives the
metadata itself. What it derives after each load equals what the plan's own derivation writes into the graph's
buffers (``ForwardPlan.meta(rows=bucket, width=...)``), over a request's forwards, a block allocated between them, and
a smaller batch replaying the same graph after a larger one (its rows past the batch become padding again)."""

import random

import pytest
import torch

from hf_specdec.cache import KVGroup, KVLayout, PagedKVCache
from hf_specdec.cache.paged_cache import StaticPlan


def _cache(batch: int, block_size: int = 4, windows=(None, 6)) -> PagedKVCache:
    groups = [KVGroup(num_kv_heads=1, head_dim=4, sliding_window=w, layers=(g,)) for g, w in enumerate(windows)]
    layout = KVLayout(groups=groups, layer_slot={g: (g, 0) for g in range(len(groups))},
                      producer={g: g for g in range(len(groups))})
    return PagedKVCache(layout, [64] * len(groups), batch, block_size=block_size, dtype=torch.float32, device="cpu")


def _graph_plan(plan, bucket: int, width: int) -> StaticPlan:
    """What a graph keeps at its capture: the static metadata and the plan's counts and tables."""
    return StaticPlan(*StaticPlan.inputs_for(plan, bucket, width), plan.q_len, plan.block_size,
                      plan.meta(rows=bucket, width=width))


def _assert_same(derived, expected, rows: int) -> None:
    """The real rows alike in every field; the padding rows with no query, no key, no slot and no page."""
    for name in ("kv_lens", "q_pos0", "q_lens", "positions"):
        assert torch.equal(derived.buffers[name][:rows], expected.buffers[name][:rows]), name
    for name in ("kv_lens", "q_lens", "positions"):
        assert not derived.buffers[name][rows:].any(), name
    assert torch.equal(derived.buffers["slots"], expected.buffers["slots"])
    assert torch.equal(derived.buffers["tables"], expected.buffers["tables"])


@pytest.mark.parametrize("seed", range(4))
def test_derived_metadata_follows_every_load(seed):
    rng = random.Random(seed)
    bucket, width, q_len = 4, 8, 3
    big, small = _cache(3), _cache(2)
    for cache in (big, small):
        cache.begin_forward([5] * cache.batch_size, 5)
        cache.commit([5] * cache.batch_size)
    graph = None
    for step in range(10):
        cache = big if step < 4 or step >= 7 else small  # a smaller batch replays the graph, then the larger again
        before = cache.seq_lens
        num_new = [rng.choice([0, q_len, rng.randint(0, q_len)]) for _ in before]
        plan = cache.plan_forward(num_new, q_len)
        if graph is None:
            graph = _graph_plan(plan, bucket, width)
        else:
            for t in graph.meta.buffers.values():
                t.fill_(77)  # what the last replay left: every field is rewritten
            graph.load(plan)
        derived = graph.derive()
        _assert_same(derived, plan.meta(rows=bucket, width=width), cache.batch_size)
        cache.commit([b + rng.randint(0, n) for b, n in zip(before, num_new)])  # new blocks now and then


def test_a_plan_wider_than_the_graph_is_refused():
    cache = _cache(1)
    cache.begin_forward([9], 9)  # three blocks of 4
    cache.commit([9])
    graph = _graph_plan(cache.plan_forward([1], 3), 2, 3)
    cache.commit([10])
    with pytest.raises(RuntimeError, match="does not fit a graph"):
        graph.load(cache.plan_forward([3], 3))  # a fourth block: wider than the graph's tables
