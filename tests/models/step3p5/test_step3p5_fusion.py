"""Step 3.5's fused forwards: where the kernels run, ``enable`` gives its norms one-launch forwards and stacks each
attention's q/k/v/gate and each MLP's gate/up projections into one storage (one GEMM per group); the model computes
what it computed before, and ``disable`` takes the forwards away."""

import copy

import torch

import hf_specdec
from hf_specdec.generation.fusion import FORCE_TRITON_ENV
from hf_specdec.kernels.stacked_linear import stacked_weight
from hf_specdec.models.step3p5.layers import Step3p5Attention, Step3p5MLP, Step3p5RMSNorm
from tests.models.step3p5.tiny_step3p5 import random_ids, tiny_model


def test_enable_stacks_the_projections_and_fuses_the_norms_where_the_kernels_run(monkeypatch):
    model = tiny_model().eval()
    reference = copy.deepcopy(model)
    ids = random_ids()
    norms = [m for m in model.modules() if isinstance(m, Step3p5RMSNorm)]
    attentions = [m for m in model.modules() if isinstance(m, Step3p5Attention)]
    mlps = [m for m in model.modules() if isinstance(m, Step3p5MLP)]
    assert len(attentions) == 7 and len(mlps) == 7  # 4 main layers + 3 MTP layers; dense MLPs and shared experts
    assert stacked_weight(attentions[0].q_proj, attentions[0].k_proj, attentions[0].v_proj) is None
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if the weights were on a GPU
    hf_specdec.enable(model)
    assert all("forward" in vars(m) for m in norms)
    for a in attentions:
        assert a.g_proj is not None and stacked_weight(a.q_proj, a.k_proj, a.v_proj, a.g_proj) is not None
    assert all(stacked_weight(m.gate_proj, m.up_proj) is not None for m in mlps)
    hf_specdec.disable(model)
    assert not any("forward" in vars(m) for m in norms)
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")  # on the CPU: the stacked weights through one F.linear each
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():
        got = model(ids).logits
        expected = reference(ids).logits
        previous = torch.randn(2, ids.shape[1], 32, generator=torch.Generator().manual_seed(1))
        mtp = model.model.mtp_forward(0, previous, ids)
        mtp_expected = reference.model.mtp_forward(0, previous, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mtp, mtp_expected, atol=1e-5, rtol=1e-5)
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=6, do_sample=False))
    # hf_specdec's own loop on the stacked weights: values are column slices of one GEMM output into the paged cache
    hf_specdec.enable(model)
    spec = model.generate(ids, max_new_tokens=6, do_sample=False, spec_mode="mtp", num_speculative_tokens=2)
    hf_specdec.disable(model)
    assert torch.equal(spec, out)


def test_a_layer_without_the_head_wise_gate_stacks_q_k_v(monkeypatch):
    model = tiny_model(use_head_wise_attn_gate=False).eval()
    reference = copy.deepcopy(model)
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    hf_specdec.enable(model)
    attention = next(m for m in model.modules() if isinstance(m, Step3p5Attention))
    assert attention.g_proj is None and stacked_weight(attention.q_proj, attention.k_proj, attention.v_proj) is not None
    hf_specdec.disable(model)
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    ids = random_ids(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
