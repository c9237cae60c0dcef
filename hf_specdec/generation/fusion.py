"""Fused forwards for small modules of an enabled model (instance-scoped, undone by ``disable``).

A decode step of a big model is bound by weight bytes, but each of its norms, rotary embeddings and residual
seams runs as several tiny kernels in eager torch; those launches cost ~20% of a step even inside a CUDA
graph. ``enable`` swaps the ``forward`` of such modules, on that model's instances only, for forwards with the
same arithmetic over fused kernels. Model packages register theirs (:func:`register_fused_forwards`, keyed by
the module class); this module registers the ones every model may have: ``nn.Linear`` layers take a
GEMM for a few rows that streams the weights faster than cuBLAS does. Each fused forward runs the module's own
forward on CPU, for variants it does not cover, and whenever autograd tracks the input (the kernels have no
backward). A model with no weights where the kernels run (all on CPU) goes without them: ``enable`` and each
``generate`` call install or remove them as the model's weights move (:func:`kernels_may_run`).

transformers' FP8 layers (``FP8Linear`` and ``FP8Experts`` of its fine-grained FP8 quantizer,
``CompressedTensorsFP8Linear`` of compressed-tensors FP8 checkpoints) are the exception: their own forwards need a
GPU kernel, so an enabled model's FP8 layers always take hf_specdec's forwards, on every device: the linears
transformers' own W8A8 arithmetic where the GPU has FP8 tensor cores (``kernels/fp8_w8a8.py``), the weight-only
product elsewhere (``kernels/fp8_gemm.py``, its dequantize-then-matmul reference on CPU); the experts likewise
(``kernels/fp8_moe.py``: W8A8 grouped kernels for dynamic activations, else weight-only). Plain, verify and draft
forwards of the target then compute the same products, which is what makes its speculative output equal its plain
output (see ``generation/quantization.py``).

Under tensor parallelism (``runtime/distributed.py``) the projections transformers wrapped with its plain column- and
row-parallel styles take the few-row GEMM on their local shards, and column-parallel shards of one input are stacked.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Callable

import torch

from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV, HAS_TRITON, on_gpu
from hf_specdec.kernels.fp8_w8a8 import compressed_fp8_linear_forward, fp8_linear_forward, fp8_linear_fusible
from hf_specdec.kernels.fp8_moe import fp8_experts_forward, fp8_experts_fusible
from hf_specdec.kernels.skinny_gemm import linear_forward
from hf_specdec.kernels.stacked_linear import dense_weight, local_tensor, stack_weights
from hf_specdec.runtime.distributed import (holds_shards, install_sharded_embedding, install_sharded_linear,
                                             remove_sharded_forward, stack_column_shards)
from hf_specdec.runtime.placement import moves_activations_only


@dataclass(frozen=True)
class FusedForward:
    """The fused ``forward`` of a module class. ``fusible(module)`` says whether an instance has what the forward
    reads; ``stacked`` lists groups of same-input projections (attribute names) that the forward runs as one
    GEMM when their weights are stacked."""

    module_type: type
    forward: Callable
    fusible: Callable[[torch.nn.Module], bool] = lambda module: True
    stacked: tuple[tuple[str, ...], ...] = ()
    # the forward differs from the module's own only where the kernels run (elsewhere it calls the module's own),
    # so a model with no weights there goes without it (see kernels_may_run)
    kernels_only: bool = True


_FUSED: dict[type, FusedForward] = {}
_LINKS: list[tuple[Callable, Callable]] = []


def register_fused_forwards(*fused: FusedForward) -> None:
    """Make ``enable`` give instances of each ``fused.module_type`` its fused forward (idempotent)."""
    for entry in fused:
        _FUSED[entry.module_type] = entry


def register_model_links(link: Callable[[torch.nn.Module], None], unlink: Callable[[torch.nn.Module], None]) -> None:
    """Relations between a model's modules that its kernels-only fused forwards read (e.g. which norm reads a
    decoder layer's output next): :func:`fuse_modules` calls ``link(model)`` once it gave them, :func:`unfuse_modules`
    ``unlink(model)`` (idempotent)."""
    if (link, unlink) not in _LINKS:
        _LINKS.append((link, unlink))


def fuse_modules(model: torch.nn.Module, kernels: bool = True, restack: bool = False) -> int:
    """Give every fusible submodule of ``model`` its fused forward (with ``kernels=False`` only those that are not
    :attr:`FusedForward.kernels_only`); returns how many were swapped. Where the kernels run (CUDA), the weights of
    projections that read the same input are also stacked into one storage (:func:`stack_projections`), so that
    the fused forward runs them as one GEMM. ``restack``: a module fused before has them stacked again where they
    were moved apart since (``model.half()``, ``.cpu().cuda()`` give each weight a storage of its own); an enabled
    target's call asks for it once its weights moved (drafters restack by their own checks)."""
    count = 0
    for module in model.modules():
        if holds_shards(module):  # a tensor-parallel shard: transformers' TP forward reads it, or ours on its shard
            if kernels and _fuse_shard(module):
                count += 1
            continue
        fused = _FUSED.get(type(module))
        if fused is None or not (kernels or not fused.kernels_only):
            continue
        wrapped = "forward" in vars(module)  # accelerate's hook wraps it (device_map): its _old_forward is fused
        if wrapped and not (moves_activations_only(module) and _ORIGINAL not in vars(module)):
            if restack and kernels and _fused_here(module, fused):
                with gpu_of_weights(module):
                    stack_projections(module)
            continue
        with gpu_of_weights(module):  # the checks ask whether the kernels run where the weights are
            if not fused.fusible(module):
                continue
            if wrapped:
                setattr(module, _ORIGINAL, module._old_forward)
                module._old_forward = types.MethodType(fused.forward, module)
            else:
                module.forward = types.MethodType(fused.forward, module)
            stack_projections(module)
        count += 1
    if kernels:
        for link, _ in _LINKS:
            link(model)
    return count


