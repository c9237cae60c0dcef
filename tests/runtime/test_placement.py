"""Placement under accelerate's device_map (runtime/placement.py, cache/kv_layout.split_by_device): the rules on
fake devices — a module's execution device from its hook, KV groups split by the device of their layers, pages and
forward descriptions on each group's device (the meta device stands in for a second device), the drafter rule."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from hf_specdec.cache import KVLayout, PagedKVCache, split_by_device
from hf_specdec.runtime.placement import execution_device, layer_devices, loaded_weights, place_drafter


def _hooked(module: torch.nn.Module, device: str) -> torch.nn.Module:
    module._hf_hook = types.SimpleNamespace(execution_device=device)
    return module


def test_execution_device_prefers_the_hook_then_weights_then_a_submodule_hook():
    assert execution_device(_hooked(torch.nn.Linear(2, 2), "cuda:1")) == torch.device("cuda:1")
    assert execution_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    offloaded = torch.nn.Sequential(_hooked(torch.nn.Linear(2, 2, device="meta"), "cuda:0"))
    assert execution_device(offloaded) == torch.device("cuda:0")
    assert execution_device(torch.nn.ReLU()) is None


def test_layer_devices_reads_each_layer_idx_once():
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    for i, (layer, device) in enumerate(zip(layers, ["cuda:0", "cuda:0", "cuda:1"])):
        layer.layer_idx = i
        _hooked(layer, device)
    assert layer_devices(layers) == {0: torch.device("cuda:0"), 1: torch.device("cuda:0"), 2: torch.device("cuda:1")}


def test_layer_devices_take_the_first_module_of_a_layer_idx_in_module_order():
    """A decoder layer and its attention carry the same layer_idx: the one met first in ``named_modules`` order (the
    layer, before its submodules; an earlier sibling before a later one) gives the device."""
    layer = torch.nn.Module()
    layer.self_attn = _hooked(torch.nn.Linear(2, 2), "cuda:1")
    layer.self_attn.layer_idx = 0
    _hooked(layer, "cuda:0").layer_idx = 0
    first, second = _hooked(torch.nn.Linear(2, 2), "cuda:2"), _hooked(torch.nn.Linear(2, 2), "cuda:3")
    first.layer_idx = second.layer_idx = 1
    model = torch.nn.ModuleList([layer, first, second])
    assert layer_devices(model) == {0: torch.device("cuda:0"), 1: torch.device("cuda:2")}
    assert list(layer_devices(model)) == [0, 1]


def _layout() -> KVLayout:
    # layers 0, 2 sliding; 1, 3 full; layer 4 shares layer 2's pages (a KV-shared layer)
    specs = [(2, 8, 4), (1, 16, None), (2, 8, 4), (1, 16, None), (2, 8, 4)]
    return KVLayout.from_layers(specs, {0: 0, 1: 1, 2: 2, 3: 3, 4: 2})


def test_split_by_device_keeps_one_device_layouts_and_splits_the_others():
    layout = _layout()
    assert split_by_device(layout, {i: "cpu" for i in range(5)}) is layout
    split = split_by_device(layout, {0: "cuda:0", 1: "cuda:0", 2: "cuda:1", 3: "cuda:1", 4: "cuda:1"})
    assert [(g.layers, g.device) for g in split.groups] == [
        ((0,), "cuda:0"), ((2,), "cuda:1"), ((1,), "cuda:0"), ((3,), "cuda:1")]
    assert split.layer_slot[4] == split.layer_slot[2]  # the shared layer still reads its producer's pages
    assert all(g.sliding_window == 4 for g in split.groups[:2]) and split.groups[2].sliding_window is None


def test_pages_and_forward_description_live_on_each_groups_device():
    split = split_by_device(_layout(), {0: "cpu", 1: "cpu", 2: "meta", 3: "meta", 4: "meta"})
    cache = PagedKVCache(split, [8] * len(split.groups), 2, block_size=4, dtype=torch.float32, device="cpu")
    assert {str(k.device) for k in cache.k_storage} == {"cpu", "meta"}
    cache.begin_forward([3, 2], 3)
    for layer in range(5):
        k, _, tables, _ = cache.layer_pages(layer)
        assert tables.device == k.device == torch.device("meta" if layer >= 2 else "cpu")
    assert cache.meta_on(torch.device("meta")) is cache.meta_on(torch.device("meta"))  # copied once per forward
    cache.commit([3, 2])
    assert cache.context_pages(3)[2].device.type == "meta" and cache.seq_lens == [3, 2]


def test_loaded_weights_runs_the_hooks_around_the_block():
    calls = []
    module = torch.nn.Linear(2, 2)
    module._hf_hook = types.SimpleNamespace(pre_forward=lambda m: calls.append("load"),
                                            post_forward=lambda m, out: calls.append("offload"))
    with loaded_weights(module, torch.nn.ReLU()):
        calls.append("read")
    assert calls == ["load", "read", "offload"]


def test_place_drafter_moves_a_small_drafter_beside_its_layers_with_a_warning():
    drafter = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert place_drafter(drafter, torch.device("cpu")) is drafter  # already there: no warning
    with pytest.warns(UserWarning, match=r"moved the assistant_model from cpu to meta"):
        place_drafter(drafter, torch.device("meta"))
    assert drafter.weight.device.type == "meta"


def test_place_drafter_refuses_what_cannot_move():
    with pytest.raises(ValueError, match=r"meta device \(not loaded\); load it with from_pretrained"):
        place_drafter(torch.nn.Linear(2, 2, device="meta"), torch.device("cpu"))
    split = torch.nn.Linear(2, 2)
    split.hf_device_map = {"a": 0, "b": 1}
    with pytest.raises(ValueError, match=r"dispatched by accelerate .*load it without device_map"):
        place_drafter(split, torch.device("cpu"), "DFlash drafter")


def test_layer_devices_skip_an_encoder_towers_own_layer_numbers():
    """A multimodal model's vision tower numbers its layers from 0 too: the text layers' devices are not its."""
    from hf_specdec.runtime import placement

    class Layer(torch.nn.Module):
        def __init__(self, idx):
            super().__init__()
            self.layer_idx = idx

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(0), Layer(1)])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = Tower()
            self.language_model = Tower()

    class Outer(torch.nn.Module):  # towers one level down, as in Gemma 4's ``model.vision_tower``, and audio ones
        def __init__(self):
            super().__init__()
            self.model = Model()
            self.model.audio_tower, self.model.embed_audio, self.model.embed_vision = Tower(), Tower(), Tower()

    model, outer = Model(), Outer()
    towers = (model.vision_tower, outer.model.vision_tower, outer.model.audio_tower, outer.model.embed_audio,
              outer.model.embed_vision)
    devices = {id(m): torch.device("meta") for tower in towers for m in tower.modules()}
    original = placement.execution_device
    try:
        placement.execution_device = lambda module: devices.get(id(module), torch.device("cpu"))
        assert placement.layer_devices(model) == {0: torch.device("cpu"), 1: torch.device("cpu")}
        assert placement.layer_devices(outer) == {0: torch.device("cpu"), 1: torch.device("cpu")}
    finally:
        placement.execution_device = original


def test_a_hooked_drafter_without_a_device_map_gets_the_error_that_names_the_fix():
    from hf_specdec.runtime.placement import place_drafter

    drafter = torch.nn.Linear(2, 2)
    drafter._hf_hook = object()  # what accelerate's cpu_offload leaves: hooks, no hf_device_map
    with pytest.raises(ValueError, match="load it without device_map"):
        place_drafter(drafter, torch.device("cpu"))


def test_gpu_devices_names_a_split_over_gpus_with_nothing_offloaded():
    """Only a model accelerate placed over several GPUs, none of its weights offloaded, gets graphs that span them."""
    from hf_specdec.runtime.placement import gpu_devices

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.hf_device_map = {"0": 1, "1": "cuda:0"}
    assert gpu_devices(model) == (torch.device("cuda:0"), torch.device("cuda:1"))
    model.hf_device_map = {"0": 0, "1": 0}
    assert gpu_devices(model) == ()  # one GPU: the model's own graphs
    for elsewhere in ("cpu", "disk"):
        model.hf_device_map = {"0": 0, "1": elsewhere}
        assert gpu_devices(model) == ()
    model.hf_device_map = {"0": 0, "1": 1}
    model[1]._hf_hook = types.SimpleNamespace(hooks=[types.SimpleNamespace(execution_device=1, offload=True)])
    assert gpu_devices(model) == ()  # weights loaded around a forward cannot be captured


class _Placed(torch.nn.Module):
    """A model whose parts accelerate placed (fake hooks): the embedding on cuda:0, one part on cuda:1, one on cuda:0,
    one on the CPU."""

    def __init__(self):
        super().__init__()
        self.embed = _hooked(torch.nn.Embedding(4, 2), "cuda:0")
        self.far, self.near, self.host = (_hooked(torch.nn.Linear(2, 2), d) for d in ("cuda:1", "cuda:0", "cpu"))

    def get_input_embeddings(self):
        return self.embed

    @classmethod
    def on_cpu(cls) -> "_Placed":
        """One whose embedding runs on the CPU."""
        model = cls()
        model.embed._hf_hook.execution_device = "cpu"
        return model


def test_guard_devices_hooks_the_modules_on_other_gpus_once_and_unguard_removes_them_from_a_copy_too():
    import copy

    from hf_specdec.kernels._dispatch import other_hooks
    from hf_specdec.runtime import placement
    from hf_specdec.runtime.placement import _guards, guard_devices, unguard_devices

    model = _Placed()
    guard_devices(model)
    guard_devices(model)  # idempotent
    assert len(_guards(model.far)) == 2 and not any(_guards(m) for m in (model.embed, model.near, model.host))
    assert model.far._forward_hooks_always_called
    assert not other_hooks(model.far, pre=True) and not other_hooks(model.far, pre=False)  # guards change nothing
    model.far.register_forward_hook(lambda *args: None)
    assert other_hooks(model.far, pre=False) and not other_hooks(model.far, pre=True)
    copied = copy.deepcopy(model)
    unguard_devices(model)
    assert not model.far._forward_pre_hooks and len(model.far._forward_hooks) == 1  # the user's hook stays
    assert not model.far._forward_hooks_always_called
    assert len(_guards(copied.far)) == 2
    unguard_devices(copied)
    assert not any(_guards(m) for m in copied.modules())
    # a module guarded again for another GPU (a drafter placed beside another target) keeps one pair, for that GPU
    placement._guard(model.near, torch.device("cuda:1"))
    placement._guard(model.near, torch.device("cuda:2"))
    pre = [model.near._forward_pre_hooks[i] for i in _guards(model.near) if i in model.near._forward_pre_hooks]
    assert len(_guards(model.near)) == 2 and [h.device for h in pre] == [torch.device("cuda:2")]


def test_keyword_tensors_reach_a_layer_on_another_device_once_per_forward_of_the_enabled_model():
    """The tensors a forward hands to every decoder layer (rotary tables, masks) are copied to a layer's device once
    per forward of the enabled model, not once per layer; the keys accelerate's hook skips and non-tensors are left as
    they are, and outside that forward (or after it) the hook changes nothing. (CPU -> meta stands for two GPUs.)"""
    from hf_specdec.runtime import placement

    meta = torch.device("meta")
    hook = placement._MoveOnce(meta, ["past_key_values"])
    cos, sin, mask, cache = torch.randn(3), torch.randn(3), torch.ones(2, dtype=torch.bool), torch.zeros(1)
    kwargs = dict(position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache, layer_idx=3)
    assert hook(None, (), kwargs) is None  # no forward of the enabled model is running
    placement._open_moves(None, ())
    try:
        _, first = hook(None, ("hidden",), kwargs)
        _, second = hook(None, ("hidden",), dict(kwargs))
        assert first["position_embeddings"][0].device == meta and first["attention_mask"].device == meta
        assert all(a is b for a, b in zip(first["position_embeddings"], second["position_embeddings"]))
        assert first["attention_mask"] is second["attention_mask"]  # copied once
        assert first["past_key_values"] is cache and first["layer_idx"] == 3  # skipped, not a tensor
        fresh = torch.ones(2, dtype=torch.bool)  # another tensor (a new forward's), even with the same values
        _, third = hook(None, (), dict(kwargs, attention_mask=fresh))
        assert third["attention_mask"] is not first["attention_mask"]
        del fresh, third
        assert len(placement._moves.copies) == 3  # a source gone takes its copy with it
    finally:
        placement._close_moves(None, (), None)
    assert not placement._moves.copies and hook(None, (), kwargs) is None
    # an interrupt inside the model's forward skips the hook that closes it: the generate call's exit does
    placement._open_moves(None, ())
    with pytest.raises(KeyboardInterrupt):
        with placement.on_input_gpu(_Placed.on_cpu()):
            raise KeyboardInterrupt
    assert placement._moves.depth == 0 and hook(None, (), kwargs) is None


def test_movers_go_on_each_placed_module_once_and_disable_takes_them_away(monkeypatch):
    """Over several GPUs, each module the device map names (and whose hooks only move its inputs) gets one
    :class:`placement._MoveOnce`, the model the pair that opens and closes a forward's copies; installing again
    keeps one of each; ``unguard_devices`` removes them (the meta device stands in for the GPUs)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from hf_specdec.runtime import placement

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).to("meta")
    for layer in model:
        add_hook_to_module(layer, AlignDevicesHook(execution_device="meta", skip_keys=["past_key_values"]))
    model.hf_device_map = {"0": "meta", "1": "meta"}
    monkeypatch.setattr(placement, "gpu_devices", lambda m: (torch.device("cuda", 0), torch.device("cuda", 1)))

    def movers(module):
        return [h for h in module._forward_pre_hooks.values() if isinstance(h, placement._MoveOnce)]

    for _ in range(2):
        placement._install_movers(model)
        assert [len(movers(layer)) for layer in model] == [1, 1]
        assert movers(model[0])[0].skip_keys == {"past_key_values"}
        assert list(model._forward_pre_hooks.values()) == [placement._open_moves]
        assert list(model._forward_hooks.values()) == [placement._close_moves]
    placement.unguard_devices(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks or m._forward_pre_hooks_with_kwargs
                   for m in model.modules())


