"""build_forward_meta derives what the host used to build token by token: positions, slot mappings, key lengths and
block tables, padding rows past the batch. Checked against the block manager's own slots (the host reference), over
random appends, rollbacks and sliding windows, and the Triton body against the torch reference."""

import random

import pytest
import torch

from hf_specdec.cache import KVGroup, KVLayout, PagedKVCache, paged_cache
from hf_specdec.cache.block_manager import RELEASED
from hf_specdec.kernels.forward_meta import build_forward_meta, build_forward_meta_reference, empty_forward_buffers
from tests.kernels.conftest import run_file_cases_in_interpreter


def _cache(batch: int, block_size: int = 4, windows=(None, 6)) -> PagedKVCache:
    groups = [KVGroup(num_kv_heads=1, head_dim=4, sliding_window=w, layers=(g,)) for g, w in enumerate(windows)]
    layout = KVLayout(groups=groups, layer_slot={g: (g, 0) for g in range(len(groups))},
                      producer={g: g for g in range(len(groups))})
    return PagedKVCache(layout, [64] * len(groups), batch, block_size=block_size, dtype=torch.float32, device="cpu")


def _host_reference(cache: PagedKVCache, before: list[int], num_new: list[int], q_len: int):
    """(kv_lens, q_pos0, positions, slots per group, tables per group) computed one token at a time from the
    block manager, as the host did before the metadata moved to the device."""
    manager = cache.manager
    kv_lens = [b + n for b, n in zip(before, num_new)]
    positions, slots = [], [[] for _ in range(manager.num_groups)]
    for row, (seq, kv, n) in enumerate(zip(cache.seq_ids, kv_lens, num_new)):
        for i in range(q_len):
            pos = kv - q_len + i
            positions.append(max(pos, 0))
            for g in range(manager.num_groups):
                slots[g].append(manager.slot(seq, g, pos) if i >= q_len - n else -1)
    width = max(1, max(len(manager.block_table(s, 0)) for s in cache.seq_ids))
    tables = [[manager.block_table(s, g) + [RELEASED] * (width - len(manager.block_table(s, g)))
               for s in cache.seq_ids] for g in range(manager.num_groups)]
    return kv_lens, [k - q_len for k in kv_lens], positions, slots, tables


@pytest.mark.parametrize("path", ["derived", "host_lists"])
@pytest.mark.parametrize("seed", range(6))
def test_device_metadata_equals_the_host_reference_over_appends_rollbacks_and_windows(seed, path, monkeypatch):
    """A request's life on one cache: a left-padded prefill, then verify-like forwards of q_len slots with a random
    number of new tokens per row (0 for a stopped row), each rolled back to a random accepted length and slid. Both
    CPU paths: the derivation (build_forward_meta's reference, as on a GPU) and small forwards built from the
    host's lists."""
    monkeypatch.setattr(paged_cache, "HOST_META_SLOTS", 0 if path == "derived" else 10 ** 6)
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 5])
    cache = _cache(batch)
    prompt = [rng.randint(1, 9) for _ in range(batch)]
    steps = [(max(prompt), prompt)] + [(q, [rng.choice([0, q, q, rng.randint(0, q)]) for _ in range(batch)])
                                       for q in [rng.randint(1, 5) for _ in range(12)]]
    for q_len, num_new in steps:
        before = cache.seq_lens
        meta = cache.begin_forward(num_new, q_len)
        kv_lens, q_pos0, positions, slots, tables = _host_reference(cache, before, num_new, q_len)
        assert meta.kv_lens.tolist() == kv_lens and meta.q_pos0.tolist() == q_pos0
        assert meta.q_lens.tolist() == num_new and meta.position_ids.flatten().tolist() == positions
        assert [s.tolist() for s in meta.slot_mapping] == slots
        assert [t.tolist() for t in meta.block_tables] == tables
        assert meta.kv_lens.dtype == meta.q_pos0.dtype == meta.q_lens.dtype == meta.block_tables[0].dtype == torch.int32
        assert meta.position_ids.dtype == meta.slot_mapping[0].dtype == torch.int64
        cache.commit([b + rng.randint(0, n) for b, n in zip(before, num_new)])


def test_a_new_token_behind_the_window_is_refused():
    cache = _cache(1, windows=(4,))
    cache.begin_forward([12], 12)
    cache.commit([12])  # positions 0..7 slid out of the window: their blocks were released
    cache.manager._seqs[cache.seq_ids[0]].num_tokens = 3  # a forged length: the next token would land in block 0
    with pytest.raises(IndexError, match="slid out of group 0's window"):
        cache.begin_forward([1], 1)


