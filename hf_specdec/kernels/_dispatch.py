"""Choosing between a Triton kernel and its torch reference, and the shared launcher checks.

Triton is optional at import time: CPU-only installs (macOS has no triton wheel) still import the
kernel modules and run the torch references. ``triton`` / ``tl`` below are then stand-ins whose
``jit`` leaves the kernel body a plain, never-launched function.
"""

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is installed wherever the tests run

    class _TritonStandIn:
        constexpr = None

        @staticmethod
        def jit(fn):
            return fn

    triton = tl = _TritonStandIn()
    HAS_TRITON = False

try:  # grid dependency control (triton 3.4+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton, or none: launches keep full serialisation
    gdc_launch_dependents = gdc_wait = None

FORCE_TRITON_ENV = "HF_SPECDEC_FORCE_TRITON"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether kernels run their Triton body for `tensor` (else the torch reference).

    Auto: Triton for CUDA tensors on the current device (Triton launches there: a tensor on another GPU takes
    the reference rather than a kernel reading the wrong device). ``HF_SPECDEC_FORCE_TRITON=1`` forces Triton
    on any device (tests
    pair it with ``TRITON_INTERPRET=1``, set before the kernels are imported, to run the bodies on
    CPU); ``HF_SPECDEC_FORCE_TRITON=0`` forces the reference, e.g. to bisect a GPU mismatch.
    """
    if not HAS_TRITON:
        return False
    forced = os.environ.get(FORCE_TRITON_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return tensor.is_cuda and tensor.get_device() == torch.cuda.current_device()


def on_gpu(device: torch.device | None):
    """A context in which ``device`` is the current GPU where it is a GPU other than the current one (kernels launch
    on the current GPU, and :func:`use_triton` takes the torch reference for tensors elsewhere); else a no-op."""
    if device is None or device.type != "cuda" or gpu_index(device) == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def other_hooks(module: torch.nn.Module, pre: bool) -> bool:
    """Whether ``module`` has forward pre-hooks (``pre``) or forward hooks other than device guards (hooks whose
    ``device_guard`` attribute is true: they make the module's GPU current around its forward and change nothing it
    computes). Fused paths that leave a hooked module to run its own forward ask this."""
    hooks = module._forward_pre_hooks if pre else module._forward_hooks
    return any(not getattr(h, "device_guard", False) for h in hooks.values())


def runs_own_forward(module: torch.nn.Module) -> bool:
    """Whether a fused path that would call ``module``'s kernels directly (stacked projections) must leave it to run
    its own forward: forward (pre-)hooks other than device guards, or an accelerate hook that does more than move
    its inputs to the GPU its weights stay on (:func:`moves_activations_only`: a model split over GPUs by a device
    map hooks every projection so, and the fused layer around it already gives its inputs there)."""
    return bool(other_hooks(module, pre=False) or other_hooks(module, pre=True)
                or (getattr(module, "_hf_hook", None) is not None and not moves_activations_only(module)))


def accelerate_hooks(module: torch.nn.Module) -> list:
    """The hooks accelerate put on ``module`` (a SequentialHook's members), [] for none."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def as_device(where) -> torch.device | None:
    """A ``hf_device_map`` value as a device (an int is a GPU index; "disk" is none)."""
    if isinstance(where, int):
        return torch.device("cuda", where)
    return None if where == "disk" else torch.device(where)


def hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device accelerate's hook on ``module`` names (a SequentialHook's first that names one)."""
    for h in accelerate_hooks(module):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return as_device(device)
    return None


def moves_activations_only(module: torch.nn.Module) -> bool:
    """Whether accelerate hooked ``module`` (its forward wrapped, the original kept as ``_old_forward``) only to move
    its inputs to its GPU, its weights and those of its submodules staying there: every hook on it and below it is
    accelerate's ``AlignDevicesHook`` without offload (an offloaded block's hooks load each submodule's weights around
    that submodule's own forward; ``CpuOffload`` or a user's hook does more than move inputs)."""
    device = hook_device(module)
    return (device is not None and device.type != "cpu" and hasattr(module, "_old_forward")
            and all(_aligns_only(h) for m in module.modules() for h in accelerate_hooks(m))
            and all(t.device == device for t in (*module.parameters(), *module.buffers())))


def _aligns_only(hook) -> bool:
    return (type(hook) is _align_devices_hook() and not hook.offload
            and getattr(hook, "weights_map", None) is None)


@functools.cache
def _align_devices_hook():
    """accelerate's AlignDevicesHook class, looked up once (asked per hooked module on eager forwards)."""
    try:
        from accelerate.hooks import AlignDevicesHook
    except ImportError:  # pragma: no cover - accelerate made the hook
        return None
    return AlignDevicesHook


