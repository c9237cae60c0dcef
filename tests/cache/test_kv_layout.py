import pytest
from transformers import Gemma4TextConfig, LlamaConfig, T5Config

from hf_specdec.cache import kv_layout_from_config
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style, llama, qwen3


def test_gemma4_e2b_style_shares_the_last_layers_with_their_producers():
    model = gemma4_e2b_style()
    layout = kv_layout_from_config(model.config)
    sliding, full = layout.groups
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.sliding_window) == (1, 16, 8)
    assert (full.num_kv_heads, full.head_dim, full.sliding_window) == (1, 32, None)
    assert sliding.layers == (0, 1, 3) and full.layers == (2,)
    # layers 4 (sliding) and 5 (full) are KV-shared: they read the last earlier layer of their type
    assert layout.producer[4] == 3 and layout.producer[5] == 2
    assert layout.layer_slot[4] == layout.layer_slot[3] and layout.layer_slot[5] == layout.layer_slot[2]
    # the layout agrees with what the HF modules actually are
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert attn.is_kv_shared_layer == (layout.producer[i] != i)
        assert layout.group_of(i).head_dim == attn.head_dim


def test_gemma4_31b_style_full_layers_have_fewer_kv_heads():
    model = gemma4_31b_style()
    layout = kv_layout_from_config(model.config)
    shapes = {(g.num_kv_heads, g.head_dim, g.sliding_window) for g in layout.groups}
    assert shapes == {(2, 16, 8), (1, 32, None)}
    assert all(layout.producer[i] == i for i in range(6))
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.k_proj.out_features == layout.group_of(i).num_kv_heads * layout.group_of(i).head_dim


def test_gemma4_31b_real_shapes_from_config_alone():
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 10
    config = Gemma4TextConfig(num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                              global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
                              sliding_window=1024, layer_types=types, hidden_size_per_layer_input=0)
    layout = kv_layout_from_config(config)
    assert [(g.num_kv_heads, g.head_dim, g.sliding_window, len(g.layers)) for g in layout.groups] == [
        (16, 256, 1024, 50), (4, 512, None, 10)]


def test_generic_decoders_get_one_group():
    for model in (llama(), qwen3()):
        layout = kv_layout_from_config(model.config)
        assert len(layout.groups) == 1 and layout.groups[0].sliding_window is None
        assert layout.groups[0].layers == tuple(range(model.config.num_hidden_layers))


def test_encoder_decoder_is_rejected():
    with pytest.raises(ValueError, match="decoder-only"):
        kv_layout_from_config(T5Config())


def test_unknown_layer_type_is_rejected():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        kv_layout_from_config(config)
