"""Transformers architectures beyond the bundled families: what their attention needs and the paged path does not
compute is refused before anything is decoded (latent caches, capped scores, K/V heads laid out by the model), MoE
configs that ask for router logits decode as transformers, and gpt-oss's learned softmax sinks are computed."""

import copy

import pytest
import torch
import transformers

import hf_specdec
from tests.tiny_models import _build, gpt_oss, left_padded_batch

SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def deepseek_v3():
    config = transformers.DeepseekV3Config(**SMALL, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
                                           moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                           n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                           v_head_dim=8)
    return _build(transformers.DeepseekV3ForCausalLM, config)


def jetmoe():
    config = transformers.JetMoeConfig(**SMALL, num_key_value_heads=2, kv_channels=8, intermediate_size=16,
                                       num_local_experts=4, num_experts_per_tok=2)
    return _build(transformers.JetMoeForCausalLM, config)


def mixtral(**overrides):
    config = transformers.MixtralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
                                        num_local_experts=4, num_experts_per_tok=2, **overrides)
    return _build(transformers.MixtralForCausalLM, config)


def gemma2():
    config = transformers.Gemma2Config(**SMALL, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, sliding_window=4, attn_logit_softcapping=2.0)
    return _build(transformers.Gemma2ForCausalLM, config)


@pytest.mark.parametrize("build,what", [(deepseek_v3, "latent attention"), (gemma2, "caps its attention scores")])
def test_attention_the_paged_path_does_not_compute_is_refused_at_enable(build, what):
    model = build()
    with pytest.raises(ValueError, match=what) as refused:
        hf_specdec.enable(model)
    assert "without hf_specdec.enable()" in str(refused.value)
    assert getattr(model, "_hf_specdec", None) is None  # nothing was changed


def test_a_model_laying_its_query_heads_over_kv_heads_itself_is_refused_before_any_token():
    """JetMoE tiles its K/V heads (query head h reads K/V head h % kv_heads); the paged attention groups consecutive
    query heads over each stored head. Its greedy tokens differed from the first one: now generate says so."""
    model = jetmoe()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    try:
        hf_specdec.enable(model)
    except ValueError as refused:  # a transformers version whose JetMoE takes no attention backend
        assert "AttentionInterface" in str(refused)
        return
    with pytest.raises(ValueError, match="K/V of 4 heads but stores 2"):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_router_logits_asked_by_the_config_do_not_break_decoding():
    """output_router_logits=True made the forward compute its load-balancing loss against the loop's mask stub
    (an IndexError); transformers' greedy tokens come out, batched with left padding too."""
    model = mixtral(output_router_logits=True)
    reference = copy.deepcopy(model)
    hf_specdec.enable(model)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    ids, mask = left_padded_batch([6, 3, 5])
    got = model.generate(ids, attention_mask=mask, **kwargs)
    reference.config.output_router_logits = False  # transformers' own loss rejects a padded batch's mask
    assert torch.equal(got, reference.generate(ids, attention_mask=mask, **kwargs))


@pytest.mark.parametrize("term", ["softcap", "position_bias"])
def test_the_attention_refuses_terms_it_does_not_compute(term):
    """A model whose config says nothing of them may still hand the attention function a term that changes the
    scores: the paged forward refuses it rather than leaving it out."""
    from hf_specdec.attention.paged import hf_specdec_attention

    class Paged:  # a request's first forward under way: the paged path is taken and checked
        meta, layers_seen = object(), (set(), set())

    module = torch.nn.Linear(1, 1)
    module.layer_idx = 0
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match=term):
        hf_specdec_attention(module, q, None, None, None, paged_cache=Paged(), **{term: torch.zeros(4)})


def nemotron():
    config = transformers.NemotronConfig(**SMALL, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return _build(transformers.NemotronForCausalLM, config)


def test_a_layer_whose_attention_does_not_read_what_it_stored_is_refused_at_the_first_forward():
    """Nemotron's decoder layer does not pass the attention's kwargs on: its attention took SDPA over this forward's
    K/V alone, and decoded other tokens silently."""
    model = hf_specdec.enable(nemotron())
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"layers \[0, 1\] stored K/V .* did not read it"):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_values_of_another_width_than_stored_are_refused():
    from hf_specdec.attention.paged import hf_specdec_attention

    class Paged:
        meta, layers_seen = object(), (set(), set())

        def layer_pages(self, layer):
            return torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), None, None

    module = torch.nn.Linear(1, 1)
    module.layer_idx = 0
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="values 4 wide but stores them 8 wide"):
        hf_specdec_attention(module, q, k, torch.zeros(1, 2, 1, 4), None, paged_cache=Paged())