def _fused_here(module: torch.nn.Module, fused: FusedForward) -> bool:
    """Whether :func:`fuse_modules` gave ``module`` the forward ``fused`` (directly, or inside accelerate's hook)."""
    forward = vars(module).get("forward") if _ORIGINAL not in vars(module) else getattr(module, "_old_forward", None)
    return getattr(forward, "__func__", None) is fused.forward


def kernels_may_run(model: torch.nn.Module) -> bool:
    """Whether the fused forwards' kernels can run for some weight of ``model``: one on a CUDA device, or any under
    ``HF_SPECDEC_FORCE_TRITON=1`` (``=0``: none). A model that has none goes without the kernels-only forwards: each
    would call the module's own forward after its checks, ~10% of a small model's step on a CPU."""
    forced = os.environ.get(FORCE_TRITON_ENV)
    if not HAS_TRITON or forced == "0":
        return False
    return forced == "1" or any(p.is_cuda for p in model.parameters())


def fuse_drafter(drafter: torch.nn.Module) -> torch.nn.Module:
    """Give a drafter (an assistant or DFlash model, not itself enabled) the kernels-only fused forwards while its
    weights are where the kernels run, as ``enable`` and ``generate`` do for the target; remove them while they are
    not. Called where a drafter is placed for a ``generate`` call, since the user may have moved it (loaded on CPU,
    then ``.to("cuda")``): without them its projections took cuBLAS, whose fp32 kernels for 7-16 rows (a block
    of 8 drafts at batch 1) take 25-50 us a call on small weights (docs/perf_log.md, session 26). Returns it."""
    if kernels_may_run(drafter):
        fuse_modules(drafter)
    else:
        unfuse_modules(drafter, kernels_only=True)
    return drafter


def unfuse_modules(model: torch.nn.Module, kernels_only: bool = False) -> None:
    """Undo :func:`fuse_modules` (with ``kernels_only=True``, for the kernels-only forwards alone)."""
    forwards = {entry.forward for entry in _FUSED.values() if entry.kernels_only or not kernels_only}
    for _, unlink in _LINKS:
        unlink(model)
    for module in model.modules():
        remove_sharded_forward(module)
        forward = vars(module).get("forward")
        if forward is not None and getattr(forward, "__func__", None) in forwards:
            del module.forward
        if _ORIGINAL in vars(module):
            original = vars(module).pop(_ORIGINAL)
            if getattr(getattr(module, "_old_forward", None), "__func__", None) in forwards:
                module._old_forward = original  # (gone where accelerate's hook was removed since)


