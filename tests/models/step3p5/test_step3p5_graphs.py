"""Step 3.5 MTP drafting on CUDA graphs (invariant 5): after the first round each MTP layer's forward has a fixed
width (k + 1 slots per row); a greedy round replays one graph of the batch's bucket (a sampled one, a graph per
layer); greedy decoding gives the tokens and the
target-forward counts of eager drafting, sampling the tokens of eager drafting with the same seed, and a later
request replays the kept graphs. The replay tests need a CUDA device; on CPU only the graphs' metadata inputs
are tested (the graph path itself runs on CPU in tests/models/step3p5/test_step3p5_fixed_width.py)."""

import pytest
import torch

import hf_specdec
from hf_specdec.runtime.cuda_graphs import batch_bucket, meta_inputs, meta_of_inputs
from tests.runtime.test_cuda_graphs import _assert_graphs_give_eager_drafts, _bundled_on_cuda, _plan
from tests.tiny_models import left_padded_batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_meta_inputs_are_the_buffers_of_the_meta_and_give_it_back():
    meta = _plan([5, 2, 8], q_len=2, width=3).meta(rows=4, width=8)
    flat = meta_inputs(meta)
    static = meta_of_inputs(flat, q_len=2)
    assert static.q_len == 2 and static.block_tables[0].shape == (4, 8) and static.slot_mapping[0].shape == (8,)
    for field in ("kv_lens", "q_pos0", "q_lens", "position_ids"):
        assert getattr(static, field) is getattr(meta, field)  # the graph's inputs themselves
    assert all(torch.equal(a, b) for a, b in zip(static.slot_mapping + static.block_tables,
                                                 meta.slot_mapping + meta.block_tables))
    assert static.buffers["slots"] is flat[4] and static.buffers["tables"] is flat[5]
    _plan([1], q_len=2, width=3).meta(out=static)  # rebuilt in place: the meta's own buffers change
    assert meta.kv_lens.tolist() == [3, 0, 0, 0] and (meta.block_tables[0][1:] == -1).all()


def _mtp_calls(store) -> set:
    return {key for key in store.calls if key[0] == "step3p5_mtp"}


@cuda
@pytest.mark.parametrize("lengths", [[9], [12, 3, 7]], ids=["batch1", "batch3"])
def test_step3p5_mtp_graphs_give_the_eager_tokens_and_later_requests_replay_them(lengths, monkeypatch):
    """Batch 1, and 3 in the bucket of 4 (a padding row that stores no K/V), fp32 bundled tiny Step 3.5."""
    (model,) = _bundled_on_cuda("tiny-step3p5")
    store = model._hf_specdec.graph_store
    kwargs = dict(spec_mode="mtp", num_speculative_tokens=3, max_new_tokens=24, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    _assert_graphs_give_eager_drafts(model, lengths, 0, kwargs, monkeypatch)
    calls = _mtp_calls(store)
    assert {key[1] for key in calls} == {"greedy_round"}, "a greedy round's layers were captured as one graph"
    # (bucket, k + 1 slots: the width of the verify's states, the round's sixth input, layer 0's states come from)
    assert {(key[4], key[5][5][0]) for key in calls} == {(batch_bucket(len(lengths)), 4)}
    kept = (set(store.graphs), set(store.calls))
    _assert_graphs_give_eager_drafts(model, lengths, 1, kwargs, monkeypatch)  # other prompts, the same shapes
    assert (set(store.graphs), set(store.calls)) == kept  # replayed, nothing captured again


@cuda
def test_sampled_step3p5_mtp_replays_the_graphs_with_the_eager_tokens():
    """Sampling selects eagerly from the layers' graphs' outputs: the same seed gives the tokens of eager drafting."""
    (model,) = _bundled_on_cuda("tiny-step3p5")
    store = model._hf_specdec.graph_store
    ids, mask = left_padded_batch([12, 3, 7], vocab=200)
    kwargs = dict(attention_mask=mask.cuda(), spec_mode="mtp", num_speculative_tokens=3, max_new_tokens=24,
                  do_sample=True, temperature=0.9, top_k=40, eos_token_id=None, pad_token_id=0)
    runs = []
    for graphs in (True, False):
        hf_specdec.enable(model, cuda_graphs=graphs)
        torch.manual_seed(0)
        runs.append(model.generate(ids.cuda(), **kwargs))
        if graphs:
            assert _mtp_calls(store)
    assert torch.equal(*runs)
