"""CUDA graphs (invariant 5): replayed decode/verify forwards give the tokens of eager ones.

The replay tests need a CUDA device (run them on the GPU machine: ``python -m pytest tests/generation/
test_cuda_graphs.py``); on CPU only the pieces that do not launch graphs are tested."""

import pytest
import torch

import hf_specdec
from hf_specdec.runtime.cuda_graphs import CUDA_GRAPHS_ENV, HookedState, cuda_graphs_wanted
from tests.generation.toy_drafters import CopyDrafter
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style, left_padded_batch, llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_graphs_are_used_only_on_cuda_and_can_be_switched_off(monkeypatch):
    assert not cuda_graphs_wanted(True, torch.device("cpu"))
    assert cuda_graphs_wanted(True, torch.device("cuda", 0))
    assert not cuda_graphs_wanted(False, torch.device("cuda", 0))
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    assert not cuda_graphs_wanted(True, torch.device("cuda", 0))


def test_hooked_state_puts_back_what_hooks_recorded():
    class Holder:
        pass

    holder = Holder()
    holder.hidden = torch.zeros(2)
    state = HookedState(holder)
    saved = state.snapshot()
    holder.hidden = torch.ones(2)  # a later eager forward's record
    state.restore(saved)
    assert torch.equal(holder.hidden, torch.zeros(2))
    records = [torch.zeros(1), None]
    listed = HookedState(records)
    saved = listed.snapshot()
    records[0], records[1] = torch.ones(1), torch.ones(1)
    listed.restore(saved)
    assert records[1] is None and torch.equal(records[0], torch.zeros(1))
    HookedState(None).restore(HookedState(None).snapshot())  # no drafter: nothing to do


def test_batch_buckets():
    from hf_specdec.runtime.cuda_graphs import batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 40]
    with pytest.raises(ValueError, match="batch must be >= 1"):
        batch_bucket(0)


def _plan(lens, q_len=2, width=3, first_block=1):
    """A forward of ``q_len`` new tokens per row after ``lens[b]`` cached ones, rows' blocks numbered from
    ``first_block`` (row b: first_block + b * width ..), one KV group of block size 4."""
    from hf_specdec.cache import ForwardPlan

    rows = len(lens)
    counts = torch.tensor([lens, [q_len] * rows], dtype=torch.int32)
    tables = (first_block + torch.arange(rows * width, dtype=torch.int32)).view(1, rows, width)
    return ForwardPlan(q_len=q_len, counts=counts, tables=tables, block_size=4)


def _assert_padding(meta, start):
    assert not meta.kv_lens[start:].any() and not meta.q_lens[start:].any() and not meta.q_pos0[start:].any()
    assert not meta.position_ids[start:].any()
    assert (meta.slot_mapping[0][start * meta.q_len:] == -1).all() and (meta.block_tables[0][start:] == -1).all()


def test_a_graph_of_a_bucket_pads_its_rows_and_resets_the_rows_a_larger_batch_left():
    """A batch of 3 in the graph of bucket 4: the 4th row has no queries, keys, slots or pages. A later batch
    of 2 derived into the same static buffers leaves none of the 3rd row's slots behind (a replay would store
    K/V there)."""
    static = _plan([5, 2, 8]).meta(rows=4, width=8)
    assert static.block_tables[0].shape == (4, 8) and static.slot_mapping[0].shape == (8,)
    assert static.kv_lens.tolist() == [7, 4, 10, 0] and static.q_pos0[:3].tolist() == [5, 2, 8]
    # row 0: positions 5, 6 in its second block (2: slots 8..11); row 1: 2, 3 in block 4; row 2: 8, 9 in block 9
    assert static.slot_mapping[0][:6].tolist() == [9, 10, 18, 19, 36, 37]
    assert (static.block_tables[0][:3, :3] == _plan([5, 2, 8]).tables[0]).all()
    assert (static.block_tables[0][:3, 3:] == -1).all()
    _assert_padding(static, 3)
    _plan([1, 1], first_block=20).meta(out=static)
    assert static.kv_lens[:2].tolist() == [3, 3] and static.slot_mapping[0][:4].tolist() == [81, 82, 93, 94]
    _assert_padding(static, 2)
    _plan([0, 0, 0, 0], width=2).meta(out=static)  # a narrower table than before: the rest of each row has no page
    assert (static.block_tables[0][:, :2] >= 1).all() and (static.block_tables[0][:, 2:] == -1).all()
    for too_big in (_plan([0] * 5), _plan([0], width=9), _plan([0], q_len=3)):  # never cut to fit
        with pytest.raises(RuntimeError, match="does not fit metadata buffers"):
            too_big.meta(out=static)