def test_under_a_top_module_hooked_to_another_gpu_the_parts_on_the_input_gpu_are_guarded_back_to_it():
    """accelerate's main device may be cuda:1 (its top-level hook moves the arguments there) while the embedding is
    on cuda:0: the top module runs with cuda:1 current, so the embedding and the parts on cuda:0 need their own
    guards; the part on cuda:1 keeps its own too (it may be called outside the top module's forward)."""
    from hf_specdec.runtime.placement import _guards, guard_devices

    model = _hooked(_Placed(), "cuda:1")
    guard_devices(model)
    devices = {name: [h.device for i, h in m._forward_pre_hooks.items() if i in _guards(m)]
               for name, m in model.named_children()}
    assert [h.device for i, h in model._forward_pre_hooks.items() if i in _guards(model)] == [torch.device("cuda:1")]
    assert devices == {"embed": [torch.device("cuda:0")], "far": [torch.device("cuda:1")],
                       "near": [torch.device("cuda:0")], "host": []}
    model._hf_hook = types.SimpleNamespace(execution_device="cuda:0")  # placed again with cuda:0 as main device
    guard_devices(model)
    assert not _guards(model) and not _guards(model.embed) and len(_guards(model.far)) == 2


def test_a_guarded_forward_restores_the_gpu_when_it_raises_and_generate_restores_it_after_an_interrupt(monkeypatch):
    """The guards keep the current GPU balanced around a forward that raises; ``on_input_gpu`` (around each generate
    call) makes the input device's GPU current and puts the one before back whatever happened inside."""
    from hf_specdec.runtime import placement

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(0, torch.device(d).index
                                                                                if not isinstance(d, int) else d))
    model = _Placed()
    placement.guard_devices(model)
    seen = []
    model.far.register_forward_pre_hook(lambda module, args: seen.append(current[0]))
    model.far(torch.zeros(1, 2))
    assert seen == [1] and current[0] == 0

    def boom(module, args, output):
        raise RuntimeError("boom")
    model.far.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model.far(torch.zeros(1, 2))
    assert current[0] == 0 and placement._previous_devices.stack == []
    current[0] = 1
    with pytest.raises(KeyboardInterrupt):
        with placement.on_input_gpu(model):
            assert current[0] == 0
            placement._previous_devices.stack.append(0)  # as a guarded forward interrupted inside leaves it
            raise KeyboardInterrupt
    assert current[0] == 1 and placement._previous_devices.stack == []