# where fuse_modules keeps the forward accelerate's hook wrapped (its ``_old_forward``) while a fused one replaces it
_ORIGINAL = "_hf_specdec_old_forward"


def _fuse_shard(module: torch.nn.Module) -> bool:
    """A tensor-parallel projection whose shard lives where the kernels run takes the few-row GEMM on its shard
    inside transformers' collectives, and a vocabulary-parallel embedding there its lookup without the DTensor
    dispatch, summed by peer_sum (runtime/distributed.py: :func:`install_sharded_linear`,
    :func:`install_sharded_embedding`)."""
    install = {torch.nn.Linear: install_sharded_linear, torch.nn.Embedding: install_sharded_embedding}
    kind = next((k for k in install if isinstance(module, k)), None)
    if kind is None:
        return False
    with gpu_of_weights(module):  # the check asks about the shard's GPU, whichever is current
        return use_triton(local_tensor(module.weight)) and install[kind](module)


def gpu_of_weights(module: torch.nn.Module):
    """A context in which ``module``'s GPU is the current one (the kernels launch there, and ``use_triton`` asks about
    it): a module accelerate placed on another GPU than the current one."""
    weight = next(module.parameters(), None)
    return on_gpu(None if weight is None else weight.device)


def stacked_groups(module: torch.nn.Module) -> tuple[tuple[str, ...], ...]:
    """The groups of same-input projections of ``module`` that its fused forward runs as one GEMM each."""
    fused = _FUSED.get(type(module))
    return fused.stacked if fused is not None else ()


def stack_projections(module: torch.nn.Module) -> None:
    """Stack the weights of ``module``'s same-input projections (:func:`stacked_groups`) when the kernels run on
    their device: same parameters and values, one storage (see :mod:`hf_specdec.kernels.stacked_linear`)."""
    for names in stacked_groups(module):
        linears = [getattr(module, n) for n in names if getattr(module, n, None) is not None]
        if linears and all(holds_shards(linear) for linear in linears):  # tensor-parallel: their local shards
            if use_triton(local_tensor(linears[0].weight)):
                stack_column_shards(*linears)
            continue
        weight = getattr(linears[0], "weight", None) if linears else None
        if isinstance(weight, torch.Tensor) and use_triton(weight):
            stack_weights(*linears)


def _fusible_linear(module) -> bool:
    """``nn.Linear`` layers on a device where the kernels run take :func:`skinny_linear` for the few rows of decode
    and verify steps (o_proj, down_proj, the LM head; stacked projections already do), a bias added to the fp32 sums
    before they are rounded (gpt-oss's and Qwen2's projections)."""
    return ((not getattr(module, "_hf_hook", None) or moves_activations_only(module))
            and dense_weight(module.weight) and use_triton(module.weight))


register_fused_forwards(FusedForward(torch.nn.Linear, linear_forward, _fusible_linear))


def fp8_fused_forwards() -> list[FusedForward]:
    """The forwards of transformers' FP8 layers (W8A8 linears and experts on GPUs with FP8 tensor cores, else
    weight-only), for the classes this transformers version has."""
    fused = []
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    except ImportError:  # pragma: no cover - every supported version has them
        pass
    else:
        fused += [FusedForward(FP8Linear, fp8_linear_forward, fp8_linear_fusible, kernels_only=False),
                  FusedForward(FP8Experts, fp8_experts_forward, fp8_experts_fusible, kernels_only=False)]
    try:
        from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear
    except ImportError:  # pragma: no cover
        pass
    else:
        fused.append(FusedForward(CompressedTensorsFP8Linear, compressed_fp8_linear_forward, kernels_only=False))
    return fused


register_fused_forwards(*fp8_fused_forwards())