def test_hooked_state_of_a_padded_batch_gives_back_the_real_rows():
    records = [torch.arange(8).view(4, 2), None, torch.zeros(3)]
    state = HookedState(records)
    saved = state.snapshot()
    state.restore(saved, rows=2)
    assert torch.equal(records[0], torch.arange(4).view(2, 2)) and records[1] is None
    assert records[2].shape == (2,)


def test_enable_records_the_graph_setting():
    model = hf_specdec.enable(llama(), cuda_graphs=False)
    assert model._hf_specdec.cuda_graphs is False
    hf_specdec.enable(model, cuda_graphs=True)
    assert model._hf_specdec.cuda_graphs is True


MODELS = {"gemma4_e2b": gemma4_e2b_style, "gemma4_31b": gemma4_31b_style, "llama": llama}


def _decode(build, graphs: bool, **kwargs):
    model = hf_specdec.enable(build().cuda(), cuda_graphs=graphs)
    ids, mask = left_padded_batch([12, 3, 9, 6])
    torch.manual_seed(0)
    extra = {}
    if "k" in kwargs:
        extra = dict(assistant_model=CopyDrafter(build().cuda(), kwargs.pop("k"), noise=0.3))
    return model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, eos_token_id=None,
                          pad_token_id=0, **extra, **kwargs)


@cuda
@pytest.mark.parametrize("name", list(MODELS))
def test_graph_replay_equals_eager_plain_greedy(name):
    assert torch.equal(_decode(MODELS[name], False, do_sample=False), _decode(MODELS[name], True, do_sample=False))


@cuda
@pytest.mark.parametrize("name,k", [("gemma4_e2b", 3), ("gemma4_31b", 7), ("llama", 1)])
def test_graph_replay_equals_eager_speculative(name, k):
    eager = _decode(MODELS[name], False, do_sample=False, k=k)
    assert torch.equal(eager, _decode(MODELS[name], True, do_sample=False, k=k))


@cuda
def test_graph_replay_equals_eager_sampled():
    eager = _decode(llama, False, do_sample=True, temperature=0.9, k=3)
    assert torch.equal(eager, _decode(llama, True, do_sample=True, temperature=0.9, k=3))


def test_graph_store_pools_storage_and_drops_graphs_when_it_grows():
    from hf_specdec.runtime.cuda_graphs import GraphStore

    store, made = GraphStore(), []

    def allocate(blocks):
        made.append(list(blocks))
        return [torch.zeros(n) for n in blocks], [torch.zeros(n) for n in blocks]

    layout = object()
    k, _, blocks = store.take_storage(layout, [5, 3], 16, torch.float32, "cpu", allocate)
    assert blocks == [8, 4] and made == [[8, 4]]  # rounded up to powers of two
    store.graphs["some graph"] = None
    generation = store.generation
    k2, _, _ = store.take_storage(layout, [8, 2], 16, torch.float32, "cpu", allocate)
    assert k2 is k and len(made) == 1 and store.graphs  # fits: reused, graphs kept
    store.take_storage(layout, [9, 2], 16, torch.float32, "cpu", allocate)
    assert made[-1] == [16, 2] and not store.graphs and store.generation > generation  # grown: graphs dropped


def test_graph_store_drops_graphs_when_a_weight_moves():
    """A graph replays the addresses it was captured with: weights replaced since (a device or dtype round trip,
    ``param.data = ...``, ``load_state_dict(assign=True)``), the target's or the drafter's, drop every graph; weights
    changed in place keep them (the graphs read the new values)."""
    from hf_specdec.runtime.cuda_graphs import GraphStore

    target, drafter = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2))
    store = GraphStore()

    def kept_after(change) -> bool:
        store.check_weights(target, drafter)
        store.graphs["a graph"] = None
        change()
        store.check_weights(target, drafter)
        return bool(store.graphs)

    with torch.no_grad():
        assert kept_after(lambda: None)
        assert kept_after(lambda: target.weight.add_(1.0))
        assert kept_after(lambda: target.load_state_dict({k: v + 1 for k, v in target.state_dict().items()}))
        assert not kept_after(lambda: setattr(target.weight, "data", target.weight.data.clone()))
        assert not kept_after(lambda: target.load_state_dict(dict(target.state_dict(), bias=torch.ones(4)),
                                                             assign=True))
        assert not kept_after(lambda: setattr(drafter[0].bias, "data", drafter[0].bias.data.clone()))
        assert not kept_after(lambda: drafter.append(torch.nn.Linear(2, 2)))
    # calls with and without the drafter in turn (plain calls, "auto" running plain): nothing moved, graphs stay
    store.graphs["a graph"] = None
    for models in ((target,), (target, drafter), (target,), (target, drafter)):
        store.check_weights(*models)
    assert store.graphs