def test_token_type_ids_take_transformers_loop():
    """transformers extends token_type_ids every step (GPT-2 embeds them); the paged steps pass ids only."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4,
                                                                 n_positions=64, pad_token_id=0)).eval()
    reference = copy.deepcopy(model)
    hf_specdec.enable(model)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    kwargs = dict(token_type_ids=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    assert hf_specdec.last_generation_stats(model) is None  # transformers' loop ran


def test_longrope_calls_crossing_the_original_length_take_transformers_loop():
    """Phi-3's longrope switches to its long factors past original_max_position_embeddings and transformers encodes
    every position again there: the paged loop's tokens differed from the 6th new one."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(**SMALL, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=64, original_max_position_embeddings=16,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "short_factor": [1.0] * 4,
                                                      "long_factor": [1.0 + 3.0 * i for i in range(4)]})
    model = _build(transformers.Phi3ForCausalLM, config)
    reference = copy.deepcopy(model)
    hf_specdec.enable(model)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    for width, paged in ((11, False), (20, True)):  # crosses 16 while decoding / past it from the prompt on
        ids = torch.randint(3, 97, (1, width), generator=torch.Generator().manual_seed(1))
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
        assert (hf_specdec.last_generation_stats(model) is not None) == paged


def test_differential_attention_takes_transformers_loop():
    """DiffLlama attends over halves of the values it stored, in the same shapes: its calls run transformers' loop."""
    config = transformers.DiffLlamaConfig(**SMALL, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = _build(transformers.DiffLlamaForCausalLM, config)
    reference = copy.deepcopy(model)
    hf_specdec.enable(model)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    assert hf_specdec.last_generation_stats(model) is None


def test_gpt_oss_sinks_decode_as_transformers():
    """gpt-oss hands its attention learned sinks (``s_aux``): the paged loop computes them, so tokens and scores are
    transformers' in fp32, batched with left padding; a plain forward of the enabled model runs the model's own
    eager attention with them (SDPA has no sink term)."""
    reference, model = gpt_oss(), hf_specdec.enable(gpt_oss())
    ids, mask = left_padded_batch([6, 3, 9])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    want, got = reference.generate(ids, **kwargs), model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        for call in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[2:, -5:])):
            rows = call.get("attention_mask", torch.ones_like(call["input_ids"])).bool()
            torch.testing.assert_close(model(**call).logits[rows], reference(**call).logits[rows])
    # the sinks matter at these values: without them the scores move
    with torch.no_grad():
        for module in reference.modules():
            if hasattr(module, "sinks"):
                module.sinks.fill_(float("-inf"))
    dropped = reference.generate(ids, **kwargs)
    assert max((a - b).abs().max() for a, b in zip(dropped.scores, want.scores)) > 0.1


def test_sampled_gpt_oss_tokens_follow_transformers_distribution():
    """Sampling over the sinks' attention: the 2nd generated token's marginal is the model's own."""
    from tests.distribution import assert_follows, second_token_marginal

    model = hf_specdec.enable(gpt_oss(vocab_size=16))
    rows, prompt = 3000, torch.tensor([[3, 5, 9, 7]])
    torch.manual_seed(0)
    out = model.generate(prompt.expand(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                         max_new_tokens=2, do_sample=True, eos_token_id=None, pad_token_id=0)
    hf_specdec.disable(model)
    assert_follows(out[:, 5], second_token_marginal(model, prompt, 16))


def test_gpt_oss_outside_the_paged_loop_masks_as_transformers():
    """A forward of an enabled gpt-oss outside the paged loop runs its eager attention with the sinks: where
    transformers leaves the causal mask to SDPA's flag (a prompt into an empty static cache longer than it), the keys
    a query sees are those of SDPA's flag, not the cache's empty slots; the same logits as without enable."""
    from transformers import StaticCache

    reference, model = gpt_oss(), hf_specdec.enable(gpt_oss())
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for cache in (lambda m: StaticCache(config=m.config, max_cache_len=16), lambda m: None):
            want = reference(ids, past_key_values=cache(reference)).logits
            torch.testing.assert_close(model(ids, past_key_values=cache(model)).logits, want, atol=1e-5, rtol=1e-5)
