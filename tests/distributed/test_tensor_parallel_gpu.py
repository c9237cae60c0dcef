"""Tensor parallelism on two GPUs (skipped on machines with fewer): two NCCL ranks, rank r on cuda:r, run the cases
of ``tp_cases`` as the CPU test does (with transformers' forwards of the sharded model, ``HF_SPECDEC_TP_FUSED=0``;
with hf_specdec's fused ones, the few-row GEMM on the projections' shards and the sums through peer_sum's launch,
the default; with those and NCCL's sums, ``HF_SPECDEC_TP_PEER_SUM=0``; and with the row-parallel sums through
symmetric memory, ``HF_SPECDEC_TP_SYMM_ALL_REDUCE=1``), with CUDA graphs (every rank
captures the same forwards and drafter calls, the all-reduces inside them). Greedy tokens and accepted drafts are
those of one process on cuda:0; sampled ones agree between the ranks; every target kept graphs it captured; and the
ranks finish although each destroys its process group under its live graphs, as a user's script does (NCCL hung
there: runtime/distributed.py releases the graphs first)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import tp_cases, tp_worker

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < tp_worker.WORLD_SIZE or not dist.is_nccl_available(),
                                reason="needs two GPUs and NCCL")

GREEDY = [case.name for case in tp_cases.CASES if not case.do_sample]
SAMPLED = [case.name for case in tp_cases.CASES if case.do_sample]


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    return tp_cases.write_shardable_gemma(tmp_path_factory.mktemp("tp_models_gpu"))


@pytest.fixture(scope="module", params=["transformers_forwards", "fused_forwards", "nccl_sums",
                                        "symmetric_memory_sums"])
def ranks(request, gemma_dirs, tmp_path_factory) -> list[dict]:
    """What each rank wrote, running transformers' forwards of the sharded model (HF_SPECDEC_TP_FUSED=0, NCCL's
    sums), or hf_specdec's fused ones (the default, sums through peer_sum), also with NCCL's sums
    (HF_SPECDEC_TP_PEER_SUM=0), or with the row-parallel sums through symmetric memory
    (HF_SPECDEC_TP_SYMM_ALL_REDUCE=1)."""
    fused = request.param != "transformers_forwards"
    nccl = {"HF_SPECDEC_TP_PEER_SUM": "0"}
    options = {"transformers_forwards": dict(env={"HF_SPECDEC_TP_FUSED": "0", **nccl}), "fused_forwards": None,
               "nccl_sums": dict(env=nccl),
               "symmetric_memory_sums": dict(env={"HF_SPECDEC_TP_SYMM_ALL_REDUCE": "1", **nccl})}[request.param]
    results = tp_worker.spawn_ranks(gemma_dirs, tmp_path_factory.mktemp("tp_ranks_gpu"), "nccl", options)
    for result in results:
        counts = {family: (result["fused_modules"][family], result["sharded_projections"][family])
                  for family in result["fused_modules"]}
        for family, (modules, projections) in counts.items():
            forwards, stacked = projections["forwards"], projections["stacked"]
            assert (modules > 0 and forwards > 0 and stacked > 0) if fused else not (modules or forwards), counts
            # the sets that ask for symmetric memory: it ran, no fallback to NCCL
            assert (projections["symmetric"] > 0) == (request.param == "symmetric_memory_sums"), counts
            assert (projections["peer"] > 0) == (request.param == "fused_forwards"), counts
            # the LM head's logits gathered by hf_specdec, the tied embedding looked up by it (where the plan shards
            # them: transformers 5.17 keeps both whole under the replicated-attention plan, which replaces its own)
            if family != "gemma_replicated_attention":
                assert projections["gathers"] >= fused and projections["embeddings"] == fused, counts
            assert fused or not (projections["gathers"] or projections["embeddings"]), counts
    return results


@pytest.fixture(scope="module")
def single(gemma_dirs) -> dict[str, dict]:
    return tp_cases.run_cases(gemma_dirs, tp=False, device="cuda:0")


@pytest.mark.parametrize("case", GREEDY)
def test_every_rank_commits_the_greedy_tokens_and_accepts_of_one_gpu(case, ranks, single):
    for rank, result in enumerate(ranks):
        assert result["cases"][case] == single[case], f"rank {rank}"


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_tokens_are_the_same_on_every_rank(case, ranks):
    assert ranks[0]["cases"][case] == ranks[1]["cases"][case]


def test_every_sharded_target_kept_the_graphs_it_captured(ranks):
    for result in ranks:
        assert all(count > 0 for count in result["graphs"].values()), result["graphs"]
