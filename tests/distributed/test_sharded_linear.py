"""Sharded projections on the few-row GEMM (runtime/distributed.py): a bias-free ``nn.Linear`` that transformers'
plain column- or row-parallel style wrapped runs its local shard through ``skinny_linear`` (a row-parallel one then
sums over the group), anything else keeps transformers' wrapper. Mostly one process, a group of one (gloo), and one
test on two gloo ranks (each rank's shares against the unsharded products); the styles are transformers' own,
installed as its loader installs them. Whole models on two ranks: test_tensor_parallel*.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_specdec.generation import fusion
from hf_specdec.kernels.stacked_linear import LOCAL_WEIGHT, stacked_projections, stacked_weight
from hf_specdec.runtime import distributed
from tests.distributed import tp_worker

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_worker._free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, style_name: str, bias: bool = False, seed: int = 0, out: int = 12) -> torch.nn.Linear:
    """A Linear(16 -> ``out``) sharded and wrapped by transformers' ``style_name`` (as its loader does: each
    parameter's ``shard_param``, then the module's ``install_forward``)."""
    torch.manual_seed(seed)
    return _apply_style(torch.nn.Linear(16, out, bias=bias), mesh, style_name)


def _apply_style(module: torch.nn.Module, mesh, style_name: str) -> torch.nn.Module:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    style = ALL_PARALLEL_STYLES[style_name]
    for name in list(module._parameters):
        style.shard_param(module, name, mesh)
    style.install_forward(module, mesh)
    return module


class _ScaledEmbedding(torch.nn.Embedding):
    """An embedding whose own forward does more than the lookup (as Gemma's scales it)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def _vocab_parallel(mesh, rows: int = 13, seed: int = 5, padding_idx: int | None = None) -> torch.nn.Embedding:
    """A 13-row table split by rows over ``mesh`` by transformers' "embedding_rowwise" style."""
    torch.manual_seed(seed)
    return _apply_style(_ScaledEmbedding(rows, 8, padding_idx=padding_idx), mesh, "embedding_rowwise")


@pytest.mark.parametrize("style, kind", [("colwise", distributed.COLUMN), ("rowwise", distributed.ROW),
                                         ("colwise_gather_output", distributed.GATHER),
                                         ("colwise_rep", distributed.GATHER), ("rowwise_rep", None)])
def test_the_kind_of_a_projection_is_read_from_its_transformers_style(mesh, style, kind):
    assert distributed.local_linear_kind(_sharded(mesh, style)) == kind


def test_a_projection_with_a_bias_or_one_not_wrapped_keeps_transformers_forward(mesh):
    assert distributed.local_linear_kind(_sharded(mesh, "colwise", bias=True)) is None
    assert distributed.local_linear_kind(torch.nn.Linear(16, 12, bias=False)) is None
    assert not distributed.install_sharded_linear(_sharded(mesh, "rowwise_rep"))


@pytest.mark.parametrize("style", ["colwise", "rowwise", "colwise_gather_output"])
def test_the_installed_forward_computes_transformers_output_and_sums_row_parallel_outputs(mesh, style, monkeypatch):
    linear = _sharded(mesh, style)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        expected = linear(x)
    wrapper = linear.forward
    assert distributed.install_sharded_linear(linear)
    reduced = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: reduced.append(t.shape) or real_all_reduce(t, **kw))
    real_all_gather = distributed._all_gather_flat
    monkeypatch.setattr(distributed, "_all_gather_flat",
                        lambda out, t, **kw: reduced.append(("gather", out.shape)) or real_all_gather(out, t, **kw))
    with torch.no_grad():
        torch.testing.assert_close(linear(x), expected, rtol=0, atol=0)
    assert reduced == {"rowwise": [torch.Size([2, 3, 12])], "colwise": [],
                       "colwise_gather_output": [("gather", torch.Size([72]))]}[style]
    reduced.clear()
    with torch.enable_grad():  # autograd: transformers' wrapper, as before
        assert linear(x.requires_grad_()).requires_grad
    distributed.remove_sharded_forward(linear)
    assert linear.forward is wrapper
    assert not {distributed.TP_FORWARD, distributed.SHARD_KIND, LOCAL_WEIGHT} & set(vars(linear))