def test_modules_with_weights_off_the_gpu_keep_accelerates_forward():
    """The fused forward goes into accelerate's wrapper only where every weight of the module stays on its GPU: not
    for weights on the CPU, nor for a block whose submodule's hook offloads."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from hf_specdec.runtime.placement import moves_activations_only

    block = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not moves_activations_only(block)  # no hook
    add_hook_to_module(block, AlignDevicesHook(execution_device="cpu"))
    assert not moves_activations_only(block)  # a CPU execution device
    block._hf_hook.execution_device = torch.device("cuda", 0)
    assert not moves_activations_only(block)  # its weights are not on the GPU
    # the meta device stands in for a GPU: weights there, the hook's device there
    block.to("meta")
    block._hf_hook.execution_device = torch.device("meta")
    assert moves_activations_only(block)
    offloaded = torch.nn.Sequential(torch.nn.Linear(2, 2))
    add_hook_to_module(offloaded[0], AlignDevicesHook(execution_device="meta", offload=True))  # weights now on meta
    add_hook_to_module(offloaded, AlignDevicesHook(execution_device="meta"))
    assert all(p.device.type == "meta" for p in offloaded.parameters())
    assert not moves_activations_only(offloaded)  # a submodule's weights are loaded around its own forward
    # a hook beside accelerate's own, or accelerate's CpuOffload (weights moved around the forward), does more
    from accelerate.hooks import CpuOffload, ModelHook, SequentialHook

    assert moves_activations_only(block)
    block._hf_hook = SequentialHook(block._hf_hook, ModelHook())
    assert not moves_activations_only(block)
    cpu_offloaded = torch.nn.Linear(2, 2)
    add_hook_to_module(cpu_offloaded, CpuOffload(execution_device="meta"))
    cpu_offloaded.to("meta")  # as if its weights were on its GPU now
    assert not moves_activations_only(cpu_offloaded)
