"""qkv_norm_rope: the torch reference is transformers' Gemma 4 q/k/v norm + rotary ops bit for bit; the
Triton kernel matches it (fp32 to rounding of the mean, bf16 to one rounding step)."""

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

from hf_specdec.kernels.norm_rope import qkv_norm_rope, qkv_norm_rope_reference
from hf_specdec.kernels.fused_moe import softmax_topk_route
from hf_specdec.kernels.gelu_mul import silu_mul
from hf_specdec.kernels.rms_norm import dual_norm_add, norm_add, rms_norm


def _case(dtype, device="cpu", batch=2, seq=3, q_heads=4, kv_heads=2, dim=32, cos_batch=None, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q, k, v = rand(batch, seq, q_heads, dim), rand(batch, seq, kv_heads, dim), rand(batch, seq, kv_heads, dim)
    angles = torch.rand(cos_batch or batch, seq, dim // 2, generator=gen) * 6
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    weights = (rand(dim), rand(dim), None)
    return q, k, v, weights, (1e-6, 1e-5, 1e-6), cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_transformers_ops_exactly(dtype):
    q, k, v, weights, eps, cos, sin = _case(dtype)
    norms = []
    for w, e in zip(weights, eps):
        norm = Gemma4RMSNorm(q.shape[-1], eps=e, with_scale=w is not None)
        if w is not None:
            norm.weight.data = w.float()
        norms.append(norm.to(dtype))
    expected = (apply_rotary_pos_emb(norms[0](q), cos, sin, unsqueeze_dim=2),
                apply_rotary_pos_emb(norms[1](k), cos, sin, unsqueeze_dim=2), norms[2](v))
    got = qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def _assert_close(got, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected.cpu(), atol=2e-6, rtol=2e-6)
    else:  # a rounding step of the products (|x| < 8 here), which may cancel in the sum; Triton's CPU
        # interpreter also truncates where the GPU rounds to nearest
        torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), atol=0.07, rtol=0.02)


@pytest.mark.parametrize("dtype,dim,cos_batch", [(torch.float32, 32, None), (torch.bfloat16, 32, 1),
                                                  (torch.float32, 24, 1)])
def test_triton_qkv_norm_rope(triton_device, dtype, dim, cos_batch):
    q, k, v, weights, eps, cos, sin = _case(dtype, triton_device, dim=dim, cos_batch=cos_batch)
    got = qkv_norm_rope(q, k, v, weights, eps, cos, sin)
    expected = qkv_norm_rope_reference(q, k, v, weights, eps, cos, sin)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype and g.is_contiguous()
        _assert_close(g, e, dtype)


def test_triton_qkv_norm_rope_q_only_and_shared_kv_input(triton_device):
    q, k, _, weights, eps, cos, sin = _case(torch.float32, triton_device)
    # q only (a Q-only drafter)
    got_q, none_k, none_v = qkv_norm_rope(q, None, None, weights, eps, cos, sin)
    assert none_k is None and none_v is None
    _assert_close(got_q, qkv_norm_rope_reference(q, None, None, weights, eps, cos, sin)[0], torch.float32)
    # v is k (Gemma 4's k_eq_v layers): v is normalised from the raw keys, not the rotated ones; and a
    # non-contiguous q (a slice of a wider projection)
    wide = torch.randn(*q.shape[:2], q.shape[2] + 1, q.shape[3], device=triton_device)
    q_view = wide[:, :, 1:]
    got = qkv_norm_rope(q_view, k, k, weights, eps, cos, sin)
    expected = qkv_norm_rope_reference(q_view, k, k, weights, eps, cos, sin)
    for g, e in zip(got, expected):
        _assert_close(g, e, torch.float32)


