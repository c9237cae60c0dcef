"""The kernels-only fused forwards live on a model exactly while it has weights where the kernels run: an enabled
CPU model goes without them (each would only call the module's own forward), and ``generate`` follows the model
when it moves."""

import importlib

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from hf_specdec.generation.fusion import FORCE_TRITON_ENV, fuse_modules, kernels_may_run
from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _fused(model) -> int:
    return sum("forward" in vars(m) for m in model.modules() if isinstance(m, Gemma4RMSNorm))


def test_a_cpu_model_goes_without_kernels_only_forwards_until_the_kernels_can_run(monkeypatch):
    model, _, _ = bundled.mode("plain")
    state = model._hf_specdec
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    assert not kernels_may_run(model) and not state.fused and _fused(model) == 0
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if its weights were on a GPU
    state.fuse_where_kernels_run(model)
    norms = sum(isinstance(m, Gemma4RMSNorm) for m in model.modules())
    assert state.fused and _fused(model) == norms > 0
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    state.fuse_where_kernels_run(model)
    assert not state.fused and _fused(model) == 0


def test_projections_are_stacked_again_once_the_weights_moved_apart(monkeypatch):
    """A cast or a round trip between devices gives every weight a storage of its own, so the stacked q/k/v and
    gate/up came apart and each projection ran its own GEMM: the next call (``fuse_where_kernels_run``) stacks
    them again; a call on weights that did not move walks no module."""
    from hf_specdec.generation import fusion
    from hf_specdec.generation.fusion import stacked_groups
    from hf_specdec.kernels.stacked_linear import stacked_weight

    model, _, _ = bundled.mode("plain")
    state = model._hf_specdec
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if its weights were on a GPU
    state.fuse_where_kernels_run(model)

    def stacked():
        groups = [[getattr(m, n) for n in names if getattr(m, n, None) is not None]
                  for m in model.modules() for names in stacked_groups(m)]
        groups = [linears for linears in groups if len(linears) > 1]  # (a KV-shared layer projects q alone)
        return sum(stacked_weight(*linears) is not None for linears in groups), len(groups)

    count, groups = stacked()
    assert count == groups > 0
    walks = []
    original = fusion.fuse_modules
    enable_module = importlib.import_module("hf_specdec.generation.enable")  # (the package names the function)
    monkeypatch.setattr(enable_module, "fuse_modules", lambda m, **k: walks.append(1) or original(m, **k))
    state.fuse_where_kernels_run(model)
    assert walks == []
    model.to(torch.float64).to(torch.float32)
    assert stacked()[0] == 0
    state.fuse_where_kernels_run(model)
    assert walks == [1] and stacked()[0] == groups
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    state.fuse_where_kernels_run(model)


def test_generate_drops_them_from_a_model_moved_to_the_cpu(monkeypatch):
    """A model enabled on a GPU and moved to the CPU (``model.to("cpu")``): the next generate removes the fused
    forwards and decodes as before, plain and speculative."""
    model, extra, _ = bundled.mode("gemma_mtp")
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    ids, mask = bundled.batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, **GREEDY)
    expected_plain = model.generate(ids, **kwargs)
    expected = model.generate(ids, **kwargs, **extra)
    for call in (dict(kwargs, **extra), kwargs):
        assert fuse_modules(model) > 0  # what enable on a GPU left
        model._hf_specdec.fused = True
        assert torch.equal(model.generate(ids, **call), expected if call is not kwargs else expected_plain)
        assert not model._hf_specdec.fused and _fused(model) == 0