def test_a_drafter_names_the_modules_its_graphs_read():
    """A Drafter passed as the assistant (not a module): its modules are what the store watches besides the target."""
    copy_model = llama()
    assert CopyDrafter(copy_model, 3).weight_modules() == [copy_model]


def test_graph_store_sees_a_quantized_weight_move():
    """A tensor subclass (torchao's int8 weights) reports no address of its own: where its inner tensors are counts."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from hf_specdec.runtime.cuda_graphs import GraphStore

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))
    quantize_(model, Int8WeightOnlyConfig())
    store = GraphStore()
    store.check_weights(model)
    store.graphs["a graph"] = None
    model[0].weight = torch.nn.Parameter(model[0].weight.clone(), requires_grad=False)
    store.check_weights(model)
    assert not store.graphs


@cuda
@pytest.mark.parametrize("change", ["device_round_trip", "dtype_round_trip", "data", "assign", "drafter_moved"])
def test_calls_after_weights_moved_give_the_new_weights_tokens(change):
    """Weights replaced between calls (the target's or the assistant's) are what the next call decodes with, in plain
    and MTP calls: graphs kept from the calls before are dropped, not replayed over freed memory (they gave other
    tokens, or an illegal memory access once the old memory was reused)."""
    import transformers

    from hf_specdec.assets import asset_path

    path = asset_path("tiny-gemma4")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    model, assistant = _bundled_on_cuda("tiny-gemma4", "tiny-gemma4-assistant")
    ids, mask = left_padded_batch([12, 3, 9], vocab=reference.config.get_text_config().vocab_size)
    kwargs = dict(attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    modes = [{}, dict(assistant_model=assistant, num_speculative_tokens=4)]
    store = model._hf_specdec.graph_store
    for call in range(2):  # the second pass replays what the first captured
        generation = store.generation
        for extra in modes:
            assert torch.equal(model.generate(ids.cuda(), **kwargs, **extra), reference.generate(ids.cuda(), **kwargs))
        assert call == 0 or store.generation == generation  # nothing dropped while no weight moved
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        if change == "device_round_trip":
            model.cpu().cuda()
        elif change == "dtype_round_trip":
            model.half().float()
            reference.half().float()
        elif change == "data":
            for name, param in reference.named_parameters():
                step = 0.02 * torch.randn(param.shape, device="cuda", generator=generator)
                param.data = param.data + step
                model.get_parameter(name).data = model.get_parameter(name).data + step
        elif change == "assign":
            stepped = {}  # tied weights (the embedding and the LM head) share one new tensor
            state = {k: stepped.setdefault(v.data_ptr(), v + 0.02 * torch.randn(v.shape, device="cuda",
                                                                                 generator=generator))
                     for k, v in reference.state_dict().items()}
            reference.load_state_dict(state)
            model.load_state_dict(state, assign=True)
        else:
            assistant.cpu().cuda()
    torch.cuda.empty_cache()
    torch.randn(10**7, device="cuda")  # the freed memory taken by something else
    expected = reference.generate(ids.cuda(), **kwargs)
    for extra in modes:
        assert torch.equal(model.generate(ids.cuda(), **kwargs, **extra), expected)


@cuda
def test_later_calls_replay_the_stored_graphs():
    model = hf_specdec.enable(llama().cuda())
    ids, mask = left_padded_batch([12, 3, 9, 6])
    kwargs = dict(attention_mask=mask.cuda(), max_new_tokens=30, eos_token_id=None, do_sample=False,
                  assistant_model=CopyDrafter(llama().cuda(), 3))
    first = model.generate(ids.cuda(), **kwargs)
    store = model._hf_specdec.graph_store
    graphs = dict(store.graphs)
    assert graphs, "the verify forward was captured"
    second = model.generate(ids.cuda(), **kwargs)
    assert torch.equal(first, second)
    assert store.graphs == graphs  # nothing captured again
    hf_specdec.disable(model)
    assert not store.graphs and store.storage is None


@cuda
def test_greedy_selection_runs_inside_the_replayed_graphs(monkeypatch):
    """Greedy plain decoding and greedy verification take their argmax and acceptance inside the forward's graph: once
    the decode and verify graphs are captured, no step calls the selection from the host again, and the tokens are
    those of the selection after the forward."""
    from hf_specdec.generation import acceptance, sampling

    calls = {"argmax": 0, "accept": 0}
    argmax, greedy_accept = sampling.argmax, acceptance.greedy_accept_no_sync
    monkeypatch.setattr(sampling, "argmax", lambda x: (calls.__setitem__("argmax", calls["argmax"] + 1), argmax(x))[1])
    monkeypatch.setattr(acceptance, "greedy_accept_no_sync",
                        lambda d, t: (calls.__setitem__("accept", calls["accept"] + 1), greedy_accept(d, t))[1])
    model = hf_specdec.enable(llama().cuda())
    ids, mask = left_padded_batch([12, 3, 9, 6])
    kwargs = dict(attention_mask=mask.cuda(), max_new_tokens=40, eos_token_id=None, do_sample=False)
    for extra in ({}, dict(assistant_model=CopyDrafter(llama().cuda(), 3, noise=0.3))):
        first = model.generate(ids.cuda(), **kwargs, **extra)  # captures
        before = dict(calls)
        again = model.generate(ids.cuda(), **kwargs, **extra)  # replays
        assert torch.equal(first, again)
        # on the host only the prefill's selection (the prefill runs eagerly); the verifies' acceptance never
        assert calls["argmax"] - before["argmax"] == 1 and calls["accept"] == before["accept"], (before, calls)
        monkeypatch.setattr(sampling, "SELECT_WITH_FORWARD", False)
        assert torch.equal(model.generate(ids.cuda(), **kwargs, **extra), first)  # selection after the forward
        if extra:  # every verify's acceptance from the host now
            assert calls["accept"] > before["accept"], (before, calls)
        else:  # every step's argmax from the host now
            assert calls["argmax"] - before["argmax"] > 30, (before, calls)
        monkeypatch.setattr(sampling, "SELECT_WITH_FORWARD", True)


@cuda
def test_plain_decode_on_cuda_stops_at_eos_and_streams_like_transformers():
    """On CUDA the plain loop queues the next forward before it reads the stop check back: rows that stop at
    EOS, the padding after them and what a streamer receives must still be transformers' own."""
    from transformers import TextIteratorStreamer  # noqa: F401 - the streamer protocol is put/end

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            pass

    ids, mask = left_padded_batch([12, 3, 9, 6])
    reference = llama().cuda()
    expected = reference.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=30, do_sample=False)
    eos = int(expected[0, ids.shape[1] + 4])  # a token row 0 emits early: rows stop at different steps
    kwargs = dict(attention_mask=mask.cuda(), max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected = reference.generate(ids.cuda(), **kwargs)
    ours, theirs = Collect(), Collect()
    model = hf_specdec.enable(llama().cuda())
    got = model.generate(ids.cuda(), streamer=ours, **kwargs)
    reference.generate(ids.cuda(), streamer=theirs, **kwargs)
    assert torch.equal(got, expected)
    assert (got[0, ids.shape[1]:] == eos).any() and got[0, -1] == 0  # row 0 stopped and was padded
    assert ours.chunks == theirs.chunks


def test_graph_store_keeps_the_most_recently_used_graphs_within_its_bound():
    from hf_specdec.runtime.cuda_graphs import GraphStore

    store = GraphStore(max_graphs=3)
    store.keep("graphs", ("decode", 1), "d1")
    store.keep("calls", ("draft", 1), "c1")
    store.keep("graphs", ("verify", 1), "v1")
    assert store.get("graphs", ("decode", 1)) == "d1"  # a replay counts as a use
    store.keep("graphs", ("decode", 2), "d2")  # over the bound: the draft call is the least recently used
    assert store.calls == {} and set(store.graphs) == {("decode", 1), ("verify", 1), ("decode", 2)}
    assert store.evicted == 1 and store.get("calls", ("draft", 1)) is None
    store.max_graphs = 1
    store.trim()
    assert list(store.graphs) == [("decode", 2)] and store.evicted == 3
    store.release()
    assert not store.graphs and not store.calls
    store.keep("graphs", ("decode", 3), "d3")  # nothing left over from before the release counts
    assert list(store.graphs) == [("decode", 3)]


def test_enable_sets_the_graph_bound_and_trims_to_a_lower_one():
    model = hf_specdec.enable(llama(), max_cuda_graphs=5)
    store = model._hf_specdec.graph_store
    assert store.max_graphs == 5
    for i in range(5):
        store.keep("graphs", ("decode", i), i)
    hf_specdec.enable(model, max_cuda_graphs=2)
    assert store.max_graphs == 2 and list(store.graphs) == [("decode", 3), ("decode", 4)]


@cuda
def test_fused_gemma4_blocks_on_cuda_give_transformers_greedy_tokens():
    """Invariant 1 on the GPU path: with the fused attention, decoder-layer and MLP forwards (31B style: no
    per-layer inputs, so every layer takes them) and graphs on, greedy tokens are transformers' own (fp32)."""
    ids, mask = left_padded_batch([12, 3, 9, 6])
    kwargs = dict(attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = gemma4_31b_style().cuda().generate(ids.cuda(), **kwargs)
    model = hf_specdec.enable(gemma4_31b_style().cuda())
    fused = [m for m in model.modules() if "forward" in vars(m)]
    kinds = {type(m).__name__ for m in fused}
    assert {"Gemma4TextAttention", "Gemma4TextDecoderLayer", "Gemma4TextMLP", "Gemma4RMSNorm"} <= kinds
    assert torch.equal(model.generate(ids.cuda(), **kwargs), expected)
    assert torch.equal(model.generate(ids.cuda(), **kwargs), expected)  # the second call replays stored graphs


def _bundled_on_cuda(*names):
    """Fresh fp32 copies of bundled tiny models on the GPU (the session-wide ones stay on the CPU)."""
    from hf_specdec.assets import asset_path

    return [hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(n), dtype=torch.float32).cuda() for n in names]


def test_drafter_graphs_replay_a_kept_graph_or_run_eagerly_and_capture(monkeypatch):
    """A drafter's read-only call: the first runs eagerly and captures over inputs padded to the batch's bucket;
    later calls of the bucket replay with their own rows and get the real rows back; a failed capture warns
    once, and the rest of the request runs eagerly."""
    from hf_specdec.runtime import drafter_graphs
    from hf_specdec.runtime.cuda_graphs import GraphStore
    from hf_specdec.runtime.drafter_graphs import DrafterGraphs

    store, seen = GraphStore(), []

    class FakeGraph:
        def __init__(self, fn, inputs, devices=()):
            seen.append(("capture", [t.tolist() for t in inputs]))

        def __call__(self, *inputs):
            seen.append(("replay", [t.tolist() for t in inputs]))
            return torch.tensor([[7], [8], [9]])

    monkeypatch.setattr(drafter_graphs, "CallGraph", FakeGraph)
    fn = lambda x: x * 2  # noqa: E731
    graphs = DrafterGraphs(store, 8, ("owner",))
    out = graphs.run("double", fn, [torch.tensor([[1], [2], [3]])], pad_values=(-1,))
    assert torch.equal(out, torch.tensor([[2], [4], [6]])) and seen == [("capture", [[[1], [2], [3], [-1]]])]
    assert torch.equal(graphs.run("double", fn, [torch.tensor([[3], [4]])]), torch.tensor([[6], [8]]))
    assert seen[-1] == ("capture", [[[3], [4]]])  # bucket 2: a graph of its own
    assert torch.equal(graphs.run("double", fn, [torch.tensor([[5], [6], [7]])]), torch.tensor([[7], [8], [9]]))
    assert seen[-1] == ("replay", [[[5], [6], [7]]])

    def broken(fn, inputs, devices=()):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(drafter_graphs, "CallGraph", broken)
    other = DrafterGraphs(store, 8, ("other",))
    with pytest.warns(RuntimeWarning, match="could not capture the thing of other"):
        out = other.run("the thing", fn, [torch.tensor([5])])
    assert torch.equal(out, torch.tensor([10])) and other.failed and not other.on
    assert not any(key[0] == "other" for _, key in store._recency)
    assert torch.equal(other.run("the thing", fn, [torch.tensor([6])]), torch.tensor([12]))  # eager, no warning


def test_drafter_graphs_pad_every_call_that_writes_kv_and_set_its_metadata(monkeypatch):
    """A call that writes K/V by slot (``plan=``) derives its metadata at the bucket's rows and the graphs' table
    width (padding rows: no query, no slot, no page), runs with it as the cache's forward, and a replay derives
    the next plan's metadata straight into the graph's static inputs."""
    from hf_specdec.runtime import drafter_graphs
    from hf_specdec.runtime.drafter_graphs import DrafterGraphs
    from hf_specdec.runtime.cuda_graphs import GraphStore

    class Cache:
        meta = "live"

        def forward_with(self, meta):
            import contextlib

            @contextlib.contextmanager
            def scope():
                live, self.meta = self.meta, meta
                try:
                    yield meta
                finally:
                    self.meta = live
            return scope()

    class Captured:  # a "graph" that reruns its function over its static inputs
        def __init__(self, fn, inputs, devices=()):
            self.fn, self.inputs = fn, [t.clone() for t in inputs]
            self.outputs = fn(*self.inputs)

        def __call__(self, *inputs):
            for static, new in zip(self.inputs, inputs):
                static[:new.shape[0]].copy_(new)
            return self.fn(*self.inputs)

    monkeypatch.setattr(drafter_graphs, "CallGraph", Captured)
    cache, seen = Cache(), []

    def body(ids, meta):
        seen.append((cache.meta is meta, ids.shape[0], meta.slot_mapping[0].tolist(), meta.block_tables[0].tolist()))
        return ids + 1

    graphs = DrafterGraphs(GraphStore(), 3, ("owner",))
    out = graphs.run("write", body, [torch.tensor([[5], [6]])], plan=_plan([2, 3], q_len=1, width=1), cache=cache)
    assert torch.equal(out, torch.tensor([[6], [7]])) and cache.meta == "live"
    assert seen[-1] == (True, 2, [6, 11], [[1, -1, -1], [2, -1, -1]])  # tables padded to the graphs' width
    out = graphs.run("write", body, [torch.tensor([[8], [9]])], plan=_plan([5, 0], q_len=1, width=2), cache=cache)
    assert torch.equal(out, torch.tensor([[9], [10]]))  # the replay: the new plan's metadata in the static inputs
    assert seen[-1] == (True, 2, [9, 12], [[1, 2, -1], [3, 4, -1]])
    graphs.run("write", body, [torch.tensor([[5], [6], [7]])[:1]], plan=_plan([2], q_len=1, width=1),
               cache=cache)  # bucket 1: its own graph
    assert seen[-1][1:] == (1, [6], [[1, -1, -1]])
    graphs.run("write", body, [torch.tensor([[1], [2], [3], [4]])], plan=_plan([0, 1, 2, 3], q_len=1), cache=cache)
    graphs.run("write", body, [torch.tensor([[1], [2], [3]])], plan=_plan([0, 1, 2], q_len=1), cache=cache)
    assert seen[-1][1:] == (4, [4, 17, 30, -1], [[1, 2, 3], [4, 5, 6], [7, 8, 9], [-1, -1, -1]])  # row 4 left: padding


def test_a_drafter_reserves_room_ahead_only_within_its_pool_and_the_graphs_tables():
    """What drafting ahead checks before planning past the rows' lengths (DFlash, Step 3.5 MTP): the pool must hold
    the extra positions, and with graphs on they must fit the graphs' block tables; off, only the pool counts."""
    from hf_specdec.cache import KVGroup, KVLayout, PagedKVCache
    from hf_specdec.runtime.cuda_graphs import GraphStore
    from hf_specdec.runtime.drafter_graphs import DrafterGraphs

    layout = KVLayout(groups=[KVGroup(1, 4, None, layers=(0,))], layer_slot={0: (0, 0)}, producer={0: 0})
    cache = PagedKVCache(layout, [5], 2, block_size=4, dtype=torch.float32, device="cpu")
    cache.begin_forward([5, 2], 5)
    cache.commit([5, 2])  # 3 of the 5 blocks taken
    on, off = DrafterGraphs(GraphStore(), 2, ("owner",)), DrafterGraphs(None, None, ("owner",))
    assert on.can_reserve(cache, 3) and off.can_reserve(cache, 3)  # row 0 reaches 8 positions: 2 blocks
    assert not on.can_reserve(cache, 4) and off.can_reserve(cache, 4)  # 9 positions: 3 blocks, wider than 2
    assert not off.can_reserve(cache, 7)  # rows need 2 + 1 more blocks, the pool has 2


@cuda
def test_batches_of_one_bucket_share_its_graphs_and_give_the_eager_tokens(monkeypatch):
    """Batches of 8, 5 and 6 replay the graphs of bucket 8 (the verify forward and Gemma 4 MTP's draft steps)
    and give the tokens of eager decoding. The batch of 5 after the batch of 8 also checks that the rows the
    larger batch left are reset: their stale slots would store K/V over this request's pages (fp32)."""
    model, assistant = _bundled_on_cuda("tiny-gemma4", "tiny-gemma4-assistant")
    store = model._hf_specdec.graph_store
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, assistant_model=assistant,
                  num_speculative_tokens=3)
    captured = None
    for seed, lengths in enumerate(([12, 3, 9, 6, 4, 7, 10, 5], [12, 3, 9, 6, 4], [5, 9, 3, 8, 2, 11])):
        _assert_graphs_give_eager_drafts(model, lengths, seed, kwargs, monkeypatch)
        keys = (set(store.graphs), set(store.calls))
        if captured is None:
            captured = keys
            assert any(key[0] == "gemma4_mtp" for key in store.calls), "the draft steps were captured"
        assert keys == captured  # the same graphs replayed, none captured for 5 or 6 rows


