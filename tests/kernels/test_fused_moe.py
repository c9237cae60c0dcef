"""fused_moe: the reference equals a per-token loop over the models' own activations and Step 3.5's MoE forward,
the routers equal Step 3.5's router by its definition and transformers' ``Gemma4TextRouter`` exactly, and the Triton
kernels match the reference (fp32 to 1e-5; bf16 / fp16 to a rounding: only the summation order differs)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from hf_specdec.kernels import fused_moe as fused_moe_module
from hf_specdec.kernels.fused_moe import (
    MoeConfig,
    _group_pairs,
    fused_moe,
    group_pairs,
    fused_moe_reference,
    sigmoid_bias_topk_route,
    softmax_topk_route,
    topk_route,
    topk_route_reference,
)
from hf_specdec.models.step3p5.configuration import Step3p5Config
from hf_specdec.models.step3p5.layers import Step3p5MoE, clamped_swiglu

from .conftest import run_file_cases_in_interpreter

ACTIVATIONS = [("gelu_tanh", None), ("silu", None), ("silu", 0.5)]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}
SMALL = MoeConfig(block_m=16, gate_up=(16, 16, 4, 2), down=(16, 16, 4, 2))  # several N and K tiles at test sizes


def make_moe(tokens, experts, top_k, hidden=32, inter=32, dtype=torch.float32, routing="random", stacked=True,
             seed=0, device="cpu"):
    """(x, w_gate, w_up, w_down, index, weights). stacked: gate / up are the halves of one [E, 2I, H] parameter
    (Gemma 4's gate_up_proj), else separate tensors (Step 3.5). routing "same": every token picks the same
    experts (their pairs need several blocks)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5 * 2
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    if routing == "same":
        index = torch.randperm(experts, generator=gen)[:top_k].expand(tokens, top_k)
    else:
        index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    x, gate_up, w_down = (t.to(dtype).to(device) for t in (x, gate_up, w_down))
    if stacked:
        w_gate, w_up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        w_gate, w_up = gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous()
    return x, w_gate, w_up, w_down, index.to(device), weights.to(device)


def per_token_loop(x, w_gate, w_up, w_down, index, weights, activation, limit):
    """One token and one slot at a time, with the models' activations (transformers' gelu_pytorch_tanh, Step
    3.5's clamped_swiglu); fp32 sum in slot order."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k, e in enumerate(index[t].tolist()):
            gate, up = F.linear(x[t:t + 1], w_gate[e]), F.linear(x[t:t + 1], w_up[e])
            h = ACT2FN["gelu_pytorch_tanh"](gate) * up if activation == "gelu_tanh" else clamped_swiglu(gate, up, limit)
            out[t] += F.linear(h, w_down[e])[0].float() * weights[t, k].float()
    return out.to(x.dtype)


# ---------------------------------------------------------------- reference (CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation,limit", ACTIVATIONS)
@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (8, 8), (288, 8)])
@pytest.mark.parametrize("tokens,routing", [(1, "random"), (17, "random"), (17, "same")])
def test_reference_equals_a_per_token_loop(dtype, activation, limit, experts, top_k, tokens, routing):
    args = make_moe(tokens, experts, top_k, hidden=16, inter=32, dtype=dtype, routing=routing, seed=top_k + tokens)
    got = fused_moe_reference(*args, activation=activation, limit=limit)
    assert got.shape == args[0].shape and got.dtype == dtype
    torch.testing.assert_close(got, per_token_loop(*args, activation, limit), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_step3p5_moe_forward_bit_for_bit(dtype):
    config = Step3p5Config(hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_intermediate_size=16,
                           moe_router_scaling_factor=2.5)
    torch.manual_seed(0)
    moe = Step3p5MoE(config, limit=0.5)
    for p in (moe.gate.weight, moe.router_bias, moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight):
        torch.nn.init.normal_(p, 0, 0.3)
    moe = moe.to(dtype)
    x = torch.randn(5, 32).to(dtype)
    with torch.no_grad():
        weights, experts = moe.route(x)
        got = fused_moe_reference(x, moe.gate_proj.weight, moe.up_proj.weight, moe.down_proj.weight, experts, weights,
                                  activation="silu", limit=0.5)
        assert torch.equal(got, _step3p5_moe_oracle(moe, x, weights, experts))
        assert torch.equal(moe(x), got)  # the module's forward takes this path on CPU


def _step3p5_moe_oracle(moe, x, weights, experts):
    """Step 3.5's MoE by its definition: one pass per selected expert (the module's own projections and clamped
    SwiGLU), each contribution times its weight in fp32, summed in fp32, cast back."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in experts.unique().tolist():
        token, slot = torch.where(experts == e)
        out.index_add_(0, token, moe.expert(x[token], e).float() * weights[token, slot, None])
    return out.to(x.dtype)


