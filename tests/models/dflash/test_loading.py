"""Loading z-lab DFlash checkpoints (config.json + safetensors with the real key names, or known aliases)."""

import json

import pytest
import torch
import transformers

from hf_specdec.models.dflash import DFlashConfig, DFlashDrafter, load_dflash_drafter
from tests.models.dflash.helpers import (
    drafter_config,
    drafter_config_dict,
    random_state_dict,
    released_layout,
    write_checkpoint,
)
from tests.tiny_models import gemma4_31b_style

ALIASES = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc.", "layers.0.": "midlayer."}


@pytest.fixture(scope="module")
def target():
    return gemma4_31b_style()


def checkpoint(path, target, edit=None, **config_overrides):
    config = drafter_config_dict(target, **config_overrides)
    state = random_state_dict(released_layout(config))
    on_disk = dict(state)
    if edit:
        edit(on_disk)
    return write_checkpoint(path, config, on_disk), state


def assert_every_tensor_landed(model, state):
    loaded = model.state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_module_tree_is_the_released_key_layout(target):
    model = DFlashDrafter(drafter_config(target))
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert ours == released_layout(drafter_config_dict(target))


def test_real_key_names_load_every_tensor(tmp_path, target):
    path, state = checkpoint(tmp_path, target)
    model = load_dflash_drafter(path)
    assert type(model) is DFlashDrafter and type(model.config) is DFlashConfig
    assert_every_tensor_landed(model, state)
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (4, 96, [0, 3, 5])


def test_aliased_key_names_load_every_tensor(tmp_path, target):
    """`encoder.fc` / `encoder.output_norm_enc` (transformers-style) and `midlayer.` (one-layer EAGLE-style)."""

    def rename(state):
        for name in list(state):
            for real, alias in ALIASES.items():
                if name.startswith(real):
                    state[alias + name[len(real):]] = state.pop(name)

    path, state = checkpoint(tmp_path, target, edit=rename, num_hidden_layers=1)
    stored = json.loads((path / "config.json").read_text())
    assert stored["num_hidden_layers"] == 1
    assert_every_tensor_landed(DFlashDrafter.from_pretrained(path), state)


def test_round_trip_through_save_pretrained(tmp_path, target):
    path, state = checkpoint(tmp_path / "in", target)
    load_dflash_drafter(path).save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("qwen3", ["DFlashDraftModel"])
    assert_every_tensor_landed(load_dflash_drafter(tmp_path / "out"), state)


def test_missing_key_raises_or_is_reported(tmp_path, target):
    missing = "layers.1.self_attn.k_norm.weight"
    path, _ = checkpoint(tmp_path, target, edit=lambda s: s.pop(missing))
    with pytest.raises(ValueError, match=r"missing keys \['layers\.1\.self_attn\.k_norm\.weight'\]"):
        load_dflash_drafter(path)
    _, info = DFlashDrafter.from_pretrained(path, output_loading_info=True)
    assert set(info["missing_keys"]) == {missing}


def test_unexpected_key_raises_but_a_copy_of_the_target_head_is_ignored(tmp_path, target):
    extra = "layers.0.self_attn.g_proj.weight"
    path, _ = checkpoint(tmp_path / "bad", target, edit=lambda s: s.update({extra: torch.zeros(4, 32)}))
    with pytest.raises(ValueError, match="unexpected keys.*g_proj"):
        load_dflash_drafter(path)
    head = {"lm_head.weight": torch.zeros(97, 32), "embed_tokens.weight": torch.zeros(97, 32)}
    path, state = checkpoint(tmp_path / "head", target, edit=lambda s: s.update(head))
    assert_every_tensor_landed(load_dflash_drafter(path), state)


def test_auto_model_maps_our_config_to_the_drafter(target):
    model = transformers.AutoModelForCausalLM.from_config(drafter_config(target))
    assert type(model) is DFlashDrafter


def test_transformers_auto_classes_see_a_qwen3_model(tmp_path, target):
    """Why `hf_specdec.AutoModelForCausalLM` must ask `is_dflash_checkpoint` first (see the package docstring)."""
    path, _ = checkpoint(tmp_path, target)
    assert type(transformers.AutoConfig.from_pretrained(path)) is transformers.Qwen3Config