def _assert_graphs_give_eager_drafts(model, lengths, seed, kwargs, monkeypatch):
    """Greedy speculative decoding of a random left-padded batch with graphs, then eagerly: the same tokens and
    the same number of target forwards (greedy output is the target's whatever the drafts; the same drafts
    also take the same verify steps)."""
    ids, mask = left_padded_batch(lengths, vocab=200, seed=seed)
    ids, mask = ids.cuda(), mask.cuda()
    graphed = model.generate(ids, attention_mask=mask, **kwargs)
    forwards = hf_specdec.last_generation_stats(model).num_target_forwards
    with monkeypatch.context() as patch:
        patch.setenv(CUDA_GRAPHS_ENV, "0")
        assert torch.equal(graphed, model.generate(ids, attention_mask=mask, **kwargs))
    assert hf_specdec.last_generation_stats(model).num_target_forwards == forwards


@cuda
def test_dflash_block_and_context_graphs_give_the_eager_tokens(monkeypatch):
    """DFlash's greedy block forward and its context appends (with the next block when drafted ahead) replay graphs
    of the batch's bucket (batches of 4, then 3 in the same bucket: padding rows store no K/V), later requests
    replay them, and the tokens are those of eager drafting (fp32, bundled tiny family)."""
    model, drafter = _bundled_on_cuda("tiny-gemma4", "tiny-gemma4-dflash")
    store = model._hf_specdec.graph_store
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0, assistant_model=drafter,
                  num_speculative_tokens=4)
    captured = None
    for seed, lengths in enumerate(([12, 3, 9, 6], [5, 10, 7], [12, 3, 9, 6])):
        _assert_graphs_give_eager_drafts(model, lengths, seed, kwargs, monkeypatch)
        if captured is None:
            captured = set(store.calls)
            # the first block, the context appends and blocks drafted ahead, the appends the last rounds left
            assert {("dflash", "block"), ("dflash", "ahead"), ("dflash", "context")} <= {key[:2] for key in store.calls}
        assert set(store.calls) == captured  # replayed, nothing captured for 3 rows or the repeated request