def test_a_vocabulary_parallel_embedding_looks_up_its_rows_and_sums_them(mesh, monkeypatch):
    embedding = _vocab_parallel(mesh)
    ids = torch.tensor([[0, 12, 5], [7, 7, 1]])
    with torch.no_grad():
        expected = embedding(ids)
    wrapper = embedding.forward
    assert distributed.vocab_parallel_embedding(embedding) == (0, 13)
    assert distributed.install_sharded_embedding(embedding)
    reduced = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: reduced.append(t.shape) or real_all_reduce(t, **kw))
    with torch.no_grad():
        torch.testing.assert_close(embedding(ids), expected, rtol=0, atol=0)
    assert reduced == [torch.Size([2, 3, 8])]
    assert type(embedding.weight).__name__ == "DTensor"  # the local table only while the lookup runs
    distributed.remove_sharded_forward(embedding)
    assert embedding.forward is wrapper and distributed.ROW_SHARD not in vars(embedding)


def test_embeddings_split_otherwise_keep_transformers_forward(mesh):
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    torch.manual_seed(0)
    # split by columns: transformers 5.24's embedding style, 5.17's column-parallel one on an embedding
    by_columns = _apply_style(torch.nn.Embedding(13, 8), mesh,
                              "embedding_colwise" if "embedding_colwise" in ALL_PARALLEL_STYLES else "colwise")
    renormed = _apply_style(torch.nn.Embedding(13, 8, max_norm=1.0), mesh, "embedding_rowwise")
    for embedding in (by_columns, renormed, torch.nn.Embedding(13, 8)):
        assert distributed.vocab_parallel_embedding(embedding) is None
        assert not distributed.install_sharded_embedding(embedding)


@pytest.mark.parametrize("total, ranks", [(13, 2), (10, 4), (9, 4), (262144, 8), (5, 1)])
def test_row_shards_follow_torchs_split(total, ranks):
    """Each rank's (rows, first row) under Shard(0): the rows torch.chunk gives each rank, back to back."""
    chunks = torch.arange(total).chunk(ranks)
    for rank in range(ranks):
        rows, first = distributed._shard_size_and_offset(total, ranks, rank)
        expected = chunks[rank] if rank < len(chunks) else torch.arange(0)
        assert rows == len(expected) and (rows == 0 or first == int(expected[0]))


def test_a_replaced_parameter_is_read_again(mesh):
    linear = _sharded(mesh, "colwise")
    assert distributed.install_sharded_linear(linear)
    linear.weight = _sharded(mesh, "colwise", seed=1).weight
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), x @ linear.weight.to_local().T)


def test_fuse_modules_installs_it_where_the_kernels_run_and_unfuse_removes_it(mesh, monkeypatch):
    model = torch.nn.Sequential(_sharded(mesh, "colwise"), _sharded(mesh, "rowwise"), _sharded(mesh, "rowwise_rep"),
                                _vocab_parallel(mesh), _sharded(mesh, "colwise_gather_output"))
    wrappers = [m.forward for m in model]
    monkeypatch.setattr(fusion, "use_triton", lambda tensor: False)
    assert fusion.fuse_modules(model) == 0
    monkeypatch.setattr(fusion, "use_triton", lambda tensor: True)
    assert fusion.fuse_modules(model) == 4
    assert [distributed.TP_FORWARD in vars(m) for m in model] == [True, True, False, True, True]
    fusion.unfuse_modules(model, kernels_only=True)
    assert [m.forward for m in model] == wrappers


def test_column_parallel_shards_stack_and_run_as_one_product_of_their_local_shards(mesh):
    q, k = _sharded(mesh, "colwise", seed=1), _sharded(mesh, "colwise", seed=2)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = (q(x), k(x))
    assert distributed.stack_column_shards(q, k)
    assert all(distributed.install_sharded_linear(m) for m in (q, k))
    assert stacked_weight(q, k) is not None  # their shards lie back to back now
    with torch.no_grad():
        for got, want in zip(stacked_projections(x, q, k), expected):
            torch.testing.assert_close(got, want)
    stacked = stacked_weight(q, k)
    assert distributed.stack_column_shards(q, k) and stacked_weight(q, k).data_ptr() == stacked.data_ptr()  # kept
    assert not distributed.stack_column_shards(q, _sharded(mesh, "rowwise"))
    handle = q.register_forward_hook(lambda module, args, out: out * 2)  # a hooked projection runs its own forward
    assert stacked_weight(q, k) is None
    with torch.no_grad():
        torch.testing.assert_close(stacked_projections(x, q, k)[0], 2 * expected[0])
    handle.remove()


