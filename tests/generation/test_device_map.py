"""accelerate placements on CPU: the bundled family loaded with device_map dicts over "cpu" and "disk" (offload)
decodes the unsplit model's greedy tokens in every mode, with the drafter wherever the user loaded it."""

from __future__ import annotations

import functools

import pytest
import torch

import hf_specdec
from hf_specdec.assets import asset_path
from tests.bundled import batch, dflash, gemma, step

GREEDY = dict(max_new_tokens=12, do_sample=False)


def _device_map(model, disk: set[str]) -> dict[str, str]:
    """Every top-level module of ``model.model`` (each decoder layer on its own) and the LM head, on "disk" when its
    name is in ``disk`` (a layer as ``"layers.i"``), else on "cpu"."""
    names = [f"layers.{i}" for i in range(len(model.model.layers))]
    names += [n for n, _ in model.model.named_children() if n != "layers"]
    placement = {f"model.{n}": "disk" if n in disk else "cpu" for n in names}
    placement["lm_head"] = "disk" if "lm_head" in disk else "cpu"
    return placement


@functools.lru_cache(maxsize=None)
def _placed(asset: str, disk: frozenset, tmp: str):
    unsplit = step()[0] if asset == "tiny-step3p5" else gemma()[0]
    return hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(asset), dtype=torch.float32,
                                                           device_map=_device_map(unsplit, set(disk)),
                                                           offload_folder=tmp)


# odd layers offloaded; "ends": also the embedding, the final norm and the tied LM head (model.device is then meta)
PLACEMENTS = {"odd_layers": {"layers.1", "layers.3", "layers.5", "layers.7"},
              "ends": {"layers.1", "layers.3", "embed_tokens", "embed_tokens_per_layer", "norm", "lm_head"}}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("mode", ["plain", "mtp", "dflash", "step_plain", "step_mtp"])
def test_offloaded_target_decodes_the_unsplit_tokens(mode, placement, tmp_path_factory):
    asset = "tiny-step3p5" if mode.startswith("step") else "tiny-gemma4"
    disk = PLACEMENTS[placement] if asset == "tiny-gemma4" else {"layers.1", "layers.3", "layers.6", "norm"}
    model = _placed(asset, frozenset(disk), str(tmp_path_factory.mktemp(f"offload_{asset}")))
    assert "disk" in model.hf_device_map.values()
    unsplit = step()[0] if asset == "tiny-step3p5" else gemma()[0]
    extra = {"plain": {}, "step_plain": {}, "mtp": dict(assistant_model=gemma()[1], num_speculative_tokens=3),
             "dflash": dict(assistant_model=dflash(), spec_mode="dflash"),
             "step_mtp": dict(spec_mode="mtp", num_speculative_tokens=3)}[mode]
    ids, mask = batch(3)
    expected = unsplit.generate(ids, attention_mask=mask, **GREEDY, **extra)
    got = model.generate(ids, attention_mask=mask, **GREEDY, **extra)
    assert torch.equal(got, expected)
    assert model._hf_specdec.dispatched and model._hf_specdec.graph_store_for(torch.device("cuda")) is None


def test_the_assistant_needs_no_placement_by_the_user(tmp_path):
    """The issue's case: the target somewhere else than the assistant (here its first weight on disk, so
    ``target.device`` is meta); generate runs the assistant beside the layers it reads, no error."""
    model = _placed("tiny-gemma4", frozenset(PLACEMENTS["ends"]), str(tmp_path))
    assert model.device.type == "meta"
    ids, mask = batch(2)
    target, assistant, _ = gemma()
    out = model.generate(ids, attention_mask=mask, assistant_model=assistant, **GREEDY)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **GREEDY))
    assert assistant.pre_projection.weight.device.type == "cpu"