@cuda
def test_sampled_mtp_draft_steps_replay_graphs_with_the_eager_tokens(monkeypatch):
    """Sampled Gemma 4 MTP (temperature and top-k processors) replays one graph per draft step's forward and
    samples eagerly from its outputs: the same seed gives the tokens of eager drafting, at a full bucket (4
    rows) and a padded one (3 rows in the bucket of 4) (fp32, bundled tiny family)."""
    model, assistant = _bundled_on_cuda("tiny-gemma4", "tiny-gemma4-assistant")
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=40, eos_token_id=None, pad_token_id=0,
                  assistant_model=assistant, num_speculative_tokens=3)
    _assert_sampled_graphs_give_eager_tokens(model, kwargs, lambda key: key[:2] == ("gemma4_mtp", "step"))


def _assert_sampled_graphs_give_eager_tokens(model, kwargs, is_draft_graph):
    """Seeded sampling with graphs, then eagerly, for a full bucket (4 rows) and a padded one (3 rows in the
    bucket of 4): the same tokens, and the graphed run kept a draft graph (``is_draft_graph(key)``)."""
    store = model._hf_specdec.graph_store
    for lengths in ([12, 3, 9, 6], [5, 10, 7]):
        ids, mask = left_padded_batch(lengths, vocab=200)
        runs = []
        for graphs in (True, False):
            hf_specdec.enable(model, cuda_graphs=graphs)
            torch.manual_seed(0)
            runs.append(model.generate(ids.cuda(), attention_mask=mask.cuda(), **kwargs))
            if graphs:
                assert any(is_draft_graph(key) for key in store.calls)
        assert torch.equal(*runs)


