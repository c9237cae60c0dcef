"""MTP layers: one step = block(eh_proj(cat[enorm(embed), hnorm(h_prev)])) + the layer's own head."""

import torch

from hf_specdec.models.step3p5 import Step3p5MTPLayer

from .tiny_step3p5 import SEQ, random_ids, tiny_model


def _draft_chain(model, ids):
    """Target forward, then MTP steps 0, 1, 2 chained on pre-norm hidden states (vLLM's shifted layout:
    MTP input i pairs token i+1 with the hidden state of position i). Returns the three logits."""
    cache = model.new_cache()
    target = model(ids, past_key_values=cache, use_cache=True, output_pre_norm_hidden_states=True)
    hidden, tokens, logits = target.pre_norm_hidden_state[:, :-1], ids[:, 1:], []
    for k in range(model.num_mtp_layers):
        step = model.mtp_step(k, tokens, hidden, position_ids=torch.arange(SEQ - 1)[None], past_key_values=cache)
        logits.append(step.logits)
        hidden = step.hidden_state
    return logits


def test_mtp_layers_are_sliding_blocks_with_their_own_heads():
    model = tiny_model()
    layers = model.model.mtp_layers
    assert [layer.layer_idx for layer in layers] == model.mtp_layer_indices == [4, 5, 6]
    assert all(isinstance(layer, Step3p5MTPLayer) and hasattr(layer, "mlp") for layer in layers)
    assert all(layer.self_attn.sliding_window == 5 and layer.self_attn.num_heads == 4 for layer in layers)
    heads = [layer.shared_head.head.weight for layer in layers]
    assert len({h.data_ptr() for h in heads} | {model.lm_head.weight.data_ptr()}) == 4


def test_mtp_step_formula():
    model = tiny_model()
    layer = model.model.mtp_layers[1]
    ids, h_prev = random_ids(), torch.randn(2, SEQ, 32)
    with torch.no_grad():
        step = model.mtp_step(1, ids, h_prev)
        x = layer.eh_proj(torch.cat([layer.enorm(model.model.embed_tokens(ids)), layer.hnorm(h_prev)], dim=-1))
        # The block alone: run the decoder-layer part of the MTP layer on x
        block_out = super(Step3p5MTPLayer, layer).forward(
            x, model.model._position_embeddings(x, torch.arange(SEQ)[None], [5])[5],
            model.model._mask("sliding_attention", x, None, None, torch.arange(SEQ)[None]))
    assert torch.allclose(step.hidden_state, block_out, atol=1e-5)
    assert torch.allclose(step.logits, layer.shared_head.head(layer.shared_head.norm(block_out)), atol=1e-5)


def test_mtp_step_with_cache_matches_one_pass_past_window():
    model = tiny_model()
    ids, h_prev = random_ids(), torch.randn(2, SEQ, 32)
    with torch.no_grad():
        full = model.mtp_step(2, ids, h_prev).logits
        cache = model.new_cache()
        parts = [model.mtp_step(2, ids[:, :3], h_prev[:, :3], past_key_values=cache).logits]
        parts += [model.mtp_step(2, ids[:, i:i + 1], h_prev[:, i:i + 1], past_key_values=cache).logits
                  for i in range(3, SEQ)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    # K/V went to layer L + 2 only
    assert [cache.get_seq_length(i) for i in range(7)] == [0, 0, 0, 0, 0, 0, SEQ]


def test_changing_mtp_layer_2_head_changes_step_2_only():
    model = tiny_model()
    ids = random_ids()
    with torch.no_grad():
        before = _draft_chain(model, ids)
        model.model.mtp_layers[2].shared_head.head.weight.mul_(-1.5)
        model.lm_head.weight.mul_(0.5)  # the target head is not an MTP head either
        after = _draft_chain(model, ids)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert not torch.allclose(before[2], after[2])