def gpu_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current device when it names none)."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def gpu_capability(index: int) -> tuple[int, int]:
    """GPU ``index``'s compute capability, read once: launchers ask per launch, and ``get_device_capability`` reads
    the device's properties at every call (~300 times in an eager E2B prefill)."""
    return torch.cuda.get_device_capability(index)


# HF_SPECDEC_PDL=0 (read at import) launches every kernel fully serialised, e.g. to compare the two
PDL = os.environ.get("HF_SPECDEC_PDL", "1") != "0"


def use_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels launched for ``tensor`` use programmatic dependent launch (Hopper and later).

    A decode step is hundreds of short kernels, most of them 2-15 us, each waiting for the one before it to end
    before it is even launched. A kernel launched this way is launched once every program of the one before it
    has started: its programs are placed on the SMs the other leaves free, set up, and wait (:func:`pdl_wait`)
    until the previous kernel has finished and its writes are visible, so the launch and the ramp overlap the
    other kernel's tail (H200, plain decode at batch 1: +7% on the 26B-A4B shape, +10% on E4B, +3% on 31B; perf
    log, session 21). So every kernel launched with ``launch_pdl=True`` waits, in every program, before it reads
    or writes anything another kernel writes or reads; kernels launched without it wait for the whole of the
    previous one as always, and a graph capture keeps both kinds of edge. Loading a GEMM's first weight tile
    before the wait was slower (it breaks the software pipeline), and an L2 prefetch of it gained nothing."""
    if not (PDL and HAS_TRITON and gdc_wait is not None and tensor.is_cuda):
        return False
    return gpu_capability(tensor.get_device())[0] >= 9


def pdl_args(tensor: torch.Tensor) -> dict:
    """The launch arguments of a kernel that calls :func:`pdl_wait`: ``kernel[grid](..., **pdl_args(x))``."""
    pdl = use_pdl(tensor)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """In a kernel launched with ``launch_pdl=PDL``: wait until the previous kernel has finished (its writes are
    visible after this), then let the next kernel start its programs. Every program must call it, before the
    first access to memory that another kernel writes or reads (else a later kernel could overtake an earlier
    one: the chain of waits is what orders them). Without PDL, nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def needs_grad(x: torch.Tensor) -> bool:
    """Whether autograd tracks ``x``: the Triton kernels have no backward, so training runs the torch ops."""
    return torch.is_grad_enabled() and x.requires_grad


def interpreting(kernel) -> bool:
    """Whether `kernel` was jitted under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check(condition: bool, message: str) -> None:
    """Launcher checks raise ValueError saying what to pass instead."""
    if not condition:
        raise ValueError(message)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"all tensors must be on one device, got {devices}")


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same shape."""
    check(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
          f"got shape {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} must equal "
          f"k_cache shape {tuple(k_cache.shape)}")
    check(v_cache.dtype == k_cache.dtype, f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) "
          "must share one dtype")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(),
          "k_cache and v_cache must be contiguous: pass the cache storage itself, not a slice or "
          "transpose of it (pages are addressed as block_id * block_size + offset)")
    check(k_cache.is_floating_point(), f"caches must be floating point, got {k_cache.dtype}")


def write_count(x: torch.Tensor) -> int | None:
    """x's count of in-place writes (torch's version counter), or None for an inference tensor (which counts none):
    what a value attached to a tensor is checked against before it is used."""
    return None if x.is_inference() else x._version