@cuda
def test_sampled_dflash_block_forward_replays_a_graph_with_the_eager_tokens():
    """Sampled DFlash (temperature and top-p) replays the block forward's graph up to the logits and samples
    eagerly from them: the same seed gives the tokens of eager drafting, at a full bucket (4 rows) and a padded
    one (3 rows in the bucket of 4) (fp32, bundled tiny family)."""
    model, drafter = _bundled_on_cuda("tiny-gemma4", "tiny-gemma4-dflash")
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_p=0.9, eos_token_id=None, pad_token_id=0,
                  assistant_model=drafter, num_speculative_tokens=4)
    _assert_sampled_graphs_give_eager_tokens(model, kwargs, lambda key: key[:2] == ("dflash", "block_logits"))


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a graph spanning GPUs needs two")


@two_gpus
def test_a_graph_spans_two_gpus_and_replays_what_runs_eagerly():
    """A function whose work runs on cuda:0 and cuda:1 (cuBLAS on both, a Triton kernel on cuda:1 with that GPU
    current, activations copied across and back), captured as one SpanningGraph: every replay with new inputs gives
    what the function gives eagerly; the capture leaves cuda:1's current stream as it was."""
    from hf_specdec.kernels.rms_norm import rms_norm
    from hf_specdec.runtime.cuda_graphs import SpanningGraph, capture_graph

    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 64, generator=gen).to("cuda:0")
    w1, norm = torch.randn(64, 64, generator=gen).to("cuda:1"), torch.rand(64, generator=gen).to("cuda:1") + 0.5

    def fn(x):
        h = (x @ w0).to("cuda:1")
        with torch.cuda.device(1):
            h = rms_norm(h, norm, 1e-6) @ w1
        return (h.relu() + 1).to("cuda:0")

    x = torch.randn(4, 64, generator=gen).to("cuda:0")
    before = torch.cuda.current_stream(1)
    graph, out = capture_graph(fn, x, devices=(torch.device("cuda:0"), torch.device("cuda:1")))
    assert torch.cuda.current_stream(1) == before and torch.cuda.current_device() == 0
    assert isinstance(graph, SpanningGraph) and graph.devices == (torch.device("cuda:1"),)
    for _ in range(3):
        new = torch.randn(4, 64, generator=gen).to("cuda:0")
        x.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, fn(new), rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, fn(torch.zeros_like(new)))


@cuda
def test_random_ops_work_after_a_capture_that_failed():
    """A capture that fails (here a host sync inside it) leaves the GPU's random generator usable: torch marks it
    capturing when a capture begins and only unmarks it when one ends well, so the eager decoding that follows a
    failed capture could not sample ("Offset increment outside graph capture"); graphs captured before keep
    replaying, seeded by ``manual_seed``."""
    from hf_specdec.runtime.cuda_graphs import capture_graph

    x = torch.ones(4, device="cuda")
    drawing, drawn = capture_graph(lambda t: t + torch.rand(4, device="cuda"), x)  # a graph captured before
    with pytest.raises(Exception):  # noqa: B017 - whatever CUDA says of a sync inside a capture
        capture_graph(lambda t: t * t.sum().item(), x)
    torch.manual_seed(0)
    first = torch.rand(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.rand(8, device="cuda"), first) and torch.multinomial(first, 2).shape == (2,)
    # the graph captured before still replays, on the generator state manual_seed reaches
    torch.manual_seed(1)
    drawing.replay()
    again = drawn.clone()
    drawing.replay()
    assert not torch.equal(drawn, again)  # each replay draws anew
    torch.manual_seed(1)
    drawing.replay()
    assert torch.equal(drawn, again)