def test_tables_reach_the_device_again_only_when_a_block_changed():
    cache = _cache(2)
    cache.begin_forward([3, 2], 3)
    tables = cache.begin_forward([1, 1], 1).block_tables[0]
    cache.commit([4, 3])
    sent = cache._device_tables()
    cache.begin_forward([0, 1], 1)  # row 1's 4th token fits its first block: no table changed
    assert cache._device_tables() is sent  # the tables on the device were not sent again
    version = cache.manager.version
    cache.commit([4, 4])
    cache.begin_forward([1, 1], 1)  # row 0's 5th token takes a new block
    assert cache.manager.version > version and cache._device_tables() is not sent
    assert cache.meta.block_tables[0].shape[1] == tables.shape[1] + 1


def _random_case(seed: int, device: str, groups=2, rows=3, out_rows=4, q_len=5, block_size=4):
    gen = torch.Generator().manual_seed(seed)
    before = torch.randint(0, 20, (rows,), generator=gen)
    new = torch.randint(0, q_len + 1, (rows,), generator=gen)
    width = int(-(-(before + new).max() // block_size)) + 1
    tables = torch.randint(0, 50, (groups, rows, width), generator=gen, dtype=torch.int32)
    counts = torch.stack([before, new]).to(torch.int32)
    out = empty_forward_buffers(out_rows, q_len, groups, width + 2, device)
    for t in out.values():
        t.fill_(77)  # stale values every field must overwrite
    return counts.to(device), tables.to(device), out


@pytest.mark.parametrize("seed", range(3))
def test_reference_pads_rows_past_the_batch_and_tables_past_their_width(seed):
    counts, tables, out = _random_case(seed, "cpu")
    build_forward_meta_reference(counts, tables, 5, 4, out)
    assert not out["kv_lens"][3:].any() and not out["q_lens"][3:].any() and not out["positions"][3:].any()
    assert (out["slots"].view(2, 4, 5)[:, 3] == -1).all() and (out["tables"][:, 3] == -1).all()
    assert (out["tables"][:, :3, tables.shape[2]:] == -1).all() and torch.equal(out["tables"][:, :3, :tables.shape[2]],
                                                                                tables)


@pytest.mark.parametrize("case", [dict(), dict(groups=1, rows=1, out_rows=1, q_len=1),
                                  dict(rows=8, out_rows=8, q_len=32),
                                  dict(groups=3, rows=2, out_rows=8, q_len=300, block_size=16)],
                         ids=["verify", "decode", "wide", "prefill"])
def test_triton_forward_meta_matches_the_reference(triton_device, case):
    for seed in range(3):
        counts, tables, out = _random_case(seed, triton_device, **case)
        expected = build_forward_meta_reference(counts.cpu(), tables.cpu(), case.get("q_len", 5),
                                                case.get("block_size", 4), {k: v.cpu().clone() for k, v in out.items()})
        build_forward_meta(counts, tables, case.get("q_len", 5), case.get("block_size", 4), out)
        for name, tensor in expected.items():
            assert torch.equal(out[name].cpu(), tensor), name


def test_bad_arguments_name_the_fix():
    counts, tables, out = _random_case(0, "cpu")
    with pytest.raises(ValueError, match="counts must be a contiguous"):
        build_forward_meta(counts.long(), tables, 5, 4, out)
    with pytest.raises(ValueError, match="out holds"):
        build_forward_meta(counts, tables, 5, 4, empty_forward_buffers(2, 5, 2, 9, "cpu"))
    with pytest.raises(ValueError, match="do not match"):
        build_forward_meta(counts, tables, 4, 4, out)


def test_triton_cases_of_this_file_in_interpreter(request):
    run_file_cases_in_interpreter(request, __file__, min_passed=4)


@pytest.mark.parametrize("seed", range(6))
def test_device_counts_describe_what_the_host_reference_gives_over_rollbacks_and_windows(seed):
    """plan_counts (a forward whose rows' starts and new tokens only the device knows, e.g. drafting ahead): each
    row starts up to two positions before its length and appends a random number of tokens right-aligned in the
    query slots, then commits a random part of them, while a sliding window releases blocks behind. The metadata
    is the block manager's, token by token, at those starts."""
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 5])
    cache = _cache(batch)
    prompt = [rng.randint(3, 9) for _ in range(batch)]
    cache.begin_forward(prompt, max(prompt))
    cache.commit(prompt)
    for _ in range(12):
        q_len = rng.randint(1, 4)
        lens = cache.seq_lens
        before = [max(0, n - rng.randint(0, 2)) for n in lens]
        num_new = [rng.randint(0, q_len) for _ in lens]
        meta = cache.plan_counts(torch.tensor([before, num_new], dtype=torch.int32), q_len).meta()
        kv_lens, q_pos0, positions, slots, _ = _host_reference(cache, before, num_new, q_len)
        assert meta.kv_lens.tolist() == kv_lens and meta.q_pos0.tolist() == q_pos0
        assert meta.q_lens.tolist() == num_new and meta.position_ids.flatten().tolist() == positions
        assert [s.tolist() for s in meta.slot_mapping] == slots
        cache.commit([b + rng.randint(0, n) for b, n in zip(before, num_new)])
