"""Where the parts of a model placed by accelerate (``from_pretrained(..., device_map=...)``) run, and the rule that
puts a drafter beside them. Knows no model.

accelerate gives every module an **execution device**: the GPU it was placed on; for a module whose weights wait in
CPU memory or on disk (offload), the first GPU of the map, onto which its hook loads the weights around each forward;
the CPU when the map names no GPU. Activations move between devices at the hooked modules' boundaries.

    target layer i      its K/V pages on layer i's execution device (KV groups split by device, cache/kv_layout.py);
                        a KV-shared layer on another device than its producer reads the producer's pages there
    Gemma 4 assistant   moved to the execution device of the producer layers it reads (the last one if they differ)
    DFlash drafter      moved to the execution device of the target's LM head (its logits go through that head)
    Step 3.5 MTP layers where accelerate put them: each MTP layer's cache on its execution device

A drafter is small beside its target, so ``generate`` moves it (in place, once; a warning says so) instead of asking
the user to guess where accelerate put the target's layers. Moving the pages the other way would copy the cache.
Refused, naming the fix: a drafter whose weights are on the meta device, offloaded or split over several devices.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

__all__ = ["execution_device", "input_device", "is_dispatched", "layer_devices", "loaded_weights", "place_drafter"]


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device accelerate's hook on ``module`` names (a SequentialHook's first that names one)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or [hook]:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return None


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module``'s forward runs: its accelerate hook's execution device, else the device of its first weight
    not on the meta device, else the hook of a submodule (an offloaded block hooks the modules that own weights);
    None for a module without weights."""
    device = _hook_device(module)
    if device is not None:
        return device
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    for sub in module.modules():
        device = _hook_device(sub)
        if device is not None:
            return device
    return None


def input_device(model: torch.nn.Module) -> torch.device:
    """The device a model's input ids go to: its input embedding's execution device (``model.device`` is the first
    weight's, the meta device when that weight is offloaded to disk)."""
    return execution_device(model.get_input_embeddings()) or model.device


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model over several devices or offloads part of it (its modules then run under
    hooks that move weights or activations, which a CUDA graph cannot capture)."""
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    return len(devices) > 1 or bool(devices & {"cpu", "disk"}) and any(
        getattr(m, "_hf_hook", None) is not None and getattr(m._hf_hook, "offload", False) for m in model.modules())


def layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """``layer_idx`` -> execution device of the first module carrying that ``layer_idx`` (a decoder layer or its
    attention: accelerate places whole layers, so both run on one device)."""
    devices: dict[int, torch.device] = {}
    for name, module in model.named_modules():
        if _in_encoder_tower(name):  # a vision / audio encoder numbers its own layers from 0 too
            continue
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in devices:
            device = execution_device(module)
            if device is not None:
                devices[idx] = device
    return devices


def _in_encoder_tower(name: str) -> bool:
    """Whether the module at ``name`` belongs to a multimodal model's vision or audio encoder (not the decoder whose
    layers own the KV pages)."""
    return any(part.startswith(("vision", "audio", "embed_vision", "embed_audio")) for part in name.split("."))


@contextlib.contextmanager
def loaded_weights(*modules: torch.nn.Module):
    """While open, the weights of ``modules`` are on their execution device even when accelerate offloaded them: its
    hooks load an offloaded module's weights only around that module's own forward, and some callers read weights
    directly (a fused kernel over packed expert weights, an embedding table row, a drafter reading the target's
    head). A no-op for modules without hooks."""
    hooked = [m for module in modules for m in module.modules() if getattr(m, "_hf_hook", None) is not None]
    for m in hooked:
        m._hf_hook.pre_forward(m)
    try:
        yield
    finally:
        for m in reversed(hooked):
            m._hf_hook.post_forward(m, None)


def place_drafter(drafter: torch.nn.Module, device: torch.device, role: str = "assistant_model"):
    """Move ``drafter`` (in place) to ``device``, where the target layers it reads run; returns it. Refused, naming
    the fix, when its weights cannot move: on the meta device, offloaded or dispatched over several devices."""
    if getattr(drafter, "hf_device_map", None) and len(set(drafter.hf_device_map.values())) > 1 or any(
            getattr(m, "_hf_hook", None) is not None for m in drafter.modules()):
        device_map = dict(getattr(drafter, "hf_device_map", None) or {})  # hooks without a map: cpu_offload
        raise ValueError(f"the {role} is dispatched by accelerate (device_map={device_map}); "
                         f"hf_specdec places a drafter whole beside the target layers it reads: load it without "
                         f"device_map, or with device_map={{'': {str(device)!r}}}.")
    weights = [*drafter.parameters(), *drafter.buffers()]
    if any(t.device.type == "meta" for t in weights):
        raise ValueError(f"the {role} has weights on the meta device (not loaded); load it with from_pretrained "
                         f"(without device_map='meta' or init_empty_weights), then pass it again.")
    current = {t.device for t in weights}
    if current and current != {device}:
        warnings.warn(f"hf_specdec moved the {role} from {', '.join(sorted(map(str, current)))} to {device}, the "
                      f"device of the target layers it reads (see docs/multi_gpu.md); load it there to skip the move.",
                      stacklevel=3)
        drafter.to(device)
    return drafter
