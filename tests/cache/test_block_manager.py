import pytest
from hypothesis import given, settings, strategies as st

from hf_specdec.cache.block_manager import RELEASED, BlockManager, OutOfBlocksError


def test_block_manager_imports_no_torch():
    import ast
    import inspect

    import hf_specdec.cache.block_manager as bm

    imported = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(bm)))
                if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(inspect.getsource(bm)))
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported


def test_append_allocates_whole_blocks_and_slots_follow_tables():
    mgr = BlockManager([8], block_size=4, windows=[None])
    seq = mgr.add_sequence()
    mgr.append({seq: 6})
    table = mgr.block_table(seq, 0)
    assert len(table) == 2 and mgr.pools[0].num_free == 6
    assert mgr.slots(seq, 0, 0, 6) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4 + i for i in range(2)]
    mgr.append({seq: 2})
    assert len(mgr.block_table(seq, 0)) == 2  # 8 tokens still fit in 2 blocks


def test_truncate_returns_blocks_and_free_sequence_returns_all():
    mgr = BlockManager([8, 8], block_size=4, windows=[None, 4])
    a, b = mgr.add_sequence(), mgr.add_sequence()
    mgr.append({a: 9, b: 3})
    assert [p.num_free for p in mgr.pools] == [4, 4]
    mgr.truncate(a, 4)
    assert mgr.num_tokens(a) == 4 and [p.num_free for p in mgr.pools] == [6, 6]
    with pytest.raises(ValueError):
        mgr.truncate(a, 5)
    mgr.free_sequence(a)
    mgr.free_sequence(b)
    assert [p.num_free for p in mgr.pools] == [8, 8]


def test_slide_releases_blocks_outside_the_window_only_in_sliding_groups():
    mgr = BlockManager([16, 16], block_size=4, windows=[None, 6])
    seq = mgr.add_sequence()
    mgr.append({seq: 14})
    mgr.slide(seq)
    # next query at position 14 sees keys 9..13: block 2 (8..11) is partly visible, blocks 0-1 are not
    assert mgr.block_table(seq, 1)[:2] == [RELEASED, RELEASED]
    assert RELEASED not in mgr.block_table(seq, 1)[2:]
    assert RELEASED not in mgr.block_table(seq, 0)
    with pytest.raises(IndexError):
        mgr.slot(seq, 1, 3)
    assert mgr.slot(seq, 1, 9) >= 0


def test_out_of_blocks_is_all_or_nothing_and_names_the_knob():
    mgr = BlockManager([3], block_size=4, windows=[None])
    a, b = mgr.add_sequence(), mgr.add_sequence()
    mgr.append({a: 4})
    with pytest.raises(OutOfBlocksError, match="CacheConfig.num_blocks"):
        mgr.append({a: 4, b: 8})
    assert mgr.num_tokens(a) == 4 and mgr.num_tokens(b) == 0 and mgr.pools[0].num_free == 2


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "truncate", "slide"]), st.integers(0, 2), st.integers(0, 9)),
                max_size=40))
def test_random_operations_keep_blocks_accounted_for(ops):
    """No block is leaked or owned twice, whatever the order of appends, rollbacks and slides."""
    mgr = BlockManager([64, 64], block_size=4, windows=[None, 5])
    seqs = [mgr.add_sequence() for _ in range(3)]
    for op, row, n in ops:
        seq = seqs[row]
        if op == "append":
            mgr.append({seq: n})
        elif op == "truncate":
            mgr.truncate(seq, min(n, mgr.num_tokens(seq)))
        else:
            mgr.slide(seq)
        for g, pool in enumerate(mgr.pools):
            owned = [b for s in seqs for b in mgr.block_table(s, g) if b != RELEASED]
            assert len(owned) == len(set(owned))
            assert len(owned) + pool.num_free == pool.num_blocks
            for s in seqs:
                assert len(mgr.block_table(s, g)) == -(-mgr.num_tokens(s) // 4)
    for s in seqs:
        mgr.free_sequence(s)
    assert all(p.num_free == 64 for p in mgr.pools)