def test_reference_matches_gemma4_text_experts():
    """fp32 (transformers sums the experts in the model dtype; the reference in fp32, as Step 3.5 does)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    experts = Gemma4TextExperts(_gemma4_config(num_experts=8, top_k=2))
    torch.nn.init.normal_(experts.gate_up_proj, 0, 0.3)
    torch.nn.init.normal_(experts.down_proj, 0, 0.3)
    x, inter = torch.randn(6, 32), experts.intermediate_dim
    logits = torch.randn(6, 8)
    weights, index = softmax_topk_route(logits, 2)
    with torch.no_grad():
        expected = experts(x, index, weights)
    got = fused_moe_reference(x, experts.gate_up_proj[:, :inter], experts.gate_up_proj[:, inter:], experts.down_proj,
                              index, weights, activation="gelu_tanh")
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_group_pairs_blocks_hold_one_expert_each():
    """Every pair lands in exactly one row; a block's rows all belong to its expert; the bound holds."""
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, 6, (37, 3), generator=gen)
    index[:20, 0] = 4  # one expert with 20+ pairs: several blocks
    row_pair, block_expert, num_blocks, max_blocks = _group_pairs(index, 6, 16)
    pairs = index.numel()
    counts = torch.bincount(index.flatten(), minlength=6)
    assert int(num_blocks) == int(((counts + 15) // 16).sum()) <= max_blocks
    real = row_pair.view(max_blocks, 16)[: int(num_blocks)]
    assert sorted(real[real < pairs].tolist()) == list(range(pairs)) and (row_pair[16 * int(num_blocks):] == pairs).all()
    for b in range(int(num_blocks)):
        rows = real[b][real[b] < pairs]
        assert len(rows) > 0 and (index.flatten()[rows] == block_expert[b]).all()
        assert rows.tolist() == sorted(rows.tolist())  # stable: an expert's pairs keep their order


def test_bad_arguments_name_the_fix():
    x, w_gate, w_up, w_down, index, weights = make_moe(2, 8, 2, hidden=32, inter=16)
    cases = [
        ((x[:, :16], w_gate, w_up, w_down, index, weights), {}, "w_gate must be"),
        ((x, w_gate, w_up[:, :8], w_down, index, weights), {}, "w_up must be"),
        ((x, w_gate, w_up, w_down.transpose(1, 2), index, weights), {}, "w_down must be"),
        ((x[None], w_gate, w_up, w_down, index, weights), {}, r"reshape\(-1, hidden\)"),
        ((x, w_gate, w_up, w_down.double(), index, weights), {}, "share hidden_states' dtype"),
        ((x, w_gate, w_up, w_down, index[:1], weights[:1]), {}, "tokens=2"),
        ((x, w_gate, w_up, w_down, index.float(), weights), {}, "integer expert ids"),
        ((x, w_gate, w_up, w_down, index, weights), dict(activation="relu"), "activation must be"),
        ((x, w_gate, w_up, w_down, index, weights), dict(activation="gelu_tanh", limit=7.0), "silu activation only"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_moe(*args, **{"activation": "silu", **kwargs})


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("renormalize,scaling_factor", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_bias_topk_route_is_step3p5s_router(renormalize, scaling_factor, dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 288, generator=gen) * 3).to(dtype)
    logits[:, 100:110] = logits[:, 50:51]  # tied scores
    bias = torch.randn(288, generator=gen) * 0.1
    bias[100:110] = bias[50]
    got = sigmoid_bias_topk_route(logits, bias, 8, renormalize, scaling_factor)
    expected = _step3p5_route_oracle(logits, bias, 8, renormalize, scaling_factor)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _step3p5_route_oracle(logits, bias, top_k, renormalize, scaling_factor):
    """Step 3.5's router by its definition (docs/models.md §4): chosen by sigmoid + bias, weighted by sigmoid."""
    scores = torch.sigmoid(logits.float())
    index = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    weights = scores.gather(-1, index)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, index


def _gemma4_config(num_experts, top_k, hidden=32):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    return Gemma4TextConfig(hidden_size=hidden, enable_moe_block=True, num_experts=num_experts, top_k_experts=top_k,
                            moe_intermediate_size=16, intermediate_size=64, num_hidden_layers=1,
                            layer_types=["full_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            vocab_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_route_is_gemma4_text_router(dtype):
    """Same logits (the router's projection output) -> same weights and experts, tied scores included."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    torch.manual_seed(0)
    router = Gemma4TextRouter(_gemma4_config(num_experts=128, top_k=8))
    with torch.no_grad():
        router.proj.weight[60:70] = router.proj.weight[3]  # experts 3 and 60-69 tie for every token
        router.per_expert_scale.uniform_(0.5, 2.0)
    router = router.to(dtype)
    logits = []
    router.proj.register_forward_hook(lambda module, inputs, output: logits.append(output))
    with torch.no_grad():
        _, expected_weights, expected_index = router(torch.randn(7, 32).to(dtype))
        weights, index = softmax_topk_route(logits[0], 8, router.per_expert_scale)
    assert weights.dtype == torch.float32 and index.dtype == torch.int64
    assert torch.equal(weights, expected_weights) and torch.equal(index, expected_index)


@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 8), (128, 8), (288, 8)])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias"])
def test_triton_topk_route(triton_device, router, tokens, experts, top_k):
    """The kernel picks the reference's experts (distinct keys: the same ids in the same order; tied keys: the same
    key values, lower ids first) and gives their weights to a last-bit difference of the renormalising sum."""
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    if experts >= 16:  # tied scores at the top of every row: experts 2 and 9-12 are all selected, ties included
        logits[:, [2, 9, 10, 11, 12]] = logits.max(-1, keepdim=True).values + 1
    scale = torch.rand(experts, generator=gen) + 0.5
    bias = torch.randn(experts, generator=gen) * 0.1
    if router == "softmax":
        scores = torch.softmax(logits, -1)
        kwargs = dict(renormalize=True, per_expert_scale=scale.to(triton_device))
        keys = scores
    else:
        bias[9:13] = bias[2]
        scores = torch.sigmoid(logits)
        kwargs = dict(bias=bias.to(triton_device), renormalize=True, renormalize_eps=1e-20, scaling_factor=2.5)
        keys = scores + bias
    weights, index = topk_route(scores.to(triton_device), top_k, **kwargs)
    expected_weights, expected_index = topk_route_reference(scores, top_k, **{
        k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    weights, index = weights.cpu(), index.cpu()
    assert weights.dtype == torch.float32 and index.dtype == torch.int64 and index.shape == (tokens, top_k)
    ties_checked = 0
    for t in range(tokens):
        assert len(set(index[t].tolist())) == top_k
        assert torch.equal(keys[t, index[t]], keys[t, expected_index[t]])  # the same keys, in the same order
        for slot in range(top_k - 1):  # equal keys: lower id first
            if keys[t, index[t, slot]] == keys[t, index[t, slot + 1]]:
                assert index[t, slot] < index[t, slot + 1]
                ties_checked += 1
    assert ties_checked > 0 or experts < 16 or top_k == 1 or router == "sigmoid_bias"  # the tie branch ran
    order = [torch.argsort(i) for i in index]  # compare the weights expert by expert (tied slots may swap)
    expected_order = [torch.argsort(i) for i in expected_index]
    for t in range(tokens):
        if torch.equal(index[t][order[t]], expected_index[t][expected_order[t]]):
            torch.testing.assert_close(weights[t][order[t]], expected_weights[t][expected_order[t]],
                                       rtol=1e-6, atol=0)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (288, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias", "sigmoid_bias_plain"])
@pytest.mark.parametrize("layout", ["contiguous", "wider_view"])
def test_triton_routers_make_their_scores_in_the_kernel(triton_device, router, dtype, experts, top_k, layout):
    """Router logits in (the projection's dtype; contiguous, or a view of wider rows): the kernel's own fp32 softmax
    / sigmoid picks the reference's experts in its order and gives its weights (and, for the softmax, all
    probabilities, written densely) to a few ulps; the GPU's exp and division are approximations a few ulps from
    torch's. Distinct logits, exact in bf16 (multiples of 1/16 below 16 in magnitude), so the order is the
    reference's."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(5)]).float().sub(experts / 2).div(16)
    logits = logits.to(dtype)
    given = logits.to(triton_device)
    if layout == "wider_view":
        given = torch.cat([given, torch.full_like(given[:, :3], 100.0)], dim=1)[:, :experts]
        assert given.stride(0) == experts + 3
    tolerance = dict(rtol=4e-6, atol=0)
    if router == "softmax":
        scale = torch.rand(experts, generator=gen) + 0.5
        probabilities, weights, index = softmax_topk_route(given, top_k, scale.to(triton_device),
                                                           return_probabilities=True)
        expected_probabilities = torch.softmax(logits.float(), -1)
        assert probabilities.shape == (5, experts) and probabilities.is_contiguous()
        torch.testing.assert_close(probabilities.cpu(), expected_probabilities, rtol=4e-6, atol=1e-12)
        expected_weights, expected_index = topk_route_reference(expected_probabilities, top_k, renormalize=True,
                                                                per_expert_scale=scale)
        alone = softmax_topk_route(given, top_k, scale.to(triton_device))  # without writing the probabilities
        assert len(alone) == 2 and torch.equal(alone[0], weights) and torch.equal(alone[1], index)
    else:
        renormalize, factor = (True, 2.5) if router == "sigmoid_bias" else (False, 1.0)
        bias = torch.randn(experts, generator=gen) * 0.1
        weights, index = sigmoid_bias_topk_route(given, bias.to(triton_device), top_k, renormalize, factor)
        expected_weights, expected_index = topk_route_reference(
            torch.sigmoid(logits.float()), top_k, bias=bias, renormalize=renormalize, renormalize_eps=1e-20,
            scaling_factor=factor)
    assert weights.dtype == torch.float32 and index.dtype == torch.int64
    assert torch.equal(index.cpu(), expected_index)
    torch.testing.assert_close(weights.cpu(), expected_weights, **tolerance)


def test_triton_topk_route_gives_valid_experts_for_a_nan_row(triton_device):
    """A token whose scores are all NaN (a model that already diverged) still gets distinct experts in range."""
    scores = torch.rand(2, 8)
    scores[1] = float("nan")
    weights, index = topk_route(scores.to(triton_device), 3, renormalize=True)
    index = index.cpu()
    assert index.min() >= 0 and index.max() < 8 and all(len(set(row.tolist())) == 3 for row in index)
    expected_weights, expected_index = topk_route_reference(scores[:1], 3, renormalize=True)
    assert torch.equal(index[:1], expected_index)  # the other row is routed as without it
    torch.testing.assert_close(weights[:1].cpu(), expected_weights, rtol=1e-6, atol=0)


def test_topk_route_bad_arguments_name_the_fix():
    scores = torch.rand(3, 8)
    with pytest.raises(ValueError, match=r"num_experts >= top_k=9"):
        topk_route(scores, 9)
    with pytest.raises(ValueError, match=r"bias must be \[num_experts=8\]"):
        topk_route(scores, 2, bias=torch.zeros(7))
    with pytest.raises(ValueError, match=r"per_expert_scale must be \[num_experts=8\]"):
        topk_route(scores, 2, per_expert_scale=torch.ones(9))


# ---------------------------------------------------------------- Triton (GPU, or the interpreter on CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (8, 8), (288, 1), (288, 2), (288, 8)])
def test_triton_fused_moe(triton_device, dtype, experts, top_k, tokens):
    """Default launch config; the activations take turns; gelu cases on views of one stacked gate_up parameter
    (Gemma 4), silu cases on separate weights (Step 3.5)."""
    activation, limit = ACTIVATIONS[(top_k + tokens) % 3]
    args = make_moe(tokens, experts, top_k, dtype=dtype, stacked=activation == "gelu_tanh", seed=tokens + experts,
                    device=triton_device)
    assert args[1].is_contiguous() != (activation == "gelu_tanh")
    _check_against_reference(args, activation, limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_fused_moe_several_tiles_and_blocks(triton_device, dtype):
    """H and I not multiples of the tiles; all 17 tokens on the same 2 experts: 2 blocks of 16 rows each."""
    args = make_moe(17, 8, 2, hidden=40, inter=24, dtype=dtype, routing="same", device=triton_device)
    _check_against_reference(args, "silu", 0.5, SMALL)
    _check_against_reference(args, "gelu_tanh", None, SMALL)


@pytest.mark.parametrize("tokens", [1, 3])
def test_triton_fused_moe_expert_repeated_in_a_row(triton_device, tokens):
    """A routing that names one expert twice for a token (top-k never does) still sums both slots."""
    args = make_moe(tokens, 8, 4, device=triton_device)
    args[4][:, 2] = args[4][:, 0]
    _check_against_reference(args, "silu", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("count", [1, 2])
def test_triton_fused_moe_addends(triton_device, dtype, tokens, count):
    """``addends``: a shared expert's output and the residual added after the sum, each sum rounded as eager torch's
    ``(moe + shared)`` then ``residual + ...`` (bf16: the same rounding steps, so the same values up to the MoE's own
    tolerance); one addend a column slice (strided rows)."""
    args = make_moe(tokens, 8, 2, dtype=dtype, seed=tokens + count, device=triton_device)
    gen = torch.Generator().manual_seed(count)
    shared = torch.randn(tokens, 2 * 32, generator=gen).to(dtype).to(triton_device)[:, :32]
    residual = (torch.randn(tokens, 32, generator=gen) * 4).to(dtype).to(triton_device)
    addends = (shared, residual)[:count]
    got = fused_moe(*args, activation="silu", addends=addends)
    expected = fused_moe_reference(*args, activation="silu")
    for a in addends:
        expected = expected + a
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])


def test_fused_moe_addends_bad_arguments_name_the_fix():
    args = make_moe(2, 8, 2)
    with pytest.raises(ValueError, match=r"addends\[0\] must be like hidden_states"):
        fused_moe(*args, activation="silu", addends=(torch.zeros(2, 31),))
    with pytest.raises(ValueError, match="at most 2"):
        fused_moe(*args, activation="silu", addends=(args[0],) * 3)
    out = fused_moe(*args, activation="silu", addends=(args[0], args[0]))  # the torch path adds them in turn
    torch.testing.assert_close(out, fused_moe_reference(*args, activation="silu") + args[0] + args[0])


@pytest.mark.parametrize("bad", [-1, 8, 1 << 20])
def test_triton_out_of_range_expert_spoils_only_its_token(triton_device, bad):
    """Not checked (a host sync): an expert id outside [0, E) leaves its token undefined, reads no weight out of
    bounds, and the other tokens are right."""
    for tokens in (1, 3):
        args = make_moe(tokens, 8, 2, device=triton_device, seed=bad % 7)
        args[4][0, 1] = bad
        got = fused_moe(*args, activation="silu")
        assert got.shape == (tokens, 32)
        if tokens > 1:
            rest = [a[1:] if i in (0, 4, 5) else a for i, a in enumerate(args)]
            torch.testing.assert_close(got[1:].cpu(), fused_moe_reference(*rest, activation="silu").cpu(),
                                       **TOLERANCE[torch.float32])


@pytest.mark.parametrize("top_k", [2, 8])
def test_triton_fused_moe_prefill(triton_device, top_k):
    """Wider forwards take taller blocks (config_for), and past ALIGN_MAX_PAIRS pairs the torch grouping."""
    tokens = fused_moe_module.DECODE_MAX_TOKENS + 1
    args = make_moe(tokens, 8, top_k, hidden=32, inter=48, device=triton_device, seed=top_k)
    assert fused_moe_module.config_for(tokens).block_m > 16
    assert (tokens * top_k > fused_moe_module.ALIGN_MAX_PAIRS) == (top_k == 8)
    _check_against_reference(args, "gelu_tanh", None)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 8, 2, 16), (3, 288, 8, 16), (17, 8, 8, 32),
                                                           (32, 288, 8, 32), (32, 8, 8, 16)])
def test_triton_align_kernel_groups_like_the_torch_ops(triton_device, tokens, experts, top_k, block_m):
    """One Triton program (<= ALIGN_MAX_PAIRS pairs) gives the torch grouping's blocks, rows and count exactly."""
    gen = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    index[: tokens // 2, 0] = 3  # one popular expert: several blocks when tokens > block_m
    index = index.to(triton_device)
    assert index.numel() <= fused_moe_module.ALIGN_MAX_PAIRS
    row_pair, block_expert, num_blocks, max_blocks = group_pairs(index, experts, block_m)
    expected = _group_pairs(index, experts, block_m)
    assert max_blocks == expected[3] and int(num_blocks) == int(expected[2])
    assert torch.equal(row_pair.long().cpu(), expected[0].cpu())
    assert torch.equal(block_expert[: int(num_blocks)].long().cpu(), expected[1][: int(num_blocks)].cpu())


def test_triton_fused_moe_falls_back_when_unsupported(triton_device, monkeypatch, caplog):
    """Too many experts for the kernel path, or fp64: the reference's answer, and one warning per reason."""
    monkeypatch.setattr(fused_moe_module, "MAX_EXPERTS", 4)
    monkeypatch.setattr(fused_moe_module, "_warned", set())
    args = make_moe(3, 8, 2, device=triton_device)
    with caplog.at_level(logging.WARNING, logger=fused_moe_module.__name__):
        for _ in range(2):
            got = fused_moe(*args, activation="silu")
            assert torch.equal(got, fused_moe_reference(*args, activation="silu"))
        args64 = make_moe(3, 2, 2, dtype=torch.float64, device=triton_device)
        assert torch.equal(fused_moe(*args64, activation="gelu_tanh"),
                           fused_moe_reference(*args64, activation="gelu_tanh"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "MAX_EXPERTS=4" in messages[0] and "float64" in messages[1]


def _check_against_reference(args, activation, limit, config=None):
    got = fused_moe(*args, activation=activation, limit=limit, config=config)
    expected = fused_moe_reference(*args, activation=activation, limit=limit)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **TOLERANCE[args[0].dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_moe_captures_in_a_cuda_graph():
    """No host sync: the whole layer captures, and a replay on new routings gives the eager answer."""
    args = make_moe(4, 128, 8, hidden=256, inter=64, dtype=torch.bfloat16, device="cuda")
    x, w_gate, w_up, w_down, index, weights = args
    fused_moe(*args, activation="gelu_tanh")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*args, activation="gelu_tanh")
    index.copy_(torch.rand(4, 128, device="cuda").topk(8, dim=-1).indices)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(*args, activation="gelu_tanh"), atol=0, rtol=0)


# ---------------------------------------------------------------- this file alone, in the interpreter


def test_fused_moe_cases_in_interpreter(request):
    """This file by itself on CPU: its ``triton_`` tests in the interpreter (``conftest.run_file_cases_in_interpreter``)."""
    run_file_cases_in_interpreter(request, __file__, min_passed=20)


def test_triton_gemma4_moe_model_through_the_experts_interface(triton_device):
    """A whole tiny Gemma 4 MoE model (26B-A4B style) after enable: its experts run fused_moe through
    transformers' experts interface (and the fused decoder layer around them), with the un-enabled model's
    logits and greedy tokens (fp32)."""
    import hf_specdec
    from hf_specdec.generation import experts as experts_module
    from tests.tiny_models import gemma4_26b_style, left_padded_batch

    ref = gemma4_26b_style().to(triton_device)
    model = hf_specdec.enable(gemma4_26b_style().to(triton_device), cuda_graphs=False)
    ids, mask = (t.to(triton_device) for t in left_padded_batch([9, 4, 7]))
    calls = []
    original = experts_module.fused_moe
    experts_module.fused_moe = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.inference_mode():
            expected, got = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        tokens = model.generate(ids, **kwargs)
    finally:
        experts_module.fused_moe = original
    assert len(calls) >= model.config.num_hidden_layers
    assert all("forward" in vars(layer) for layer in model.model.layers)  # the fused decoder layer, MoE branch
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, ref.generate(ids, **kwargs))


@pytest.mark.parametrize("case", ["random", "same", "repeated", "out_of_range"])
def test_triton_expert_kernels_group_few_pairs_themselves(triton_device, monkeypatch, case):
    """Up to FEW_MAX_PAIRS pairs the expert kernels group the pairs (no grouping launch): the answer is the one the
    grouping launch gives and the reference's, an expert with more than BLOCK_M pairs in several blocks included
    ("same": 20 tokens on 2 experts, 20 pairs each); an out-of-range id spoils only its token."""
    tokens = 20 if case == "same" else 5
    args = make_moe(tokens, 8, 2, hidden=40, inter=24, routing="same" if case == "same" else "random",
                    device=triton_device, seed=3)
    if case == "repeated":
        args[4][:, 1] = args[4][:, 0]
    if case == "out_of_range":
        args[4][0, 1] = 8
    assert fused_moe_module.route_blocks(args[4], 8, 16)[0] >= args[4].numel()  # the kernels group the pairs
    grouped_in_kernels = fused_moe(*args, activation="silu")
    monkeypatch.setattr(fused_moe_module, "FEW_MAX_PAIRS", 0)
    assert fused_moe_module.route_blocks(args[4], 8, 16)[0] == 0
    grouped_before = fused_moe(*args, activation="silu")
    first = 1 if case == "out_of_range" else 0
    if case != "out_of_range":
        torch.testing.assert_close(grouped_in_kernels.cpu(), fused_moe_reference(*args, activation="silu").cpu(),
                                   **TOLERANCE[torch.float32])
    torch.testing.assert_close(grouped_in_kernels[first:].cpu(), grouped_before[first:].cpu(), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- gpt-oss: biases, interleaved gate/up, its SwiGLU


def _gpt_oss_experts(experts=8, top_k=2, hidden=32, inter=24, dtype=torch.float32, device="cpu"):
    """transformers' GptOssExperts with random weights and biases (its own layout: [E, H, 2I] interleaved gate/up
    columns, biases [E, 2I] and [E, H]), a limit that clamps, and its module-level config."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=top_k)
    module = GptOssExperts(config)
    module.limit = 1.5  # (its configs fix 7.0 in some versions)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.6 if p.dim() == 3 else 0.5))
    return module.to(device, dtype)


def _gpt_oss_args(module, tokens, top_k, seed=0):
    from hf_specdec.generation.experts import fused_weights

    w_gate, w_up, w_down, terms = fused_weights(module)
    gen = torch.Generator().manual_seed(seed)
    device, dtype = w_gate.device, w_gate.dtype
    x = torch.randn(tokens, w_gate.shape[2], generator=gen).to(device, dtype)
    index = torch.rand(tokens, w_gate.shape[0], generator=gen).topk(top_k, dim=-1).indices.to(device)
    weights = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
    return (x, w_gate, w_up, w_down, index, weights), terms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 6])
def test_reference_is_gpt_oss_experts(dtype, tokens):
    """The reference with gpt-oss's terms (registered for its experts' own gate: interleaved columns, biases,
    ``swiglu_oai`` with its limit and alpha) computes transformers' GptOssExperts: to fp32 rounding, and in bf16 to
    the last roundings (transformers sums the weighted parts in bf16 in expert order, the reference in fp32)."""
    module = _gpt_oss_experts(dtype=dtype)
    args, terms = _gpt_oss_args(module, tokens, 2)
    assert terms["activation"] == "swiglu_oai" and terms["limit"] == 1.5 and terms["alpha"] == module.alpha
    storage = module.gate_up_proj.untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in args[1:3])  # views of the parameter, not copies
    x, _, _, _, index, weights = args
    with torch.no_grad():
        expected = type(module).forward.__wrapped__(module, x, index, weights)
    got = fused_moe_reference(*args, **terms)
    torch.testing.assert_close(got, expected, **({} if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)))
    # the terms matter: without the biases, or with the plain SwiGLU, the answer moves
    plain = dict(terms, biases=None)
    assert (fused_moe_reference(*args, **plain).float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_triton_fused_moe_gpt_oss_terms(triton_device, dtype, tokens):
    """Biases and ``swiglu_oai`` in the expert kernels over gpt-oss's interleaved views: one token (each pair its
    block), 5 (grouped in the kernels) and 40 (the grouping launch); odd widths over the small tiles."""
    module = _gpt_oss_experts(hidden=40, inter=24, dtype=dtype, device=triton_device)
    args, terms = _gpt_oss_args(module, tokens, 2, seed=tokens)
    for config in (None, SMALL):
        got = fused_moe(*args, **terms, config=config)
        expected = fused_moe_reference(*args, **terms)
        torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])


def test_gpt_oss_experts_with_biases_of_another_dtype_keep_their_own_forward():
    """Biases the kernels would refuse (another dtype than the weights): no fused terms, so the module's own forward
    runs instead of an error."""
    from hf_specdec.generation.experts import fused_weights

    module = _gpt_oss_experts()
    assert fused_weights(module) is not None
    module.down_proj_bias.data = module.down_proj_bias.data.double()
    assert fused_weights(module) is None


def test_gpt_oss_terms_bad_arguments_name_the_fix():
    module = _gpt_oss_experts()
    args, terms = _gpt_oss_args(module, 2, 2)
    with pytest.raises(ValueError, match="needs its limit"):
        fused_moe(*args, **dict(terms, alpha=None))
    with pytest.raises(ValueError, match="alpha is the slope"):
        fused_moe(*args, activation="silu", alpha=1.0)
    gate, up, down = terms["biases"]
    with pytest.raises(ValueError, match="the down bias must be"):
        fused_moe(*args, **dict(terms, biases=(gate, up, down[:, :-1])))
