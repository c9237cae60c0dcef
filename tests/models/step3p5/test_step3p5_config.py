"""Step3p5Config reads the real config.json keys and round-trips through save/load."""

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_specdec.models.step3p5 import Step3p5Config
from hf_specdec.models.step3p5.layers import layer_inv_freq, llama3_inv_freq

from .tiny_step3p5 import F, S, real_config_dict, tiny_config


def test_per_layer_values_cover_main_and_mtp_layers():
    config = tiny_config()
    assert config.layer_types == [F, S, S, F] and config.mtp_layer_types == [S, S, S]
    assert [config.layer_num_heads(i) for i in range(7)] == [2, 4, 4, 2, 4, 4, 4]
    assert config.num_key_value_heads == 1 and config.layer_num_kv_heads(5) == 1
    assert [config.layer_sliding_window(i) for i in (0, 1, 4)] == [None, 5, 5]
    assert config.layer_rope_theta(0) == 5e6 and config.layer_rope_theta(4) == 1e4
    assert config.layer_partial_rotary_factor(0) == 0.5 and config.layer_partial_rotary_factor(6) == 1.0
    assert config.layer_rope_scaling_params(0)["factor"] == 2.0
    assert config.layer_rope_scaling_params(1) is None and config.layer_rope_scaling_params(4) is None
    assert config.moe_layer_indices == {2, 3} and not config.is_moe_layer(4)
    assert config.layer_swiglu_limit(3, shared=False) == 0.5 and config.layer_swiglu_limit(3, shared=True) is None
    assert config.layer_swiglu_limit(2, shared=True) == 0.7 and config.layer_swiglu_limit(0, shared=False) is None


def test_short_lists_and_defaults():
    raw = real_config_dict()
    raw.update(layer_types=raw["layer_types"][:4], rope_theta=raw["rope_theta"][:4],
               partial_rotary_factors=raw["partial_rotary_factors"][:4], swiglu_limits=None,
               moe_layers_enum=[3], yarn_only_types=None)
    config = Step3p5Config(**raw)
    assert config.mtp_layer_types == [S, S, S]  # MTP blocks default to sliding
    assert config.layer_rope_theta(5) == 1e4  # first sliding main layer's value
    assert config.layer_swiglu_limit(3, shared=False) is None
    assert config.moe_layer_indices == {3}
    assert config.layer_rope_scaling_params(1) is not None  # no yarn_only_types: every layer


def test_save_load_roundtrip_and_auto_config(tmp_path):
    config = tiny_config()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, Step3p5Config)
    assert {**loaded.to_dict(), "_name_or_path": ""} == config.to_dict()


def test_saved_config_keeps_the_checkpoint_format(tmp_path):
    """save_pretrained writes the checkpoint's own keys: ``rope_scaling`` and one ``layer_types`` over the main and
    MTP layers (the fields this class splits them into do not leak into the file, where other readers lost the
    rope scaling and the MTP layers' types), and the saved file reads back to the same config."""
    import json

    raw = real_config_dict()
    config = Step3p5Config(**raw)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_scaling"] == raw["rope_scaling"] and saved["layer_types"] == raw["layer_types"]
    assert "layer_rope_scaling" not in saved and "mtp_layer_types" not in saved
    loaded = Step3p5Config.from_pretrained(tmp_path)
    assert loaded.layer_types == config.layer_types and loaded.mtp_layer_types == config.mtp_layer_types
    assert loaded.layer_rope_scaling == config.layer_rope_scaling


@pytest.mark.parametrize("variant", [{"use_moe_router_bias": False}, {"moe_router_activation": "softmax"},
                                     {"sink": True}, {"zero_centered": False}])
def test_unsupported_variants_raise(variant):
    with pytest.raises(ValueError, match="support"):
        tiny_config(**variant)


def test_llama3_rope_matches_transformers():
    params = {"rope_type": "llama3", "rope_theta": 5e6, "factor": 2.0, "original_max_position_embeddings": 16,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "partial_rotary_factor": 0.5}
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](llama, None)
    assert torch.allclose(layer_inv_freq(tiny_config(), 0), expected)
    # the ramp region is exercised: some frequencies are scaled, some kept, some in between
    base = 1.0 / (5e6 ** (torch.arange(0, 4, 2).float() / 4))
    assert torch.allclose(llama3_inv_freq(base, params), expected)
