"""The fused forwards on a tensor-parallel model's shards (the default; ``HF_SPECDEC_TP_FUSED=0`` keeps transformers'
forwards), the sharded projections on hf_specdec's forward, the column-parallel ones stacked: two gloo ranks run them
with the Triton bodies interpreted on the CPU and commit the tokens of one plain process. The case is Step 3.5 (MoE
layers, experts sharded): its fused decoder layer added the residual and the shared expert inside the experts' sum
launch, which the tensor-parallel all-reduce then counted once per rank. About a minute on two cores (the
interpreter)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_specdec.generation.fusion import FORCE_TRITON_ENV
from tests.distributed import tp_cases, tp_worker

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

CASE = "step_plain_greedy"
NEW_TOKENS = 3


def test_fused_forwards_on_the_shards_commit_the_tokens_of_one_process(tmp_path, monkeypatch):
    dirs = tp_cases.write_shardable_gemma(tmp_path / "models")
    env = {FORCE_TRITON_ENV: "1", "TRITON_INTERPRET": "1"}
    ranks = tp_worker.spawn_ranks(dirs, tmp_path, "gloo", dict(env=env, cases=[CASE], max_new_tokens=NEW_TOKENS))
    monkeypatch.setattr(tp_cases, "MAX_NEW_TOKENS", NEW_TOKENS)
    case = next(c for c in tp_cases.CASES if c.name == CASE)
    single = tp_cases.run_case(case, dirs, tp=False)
    for rank, result in enumerate(ranks):
        sharded = result["sharded_projections"][CASE]
        assert result["fused_modules"][CASE] > 0 and sharded["forwards"] > 0 and sharded["stacked"] > 0, rank
        # the LM head and the MTP layers' heads, their logits gathered by hf_specdec; the tied embedding's lookup
        assert sharded["gathers"] == 4 and sharded["embeddings"] == 1, (rank, sharded)
        assert result["cases"][CASE]["tokens"] == single["tokens"], f"rank {rank}"
