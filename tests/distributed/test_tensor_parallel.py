"""Tensor parallelism on CPU: two gloo ranks load the tiny Gemma 4 and Step 3.5 with their tp_plan, enable
hf_specdec and decode in every mode (plain, Gemma 4 MTP assistant, DFlash drafter, Step 3.5's own MTP layers),
greedy and seeded sampling (each rank seeded differently: only rank 0's draws may count); every rank must commit
the tokens one plain process seeded like rank 0 commits, with the same number of accepted drafts (the drafters see
exactly what they see in one process), from a cache holding its own share of the KV heads.

The two ranks run once per module (``tests/distributed/tp_worker.py``, spawned; about 20 s on two cores); each
test checks one part of what they wrote.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_specdec.runtime.distributed import local_kv_layout, tensor_parallel_group
from tests.distributed import tp_cases, tp_worker

WORLD_SIZE = tp_worker.WORLD_SIZE

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    return tp_cases.write_shardable_gemma(tmp_path_factory.mktemp("tp_models"))


@pytest.fixture(scope="module")
def ranks(gemma_dirs, tmp_path_factory) -> list[dict]:
    """What each rank wrote (see tp_worker.main)."""
    return tp_worker.spawn_ranks(gemma_dirs, tmp_path_factory.mktemp("tp_ranks"), "gloo")


@pytest.fixture(scope="module")
def single(gemma_dirs) -> dict[str, dict]:
    """The same cases in this one process, without tensor parallelism."""
    return tp_cases.run_cases(gemma_dirs, tp=False)


@pytest.mark.parametrize("case", [case.name for case in tp_cases.CASES])
def test_every_rank_commits_the_tokens_of_one_process(case, ranks, single):
    for rank, result in enumerate(ranks):
        assert result["cases"][case]["tokens"] == single[case]["tokens"], f"rank {rank}"


def test_auto_k_chooses_alike_on_every_rank(ranks):
    """"auto" k under tensor parallelism: the acceptance alone decides (round timings differ between ranks), so every
    rank runs the same rounds (one process, which times its rounds, may choose other k)."""
    rounds = {(r["cases"]["gemma_mtp_auto_greedy"]["target_forwards"], r["cases"]["gemma_mtp_auto_greedy"]["accepted"])
              for r in ranks}
    assert len(rounds) == 1


@pytest.mark.parametrize("case", [case.name for case in tp_cases.CASES if case.mode not in ("plain", "mtp_auto")])
def test_drafters_accept_what_they_accept_in_one_process(case, ranks, single):
    """Same drafts, same verdicts: the drafters read the sharded target exactly as the whole one."""
    expected = {key: single[case][key] for key in ("accepted", "target_forwards")}
    assert expected["accepted"] > 0
    for rank, result in enumerate(ranks):
        assert {key: result["cases"][case][key] for key in expected} == expected, f"rank {rank}"


def test_each_rank_caches_its_own_share_of_the_kv_heads(ranks, gemma_dirs):
    whole = tp_cases.kv_heads(gemma_dirs, tp=False)
    for result in ranks:
        assert result["kv_heads"]["gemma"] == [n // WORLD_SIZE for n in whole["gemma"]]
        assert result["kv_heads"]["step"] == [n // WORLD_SIZE for n in whole["step"]]
        # attention kept replicated (the fix for a KV head that cannot split): every rank holds every head
        assert result["kv_heads"]["gemma_replicated_attention"] == whole["gemma_replicated_attention"]


def test_placements_that_cannot_work_are_refused_naming_the_fix(ranks):
    for result in ranks:
        errors = result["errors"]
        assert "layer 3 has 1 KV heads" in errors["one_kv_head"]
        assert "tensor-parallel size that divides" in errors["one_kv_head"]
        assert "replicate" in errors["one_kv_head"]
        assert "load it without tp_plan" in errors["sharded_drafter"]


def test_a_model_outside_a_process_group_is_not_tensor_parallel(gemma_dirs):
    model = tp_cases.target_of("gemma", gemma_dirs, tp=False)
    assert tensor_parallel_group(model) is None
    layout = model._hf_specdec.layout
    assert local_kv_layout(model, layout) == layout
    assert model._hf_specdec.ranks is None and model._hf_specdec.head_shard is None
