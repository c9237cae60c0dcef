"""Loading released-format `gemma4_assistant` checkpoints (config.json + safetensors with the real key names)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_specdec.models.gemma4 import Gemma4MTPAssistant, HFSpecGemma4AssistantConfig
from tests.models.gemma4.helpers import (
    assistant_config,
    assistant_config_dict,
    random_state_dict,
    released_layout,
    write_checkpoint,
)
from tests.tiny_models import gemma4_e2b_style


@pytest.fixture(scope="module")
def target_config():
    return gemma4_e2b_style(vocab_size=96, vocab_size_per_layer_input=96).config


@pytest.fixture(params=[False, True], ids=["tied_head", "centroid_head"])
def ordered(request):
    return request.param


def released_checkpoint(path, target_config, ordered, edit=None):
    config = assistant_config_dict(target_config, ordered)
    state = random_state_dict(released_layout(config))
    if edit:
        edit(state)
    return write_checkpoint(path, config, state), state


def test_module_tree_is_the_released_key_layout(target_config, ordered):
    model = Gemma4MTPAssistant(assistant_config(target_config, ordered))
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert ours == released_layout(assistant_config_dict(target_config, ordered))
    if ordered:
        assert model.state_dict()["masked_embedding.token_ordering"].dtype == torch.int64


def test_auto_classes_load_ours_with_every_tensor(tmp_path, target_config, ordered):
    path, state = released_checkpoint(tmp_path, target_config, ordered)
    assert type(AutoConfig.from_pretrained(path)) is HFSpecGemma4AssistantConfig
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model) is Gemma4MTPAssistant
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    text = model.config.text_config
    assert [text.per_layer_config[i].head_dim for i in range(3)] == [16, 16, 32]  # global_head_dim for full


def test_missing_key_raises_or_is_reported(tmp_path, target_config):
    missing = "model.layers.1.self_attn.q_norm.weight"
    path, _ = released_checkpoint(tmp_path, target_config, True, edit=lambda s: s.pop(missing))
    with pytest.raises(ValueError, match=r"missing keys \['model\.layers\.1\.self_attn\.q_norm\.weight'\]"):
        Gemma4MTPAssistant.from_pretrained(path)
    _, info = Gemma4MTPAssistant.from_pretrained(path, output_loading_info=True)
    assert set(info["missing_keys"]) == {missing}


def test_missing_token_ordering_is_an_error(tmp_path, target_config):
    drop_ordering = lambda s: s.pop("masked_embedding.token_ordering")  # noqa: E731
    path, _ = released_checkpoint(tmp_path, target_config, True, edit=drop_ordering)
    with pytest.raises(ValueError, match="token_ordering"):
        Gemma4MTPAssistant.from_pretrained(path)


def test_unexpected_key_raises_or_is_reported(tmp_path, target_config):
    extra = "model.layers.0.self_attn.k_proj.weight"
    add_k_proj = lambda s: s.update({extra: torch.zeros(16, 24)})  # noqa: E731
    path, _ = released_checkpoint(tmp_path, target_config, False, edit=add_k_proj)
    with pytest.raises(ValueError, match="unexpected keys.*k_proj"):
        Gemma4MTPAssistant.from_pretrained(path)
    _, info = Gemma4MTPAssistant.from_pretrained(path, output_loading_info=True)
    assert set(info["unexpected_keys"]) == {extra}


def test_stored_copy_of_tied_head_is_accepted(tmp_path, target_config):
    def add_head(state):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()

    path, state = released_checkpoint(tmp_path, target_config, False, edit=add_head)
    model = Gemma4MTPAssistant.from_pretrained(path)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_token_ordering_must_be_a_permutation(tmp_path, target_config):
    def duplicate(state):
        state["masked_embedding.token_ordering"][0] = state["masked_embedding.token_ordering"][1]

    path, _ = released_checkpoint(tmp_path, target_config, True, edit=duplicate)
    with pytest.raises(ValueError, match="not a permutation"):
        Gemma4MTPAssistant.from_pretrained(path)


def test_save_pretrained_round_trip(tmp_path, target_config, ordered):
    path, state = released_checkpoint(tmp_path / "released", target_config, ordered)
    Gemma4MTPAssistant.from_pretrained(path).save_pretrained(tmp_path / "saved")
    again = Gemma4MTPAssistant.from_pretrained(tmp_path / "saved")
    assert again.config.model_type == "gemma4_assistant"
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["Gemma4AssistantForCausalLM"]  # the released name, not this class's
    assert again.config.use_ordered_embeddings == ordered
    for name, tensor in state.items():
        assert torch.equal(again.state_dict()[name], tensor), name
