"""DFlashConfig: the z-lab config.json keys, where they may live, and the errors that name the fix."""

import json

import pytest
from transformers import Qwen3Config

from hf_specdec.models.dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids, is_dflash_checkpoint
from tests.models.dflash.helpers import MASK_TOKEN_ID, F, S, drafter_config, drafter_config_dict, write_checkpoint
from tests.tiny_models import gemma4_31b_style, llama


@pytest.fixture(scope="module")
def target():
    return gemma4_31b_style()


def config_from_json(tmp_path, config: dict) -> DFlashConfig:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return DFlashConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("nested", [False, True], ids=["top_level", "in_dflash_config"])
def test_block_size_is_read_from_either_level(tmp_path, target, nested):
    config = config_from_json(tmp_path, drafter_config_dict(target, nested_block_size=nested, block_size=6))
    assert config.dflash.block_size == 6
    assert config.dflash.mask_token_id == MASK_TOKEN_ID
    assert config.dflash.target_layer_ids == (0, 3, 5)
    assert config.num_target_layers == 6


def test_dflash_config_wins_over_the_top_level_and_block_size_defaults_to_16(target):
    both = drafter_config_dict(target, block_size=4)
    both["dflash_config"]["block_size"] = 8
    assert DFlashConfig(**both).dflash.block_size == 8
    neither = drafter_config_dict(target)
    neither.pop("block_size")
    assert DFlashConfig(**neither).dflash.block_size == 16


def test_optional_drafting_keys(target):
    config = drafter_config(target, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=20.0)
    assert (config.dflash.input_embedding_scale, config.dflash.output_multiplier) == (2.0, 0.5)
    assert config.dflash.final_logit_softcapping == 20.0
    plain = drafter_config(target).dflash
    assert (plain.input_embedding_scale, plain.output_multiplier, plain.final_logit_softcapping) == (None, 1.0, None)


def test_target_layer_ids_default_to_the_reference_spread():
    # Published drafters: Qwen3-8B (36 layers, 5 draft layers), Gemma 4 31B (60 layers, 6 fused features).
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(60, 6) == [1, 12, 23, 35, 46, 57]
    assert build_target_layer_ids(24, 1) == [12]
    config = drafter_config_dict(llama(num_hidden_layers=8))  # a 2-layer drafter
    config["dflash_config"].pop("target_layer_ids")
    assert DFlashConfig(**config).dflash.target_layer_ids == (1, 5)


def test_sliding_layers_are_causal_with_their_window(target):
    config = drafter_config(target, layer_types=[S, F], use_sliding_window=True, sliding_window=5)
    specs = DFlashDrafter(config).layer_specs
    assert [(s.layer_type, s.sliding_window, s.causal_block) for s in specs] == [(S, 5, True), (F, None, False)]
    assert (specs[0].num_kv_heads, specs[0].head_dim) == (2, 8)


def test_sliding_window_follows_qwen3_parsing(target):
    """As in the reference (a Qwen3Config): without use_sliding_window the window is dropped, not the causality."""
    config = drafter_config(target, layer_types=[S, F], sliding_window=5)
    assert config.sliding_window is None
    assert [(s.sliding_window, s.causal_block) for s in DFlashDrafter(config).layer_specs] == [(None, True),
                                                                                             (None, False)]
    assert drafter_config(target, use_sliding_window=True, sliding_window=5).layer_types == [F, F]


@pytest.mark.parametrize("is_causal", [True, False])
def test_is_causal_overrides_every_layer(target, is_causal):
    config = drafter_config(target, layer_types=[S, F], use_sliding_window=True, sliding_window=5, is_causal=is_causal)
    assert [s.causal_block for s in DFlashDrafter(config).layer_specs] == [is_causal, is_causal]


def test_saved_config_is_a_zlab_config(tmp_path, target):
    config = drafter_config(target, layer_types=[S, F], use_sliding_window=True, sliding_window=5)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["DFlashDraftModel"]
    assert saved["dflash_config"] == {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": [0, 3, 5]}
    reloaded = DFlashConfig.from_pretrained(tmp_path)
    assert reloaded.dflash == config.dflash and reloaded.layer_types == [S, F] and reloaded.sliding_window == 5


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(block_size=1), "block_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 1]), "duplicates"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 6]), "num_target_layers"),
        (lambda c: (c["dflash_config"].pop("target_layer_ids"), c.pop("num_target_layers")), "target_layer_ids"),
        (lambda c: c.update(layer_types=[S]), "layer_types has 1 entries"),
        (lambda c: c.update(layer_types=[S, "chunked_attention"]), "layer_types may only contain"),
        (lambda c: c.update(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
    ],
    ids=["no_mask", "block_1", "dup_ids", "ids_past_target", "no_ids", "short_types", "bad_type", "gqa", "dflash2"],
)
def test_bad_configs_raise_naming_the_key(target, edit, match):
    config = drafter_config_dict(target)
    edit(config)
    with pytest.raises(ValueError, match=match):
        DFlashConfig(**config)


def test_is_dflash_checkpoint(tmp_path, target):
    config = drafter_config_dict(target)
    assert is_dflash_checkpoint(config) and is_dflash_checkpoint(drafter_config(target))
    assert is_dflash_checkpoint(write_checkpoint(tmp_path / "dflash", config, {}))
    assert is_dflash_checkpoint(str(tmp_path / "dflash"), dtype="float32", revision=None)  # from_pretrained kwargs
    assert is_dflash_checkpoint({**config, "architectures": ["DFlash2DraftModel"]})  # loads into the clear error
    Qwen3Config(num_hidden_layers=2).save_pretrained(tmp_path / "qwen3")
    assert not is_dflash_checkpoint(tmp_path / "qwen3")
    assert not is_dflash_checkpoint(Qwen3Config())
    (tmp_path / "no_config").mkdir()
    assert not is_dflash_checkpoint(tmp_path / "no_config")