def test_a_copy_of_a_model_with_the_forward_installed_is_made(mesh):
    import copy

    linear = _sharded(mesh, "rowwise")
    assert distributed.install_sharded_linear(linear)
    copied = copy.deepcopy(linear)
    assert copied.weight is not linear.weight and vars(copied)[distributed.SHARD_KIND] == distributed.ROW


def test_row_parallel_sums_off_the_gpu_take_the_process_groups_all_reduce(mesh, monkeypatch):
    group = mesh.get_group()
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append(group))
    for symmetric in (False, True):  # symmetric memory is for CUDA tensors only
        monkeypatch.setattr(distributed, "SYMM_ALL_REDUCE", symmetric)
        monkeypatch.setattr(distributed, "PEER_SUM", symmetric)
        out = torch.ones(2, 3)
        assert distributed.all_reduce_sum(out, group) is out
    assert calls == [group, group] and not distributed._PEER_STATES


def _two_ranks(rank: int, port: int) -> None:
    """One of two gloo ranks: projections sharded by transformers' styles over both, against the unsharded product."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        q, k, o = (_sharded(mesh, style, seed=seed) for style, seed in (("colwise", 1), ("colwise", 2),
                                                                        ("rowwise", 3)))
        # LM heads that gather their outputs: split evenly (an all-gather) and unevenly (7 and 6 rows: a sum)
        heads = {out: _sharded(mesh, "colwise_gather_output", seed=6, out=out) for out in (12, 13)}
        full = {}
        for name, seed in (("q", 1), ("k", 2), ("o", 3)):  # the unsharded weights: the same seeds
            torch.manual_seed(seed)
            full[name] = torch.nn.Linear(16, 12, bias=False)
        for out in heads:
            torch.manual_seed(6)
            full[out] = torch.nn.Linear(16, out, bias=False)
        torch.manual_seed(5)
        full["embedding"] = _ScaledEmbedding(13, 8)
        # padding rows (they shape gradients only) past a rank's local table, and inside one
        embeddings = [_vocab_parallel(mesh), _vocab_parallel(mesh, padding_idx=10),
                      _vocab_parallel(mesh, padding_idx=2)]
        torch.manual_seed(4)
        x = torch.randn(3, 16)
        assert distributed.stack_column_shards(q, k) and all(distributed.install_sharded_linear(m) for m in (q, k, o))
        assert all(distributed.install_sharded_linear(head) for head in heads.values())
        assert all(distributed.install_sharded_embedding(embedding) for embedding in embeddings)
        assert stacked_weight(q, k) is not None
        # a table of fewer rows than ranks leaves a rank without rows: every rank keeps transformers' forward
        assert distributed.local_linear_kind(_sharded(mesh, "colwise_gather_output", out=1)) is None
        outputs, inputs = slice(6 * rank, 6 * rank + 6), slice(8 * rank, 8 * rank + 8)  # this rank's shares
        ids = torch.tensor([[0, 6, 7, 12], [3, 9, 9, 1]])  # rows of both shards
        with torch.no_grad():
            got_q, got_k = stacked_projections(x, q, k)
            torch.testing.assert_close(got_q, full["q"](x)[:, outputs])
            torch.testing.assert_close(got_k, full["k"](x)[:, outputs])
            torch.testing.assert_close(o(x[:, inputs]), full["o"](x))  # the two ranks' partial sums added
            for out, head in heads.items():
                torch.testing.assert_close(head(x), full[out](x))
            for embedding in embeddings:
                torch.testing.assert_close(embedding(ids), full["embedding"](ids), rtol=0, atol=0)
                assert embedding.padding_idx in (None, 10, 2)  # as it was
            # the logits summed in zeros (as peer_sum does on GPUs) rather than all-gathered: the same values
            distributed._peer_sum_state = lambda *args: object()
            for out, head in heads.items():
                torch.testing.assert_close(head(x), full[out](x))
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_their_shards_and_sum_the_row_parallel_outputs():
    import torch.multiprocessing as mp

    mp.start_processes(_two_ranks, args=(tp_worker._free_port(),), nprocs=2, join=True, start_method="spawn")
