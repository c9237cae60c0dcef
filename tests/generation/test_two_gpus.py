"""accelerate placements over two GPUs (skipped on machines with fewer): the bundled family with its decoder layers
split between cuda:0 and cuda:1 decodes the tokens of the same weights on one GPU, in every mode, with the drafter
loaded on the CPU (generate moves it beside what it reads)."""

from __future__ import annotations

import functools

import pytest
import torch

import hf_specdec
from hf_specdec.assets import asset_path
from hf_specdec.generation.fusion import _FUSED, stacked_groups
from hf_specdec.kernels.stacked_linear import stacked_weight
from hf_specdec.runtime import placement
from hf_specdec.runtime.cuda_graphs import SpanningGraph
from tests.bundled import batch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

GREEDY = dict(max_new_tokens=12, do_sample=False)


def _split(asset: str, second_from: int) -> dict[str, str]:
    """Layers ``second_from`` and later (the MTP layers of Step 3.5 among them) on cuda:1; everything else, the tied
    embedding and LM head too, on cuda:0."""
    import transformers

    text = transformers.AutoConfig.from_pretrained(asset_path(asset)).get_text_config()
    layers = text.num_hidden_layers + (getattr(text, "num_nextn_predict_layers", 0) or 0)
    names = ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"]
    if asset == "tiny-gemma4":
        names += ["model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm"]
    placement = {name: "cuda:0" for name in names}
    placement.update({f"model.layers.{i}": "cuda:1" if i >= second_from else "cuda:0" for i in range(layers)})
    return placement


@functools.lru_cache(maxsize=None)
def _model(asset: str, second_from: int | None):
    device_map = {"": "cuda:0"} if second_from is None else _split(asset, second_from)
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(asset), dtype=torch.float32,
                                                            device_map=device_map)
    model.generation_config.eos_token_id = None
    return model


def _drafter(mode: str):
    if mode in ("plain", "step_plain"):
        return {}
    if mode == "step_mtp":
        return dict(spec_mode="mtp", num_speculative_tokens=3)
    name = "tiny-gemma4-assistant" if mode == "mtp" else "tiny-gemma4-dflash"
    drafter = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(name), dtype=torch.float32)
    return dict(assistant_model=drafter, spec_mode=mode, num_speculative_tokens=3)


# second_from: the first layer on cuda:1. The tiny Gemma 4 has 8 layers, the last two sharing the KV of layers 5
# (sliding) and 3 (full): 4 leaves layer 7 apart from its producer, 6 both shared layers. Step 3.5 has 5 layers and
# 3 MTP layers: 5 puts exactly the MTP layers apart.
SPLITS = {"tiny-gemma4": [4, 6], "tiny-step3p5": [3, 5]}


@pytest.mark.parametrize("mode", ["plain", "mtp", "dflash", "step_plain", "step_mtp"])
@pytest.mark.parametrize("split", [0, 1])
def test_layers_on_two_gpus_decode_the_one_gpu_tokens(mode, split):
    asset = "tiny-step3p5" if mode.startswith("step") else "tiny-gemma4"
    second_from = SPLITS[asset][split]
    model, single = _model(asset, second_from), _model(asset, None)
    assert {str(d) for d in model.hf_device_map.values()} == {"cuda:0", "cuda:1"}
    ids, mask = (t.to("cuda:0") for t in batch(3))
    expected = single.generate(ids, attention_mask=mask, **GREEDY, **_drafter(mode))
    got = model.generate(ids, attention_mask=mask, **GREEDY, **_drafter(mode))
    assert torch.equal(got, expected)
    assert model._hf_specdec.dispatched
    # nothing is offloaded: the decode and verify forwards replay graphs that span both GPUs, and the layers on
    # cuda:1 run the fused forwards (accelerate's wrapped forward calls them)
    store = model._hf_specdec.graph_store
    assert store.devices == (torch.device("cuda:0"), torch.device("cuda:1")) and store.disabled_reason is None
    assert store.graphs and all(isinstance(g.graph, SpanningGraph) for g in store.graphs.values())
    layer = model.model.layers[second_from]
    assert getattr(layer._old_forward, "__func__", None) is _FUSED[type(layer)].forward
    # and its same-input projections (each hooked by accelerate to move its inputs only) share one GEMM
    groups = [[getattr(m, n) for n in names if getattr(m, n, None) is not None]
              for m in layer.modules() for names in stacked_groups(m)]
    assert groups and all(stacked_weight(*linears) is not None for linears in groups if len(linears) > 1)
    # the tensors every layer takes reach each GPU once per forward (placement._MoveOnce, before accelerate's move)
    assert any(isinstance(h, placement._MoveOnce) for h in layer._forward_pre_hooks.values())


