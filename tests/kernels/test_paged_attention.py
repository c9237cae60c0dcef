"""paged_attention: reference == dense attention built straight from the pages, Triton == reference.

Every case shuffles the physical blocks, gives rows different kv_lens, and poisons the table entries
that no query can see (unused tail, released window blocks) with -1, an out-of-range id, or the id of
a block of NaNs: a kernel that dereferences one reads garbage, raises, or outputs NaN.
"""

import importlib
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hf_specdec.kernels import paged_attention, paged_attention_reference, use_triton
from hf_specdec.kernels.paged_attention import (NO_SPLIT, _paged_attention_triton, _pick_tiles, kv_chunk, num_kv_splits,
                                                paged_attention_rows)

pa = importlib.import_module("hf_specdec.kernels.paged_attention")  # the package exports the function by that name
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
FAR_BLOCK = 10**6  # poison that makes torch indexing raise if a kernel dereferences it
NAN_BLOCK = "nan block"  # poison naming a block of NaNs: any read of it shows, even when masked later


@dataclass
class PagedCase:
    q: torch.Tensor  # [batch, q_len, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks_per_row] int32
    kv_lens: torch.Tensor  # [batch] int32
    q_pos0: torch.Tensor  # [batch] int32
    q_lens: torch.Tensor  # [batch] int32

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.kv_lens, self.q_pos0, self.q_lens)


