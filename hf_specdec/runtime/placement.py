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
import itertools
import threading
import warnings
import weakref

import torch

from hf_specdec.kernels._dispatch import accelerate_hooks as _hooks
from hf_specdec.kernels._dispatch import as_device as _as_device
from hf_specdec.kernels._dispatch import hook_device as _hook_device
from hf_specdec.kernels._dispatch import moves_activations_only

__all__ = ["execution_device", "gpu_devices", "guard_devices", "input_device", "is_dispatched", "layer_devices",
           "loaded_weights", "moves_activations_only", "on_input_gpu", "place_drafter", "unguard_devices"]


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module``'s forward runs: its accelerate hook's execution device, else the device of its first weight
    not on the meta device, else the hook of a submodule (an offloaded block hooks the modules that own weights);
    None for a module without weights."""
    device = _hook_device(module)
    if device is not None:
        return device
    for tensor in itertools.chain(module.parameters(), module.buffers()):  # lazily: the first one usually answers
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
    hooks that move weights or activations; :func:`gpu_devices` says when CUDA graphs still capture its forwards)."""
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    return len(devices) > 1 or bool(devices & {"cpu", "disk"}) and any(
        getattr(m, "_hf_hook", None) is not None and getattr(m._hf_hook, "offload", False) for m in model.modules())


def gpu_devices(model: torch.nn.Module) -> tuple[torch.device, ...]:
    """The GPUs of a model accelerate dispatched over several of them with nothing offloaded, in index order; () for
    any other model. Its hooks then only move activations from GPU to GPU, which a CUDA graph spanning the GPUs
    captures (runtime/cuda_graphs.py, SpanningGraph); weights loaded around each forward (offload) cannot be."""
    devices = {_as_device(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) < 2 or any(d is None or d.type != "cuda" for d in devices):
        return ()
    if any(getattr(h, "offload", False) for m in model.modules() for h in _hooks(m)):
        return ()
    return tuple(sorted(devices, key=lambda d: d.index if d.index is not None else torch.cuda.current_device()))


_previous_devices = threading.local()


class _EnterDevice:
    """Forward pre-hook: make ``device`` the current GPU (the one before it is restored by :func:`_leave_device`)."""

    device_guard = True

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, module, args):
        stack = getattr(_previous_devices, "stack", None)
        if stack is None:
            stack = _previous_devices.stack = []
        stack.append(torch.cuda.current_device())
        torch.cuda.set_device(self.device)


def _leave_device(module, args, output):
    torch.cuda.set_device(_previous_devices.stack.pop())


_leave_device.device_guard = True


def guard_devices(model: torch.nn.Module) -> None:
    """Make each module accelerate placed on another GPU than the one current when it is called run with its GPU
    current (:func:`unguard_devices` undoes it; ``generate`` runs with the input device current,
    :func:`on_input_gpu`). accelerate moves a module's inputs to its device, but a Triton kernel launches on the
    current GPU and its current stream, and the kernels take their torch reference for tensors on another GPU:
    without this, the layers on cuda:1 ran every kernel's reference. Guarded: every module placed on another GPU
    than the input device (some are also called outside their parent's forward, with the input GPU current: an LM
    head read by a drafter, Step 3.5's MTP layers), and every module placed on another GPU than the one its nearest
    guarded ancestor makes current (under a top module hooked to cuda:1, accelerate's main device, an embedding on
    the input GPU is guarded back to it)."""
    home = input_device(model)

    def walk(module: torch.nn.Module, current: torch.device) -> None:
        device = _hook_device(module)
        if device is not None and device.type == "cuda" and (device != current or device != home):
            _guard(module, device)
            current = device
        else:
            _unguard(module)  # (guarded for another parent's GPU before)
        for child in module.children():
            walk(child, current)
    walk(model, home)
    _install_movers(model)


# Tensors a forward hands to every decoder layer (the rotary tables, masks, position ids) sit on one GPU; accelerate's
# hook on each layer placed on another one copies them there again for every layer: two or three copies, each a
# cross-GPU dependency on the step's critical path, ~16 us a layer (31B cut to 12 layers, two H200: 0.92x one GPU with
# them). While the enabled model's own forward runs, a layer's keyword tensors are copied to its GPU once per forward
# and source tensor (the same object: transformers builds them once a forward and no layer writes them), then handed
# to accelerate's hook already there. Outside that forward (a drafter calling a target module with tensors it updates
# in place between calls) accelerate moves them as always.
_moves = threading.local()


class _MoveOnce:
    """Forward pre-hook (with keyword arguments) of a module accelerate placed on ``device``: its keyword tensors (and
    tuples or lists of tensors) copied there once per forward of the enabled model (:func:`_moved`); the keys
    accelerate's hook skips are left to it."""

    device_guard = True  # changes nothing the module computes

    def __init__(self, device: torch.device, skip_keys):
        self.device = device
        self.skip_keys = set([skip_keys] if isinstance(skip_keys, str) else skip_keys or ())

    def __call__(self, module, args, kwargs):
        if not getattr(_moves, "depth", 0):
            return None
        return args, {k: v if k in self.skip_keys else _moved(v, self.device) for k, v in kwargs.items()}


