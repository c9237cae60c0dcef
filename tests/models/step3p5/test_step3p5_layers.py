"""Step 3.5 building blocks against hand-computed references."""

import pytest
import torch
import torch.nn.functional as F

from hf_specdec.kernels.fused_moe import sigmoid_bias_topk_route
from hf_specdec.models.step3p5.layers import (
    Step3p5Attention,
    Step3p5MoE,
    Step3p5RMSNorm,
    clamped_swiglu,
)

from .tiny_step3p5 import tiny_config


def test_rmsnorm_is_zero_centred_and_computes_in_fp32():
    norm = Step3p5RMSNorm(4, eps=1e-5)
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    rms = x.pow(2).mean().add(1e-5).sqrt()
    assert torch.allclose(norm(x), x / rms)  # weight 0 -> scale 1
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    assert torch.allclose(norm(x), x / rms * torch.tensor([1.0, 2.0, 0.0, 1.5]))
    xb = torch.randn(3, 4).bfloat16()
    xf = xb.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight)).bfloat16()
    assert norm(xb).dtype == torch.bfloat16 and torch.equal(norm(xb), expected)


def test_swiglu_clamp_semantics():
    gate = torch.tensor([10.0, -10.0, 1.0])
    up = torch.tensor([20.0, -20.0, 0.5])
    assert torch.allclose(clamped_swiglu(gate, up, None), F.silu(gate) * up)
    limit = 7.0  # silu(gate) clamped above only; up clamped to [-7, 7]
    silu = F.silu(torch.tensor([-10.0, 1.0]))
    expected = torch.stack([torch.tensor(7.0 * 7.0), silu[0] * -7.0, silu[1] * 0.5])
    assert torch.allclose(clamped_swiglu(gate, up, limit), expected)


def test_router_selects_with_bias_but_weights_by_score():
    logits = torch.logit(torch.tensor([[0.9, 0.5, 0.1]]))
    bias = torch.tensor([0.0, 0.0, 1.0])  # 0.1 + 1.0 beats 0.5: expert 2 replaces expert 1
    weights, experts = sigmoid_bias_topk_route(logits, bias, top_k=2, renormalize=True, scaling_factor=2.5)
    assert sorted(experts[0].tolist()) == [0, 2]
    by_expert = dict(zip(experts[0].tolist(), weights[0].tolist()))
    assert abs(by_expert[0] - 0.9 / 1.0 * 2.5) < 1e-5 and abs(by_expert[2] - 0.1 / 1.0 * 2.5) < 1e-5
    weights, _ = sigmoid_bias_topk_route(logits, bias, top_k=2, renormalize=False, scaling_factor=1.0)
    assert sorted(weights[0].tolist()) == pytest.approx([0.1, 0.9], abs=1e-5)


def _moe_reference(moe: Step3p5MoE, x: torch.Tensor, chosen: list[list[int]]) -> torch.Tensor:
    """Per-token loop: sum over the given experts of score-weights (renormalised, scaled) x expert(x)."""
    out = []
    for t, experts in enumerate(chosen):
        scores = torch.sigmoid(x[t] @ moe.gate.weight.T)[experts]
        weights = scores / scores.sum() * moe.scaling_factor
        y = torch.zeros_like(x[t])
        for w, e in zip(weights, experts):
            act = clamped_swiglu(moe.gate_proj.weight[e] @ x[t], moe.up_proj.weight[e] @ x[t], moe.limit)
            y = y + w * (moe.down_proj.weight[e] @ act)
        out.append(y)
    return torch.stack(out)


def test_moe_output_matches_hand_reference_when_bias_flips_selection():
    torch.manual_seed(0)
    config = tiny_config()
    moe = Step3p5MoE(config, limit=0.5)
    for p in (moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight):
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(1, 2, config.hidden_size)
    with torch.no_grad():
        # token 0 scores (0.9, 0.5, 0.1), token 1 scores (0.2, 0.8, 0.6): gate rows solve x @ W.T = logit
        target = torch.logit(torch.tensor([[0.9, 0.5, 0.1], [0.2, 0.8, 0.6]]))
        moe.gate.weight.copy_(torch.linalg.lstsq(x[0], target).solution.T)
        moe.router_bias.copy_(torch.tensor([0.0, 0.0, 1.0]))
    assert torch.allclose(torch.sigmoid(x[0] @ moe.gate.weight.T), torch.sigmoid(target), atol=1e-4)
    out = moe(x)[0]
    assert torch.allclose(out, _moe_reference(moe, x[0], [[0, 2], [1, 2]]), atol=1e-5)
    assert not torch.allclose(out[0], _moe_reference(moe, x[0], [[0, 1], [1, 2]])[0], atol=1e-3)


def _eager_config(**overrides):
    config = tiny_config(**overrides)
    config._attn_implementation = "eager"
    return config


def _attention_pair():
    torch.manual_seed(0)
    gated = Step3p5Attention(_eager_config(), layer_idx=1)
    plain = Step3p5Attention(_eager_config(use_head_wise_attn_gate=False), layer_idx=1)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("g_proj")})
    return gated.eval(), plain.eval()


def test_head_wise_gate_scales_each_head_before_o_proj():
    gated, plain = _attention_pair()
    assert gated.g_proj.weight.shape == (4, 32) and gated.num_heads == 4  # sliding layer: 4 query heads
    x = torch.randn(1, 3, 32)
    mask = torch.full((3, 3), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        gated.g_proj.weight.zero_()  # sigmoid(0) = 1/2 for every head
        assert torch.allclose(gated(x, None, mask)[0], 0.5 * plain(x, None, mask)[0], atol=1e-6)
        gated.g_proj.weight[0].copy_(-100 * x[0, 0] / x[0, 0].pow(2).sum())  # token 0: head-0 gate sigmoid(-100)
        plain.o_proj.weight[:, :8].zero_()  # the ungated reference without head 0
        got = gated(x, None, mask)[0][0, 0]
        assert torch.allclose(got, 0.5 * plain(x, None, mask)[0][0, 0], atol=1e-5)