@pytest.mark.parametrize("mode", ["plain", "mtp", "dflash", "step_plain", "step_mtp"])
def test_a_main_device_apart_from_the_embedding(mode):
    """accelerate picks a dispatched model's main device (where its top-level hook moves the arguments) from a set,
    so either GPU of a two-GPU map: here cuda:1, while the embedding, final norm and head sit on cuda:0."""
    import transformers
    from accelerate import dispatch_model

    asset = "tiny-step3p5" if mode.startswith("step") else "tiny-gemma4"
    model = transformers.AutoModelForCausalLM.from_pretrained(asset_path(asset), dtype=torch.float32)
    dispatch_model(model, device_map=_split(asset, SPLITS[asset][0]), main_device="cuda:1",
                   skip_keys=model._skip_keys_device_placement)  # as from_pretrained dispatches
    model = hf_specdec.enable(model)
    model.generation_config.eos_token_id = None
    ids, mask = (t.to("cuda:0") for t in batch(3))
    expected = _model(asset, None).generate(ids, attention_mask=mask, **GREEDY, **_drafter(mode))
    seen = _current_gpus(model.model.embed_tokens, model.model.layers[SPLITS[asset][0]])
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY, **_drafter(mode)).to("cuda:0"), expected)
    assert model._hf_specdec.graph_store.graphs
    # the top module runs with cuda:1 current (its hook's device); the embedding on cuda:0 is guarded back to it
    assert seen == {0: {0}, 1: {1}}


def _current_gpus(*modules) -> dict[int, set[int]]:
    """{i: the GPUs current when ``modules[i]``'s forward ran} (eager forwards: a prompt's), filled as they run."""
    seen: dict[int, set[int]] = {i: set() for i in range(len(modules))}
    for i, module in enumerate(modules):
        module.register_forward_pre_hook(lambda m, args, i=i: seen[i].add(torch.cuda.current_device()))
    return seen


def test_a_model_offloaded_in_part_decodes_eagerly_and_disable_undoes_the_gpu_guards():
    """With a layer offloaded to the CPU, no graph is captured (its hook loads weights around each forward); the
    tokens are the one-GPU ones; ``disable`` removes the hooks that make each layer's GPU current."""
    from hf_specdec.runtime.placement import _guards

    placement = _split("tiny-gemma4", 6) | {"model.layers.5": "cpu"}
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32,
                                                            device_map=placement)
    model.generation_config.eos_token_id = None
    ids, mask = (t.to("cuda:0") for t in batch(3))
    expected = _model("tiny-gemma4", None).generate(ids, attention_mask=mask, **GREEDY)
    seen = _current_gpus(model.model.embed_tokens, model.model.layers[7])
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), expected)
    assert model._hf_specdec.graph_store.devices == () and not model._hf_specdec.graph_store.graphs
    # each module runs with its GPU current (accelerate's main device, whose hook is on the top module, is either)
    assert seen == {0: {0}, 1: {1}} and _guards(model.model.layers[7])  # (off the input GPU: guarded itself)
    hf_specdec.disable(model)
    assert not any(_guards(m) for m in model.modules())
