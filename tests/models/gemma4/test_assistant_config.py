"""Assistant config validation, producer-layer mapping and assistant/target compatibility checks."""

import pytest
from transformers import Gemma4Config, Gemma4TextConfig, LlamaConfig

from hf_specdec.models.gemma4 import (
    HFSpecGemma4AssistantConfig,
    check_compatible,
    producer_layer_for,
    target_embedding,
)
from tests.models.gemma4.helpers import F, S, assistant_config, assistant_config_dict
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style


@pytest.fixture(scope="module")
def e2b():
    """Layers [S, S, F, S, S, F], the last 2 KV-shared: producers are layers 3 (sliding) and 2 (full)."""
    return gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96)


@pytest.fixture(scope="module")
def dense_31b():
    """Layers [S, S, F, S, S, F], no KV sharing, 2 sliding / 1 full kv heads."""
    return gemma4_31b_style(vocab_size=96)


def test_producers_of_a_target_with_shared_layers(e2b):
    assert (producer_layer_for(e2b.config, S), producer_layer_for(e2b.config, F)) == (3, 2)


def test_producers_of_a_target_without_shared_layers(dense_31b):
    assert (producer_layer_for(dense_31b.config, S), producer_layer_for(dense_31b.config, F)) == (4, 5)


def test_producers_agree_with_transformers_kv_sharing_modes(e2b):
    modes = getattr(e2b.config, "kv_sharing_modes", None)  # transformers >= 5.2x only
    if modes is None:
        pytest.skip("this transformers has no Gemma4TextConfig.kv_sharing_modes")
    stores = {e2b.config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    assert stores == {t: producer_layer_for(e2b.config, t) for t in (S, F)}


def test_conditional_generation_config_is_unwrapped(e2b, dense_31b):
    for target in (e2b, dense_31b):
        wrapped = Gemma4Config(text_config=target.config.to_dict())
        assert producer_layer_for(wrapped, F) == producer_layer_for(target.config, F)
        check_compatible(assistant_config(target.config, ordered=True), wrapped)


@pytest.mark.parametrize("ordered", [False, True])
def test_matching_pairs_are_compatible(e2b, dense_31b, ordered):
    for target in (e2b, dense_31b):
        check_compatible(assistant_config(target.config, ordered), target.config)
        check_compatible(assistant_config(target.config, ordered), target)  # a model works too


def test_target_embedding_is_the_scaled_embedding(e2b):
    assert target_embedding(e2b) is e2b.get_input_embeddings()
    assert float(e2b.get_input_embeddings().embed_scale) == pytest.approx(e2b.config.hidden_size**0.5)


def test_non_gemma4_target_is_rejected(e2b):
    llama = LlamaConfig(vocab_size=96, hidden_size=e2b.config.hidden_size, num_attention_heads=4)
    with pytest.raises(ValueError, match="needs a Gemma 4 target.*'llama'"):
        check_compatible(assistant_config(e2b.config, ordered=False), llama)


def test_assistant_for_another_target_width_is_rejected(e2b):
    wide = gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96, hidden_size=64).config
    with pytest.raises(ValueError, match=r"hidden_size 32, but the target has hidden_size 64.*load the assistant"):
        check_compatible(assistant_config(e2b.config, ordered=False), wide)


def test_vocab_mismatch_is_rejected(e2b):
    config = assistant_config(e2b.config, ordered=False, vocab_size=128)
    with pytest.raises(ValueError, match="vocab_size 128 != target vocab_size 96"):
        check_compatible(config, e2b.config)


def test_head_dim_or_kv_heads_mismatch_is_rejected(e2b, dense_31b):
    with pytest.raises(ValueError, match=r"layer 2 \(full_attention\).*\(64, 1\).*target layer 2.*\(32, 1\)"):
        check_compatible(assistant_config(e2b.config, ordered=False, global_head_dim=64), e2b.config)
    with pytest.raises(ValueError, match=r"layer 0 \(sliding_attention\).*\(16, 1\).*target layer 4.*\(16, 2\)"):
        check_compatible(assistant_config(e2b.config, ordered=False), dense_31b.config)


def test_released_config_keys_are_read(e2b):
    config = assistant_config(e2b.config, ordered=True, num_centroids=12, top_k=5)
    assert (config.backbone_hidden_size, config.num_centroids, config.centroid_intermediate_top_k) == (32, 12, 5)
    assert config.use_ordered_embeddings and config.tie_word_embeddings
    assert isinstance(config.text_config, Gemma4TextConfig)
    zero_shared = assistant_config(e2b.config, ordered=False, num_kv_shared_layers=0)
    assert zero_shared.text_config.num_kv_shared_layers == 3  # 0 means "all", as in transformers


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_centroids=7), "divisible by num_centroids 7"),
        (dict(top_k=9), "centroid_intermediate_top_k must be in"),
        (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input must be 0"),
        (dict(use_double_wide_mlp=True), "use_double_wide_mlp"),
        (dict(num_kv_shared_layers=2), "num_kv_shared_layers must equal"),
        (dict(layer_types=[S, "chunked_attention", F]), "layer_types may only contain"),
    ],
)
def test_invalid_configs_name_the_key(e2b, change, message):
    with pytest.raises(ValueError, match=message):
        assistant_config(e2b.config, ordered=True, **change)


def test_untied_head_is_rejected(e2b):
    fields = assistant_config_dict(e2b.config, ordered=False)
    fields.pop("architectures"), fields.pop("model_type")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        HFSpecGemma4AssistantConfig(**{**fields, "tie_word_embeddings": False})