def _moved(value, device: torch.device):
    """``value`` on ``device``: a tensor elsewhere copied once per forward (the copy kept while the forward runs and
    the source lives), a tuple or list of tensors element by element; anything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        copies = _moves.copies
        key = (id(value), device)
        found = copies.get(key)
        if found is not None and found[0]() is value:
            return found[1]
        copy = value.to(device)
        copies[key] = (weakref.ref(value, lambda _, key=key, copies=copies: copies.pop(key, None)), copy)
        return copy
    if type(value) in (tuple, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_moved(v, device) for v in value)
    return value


def _open_moves(module, args):
    depth = getattr(_moves, "depth", 0)
    if not depth:
        _moves.copies = {}
    _moves.depth = depth + 1


def _close_all_moves() -> None:
    """No forward open and no copies kept (after a generate call, whatever ended it)."""
    _moves.depth, _moves.copies = 0, {}


def _close_moves(module, args, output):
    depth = getattr(_moves, "depth", 1) - 1
    if depth > 0:
        _moves.depth = depth
    else:
        _close_all_moves()


_open_moves.device_guard = _close_moves.device_guard = True


def _install_movers(model: torch.nn.Module) -> None:
    """:class:`_MoveOnce` on each module a device map placed on one of several GPUs (only moving its inputs there),
    opened and closed by the enabled model's forward."""
    for module in model.modules():  # (again: once)
        for i in _guards(module):
            pre, post = module._forward_pre_hooks.get(i), module._forward_hooks.get(i)
            if isinstance(pre, _MoveOnce) or pre is _open_moves or post is _close_moves:
                _remove_hook(module, i)
    if not gpu_devices(model):
        return
    for name, module in model.named_modules():
        if name and name in model.hf_device_map and moves_activations_only(module):
            hook = next(h for h in _hooks(module) if getattr(h, "execution_device", None) is not None)
            if getattr(hook, "io_same_device", False):
                continue  # (accelerate notes where the inputs came from)
            module.register_forward_pre_hook(_MoveOnce(_hook_device(module), getattr(hook, "skip_keys", None)),
                                             with_kwargs=True)
    model.register_forward_pre_hook(_open_moves)
    model.register_forward_hook(_close_moves, always_call=True)


def _guard(module: torch.nn.Module, device: torch.device) -> None:
    """``module`` runs with ``device`` current (its guards replaced where it had some for another device)."""
    found = [module._forward_pre_hooks[i] for i in _guards(module)
             if isinstance(module._forward_pre_hooks.get(i), _EnterDevice)]
    if found and all(h.device == device for h in found):
        return
    _unguard(module)
    module.register_forward_pre_hook(_EnterDevice(device))
    module.register_forward_hook(_leave_device, always_call=True)


def _guards(module: torch.nn.Module) -> list[int]:
    """Ids of the hooks :func:`guard_devices` put on ``module``."""
    return [i for i, h in (*module._forward_pre_hooks.items(), *module._forward_hooks.items())
            if getattr(h, "device_guard", False)]


def unguard_devices(model: torch.nn.Module) -> None:
    """Remove what :func:`guard_devices` added (from a copy of the model too)."""
    for module in model.modules():
        _unguard(module)


def _unguard(module: torch.nn.Module) -> None:
    for i in _guards(module):
        _remove_hook(module, i)


def _remove_hook(module: torch.nn.Module, i: int) -> None:
    module._forward_pre_hooks.pop(i, None)
    module._forward_pre_hooks_with_kwargs.pop(i, None)
    module._forward_hooks.pop(i, None)
    module._forward_hooks_always_called.pop(i, None)


@contextlib.contextmanager
def on_input_gpu(model: torch.nn.Module):
    """While open, the GPU of ``model``'s input device is the current one (a no-op elsewhere): the loop's kernels
    launch there, and a model on a GPU other than the current one does not take the kernels' torch references. On
    exit the current GPU is the one before, also after an interrupt inside a guarded forward (whose hooks then did
    not restore it), and no forward's copies (:class:`_MoveOnce`) are kept open."""
    device = input_device(model)
    before = torch.cuda.current_device() if device.type == "cuda" else None
    if before is not None:
        torch.cuda.set_device(device)
    try:
        yield
    finally:
        _close_all_moves()  # (an interrupt skips the model's forward hooks that close them)
        if before is not None:
            _previous_devices.stack = []
            torch.cuda.set_device(before)


def layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """``layer_idx`` -> execution device of the first module carrying that ``layer_idx`` (a decoder layer or its
    attention: accelerate places whole layers, so both run on one device)."""
    devices: dict[int, torch.device] = {}
    # the modules in named_modules' order (each once), without descending into a vision / audio encoder, which
    # numbers its own layers from 0 too (a walk of every module's name costs ~1 ms a call on a small model's CPU); a
    # module shared by an encoder and the decoder counts where the decoder holds it
    seen, stack = set(), [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in devices:
            device = execution_device(module)
            if device is not None:
                devices[idx] = device
        stack.extend(child for name, child in reversed(module._modules.items())
                     if child is not None and not _is_encoder_tower(name))
    return devices


def _is_encoder_tower(name: str) -> bool:
    """Whether a submodule called ``name`` is (the root of) a multimodal model's vision or audio encoder, not the
    decoder whose layers own the KV pages."""
    return name.startswith(("vision", "audio", "embed_vision", "embed_audio"))


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


def place_drafter(drafter: torch.nn.Module, device: torch.device, role: str = "assistant_model",
                  home: torch.device | None = None):
    """Move ``drafter`` (in place) to ``device``, where the target layers it reads run; returns it. Refused, naming
    the fix, when its weights cannot move: on the meta device, offloaded or dispatched over several devices.
    ``home``: where the loop runs (the target's input device); a drafter on another GPU runs its top module and
    its parts with that GPU current, as :func:`guard_devices` does for the target's modules (a drafter placed again,
    beside another target, is guarded for its new place, or unguarded)."""
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
    guarded = home is not None and device.type == "cuda" and device != home
    for module in (drafter, *drafter.children()):  # its top module (a call) and the parts its steps call
        for part in (module if isinstance(module, torch.nn.ModuleList) else [module]):
            if guarded:
                _guard(part, device)
            else:
                _unguard(part)
    return drafter