def make_case(kv_lens, q_len, q_lens=None, q_pos0=None, *, num_heads=4, num_kv_heads=2, head_dim=16,
              block_size=4, dtype=torch.float32, sliding_window=None, poison=FAR_BLOCK, seed=0,
              device="cpu") -> PagedCase:
    """Random pages for rows of `kv_lens` keys; q_pos0 defaults to kv_len - q_len (new tokens last)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(kv_lens)
    q_lens = q_lens if q_lens is not None else [q_len] * batch
    q_pos0 = q_pos0 if q_pos0 is not None else [n - q_len for n in kv_lens]
    blocks_per_row = max(kv_lens) // block_size + 2  # always some unused tail
    num_blocks = batch * blocks_per_row + 3  # two blocks belong to no row; the last one is all NaN
    table = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_row].view(batch, blocks_per_row)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache[-1] = math.nan
        for b, kv_len in enumerate(kv_lens):  # never-written slots of a row's last block: garbage (torch.empty)
            cache[table[b, kv_len // block_size], kv_len % block_size:] = math.nan
    poison = num_blocks - 1 if poison == NAN_BLOCK else poison
    for b in range(batch):
        table[b, math.ceil(kv_lens[b] / block_size):] = poison
        if sliding_window is not None:  # released: every key below the first valid query's window
            first_visible = max(0, q_pos0[b] + q_len - q_lens[b] - sliding_window + 1)
            table[b, : first_visible // block_size] = poison
    q = torch.randn(batch, q_len, num_heads, head_dim, generator=gen).to(dtype)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return PagedCase(q.to(device), k_cache.to(device), v_cache.to(device), table.to(torch.int32).to(device),
                     as_int(kv_lens), as_int(q_pos0), as_int(q_lens))


def dense_attention(case: PagedCase, *, scale, sliding_window=None, causal=True, sinks=None) -> torch.Tensor:
    """fp64 attention of each valid query over exactly its visible keys, read page by page (``sinks``: each head's
    logit joins the softmax and its share is dropped, as gpt-oss's eager attention computes)."""
    q, table = case.q.double().cpu(), case.block_tables.cpu()
    k_cache, v_cache = case.k_cache.double().cpu(), case.v_cache.double().cpu()
    batch, q_len, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.zeros_like(q)
    for b in range(batch):
        kv_len, pos0, num_valid = int(case.kv_lens[b]), int(case.q_pos0[b]), int(case.q_lens[b])
        for i in range(q_len - num_valid, q_len):
            p = pos0 + i
            keys = [j for j in range(kv_len)
                    if (not causal or j <= p) and (sliding_window is None or j > p - sliding_window)]
            if not keys:
                continue
            blocks = table[b, [j // block_size for j in keys]].long()
            offsets = torch.tensor([j % block_size for j in keys])
            k = k_cache[blocks, offsets][:, kv_head]  # [num_keys, num_heads, head_dim]
            v = v_cache[blocks, offsets][:, kv_head]
            scores = torch.einsum("nhd,hd->hn", k, q[b, i]) * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().cpu()[:, None]], dim=-1)
            probs = torch.softmax(scores, dim=-1)[:, :len(keys)]
            out[b, i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def assert_matches_dense(case, out, *, scale, sliding_window=None, causal=True, sinks=None):
    expected = dense_attention(case, scale=scale, sliding_window=sliding_window, causal=causal, sinks=sinks)
    assert expected.abs().sum() > 0, "degenerate case: no query sees a key"
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------- reference vs dense

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_reference_prefill_left_padded(dtype, sliding_window):
    # Row 1 continues after a 5-token prefix (chunked prefill); row 2 is mostly padding.
    case = make_case([7, 10, 2], q_len=7, q_lens=[7, 5, 2], dtype=dtype, sliding_window=sliding_window)
    out = paged_attention_reference(*case.args(), scale=16**-0.5, sliding_window=sliding_window)
    assert_matches_dense(case, out, scale=16**-0.5, sliding_window=sliding_window)
    assert (out[1, :2] == 0).all() and (out[2, :5] == 0).all(), "left-padding slots must output 0"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (4, 4, 16), (8, 2, 16), (32, 4, 16), (32, 16, 16), (6, 2, 16),
    (8, 2, 32), (8, 2, 64), (8, 2, 80), (8, 2, 128), (8, 2, 256), (8, 2, 512),
])
def test_reference_decode_gqa_and_head_dims(num_heads, num_kv_heads, head_dim):
    case = make_case([9, 17, 33], q_len=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    out = paged_attention_reference(*case.args(), scale=head_dim**-0.5)
    assert_matches_dense(case, out, scale=head_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_reference_verify_causal_per_row_offsets(dtype, sliding_window):
    case = make_case([12, 21, 5], q_len=4, num_heads=8, num_kv_heads=2, dtype=dtype,
                     sliding_window=sliding_window, seed=1)
    out = paged_attention_reference(*case.args(), scale=1.0, sliding_window=sliding_window)
    assert_matches_dense(case, out, scale=1.0, sliding_window=sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_reference_q_only_query_after_last_key(sliding_window):
    kv_lens = [9, 14, 4]
    case = make_case(kv_lens, q_len=1, q_pos0=kv_lens, sliding_window=sliding_window, seed=2)
    out = paged_attention_reference(*case.args(), scale=0.25, sliding_window=sliding_window)
    assert_matches_dense(case, out, scale=0.25, sliding_window=sliding_window)


@pytest.mark.parametrize("poison", [FAR_BLOCK, NAN_BLOCK])
@pytest.mark.parametrize("q_len", [1, 3, 10])
def test_reference_sliding_window_never_reads_released_blocks(q_len, poison):
    case = make_case([30, 45, 13], q_len=q_len, sliding_window=8, block_size=4, poison=poison, seed=3)
    assert (case.block_tables[:2, :2] == case.block_tables[0, 0]).all(), "the case must release blocks"
    out = paged_attention_reference(*case.args(), scale=0.25, sliding_window=8)
    assert_matches_dense(case, out, scale=0.25, sliding_window=8)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_reference_bidirectional_block(sliding_window):
    # DFlash-style: a block of queries sees every context key (and each other), window still applies.
    case = make_case([11, 20, 4], q_len=4, sliding_window=sliding_window, seed=4)
    out = paged_attention_reference(*case.args(), scale=0.25, sliding_window=sliding_window, causal=False)
    assert_matches_dense(case, out, scale=0.25, sliding_window=sliding_window, causal=False)


def test_reference_queries_without_keys_output_zero():
    # Row 0: empty row with a valid query; row 1: all padding; row 2: normal decode.
    case = make_case([0, 6, 9], q_len=2, q_lens=[2, 0, 2], q_pos0=[0, 4, 7], seed=5)
    out = paged_attention_reference(*case.args(), scale=0.25)
    assert torch.isfinite(out).all()
    assert (out[:2] == 0).all() and (out[2] != 0).any()
    assert_matches_dense(case, out, scale=0.25)


def test_reference_strided_q_and_out():
    case = make_case([9, 17], q_len=3, num_heads=8, seed=6)
    q_heads_first = case.q.transpose(1, 2).contiguous()  # HF layout [batch, num_heads, q_len, head_dim]
    case.q = q_heads_first.transpose(1, 2)
    out = torch.full_like(q_heads_first, float("nan")).transpose(1, 2)
    returned = paged_attention(*case.args(), scale=0.25, out=out)
    assert returned is out
    assert_matches_dense(case, out, scale=0.25)


def test_cpu_dispatch_is_the_reference_where_rows_decline(monkeypatch):
    monkeypatch.delenv("HF_SPECDEC_FORCE_TRITON", raising=False)
    case = make_case([9, 17], q_len=5, q_lens=[3, 5], seed=7)  # a left-padded row: the per-row path declines
    assert not use_triton(case.q)
    torch.testing.assert_close(paged_attention(*case.args(), scale=0.25, sliding_window=4),
                               paged_attention_reference(*case.args(), scale=0.25, sliding_window=4),
                               atol=0, rtol=0)


def with_consecutive_blocks(case: PagedCase) -> PagedCase:
    """The same rows with each row's pages moved to consecutive blocks (as the pool hands them out at batch 1);
    poisoned table entries stay as they are."""
    table = case.block_tables.clone()
    num_blocks = case.k_cache.shape[0]
    k_cache, v_cache = torch.full_like(case.k_cache, math.nan), torch.full_like(case.v_cache, math.nan)
    k_cache[-1], v_cache[-1] = case.k_cache[-1], case.v_cache[-1]
    for b in range(table.shape[0]):
        for j in range(table.shape[1]):
            old = int(table[b, j])
            if 0 <= old < num_blocks - 1:
                new = b * table.shape[1] + j
                k_cache[new], v_cache[new], table[b, j] = case.k_cache[old], case.v_cache[old], new
    return PagedCase(case.q, k_cache, v_cache, table, case.kv_lens, case.q_pos0, case.q_lens)


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("kv_lens,q_len,q_pos0,sliding_window,causal", [
    ([17], 1, None, None, True),  # decode
    ([17], 1, None, 6, True),
    ([9, 23, 14], 1, None, 5, True),
    ([21], 4, None, 6, True),  # verify
    ([9, 23, 14], 4, None, None, True),
    ([9, 23, 14], 4, None, 6, True),
    ([12, 20], 1, [12, 20], 4, True),  # a drafter's query one position after the last cached key
    ([12, 20], 5, [8, 16], None, False),  # a bidirectional block
    ([12, 20], 5, [8, 16], 7, False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rows_path_matches_dense_and_reference(consecutive, kv_lens, q_len, q_pos0, sliding_window, causal,
                                                   dtype):
    case = make_case(kv_lens, q_len, q_pos0=q_pos0, num_heads=8, dtype=dtype, sliding_window=sliding_window,
                     poison=NAN_BLOCK, seed=len(kv_lens) + q_len)
    if consecutive:
        case = with_consecutive_blocks(case)
    out = torch.full_like(case.q, math.nan)
    assert paged_attention_rows(*case.args(), scale=0.3, sliding_window=sliding_window, causal=causal, out=out)
    assert_matches_dense(case, out, scale=0.3, sliding_window=sliding_window, causal=causal)
    reference = paged_attention_reference(*case.args(), scale=0.3, sliding_window=sliding_window, causal=causal)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference, atol=tol, rtol=tol)
    dispatched = paged_attention(*case.args(), scale=0.3, sliding_window=sliding_window, causal=causal)
    # the CPU dispatch takes this path for one row, the reference for several
    torch.testing.assert_close(dispatched, out if len(kv_lens) == 1 else reference, atol=0, rtol=0)


@pytest.mark.parametrize("q_lens,q_pos0,sliding_window", [
    ([3, 5], None, None),  # a left-padded prefill row
    ([1], [40], 4),  # the one query is past every key of its window
])
def test_cpu_rows_path_declines_and_writes_nothing(q_lens, q_pos0, sliding_window):
    case = make_case([9, 17][:len(q_lens)], q_len=max(q_lens), q_lens=q_lens, q_pos0=q_pos0, seed=3)
    out = torch.full_like(case.q, math.nan)
    assert not paged_attention_rows(*case.args(), scale=0.3, sliding_window=sliding_window, causal=True, out=out)
    assert out.isnan().all()


@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("q_lens,q_len,sliding_window,chunk", [
    ([13], 13, None, 256),  # one row: causal, no mask
    ([13, 6, 9], 13, None, 256),  # left-padded rows
    ([13, 6, 9], 13, 20, 256),  # a window longer than the prompt: plain causal
    ([13, 6, 9], 13, 4, 256),  # a window inside the prompt: one band of keys
    ([13, 6, 9], 13, 4, 3),  # in chunks of 3 queries over their keys and the window before them
    ([17, 1], 17, 5, 4),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prompt_path_matches_dense_and_reference(consecutive, q_lens, q_len, sliding_window, chunk, dtype,
                                                     monkeypatch):
    """A prompt's causal forward on CPU (every row's keys are its own valid queries', positions from 0): causal SDPA
    per row, a window's layer in bands of chunks; padding slots output exactly 0."""
    monkeypatch.setattr(pa, "PROMPT_CHUNK", chunk)
    case = make_case(q_lens, q_len, q_lens=q_lens, q_pos0=[n - q_len for n in q_lens], num_heads=8, dtype=dtype,
                     sliding_window=sliding_window, poison=NAN_BLOCK, seed=len(q_lens) + q_len)
    if consecutive:
        case = with_consecutive_blocks(case)
    out = torch.full_like(case.q, math.nan)
    assert pa.paged_attention_prompt(*case.args(), scale=0.3, sliding_window=sliding_window, out=out)
    assert_matches_dense(case, out, scale=0.3, sliding_window=sliding_window)
    for b, n in enumerate(q_lens):
        assert (out[b, :q_len - n] == 0).all()
    reference = paged_attention_reference(*case.args(), scale=0.3, sliding_window=sliding_window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference, atol=tol, rtol=tol)
    dispatched = paged_attention(*case.args(), scale=0.3, sliding_window=sliding_window)
    torch.testing.assert_close(dispatched, out, atol=0, rtol=0)


@pytest.mark.parametrize("kv_lens,q_lens,q_len,q_pos0", [
    ([9, 17], [5, 5], 5, None),  # a verify: keys cached before its queries
    ([5, 12], [5, 5], 5, [0, 0]),  # a row with more keys than queries
    ([5, 3], [5, 3], 5, [0, 0]),  # a padded row whose first valid query is not at position 0
])
def test_cpu_prompt_path_declines_and_writes_nothing(kv_lens, q_lens, q_len, q_pos0):
    case = make_case(kv_lens, q_len, q_lens=q_lens, q_pos0=q_pos0, seed=5)
    out = torch.full_like(case.q, math.nan)
    assert not pa.paged_attention_prompt(*case.args(), scale=0.3, sliding_window=None, out=out)
    assert out.isnan().all()


def test_the_cpu_plan_from_host_lists_is_the_tensor_plan():
    """The reference's plan (slots, visibility, which queries see a key) built from host lists on the CPU equals
    the one built by tensor ops, over random lengths, offsets, windows, padded and empty rows, released blocks and
    tables of any width."""
    from hf_specdec.kernels.paged_attention import _build_plan

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        batch, q_len, block_size = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((1, 6), (1, 6), (1, 9)))
        kv_lens = torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int32)
        q_lens = torch.randint(0, q_len + 1, (batch,), generator=gen, dtype=torch.int32)
        q_pos0 = (kv_lens - q_len + torch.randint(-3, 2, (batch,), generator=gen)).to(torch.int32)
        width = int(torch.randint(0, 45 // block_size + 2, (), generator=gen))
        tables = torch.randint(-1, 50, (batch, width), generator=gen, dtype=torch.int32)
        window = [None, 1, 3, 8][int(torch.randint(0, 4, (), generator=gen))]
        for causal in (True, False):
            args = (tables, kv_lens, q_pos0, q_lens, q_len, block_size, window, causal)
            (slots, visible, sees), (slots_t, visible_t, sees_t) = _build_plan(*args, host=True), _build_plan(
                *args, host=False)
            assert torch.equal(visible, visible_t), args
            assert (sees is None) == (sees_t is None) and (sees is None or torch.equal(sees, sees_t)), args
            assert torch.equal(slots.view(batch, -1), slots_t.view(batch, -1)), args


def _kept_masks(module, kv_lens):
    return [mask for _, plan in module.kept_plans(kv_lens).values()
            for mask in plan[1].__dict__.get(module.KEPT_MASKS, {}).values()]


def test_the_reference_keeps_a_decode_mask_for_the_next_layers_and_computes_a_long_one_each_call(monkeypatch):
    """The reference's additive mask, kept with its forward's plan for the other layers of that forward, gives the
    bit-identical output of the boolean mask built per call (what a prefill over the kept size still uses): padded
    rows, a window, a row whose only query sees no key."""
    import sys

    module = sys.modules[paged_attention_reference.__module__]
    case = make_case([9, 14, 3], 3, q_lens=[3, 2, 0], sliding_window=4)
    kept = paged_attention_reference(*case.args(), scale=0.3, sliding_window=4)
    assert [mask.shape[0] for mask in _kept_masks(module, case.kv_lens)] == [3]
    monkeypatch.setattr(module, "MAX_KEPT_MASK", 0)
    per_call = paged_attention_reference(*case.args(), scale=0.3, sliding_window=4)
    assert torch.equal(kept, per_call) and len(_kept_masks(module, case.kv_lens)) == 1  # the plan's, none more
    torch.testing.assert_close(kept, dense_attention(case, scale=0.3, sliding_window=4).float(), rtol=1e-5, atol=1e-5)


def test_plans_and_masks_go_with_their_forwards_metadata():
    """Nothing the reference keeps outlives the forward's metadata: once a forward's metadata tensors are gone,
    so are its plans and masks (a long run holds no more tensors than its first calls)."""
    import gc
    import sys
    import weakref

    module = sys.modules[paged_attention_reference.__module__]
    case = make_case([9, 14, 3], 3, q_lens=[3, 2, 0], sliding_window=4)
    paged_attention_reference(*case.args(), scale=0.3, sliding_window=4)
    (_, plan), = module.kept_plans(case.kv_lens).values()
    visible = weakref.ref(plan[1])
    mask = weakref.ref(_kept_masks(module, case.kv_lens)[0])
    del plan, case
    gc.collect()
    assert visible() is None and mask() is None


# ---------------------------------------------------------------- Triton vs reference

def assert_triton_matches_reference(case, *, scale, sliding_window=None, causal=True, block_n=None):
    expected = paged_attention_reference(*case.args(), scale=scale, sliding_window=sliding_window, causal=causal)
    if block_n is None:
        assert use_triton(case.q)
        out = paged_attention(*case.args(), scale=scale, sliding_window=sliding_window, causal=causal)
    else:
        out = _paged_attention_triton(*case.args(), scale=scale, sliding_window=sliding_window, causal=causal,
                                      out=torch.empty_like(case.q), block_n=block_n)
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert expected.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_left_padded(triton_device, dtype):
    case = make_case([7, 10, 2], q_len=7, q_lens=[7, 5, 2], dtype=dtype, poison=NAN_BLOCK, device=triton_device)
    assert_triton_matches_reference(case, scale=0.25)


def _prompt_case(dtype, sliding_window, cached, q_len, head_dim, device):
    """Three rows of a prompt launch (left padded) after ``cached`` keys each, GQA 8 / 2."""
    lens = [cached + q_len, cached + q_len * 2 // 3, cached + 5]
    return make_case(lens, q_len=q_len, q_lens=[n - cached for n in lens], num_heads=8, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype, sliding_window=sliding_window,
                     block_size=4 if head_dim < 64 else 16, poison=NAN_BLOCK, seed=11, device=device)


def _check_prompt_launch(case, sliding_window, monkeypatch, tol=None):
    """The launch runs without split-KV chunks (no merge: chunks of 4 keys would need one) and matches the
    reference (within ``tol``, default the dtype's)."""
    monkeypatch.setattr(pa, "kv_chunk", lambda *args: 4)

    class NoMerge:
        def __getitem__(self, grid):
            raise AssertionError("a prompt's launch ran split-KV chunks")

    monkeypatch.setattr(pa, "_merge_splits_kernel", NoMerge())
    assert use_triton(case.q) and pa.is_prefill(case.q.shape[1])
    expected = paged_attention_reference(*case.args(), scale=0.25, sliding_window=sliding_window)
    out = paged_attention(*case.args(), scale=0.25, sliding_window=sliding_window,
                          out=torch.full_like(case.q, float("nan")))
    tol = TOLERANCE[case.q.dtype] if tol is None else tol
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert expected.abs().sum() > 0


@pytest.mark.parametrize("sliding_window,cached", [(None, 0), (24, 0), (24, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prompt_launch_matches_reference(triton_device, dtype, sliding_window, cached, monkeypatch):
    """A prompt's launch (PREFILL_QUERIES queries a row or more: no split-KV chunks, taller query tiles), left
    padded, past a sliding window, with and without keys cached before it (a prompt after a prefix)."""
    monkeypatch.setattr(pa, "PREFILL_QUERIES", 16)  # the interpreter's pace: a 20-query launch takes the shape
    case = _prompt_case(dtype, sliding_window, cached, 20, 16, triton_device)
    tiles = _pick_tiles(16, 4, 20, ieee=dtype == torch.float32)
    assert tiles.block_m == (32 if dtype == torch.float32 else 64)
    _check_prompt_launch(case, sliding_window, monkeypatch)


def test_prompt_tiles_keep_decode_heights_where_shared_memory_is_small(monkeypatch):
    """A GPU that gives a program ~99 KB of shared memory (sm_86/89/120) keeps the decode step's tile heights for a
    prompt (the taller tiles need ~128 KB at head_dim 256); Hopper's 227 KB takes them; known once per GPU."""
    asked = []
    try:
        for shared, rows, block_m in ((101376, 1, 32), (232448, pa.PREFILL_ROWS, 64)):
            pa._prompt_rows_on.cache_clear()
            monkeypatch.setattr(pa, "shared_memory_bytes", lambda index, shared=shared: asked.append(index) or shared)
            device = torch.device("cuda", 5)
            assert pa.prompt_rows(device) == rows and pa.prompt_rows(device) == rows
            assert _pick_tiles(256, 8, 512, prompt_rows=pa.prompt_rows(device)).block_m == block_m
    finally:
        pa._prompt_rows_on.cache_clear()  # the fake GPU's answers go
    assert asked == [5, 5]  # once per GPU
    assert pa.prompt_rows(torch.device("cpu")) == pa.PREFILL_ROWS  # the interpreter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real head dims in the interpreter take minutes")
@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_launch_at_real_head_dims_on_the_gpu(dtype, head_dim, monkeypatch):
    """The prompt launch's real tiles (64 query rows at head_dim 128 and 256 in half precision, 16 at 512) at a
    real prompt width, past a sliding window, after a cached prefix."""
    case = _prompt_case(dtype, 48, 16, pa.PREFILL_QUERIES + 36, head_dim, "cuda")
    # fp32 at head_dim 512: a 512-wide row's dots, summed in the kernel's order over its key tiles, differ from the
    # reference's by up to 2.5e-5 (measured on an H200), past the 1e-5 that 128 and 256 keep
    _check_prompt_launch(case, 48, monkeypatch, tol=1e-4 if dtype == torch.float32 and head_dim == 512 else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_verify_gqa_head_dim_80(triton_device, dtype):
    case = make_case([12, 21, 5], q_len=4, num_heads=8, num_kv_heads=2, head_dim=80, dtype=dtype,
                     poison=NAN_BLOCK, seed=1, device=triton_device)
    assert_triton_matches_reference(case, scale=1.0)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_triton_fp32_verify_tiles_of_wide_heads(triton_device, head_dim):
    """fp32 verify tiles of 32 query rows at head_dim 128 and 256 take their own settings (8 warps, 16 keys a step at
    256: the bf16 ones spilled registers on fp32 dots); they attend like the reference."""
    tiles = _pick_tiles(head_dim, 4, 8, ieee=True)
    assert tiles.block_m == 32 and tiles.num_warps == 8 and tiles != _pick_tiles(head_dim, 4, 8)
    case = make_case([12, 30], q_len=8, num_heads=4, num_kv_heads=1, head_dim=head_dim, dtype=torch.float32,
                     poison=NAN_BLOCK, seed=7, device=triton_device)
    assert_triton_matches_reference(case, scale=head_dim**-0.5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype", [
    (8, 2, 16, torch.float32), (32, 4, 80, torch.bfloat16), (32, 16, 32, torch.float16), (6, 2, 16, torch.float32),
])
def test_triton_decode(triton_device, num_heads, num_kv_heads, head_dim, dtype):
    case = make_case([9, 17, 33], q_len=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, poison=NAN_BLOCK, seed=2, device=triton_device)
    assert_triton_matches_reference(case, scale=head_dim**-0.5)


def test_triton_q_only_query_after_last_key(triton_device):
    kv_lens = [9, 14, 4]
    case = make_case(kv_lens, q_len=1, q_pos0=kv_lens, poison=-1, seed=3, device=triton_device)
    assert_triton_matches_reference(case, scale=0.25)


@pytest.mark.parametrize("dtype,block_n,sliding_window,poison", [
    (torch.float32, None, 8, -1), (torch.bfloat16, None, 8, NAN_BLOCK), (torch.float32, 16, 20, NAN_BLOCK),
])
def test_triton_sliding_window_released_blocks(triton_device, dtype, block_n, sliding_window, poison):
    # Rows longer than one 64-key step, so the loop must start inside the window.
    case = make_case([90, 45, 13], q_len=3, sliding_window=sliding_window, block_size=4, dtype=dtype,
                     poison=poison, seed=4, device=triton_device)
    assert (case.block_tables[0, :15] == case.block_tables[0, 0]).all(), "row 0 must release blocks"
    assert_triton_matches_reference(case, scale=0.25, sliding_window=sliding_window, block_n=block_n)


def test_triton_bidirectional_block(triton_device):
    case = make_case([11, 20, 4], q_len=4, sliding_window=5, poison=NAN_BLOCK, seed=5, device=triton_device)
    assert_triton_matches_reference(case, scale=0.25, sliding_window=5, causal=False)


def test_triton_queries_without_keys_output_zero(triton_device):
    case = make_case([0, 6, 9], q_len=2, q_lens=[2, 0, 2], q_pos0=[0, 4, 7], poison=-1, seed=6,
                     device=triton_device)
    out = paged_attention(*case.args(), scale=0.25, out=torch.full_like(case.q, float("nan")))
    assert torch.isfinite(out).all() and (out[:2] == 0).all()
    assert_triton_matches_reference(case, scale=0.25)


def test_triton_strided_q_and_out(triton_device):
    case = make_case([9, 17], q_len=3, num_heads=8, seed=7, poison=NAN_BLOCK, device=triton_device)
    case.q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty_like(case.q.transpose(1, 2)).transpose(1, 2)
    paged_attention(*case.args(), scale=0.25, out=out)
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), scale=0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len,sliding_window,causal,chunk", [
    (1, None, True, 64), (1, None, True, 16), (4, None, True, 32), (3, 20, True, 16), (4, 5, False, 16),
])
def test_triton_split_kv_matches_reference(triton_device, q_len, sliding_window, causal, chunk):
    # Rows long enough that every chunk holds keys for some rows and none for the short row 2.
    case = make_case([150, 97, 13], q_len=q_len, sliding_window=sliding_window, num_heads=8, num_kv_heads=2,
                     poison=NAN_BLOCK, seed=8, device=triton_device)
    expected = paged_attention_reference(*case.args(), scale=0.25, sliding_window=sliding_window, causal=causal)
    out = _paged_attention_triton(*case.args(), scale=0.25, sliding_window=sliding_window, causal=causal,
                                  out=torch.full_like(case.q, float("nan")), block_n=16, kv_chunk_keys=chunk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window,chunk", [(None, NO_SPLIT), (None, 16), (20, 16), (20, 32)])
def test_triton_verify_queries_equal_decode_queries(triton_device, sliding_window, chunk):
    """Batch invariance: each query of a 4-query verify launch has the bits of a one-query decode launch at its
    position (tiles of the same height, so only the key ranges, chunks and merge differ), and a wider block
    table changes nothing."""
    lens = [150, 97]
    case = make_case(lens, q_len=4, sliding_window=sliding_window, num_heads=8, num_kv_heads=2, seed=9,
                     device=triton_device)
    run = dict(scale=0.25, sliding_window=sliding_window, causal=True, block_n=16, kv_chunk_keys=chunk)
    verify = _paged_attention_triton(*case.args(), out=torch.empty_like(case.q), **run)
    for i in range(4):
        kv_lens = case.kv_lens - 3 + i  # the decode step of query i sees the keys up to its own position
        for tables in (case.block_tables, F.pad(case.block_tables, (0, 5), value=-1)):
            args = (case.q[:, i:i + 1].contiguous(), case.k_cache, case.v_cache, tables, kv_lens,
                    kv_lens - 1, torch.ones_like(kv_lens))
            decode = _paged_attention_triton(*args, out=torch.empty_like(case.q[:, :1]), **run)
            if case.q.is_cuda:
                assert torch.equal(decode[:, 0], verify[:, i]), (i, (decode[:, 0] - verify[:, i]).abs().max())
            else:
                # the interpreter's dots are numpy matmuls, whose BLAS kernel (picked by the CPU) may sum a row's
                # products in another order at another row of the tile: bits there are the CPU's, not the kernel's
                torch.testing.assert_close(decode[:, 0], verify[:, i], atol=2e-6, rtol=2e-6)


def test_wide_key_steps_for_decode_and_verify_tiles(monkeypatch):
    """Half-precision decode and verify tiles at head_dim 256 and 512 walk WIDE_KEY_STEPS keys a step, two stages deep,
    where the GPU's programs may take the shared memory; both launches of a layer take the same steps (batch
    invariance); a prompt's launch, fp32 tiles and head_dim 128 keep theirs; known once per GPU."""
    for head_dim, group in ((256, 8), (512, 4)):
        decode, verify = (_pick_tiles(head_dim, group, q_len, wide_steps=True) for q_len in (1, 8))
        assert decode.block_n == verify.block_n == pa.WIDE_KEY_STEPS == 64
        assert decode.num_stages == verify.num_stages == pa.WIDE_KEY_STAGES
        assert _pick_tiles(head_dim, group, 1).block_n == 32 and _pick_tiles(head_dim, group, 1).num_stages is None
        assert _pick_tiles(head_dim, group, pa.PREFILL_QUERIES, wide_steps=True).block_n < 64
        assert _pick_tiles(head_dim, group, 1, ieee=True, wide_steps=True) == _pick_tiles(head_dim, group, 1, ieee=True)
    assert _pick_tiles(128, 8, 1, wide_steps=True) == _pick_tiles(128, 8, 1)
    monkeypatch.setattr(pa, "WIDE_KEY_STEPS", 0)
    assert _pick_tiles(256, 8, 1, wide_steps=True) == _pick_tiles(256, 8, 1)
    asked = []
    try:
        for shared, wide in ((101376, False), (232448, True)):
            pa._wide_key_steps_on.cache_clear()
            monkeypatch.setattr(pa, "shared_memory_bytes", lambda index, shared=shared: asked.append(index) or shared)
            device = torch.device("cuda", 3)
            assert pa.wide_key_steps(device) is wide and pa.wide_key_steps(device) is wide
    finally:
        pa._wide_key_steps_on.cache_clear()  # the fake GPU's answers go
    assert asked == [3, 3]  # once per GPU
    assert pa.wide_key_steps(torch.device("cpu"))  # the interpreter


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_triton_wide_key_steps_attend_like_the_reference_and_decode_like_verify(triton_device, sliding_window):
    """bf16 at head_dim 256 with the launcher's own tiles (64-key steps) and chunks: a decode and a 4-query verify
    launch attend like the reference, and each verify query has its decode launch's output."""
    lens = [150, 71]
    case = make_case(lens, q_len=4, sliding_window=sliding_window, num_heads=2, num_kv_heads=1, head_dim=256,
                     dtype=torch.bfloat16, poison=NAN_BLOCK, seed=10, device=triton_device)
    assert _pick_tiles(256, 2, 4, wide_steps=pa.wide_key_steps(case.q.device)).block_n == 64
    run = dict(scale=0.0625, sliding_window=sliding_window, causal=True)
    verify = _paged_attention_triton(*case.args(), out=torch.full_like(case.q, float("nan")), **run)
    torch.testing.assert_close(verify, paged_attention_reference(*case.args(), **run), atol=1e-2, rtol=1e-2)
    assert_verify_queries_are_decode_queries(case, verify, run, tol=1e-2)


def assert_verify_queries_are_decode_queries(case, verify, run, tol):
    """Each query i of a verify launch ``verify`` over ``case`` (4 queries a row, ending at the rows' kv_lens) has the
    bits of a one-query decode launch at its position on the GPU (within ``tol`` in the interpreter, whose dots are
    numpy's: see test_triton_verify_queries_equal_decode_queries)."""
    for i in range(4):
        kv_lens = case.kv_lens - 3 + i
        args = (case.q[:, i:i + 1].contiguous(), case.k_cache, case.v_cache, case.block_tables, kv_lens,
                kv_lens - 1, torch.ones_like(kv_lens))
        decode = _paged_attention_triton(*args, out=torch.empty_like(case.q[:, :1]), **run)
        if case.q.is_cuda:
            assert torch.equal(decode[:, 0], verify[:, i]), (i, (decode[:, 0] - verify[:, i]).abs().max())
        else:
            torch.testing.assert_close(decode[:, 0], verify[:, i], atol=tol, rtol=tol)


def test_chunks_depend_on_batch_and_heads_only():
    assert kv_chunk(rows_x_kv_heads=4, block_n=32) == 64  # full layer, batch 1: at least 64 keys per chunk
    assert kv_chunk(rows_x_kv_heads=16, block_n=32) == 128  # ~16 chunks of a 2048-key context
    assert kv_chunk(rows_x_kv_heads=64, block_n=64) == 512
    assert kv_chunk(rows_x_kv_heads=132, block_n=64) == NO_SPLIT  # the pairs fill the GPU already
    assert num_kv_splits(64, max_keys=600, aligned_start=True) == 16  # 10 chunks -> a power of two
    assert num_kv_splits(64, max_keys=64, aligned_start=True) == 1
    assert num_kv_splits(64, max_keys=64, aligned_start=False) == 2  # a window may straddle a chunk boundary
    assert num_kv_splits(NO_SPLIT, max_keys=10**6, aligned_start=False) == 1


def test_triton_cases_in_interpreter(run_triton_cases_in_interpreter):
    run_triton_cases_in_interpreter(min_passed=192)


# ---------------------------------------------------------------- launcher errors

@pytest.mark.parametrize("mutate,message", [
    (lambda c: setattr(c, "block_tables", c.block_tables.long()), "block_tables must be int32"),
    (lambda c: setattr(c, "kv_lens", c.kv_lens.long()), "kv_lens must be"),
    (lambda c: setattr(c, "q", c.q[..., :8]), "head_dim"),
    (lambda c: setattr(c, "q", c.q[:, :, :3]), "multiple of the cache's num_kv_heads"),
    (lambda c: setattr(c, "k_cache", c.k_cache.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
    (lambda c: setattr(c, "q", c.q.double()), "cast q to the cache dtype"),
    (lambda c: setattr(c, "q_lens", c.q_lens[:1]), r"q_lens must be a contiguous \[batch=2\]"),
    (lambda c: setattr(c, "q_pos0", torch.stack([c.q_pos0, c.q_pos0], 1)[:, 0]), "q_pos0 must be a contiguous"),
])
def test_launcher_errors(mutate, message):
    case = make_case([9, 17], q_len=2)
    mutate(case)
    with pytest.raises(ValueError, match=message):
        paged_attention(*case.args(), scale=0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_run_only_for_tensors_on_the_current_cuda_device(monkeypatch):
    """Triton launches on the current device: a tensor on another GPU takes the torch reference."""
    monkeypatch.delenv("HF_SPECDEC_FORCE_TRITON", raising=False)
    x = torch.zeros(1, device="cuda")
    assert use_triton(x)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: x.get_device() + 1)
    assert not use_triton(x)


def test_use_triton_env_override(monkeypatch):
    cpu_tensor = torch.zeros(1)
    monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "1")
    assert use_triton(cpu_tensor)
    monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "0")
    assert not use_triton(cpu_tensor)
    monkeypatch.delenv("HF_SPECDEC_FORCE_TRITON")
    assert not use_triton(cpu_tensor)


# ---------------------------------------------------------------- learned softmax sinks (gpt-oss)

def _sinks(num_heads, device="cpu", seed=11):
    """One logit per query head, spread widely (some dominate a query's keys, some vanish beside them)."""
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


@pytest.mark.parametrize("q_len,q_lens,q_pos0,sliding_window,causal", [
    (1, None, None, None, True),  # decode
    (3, None, None, 6, True),  # verify under a window
    (5, [5, 2, 0], [0, 6, 7], 3, True),  # a left-padded prompt, a padded row, a window
    (4, None, None, None, False),  # a bidirectional block
])
def test_sinks_join_the_softmax_denominator(q_len, q_lens, q_pos0, sliding_window, causal):
    kv_lens = [5, 9, 12] if q_pos0 else [11, 20, 4]
    case = make_case(kv_lens, q_len=q_len, q_lens=q_lens, q_pos0=q_pos0, sliding_window=sliding_window,
                     num_heads=8, num_kv_heads=2, seed=12)
    sinks = _sinks(8)
    run = dict(scale=0.25, sliding_window=sliding_window, causal=causal)
    out = paged_attention(*case.args(), **run, sinks=sinks)  # the CPU dispatch: the reference's own softmax
    assert_matches_dense(case, out, **run, sinks=sinks)
    plain = paged_attention(*case.args(), **run)
    assert (out - plain).abs().max() > 0.05  # the sinks moved every query's weights
    # a sink of -inf takes no share: the attention without sinks
    torch.testing.assert_close(paged_attention(*case.args(), **run, sinks=torch.full((8,), float("-inf"))), plain,
                               atol=1e-6, rtol=1e-6)


def test_sinks_leave_queries_without_keys_at_zero():
    case = make_case([0, 6, 9], q_len=2, q_lens=[2, 0, 2], q_pos0=[0, 4, 7], seed=5)
    out = paged_attention(*case.args(), scale=0.25, sinks=_sinks(4))
    assert torch.isfinite(out).all() and (out[:2] == 0).all() and (out[2] != 0).any()


def test_sinks_of_another_shape_are_refused():
    case = make_case([9], q_len=1)
    with pytest.raises(ValueError, match="one float logit per query head"):
        paged_attention(*case.args(), scale=0.25, sinks=torch.zeros(2))


@pytest.mark.parametrize("q_len,sliding_window,chunk", [(1, None, NO_SPLIT), (1, None, 16), (4, 20, 16),
                                                        (3, None, NO_SPLIT)])
def test_triton_sinks_match_reference(triton_device, q_len, sliding_window, chunk):
    """The unsplit kernel adds the sink at its end, the split merge after the chunks; rows of one short and two long
    contexts (chunks without keys for the short one), padding poisoned."""
    case = make_case([150, 97, 13], q_len=q_len, sliding_window=sliding_window, num_heads=8, num_kv_heads=2,
                     poison=NAN_BLOCK, seed=8, device=triton_device)
    sinks = _sinks(8, triton_device)
    run = dict(scale=0.25, sliding_window=sliding_window, causal=True)
    expected = paged_attention_reference(*case.args(), **run, sinks=sinks)
    assert_matches_dense(case, expected, **run, sinks=sinks)
    out = _paged_attention_triton(*case.args(), **run, out=torch.full_like(case.q, float("nan")), block_n=16,
                                  kv_chunk_keys=chunk, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [NO_SPLIT, 4])
def test_triton_sinks_of_minus_infinity_leave_queries_without_keys_at_zero(triton_device, chunk):
    """A sink of -inf (a sink switched off) beside a query that sees no key (an empty row, a padded slot): zeros, not
    NaN, in the unsplit kernel and the split merge alike; the other queries get the attention without sinks."""
    case = make_case([0, 6, 9], q_len=2, q_lens=[2, 1, 2], q_pos0=[0, 4, 7], seed=5, device=triton_device)
    sinks = torch.full((4,), float("-inf"), device=triton_device)
    out = _paged_attention_triton(*case.args(), scale=0.25, sliding_window=None, causal=True,
                                  out=torch.full_like(case.q, float("nan")), block_n=16, kv_chunk_keys=chunk,
                                  sinks=sinks)
    assert torch.isfinite(out).all() and (out[0] == 0).all() and (out[1, 0] == 0).all()
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), scale=0.25), atol=1e-5, rtol=1e-5)


def test_triton_sinks_keep_verify_queries_equal_to_decode_queries(triton_device):
    """Batch invariance holds with sinks: a verify query's output is a decode query's at its position."""
    case = make_case([150, 97], q_len=4, num_heads=8, num_kv_heads=2, seed=9, device=triton_device)
    sinks = _sinks(8, triton_device)
    run = dict(scale=0.25, sliding_window=None, causal=True, block_n=16, kv_chunk_keys=16, sinks=sinks)
    verify = _paged_attention_triton(*case.args(), out=torch.empty_like(case.q), **run)
    assert_verify_queries_are_decode_queries(case, verify, run, tol=2e-6)