def test_a_drafter_takes_the_fused_forwards_where_the_kernels_run_and_drops_them_elsewhere(monkeypatch):
    """A drafter is not an enabled model: the drafter built for each generate call gives it the kernels-only forwards
    while its weights are where the kernels run (a drafter loaded on the CPU, then moved to the GPU, had none: its
    projections took cuBLAS), and takes them away where they are not."""
    from hf_specdec.generation.registry import build_drafter

    for mode in ("gemma_mtp", "gemma_dflash"):
        model, extra, _ = bundled.mode(mode)
        drafter = extra["assistant_model"]

        def fused_linears():
            return sum("forward" in vars(m) for m in drafter.modules() if isinstance(m, torch.nn.Linear))

        monkeypatch.setenv(FORCE_TRITON_ENV, "0")
        build_drafter(model, drafter, None, None)
        assert fused_linears() == 0, mode
        monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if its weights were on a GPU
        build_drafter(model, drafter, None, None)
        assert fused_linears() > 0, mode
        monkeypatch.setenv(FORCE_TRITON_ENV, "0")
        build_drafter(model, drafter, None, None)
        assert fused_linears() == 0, mode


def test_a_module_accelerate_wraps_takes_the_fused_forward_inside_the_wrapper_and_gets_its_own_back(monkeypatch):
    """Under a device_map accelerate wraps a placed module's forward (the original kept as ``_old_forward``): where it
    only moves activations, the fused forward replaces ``_old_forward``, so the hook still moves the inputs and calls
    it; ``unfuse_modules`` puts the original back. A module it offloads keeps its own."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from hf_specdec.generation import fusion

    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if the weights were on a GPU
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    for layer in layers:
        add_hook_to_module(layer, ModelHook())
    wrapped, original = layers[0].forward, layers[0]._old_forward
    monkeypatch.setattr(fusion, "moves_activations_only", lambda module: module is layers[0])
    assert fuse_modules(layers) == 1
    assert layers[0].forward is wrapped and layers[0]._old_forward.__func__ is fusion.linear_forward
    assert layers[1]._old_forward.__func__ is torch.nn.Linear.forward  # offloaded: its own
    assert fuse_modules(layers) == 0  # once
    fusion.unfuse_modules(layers)
    assert layers[0]._old_forward == original and "_hf_specdec_old_forward" not in vars(layers[0])
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    x = torch.randn(2, 4)
    torch.testing.assert_close(layers(x), x @ layers[0].weight.T @ layers[1].weight.T)


def test_a_layer_a_device_map_only_moves_inputs_for_still_computes_the_next_norm_in_its_seam(monkeypatch):
    """Gemma 4's cross-layer seams (a layer's last seam computes the next layer's input norm) stay on for layers
    accelerate hooked only to move their inputs to their GPU, and beside hf_specdec's device guards; a hook that may
    change what the next norm reads (any other forward hook on the layer, pre-hook on the next one, or an accelerate
    hook that does more) turns them off."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from hf_specdec.generation.fusion import unfuse_modules
    from hf_specdec.kernels import _dispatch
    from hf_specdec.models.gemma4 import fusion as gemma4_fusion
    from tests import tiny_models

    model = tiny_models.gemma4_31b_style()
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")  # as if its weights were on a GPU: the fused forwards and their links
    assert fuse_modules(model) > 0
    first, second = model.model.layers[0], model.model.layers[1]
    hidden = torch.randn(1, 2, model.config.hidden_size)

    def follows() -> bool:
        norm, _ = gemma4_fusion._following_norm(first, hidden)
        assert norm is None or norm is second.input_layernorm
        return norm is not None

    assert follows()
    add_hook_to_module(first, ModelHook())
    assert not follows()  # not known to move inputs only (on the CPU none does)
    monkeypatch.setattr(_dispatch, "moves_activations_only", lambda module: module is first)
    assert follows()

    def guard(*args):
        return None

    guard.device_guard = True
    handles = [first.register_forward_hook(guard), second.register_forward_pre_hook(guard)]
    assert follows()
    handles.append(second.register_forward_pre_hook(lambda module, args: None))
    assert not follows()
    handles.pop().remove()
    handles.append(first.register_forward_hook(lambda module, args, out: None))
    assert not follows()
    handles.pop().remove()
    handles.append(first.register_forward_pre_hook(lambda module, args: None))  # anyone else's hook: as written
    assert not follows()
    for handle in handles:
        handle.remove()
    unfuse_modules(model)
    assert not follows()  # unlinked