def _qwen3_heads(x, weight, eps, cos, sin):
    """transformers' Qwen3 q/k ops after the projection (a DFlash drafter's attention): its RMSNorm, then rotary."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    norm.weight.data = weight.clone()
    return apply_rotary_pos_emb(norm(x), cos, sin, unsqueeze_dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rounding_before_the_weight_is_qwen3s_ops_exactly(dtype):
    """``round_before_weight``: transformers' Qwen3 norm (``weight * norm(x).to(dtype)``) then rotary, bit for bit;
    in bf16 it differs from Gemma 4's order (one rounding of the fp32 weight product)."""
    q, k, _, weights, eps, cos, sin = _case(dtype, seed=3)
    got = qkv_norm_rope_reference(q, k, None, weights, eps, cos, sin, round_before_weight=True)
    assert got[2] is None
    for g, x, w, e in zip(got, (q, k), weights, eps):
        assert torch.equal(g, _qwen3_heads(x, w, e, cos, sin))
    if dtype == torch.bfloat16:
        assert not torch.equal(got[0], qkv_norm_rope_reference(q, k, None, weights, eps, cos, sin)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_qkv_norm_rope_rounding_before_the_weight(triton_device, dtype):
    q, k, _, weights, eps, cos, sin = _case(dtype, triton_device, seed=3)
    got = qkv_norm_rope(q, k, None, weights, eps, cos, sin, round_before_weight=True)
    expected = qkv_norm_rope_reference(q, k, None, weights, eps, cos, sin, round_before_weight=True)
    assert got[2] is None
    for g, e in zip(got[:2], expected[:2]):
        assert g.shape == e.shape and g.dtype == e.dtype
        _assert_close(g, e, dtype)


def test_bad_shapes_name_the_fix():
    q, k, v, weights, eps, cos, sin = _case(torch.float32)
    with pytest.raises(ValueError, match="v needs k"):
        qkv_norm_rope(q, None, v, weights, eps, cos, sin)
    with pytest.raises(ValueError, match="cos/sin must be"):
        qkv_norm_rope(q, k, v, weights, eps, cos, sin[..., :-2])
    with pytest.raises(ValueError, match="even number of rotated dims"):
        qkv_norm_rope(q, k, v, weights, eps, cos[..., :-1], sin[..., :-1])
    with pytest.raises(ValueError, match="needs its weight"):
        qkv_norm_rope(q, k, v, weights, eps, cos, sin, weight_offset=1.0)  # v has no weight
    with pytest.raises(ValueError, match="pass weights in it"):
        qkv_norm_rope(q, k, None, (weights[0].double(), weights[1], None), eps, cos, sin, round_before_weight=True)


def _step3p5_heads(q, k, cos, sin, q_weight, k_weight, eps):
    """Step 3.5's eager attention ops between the projections and the cache: its zero-centred q/k norms (1 +
    weight), then partial rotary over the first cos.shape[-1] dims (layers.apply_partial_rotary)."""
    from hf_specdec.models.step3p5.layers import Step3p5RMSNorm, apply_partial_rotary

    norms = []
    for w in (q_weight, k_weight):
        norm = Step3p5RMSNorm(q.shape[-1], eps).to(q.dtype)
        norm.weight.data = w.clone()
        norms.append(norm.to(q.device))
    query, key = (n(x).transpose(1, 2) for n, x in zip(norms, (q, k)))  # [batch, heads, seq, dim]
    query, key = apply_partial_rotary(query, key, cos, sin)
    return query.transpose(1, 2), key.transpose(1, 2)


@pytest.mark.parametrize("dtype,rot", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 32)])
def test_triton_partial_rotary_zero_centred_norms_and_no_v_are_step3p5s_heads(triton_device, dtype, rot):
    """Step 3.5's layers: q and k normalised by 1 + weight, only the first ``rot`` dims rotated (half the head on
    its full-attention layers), the values left alone (v None)."""
    q, k, _, _, eps, _, _ = _case(dtype, triton_device, dim=32, seed=2)
    gen = torch.Generator().manual_seed(7)
    q_weight, k_weight = ((torch.randn(32, generator=gen) * 0.2).to(dtype).to(triton_device) for _ in range(2))
    angles = torch.rand(q.shape[0], q.shape[1], rot // 2, generator=gen) * 6
    angles = torch.cat([angles, angles], -1)
    cos, sin = (f(angles).to(dtype).to(triton_device) for f in (torch.cos, torch.sin))
    got_q, got_k, none_v = qkv_norm_rope(q, k, None, (q_weight, k_weight, None), (1e-5, 1e-5, 0.0), cos, sin,
                                         weight_offset=1.0)
    assert none_v is None
    ref_q, ref_k, _ = qkv_norm_rope_reference(q, k, None, (q_weight, k_weight, None), (1e-5, 1e-5, 0.0), cos, sin,
                                              weight_offset=1.0)
    step_q, step_k = _step3p5_heads(q, k, cos, sin, q_weight, k_weight, 1e-5)
    for got, ref, step in ((got_q, ref_q, step_q), (got_k, ref_k, step_k)):
        _assert_close(got, ref, dtype)
        _assert_close(ref, step, dtype)  # the reference is Step 3.5's ops (rsqrt vs pow(-0.5): rounding)


def test_triton_fused_step3p5_forwards_keep_the_models_logits(triton_device, monkeypatch):
    """enable's Step 3.5 forwards inside a whole tiny Step 3.5 (full layers rotating half of each head, sliding
    layers all of it; dense and MoE layers; MTP layers): one qkv_norm_rope launch per attention (zero-centred q/k
    norms, no v norm), one rms_norm launch per other norm, q/k/v/gate and gate/up stacked into one GEMM each; per
    layer the residual add and the norm after the attention in one add_rms_norm launch, the head-wise gate in one
    head_gate_mul launch, and an MoE layer's shared expert and residual added in the experts' sum launch."""
    from hf_specdec.generation.fusion import fuse_modules, unfuse_modules
    from hf_specdec.kernels.stacked_linear import stacked_weight
    from hf_specdec.models.step3p5 import fusion
    from hf_specdec.kernels.gelu_mul import head_gate_mul
    from hf_specdec.kernels.rms_norm import add_rms_norm
    from hf_specdec.models.step3p5.layers import Step3p5Attention, Step3p5MLP, Step3p5MoE, Step3p5RMSNorm
    from tests.models.step3p5.tiny_step3p5 import random_ids, tiny_model

    model = tiny_model().eval().to(triton_device)
    ids = random_ids().to(triton_device)
    previous = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    previous = previous.to(triton_device)
    with torch.inference_mode():
        expected, expected_mtp = model(ids).logits, model.model.mtp_forward(0, previous, ids)
        attentions = [m for m in model.modules() if isinstance(m, Step3p5Attention)]
        mlps = [m for m in model.modules() if isinstance(m, Step3p5MLP)]
        norms = [m for m in model.modules() if isinstance(m, Step3p5RMSNorm)]
        fuse_modules(model)
        assert all("forward" in vars(m) for m in attentions + norms)
        assert all(stacked_weight(m.q_proj, m.k_proj, m.v_proj, m.g_proj) is not None for m in attentions)
        assert all(stacked_weight(m.gate_proj, m.up_proj) is not None for m in mlps)
        ropes, normed, swiglus, added, gated, moe_addends = [], [], [], [], [], []
        monkeypatch.setattr(fusion, "qkv_norm_rope", lambda *a, **kw: ropes.append(a[6].shape[-1])
                            or qkv_norm_rope(*a, **kw))
        monkeypatch.setattr(fusion, "rms_norm", lambda *a, **kw: normed.append(1) or rms_norm(*a, **kw))
        monkeypatch.setattr(fusion, "silu_mul", lambda *a: swiglus.append(a[2]) or silu_mul(*a))
        monkeypatch.setattr(fusion, "add_rms_norm", lambda *a, **kw: added.append(1) or add_rms_norm(*a, **kw))
        monkeypatch.setattr(fusion, "head_gate_mul", lambda *a: gated.append(1) or head_gate_mul(*a))
        moe_forward = Step3p5MoE.forward
        monkeypatch.setattr(Step3p5MoE, "forward", lambda self, x, addends=(): moe_addends.append(len(addends))
                            or moe_forward(self, x, addends))
        got = model(ids).logits
        got_mtp = model.model.mtp_forward(0, previous, ids)
        main = model.config.num_hidden_layers
        moe_layers = sum(model.config.is_moe_layer(i) for i in range(main + 1))
        assert len(ropes) == main + 1 and set(ropes) == {4, 8}  # full layers rotate 4 of 8 dims
        assert len(normed) == main + 1 + 3  # a layer's first norm and the final norm; the MTP layer's first
        # norm and its norms of the embeddings and of the previous hidden states
        assert len(added) == len(gated) == main + 1  # every layer's second norm, its gate
        assert moe_layers and moe_addends == [2] * moe_layers  # the shared expert's output and the residual
        assert len(swiglus) == main + 1 and set(swiglus) == {0.7, None}  # MLPs, shared experts (layer 2 clamps)
        unfuse_modules(model)
    assert not any("forward" in vars(m) for m in attentions + norms)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # fp32: the order of the norms' sums
    torch.testing.assert_close(got_mtp, expected_mtp, atol=1e-4, rtol=1e-4)


def test_triton_dflash_drafter_kernels_keep_its_block_and_context(triton_device, monkeypatch):
    """A DFlash drafter where the kernels run: per layer one qkv_norm_rope launch for the block's q and k (Qwen3's
    rounding), one rms_norm launch per norm, q/k/v and gate/up as one GEMM each (stacked), one silu_mul launch; the
    context K/V one GEMM and one launch per layer. The block and the context equal the modules' own ops (run with the
    kernels forced off)."""
    from hf_specdec.kernels.stacked_linear import stacked_weight
    from hf_specdec.models.dflash import DenseDFlashContext
    from hf_specdec.models.dflash import modeling
    from tests.models.dflash.helpers import random_drafter
    from tests.tiny_models import gemma4_31b_style

    target = gemma4_31b_style()
    drafter = random_drafter(target, block_size=5).eval()
    drafter.stack_projections()
    target, drafter = target.to(triton_device), drafter.to(triton_device)
    drafter.stack_projections()  # .to() on CPU keeps the storage; on a GPU it separated the weights again
    layer = drafter.layers[0]
    assert stacked_weight(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) is not None
    assert stacked_weight(layer.mlp.gate_proj, layer.mlp.up_proj) is not None
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 7, drafter.config.hidden_size, generator=gen).to(triton_device)
    ids = torch.randint(3, 96, (2, 5), generator=gen).to(triton_device)
    positions = 7 + torch.arange(5, device=triton_device)[None].expand(2, -1)

    def run():
        embeds = drafter.embed_block(target, ids)
        block = drafter.draft_block(embeds, positions, DenseDFlashContext.from_features(drafter, features))
        return block, drafter.context_kv_all_layers(features, torch.arange(7, device=triton_device)[None])

    with torch.inference_mode():
        monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "0")
        expected, expected_kv = run()
        monkeypatch.setenv("HF_SPECDEC_FORCE_TRITON", "1")
        heads, normed, swiglus = [], [], []
        monkeypatch.setattr(modeling, "qkv_norm_rope", lambda *a, **kw: heads.append(kw["round_before_weight"])
                            or qkv_norm_rope(*a, **kw))
        monkeypatch.setattr(modeling, "rms_norm", lambda *a, **kw: normed.append(1) or rms_norm(*a, **kw))
        monkeypatch.setattr(modeling, "silu_mul", lambda *a: swiglus.append(1) or silu_mul(*a))
        got, got_kv = run()
    layers = len(drafter.layers)
    # the block's q/k per layer, then each layer's context keys (the dense context's and the context_kv call's)
    assert heads == [True] * (3 * layers)
    assert len(normed) == 2 * layers + 1  # two norms a layer and the block's final norm
    assert len(swiglus) == layers
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # fp32: the order of the norms' sums
    for (gk, gv), (ek, ev) in zip(got_kv, expected_kv):
        torch.testing.assert_close(gk, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv, ev, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", ["gemma4_31b_style", "gemma4_e2b_style", "gemma4_26b_style"])
def test_triton_fused_gemma4_attention_keeps_the_models_logits(triton_device, build, monkeypatch):
    """enable's fused attention forward (one qkv_norm_rope launch per layer) and decoder-layer forward
    (norm_add at the residual seams) and MLP forward (gelu_tanh_mul) inside a whole model: sliding and full
    layers, k_eq_v layers (v normalised from the raw keys), KV-shared layers (a query-only qkv_norm_rope over
    the producer's K/V), per-layer-input blocks (their gate fused too: three norm_add seams per layer
    instead of two) and MoE blocks (the experts' pre-norm from the first seam, both branches ending in one
    dual_norm_add; the router's softmax and top-k in one softmax_topk_route launch)."""
    from hf_specdec.models.gemma4 import fusion
    from hf_specdec.generation.fusion import fuse_modules, unfuse_modules
    from hf_specdec.kernels.stacked_linear import stacked_weight
    from tests import tiny_models

    model = getattr(tiny_models, build)().to(triton_device)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    ids = ids.to(triton_device)
    with torch.inference_mode():
        expected = model(ids).logits
        attentions = [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"]
        shared = [m for m in attentions if m.is_kv_shared_layer]
        layers = [m for m in model.modules() if type(m).__name__ in ("Gemma4TextDecoderLayer", "Gemma4TextMLP")]
        fuse_modules(model)
        assert all("forward" in vars(m) for m in attentions)
        assert all("forward" in vars(m) for m in layers)
        # q/k/v (gate/up) weights now share one storage each: the fused forwards run one GEMM for them
        assert all(stacked_weight(m.q_proj, m.k_proj, *([m.v_proj] if m.v_proj is not None else [])) is not None
                   for m in attentions if m not in shared)
        assert all(stacked_weight(m.gate_proj, m.up_proj) is not None for m in layers if hasattr(m, "gate_proj"))
        seams, ropes, routes = [], [], []
        monkeypatch.setattr(fusion, "norm_add", lambda *a, **kw: seams.append(1) or norm_add(*a, **kw))
        monkeypatch.setattr(fusion, "dual_norm_add", lambda *a, **kw: seams.append(1) or dual_norm_add(*a, **kw))
        monkeypatch.setattr(fusion, "softmax_topk_route",
                            lambda *a, **kw: routes.append(1) or softmax_topk_route(*a, **kw))
        monkeypatch.setattr(fusion, "qkv_norm_rope", lambda *a, **kw: ropes.append(1) or qkv_norm_rope(*a, **kw))
        got = model(ids).logits
        per_layer = bool(model.config.get_text_config().hidden_size_per_layer_input)
        assert len(seams) == (3 if per_layer else 2) * len(attentions) and len(ropes) == len(attentions)
        moe_layers = sum(1 for m in model.modules() if getattr(m, "enable_moe_block", False))
        assert len(routes) == moe_layers and (moe_layers > 0) == (build == "gemma4_26b_style")
        unfuse_modules(model)
    assert not any("forward" in vars(m) for m in attentions + layers)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # fp32: the order of the norms' sums


def test_triton_fused_forwards_leave_training_to_torch(triton_device):
    """The kernels have no backward: where autograd tracks the input, the fused forwards run transformers'
    ops, so gradients are the unfused model's exactly."""
    from hf_specdec.generation.fusion import fuse_modules, unfuse_modules
    from tests.tiny_models import gemma4_31b_style

    model = gemma4_31b_style().to(triton_device)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    params = [model.model.layers[0].self_attn.q_norm.weight, model.model.layers[0].post_attention_layernorm.weight]

    def grads():
        return torch.autograd.grad(model(ids.to(triton_device)).logits.square().mean(), params)

    expected = grads()
    fuse_modules(model)
    got = grads()
    unfuse_modules(model)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("build", ["gemma4_31b_style", "gemma4_e2b_style", "gemma4_26b_style"])
def test_triton_fused_gemma4_generate_gives_transformers_tokens(triton_device, build):
    """Invariant 1 through every Triton kernel (paged attention, K/V store, norms, qkv_norm_rope, norm_add,
    gelu_tanh_mul): an enabled 31B-style model's greedy tokens are transformers' own, and an E2B-style one's
    (per-layer inputs, KV-shared layers), and a 26B-A4B-style one's (MoE blocks: fused router, experts and
    seams) (fp32)."""
    import hf_specdec
    from tests import tiny_models
    from tests.tiny_models import left_padded_batch

    moe = build == "gemma4_26b_style"  # the interpreter runs its experts slowly: a smaller case on CPU
    ids, mask = left_padded_batch([12, 3] if moe and triton_device == "cpu" else [12, 3, 9, 6])
    kwargs = dict(attention_mask=mask.to(triton_device), max_new_tokens=4 if moe and triton_device == "cpu" else 8,
                  do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = getattr(tiny_models, build)().to(triton_device).generate(ids.to(triton_device), **kwargs)
    model = hf_specdec.enable(getattr(tiny_models, build)().to(triton_device))
    assert torch.equal(model.generate(ids.to(triton_device), **kwargs), expected)


def test_triton_mtp_drafting_proposes_the_reference_drafts(triton_device, monkeypatch):
    """The MTP assistant drafting through the kernels (fused norms and seams, q norm + rotary, gelu gate,
    paged Q-only attention, the centroid head's gather_matvec) proposes what its torch ops propose: the same
    number of target forwards for the same greedy tokens (fp32, bundled tiny family)."""
    import transformers

    import hf_specdec
    from hf_specdec.assets import asset_path, held_out_snippets
    from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV

    path = asset_path("tiny-gemma4")
    target = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(triton_device)
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                dtype=torch.float32).to(triton_device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(held_out_snippets()[0]["text"][:200], return_tensors="pt").input_ids.to(triton_device)
    hf_specdec.enable(target, cuda_graphs=False)
    runs = {}
    for force in ("0", "1"):
        monkeypatch.setenv(FORCE_TRITON_ENV, force)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              assistant_model=assistant, num_speculative_tokens=4)  # fixed: the runs' drafts compared
        runs[force] = (out, hf_specdec.last_generation_stats(target).num_target_forwards)
    assert torch.equal(runs["0"][0], runs["1"][0])
    assert runs["0"][1] == runs["1"][1] < 12  # the same drafts accepted, and some were
    from hf_specdec.kernels.stacked_linear import stacked_weight

    # the kernels' run read post_projection and the centroid scores through one stacked GEMM
    assert stacked_weight(assistant.post_projection, assistant.masked_embedding.centroids) is not None


@pytest.mark.parametrize("build", ["gemma4_31b_style", "gemma4_e2b_style", "gemma4_26b_style"])
def test_triton_cross_layer_seams_compute_the_next_norms(triton_device, build, monkeypatch):
    """Each fused decoder layer's last seam also computes the norm that reads its output next (the next layer's input
    norm; after the last layer the final norm), which then runs no launch of its own: one norm launch less per layer,
    the model's logits kept (but for the first KV-shared layer's input where transformers slices it first). A forward
    hook on a layer, which may change its output (here in place, which inference tensors do not count), makes that
    layer's next norm run on its own again; unfuse_modules takes the links away."""
    from hf_specdec.generation.fusion import unfuse_modules
    from hf_specdec.models.gemma4 import fusion
    from tests import tiny_models

    model = getattr(tiny_models, build)().to(triton_device)
    model.set_attn_implementation("sdpa")
    layers = [m for m in model.modules() if type(m).__name__ == "Gemma4TextDecoderLayer"]
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    ids = ids.to(triton_device)
    with torch.inference_mode():
        expected, launches, logits, norms = _fused_norm_launches(model, ids, monkeypatch, "CROSS_LAYER_SEAMS")
        # every layer's, but where transformers (5.24+) slices the hidden states before the first KV-shared layer (a
        # new tensor: that layer's input norm runs on its own)
        sliced = (bool(model.config.get_text_config().num_kv_shared_layers)
                  and hasattr(fusion.Gemma4TextModel, "_maybe_slice_kv_shared_inputs"))
        assert launches[False] - launches[True] == len(layers) - sliced
        handle = layers[1].register_forward_hook(lambda module, args, out: out.mul_(0.5))
        norms.clear()
        hooked = model(ids).logits
        assert launches[True] - len(norms) == -1  # layer 1's next norm (layer 2's input norm) on its own
        unfuse_modules(model)
        assert not any(layer in fusion._FOLLOWING for layer in layers)
        expected_hooked = model(ids).logits
        handle.remove()
    # a norm computed in a seam has the bits of the same norm launched alone: where a hook turns the seams off for
    # some forwards (DFlash's target capture hooks the verify's layers, not the plain decode's), rows stay equal
    assert torch.equal(logits[True], logits[False])
    torch.testing.assert_close(logits[True], expected, atol=1e-4, rtol=1e-4)  # fp32: the order of the norms' sums
    torch.testing.assert_close(hooked, expected_hooked, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(hooked, expected, atol=1e-3)


def test_triton_router_input_in_the_seam(triton_device, monkeypatch):
    """An MoE block's router input (its unscaled norm of the residual, times its scale and hidden_size ** -0.5) comes
    from the seam before the block: one norm launch less per MoE layer, the logits' bits kept. A forward hook on a
    router (which would not run if its forward were skipped) makes that router run as a module again."""
    from hf_specdec.generation.fusion import unfuse_modules
    from tests.tiny_models import gemma4_26b_style

    model = gemma4_26b_style().to(triton_device)
    model.set_attn_implementation("sdpa")
    routers = [m for m in model.modules() if type(m).__name__ == "Gemma4TextRouter"]
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    ids = ids.to(triton_device)
    with torch.inference_mode():
        expected, launches, logits, norms = _fused_norm_launches(model, ids, monkeypatch, "ROUTER_IN_SEAM")
        assert routers and launches[False] - launches[True] == len(routers)
        called = []
        handle = routers[0].register_forward_hook(lambda module, args, out: called.append(1))
        norms.clear()
        hooked = model(ids).logits
        handle.remove()
        assert called == [1] and len(norms) == launches[True] + 1
        unfuse_modules(model)
    assert torch.equal(logits[True], logits[False]) and torch.equal(hooked, logits[True])
    torch.testing.assert_close(logits[True], expected, atol=1e-4, rtol=1e-4)  # fp32: the order of the norms' sums


def _fused_norm_launches(model, ids, monkeypatch, switch: str):
    """Run ``model`` unfused, then fused with the Gemma 4 fusion's ``switch`` off and on (in inference mode):
    (the unfused logits, {setting: rms_norm launches of its forward}, {setting: its logits}, the list that records
    the launches, which the forwards after it go on filling)."""
    from hf_specdec.generation.fusion import fuse_modules
    from hf_specdec.models.gemma4 import fusion

    norms, launches, logits = [], {}, {}
    expected = model(ids).logits
    fuse_modules(model)
    monkeypatch.setattr(fusion, "rms_norm", lambda *a, **kw: norms.append(1) or rms_norm(*a, **kw))
    for setting in (False, True):
        monkeypatch.setattr(fusion, switch, setting)
        norms.clear()
        logits[setting] = model(ids).logits
        launches[setting] = len(norms)
    return expected, launches, logits, norms


def test_the_router_input_comes_from_the_seam_only_where_nothing_sees_the_router_skipped(monkeypatch):
    """The seam computes a router's input only where its own forward could be skipped unseen: the fused forward
    installed, no hook on it, no global hook, the residual's dtype and device, and a projection that does not take
    codes of its rows (W8A8)."""
    from hf_specdec.generation.fusion import fuse_modules, unfuse_modules
    from hf_specdec.models.gemma4 import fusion
    from tests.tiny_models import gemma4_26b_style

    model = gemma4_26b_style()
    router = next(m for m in model.modules() if type(m).__name__ == "Gemma4TextRouter")
    hidden = torch.zeros(1, 2, model.config.get_text_config().hidden_size)
    assert fusion._router_seam(router, hidden) == {}  # not fused
    fuse_modules(model)
    seam = fusion._router_seam(router, hidden)
    assert seam["next3_eps"] == router.norm.eps and seam["next3_mul"] is router.scale
    assert seam["next3_scalar"] == router.scalar_root_size
    handle = router.register_forward_pre_hook(lambda module, args: None)
    assert fusion._router_seam(router, hidden) == {}
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert fusion._router_seam(router, hidden) == {}
    handle.remove()
    assert fusion._router_seam(router, hidden.double()) == {}
    monkeypatch.setattr(fusion, "w8a8_input_group", lambda *args: 128)
    assert fusion._router_seam(router, hidden) == {}
    monkeypatch.undo()
    monkeypatch.setattr(fusion, "ROUTER_IN_SEAM", False)
    assert fusion._router_seam(router, hidden) == {}
    monkeypatch.undo()
    assert fusion._router_seam(router, hidden) == seam
    unfuse_modules(model)
    assert fusion._router_seam(router, hidden) == {}
