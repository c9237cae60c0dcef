"""One GEMM for several projections of the same input (q/k/v, gate/up).

At decode a projection's GEMM streams its weight once; three small GEMMs over q, k and v (or two over gate
and up) pay three ramp-ups, three tails and three split-K reductions where one GEMM over the stacked rows
pays one. The checkpoint keeps one tensor per projection, so the weights are not replaced by a new
parameter: :func:`stack_weights` moves each projection's weight (``param.data``) into one new storage,
back to back, so every ``nn.Linear`` keeps its own ``Parameter`` object, name and values, and
:func:`stacked_weight` finds the adjacent rows again at forward time and returns them as one
``[sum of outputs, in]`` view. Anything that separates the weights again (``model.to(...)``,
``load_state_dict(assign=True)``) simply makes :func:`stacked_weight` return None, and callers run the
projections one by one. ``save_pretrained`` stores each weight under its own key (transformers clones
disjoint views of one storage before writing).

FP8 projections (transformers' fine-grained ``FP8Linear``: e4m3 ``weight`` and block scales ``weight_scale_inv``,
dynamic activations) stack the same way, weights and scales each into one storage, when they share a block size and
each one's outputs are whole blocks of scales; one GEMM then reads them, with the layers' own arithmetic
(:func:`.fp8_w8a8.fine_grained_fp8_linear`: W8A8 where the GPU has FP8 tensor cores, the rows quantized once for all
of them, else weight-only).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._dispatch import runs_own_forward
from .fp8_gemm import FP8_DTYPE
from .fp8_w8a8 import fine_grained_fp8_linear
from .skinny_gemm import skinny_linear


# A projection whose ``weight`` is a DTensor and whose output is ``x @ W.T`` for W its local shard (a column-parallel
# projection of a tensor-parallel model, whose output is this rank's slice: runtime/distributed.py) is marked with
# this attribute (True); stacked projections then read such W (:func:`local_tensor`) as they read plain weights.
LOCAL_WEIGHT = "_hf_specdec_local_weight"


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor behind this process's shard of a DTensor parameter (the object itself, so that moving it into
    another storage reaches the parameter); a plain tensor as it is."""
    local = getattr(param, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return param.to_local() if hasattr(param, "to_local") else param


def stacked_weight(*linears: nn.Linear) -> torch.Tensor | None:
    """The weights of ``linears`` as one ``[sum of out_features, in_features]`` view when they lie back to back
    in one storage, in this order, without biases, and each module is a plain ``nn.Linear`` without hooks
    (a wrapped or hooked projection, e.g. an adapter, must run its own forward) or names its :data:`LOCAL_WEIGHT`;
    otherwise None."""
    weights = _operands(linears)
    return None if weights is None else adjacent(weights)


def _operands(linears) -> list[torch.Tensor] | None:
    """What each of ``linears`` multiplies its input by (:data:`LOCAL_WEIGHT`, or a plain bias-free projection's
    weight), or None if one has none."""
    weights = []
    for linear in linears:
        if linear.bias is not None:
            return None
        if vars(linear).get(LOCAL_WEIGHT) and not runs_own_forward(linear):  # (a hooked one runs its own forward)
            weights.append(local_tensor(linear.weight))
        elif _plain_linear(linear):
            weights.append(linear.weight)
        else:
            return None
    return weights


def stacked_fp8(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
    """(weights, block scales, block size) of FP8 ``linears`` as one view each when both lie back to back in one
    storage (:func:`stack_weights`), in this order; otherwise None."""
    if not linears or not all(_stackable_fp8(linear, linears[0]) for linear in linears):
        return None
    weight = adjacent([linear.weight for linear in linears])
    scale = adjacent([linear.weight_scale_inv for linear in linears])
    return None if weight is None or scale is None else (weight, scale, tuple(linears[0].block_size))


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (2-D, one width and dtype) as one ``[sum of rows, width]`` view when they lie back to back in
    one storage, in this order; otherwise None."""
    first = tensors[0]
    if first.dim() != 2 or not first.is_contiguous() or first.device.type == "meta":
        return None
    width, rows, base = first.shape[1], 0, first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.dim() != 2 or t.shape[1] != width or not t.is_contiguous() or t.dtype != first.dtype
                or t.untyped_storage().data_ptr() != base
                or t.storage_offset() != first.storage_offset() + rows * width):
            return None
        rows += t.shape[0]
    return first.detach().as_strided((rows, width), (width, 1))


def stack_weights(*linears: nn.Module) -> bool:
    """Move the weights of ``linears`` into one storage, back to back (same values, same ``Parameter``
    objects); returns whether they are stacked now. Projections with a bias, different input widths, dtypes
    or devices, or weights that are not plain dense tensors, are left as they are. FP8 projections
    (:func:`stacked_fp8`) stack their weights and their scales."""
    if linears and all(_stackable_fp8(linear, linears[0]) for linear in linears):
        if stacked_fp8(*linears) is not None:
            return True
        return (move_into_one_storage([linear.weight for linear in linears])
                and move_into_one_storage([linear.weight_scale_inv for linear in linears]))
    if not all(_plain_linear(linear) for linear in linears):
        return False
    if stacked_weight(*linears) is not None:
        return True
    if any(linear.bias is not None for linear in linears):
        return False
    return move_into_one_storage([linear.weight for linear in linears])


def move_into_one_storage(params: list[torch.Tensor]) -> bool:
    """Move ``params`` (parameters or the plain tensors behind them, 2-D, one width, dtype and device) into one new
    storage, back to back in this order (``.data``: the same objects, the same values); returns whether it did."""
    first = params[0]
    if any(type(p) not in (nn.Parameter, torch.Tensor) or p.dim() != 2 or p.layout != torch.strided
           or p.shape[1] != first.shape[1]
           or p.dtype != first.dtype or p.device != first.device or p.device.type == "meta" for p in params):
        return False
    with torch.no_grad():
        # through bytes: cat has no kernel for every dtype (float8 on some devices)
        stacked = torch.cat([p.detach().contiguous().view(torch.uint8) for p in params]).view(first.dtype)
        row = 0
        for p in params:
            p.data = stacked[row:row + p.shape[0]]
            row += p.shape[0]
    return True


def stacked_projections(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``: one GEMM over the stacked weights when they are stacked
    (the outputs are then column slices of one tensor), else one call per projection."""
    weights = _operands(linears)
    weight = None if weights is None else adjacent(weights)
    if weight is not None and weight.device == x.device:  # (a device-map hook would have moved x to the weights)
        return skinny_linear(x, weight).split([w.shape[0] for w in weights], dim=-1)
    fp8 = stacked_fp8(*linears)
    if fp8 is not None and fp8[0].device == x.device:  # the layers' own product (dynamic activations: stacked_fp8)
        return fine_grained_fp8_linear(x, *fp8).split([linear.weight.shape[0] for linear in linears], dim=-1)
    return tuple(linear(x) for linear in linears)


def _stackable_fp8(module, first) -> bool:
    """An FP8 projection without bias or hooks, with dynamic activations (a static scale is the layer's own) and
    block scales of ``first``'s block size that cover whole blocks of its outputs."""
    weight, scale = getattr(module, "weight", None), getattr(module, "weight_scale_inv", None)
    block = getattr(module, "block_size", None)
    return (isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor) and weight.dtype == FP8_DTYPE
            and getattr(module, "bias", None) is None and block is not None
            and getattr(module, "activation_scheme", "dynamic") == "dynamic"
            and len(block) == 2 and tuple(block) == tuple(getattr(first, "block_size", None) or ())
            and weight.dim() == 2 and weight.shape[0] % block[0] == 0 and scale.dim() == 2
            and scale.shape[0] == weight.shape[0] // block[0]
            and not runs_own_forward(module))


def _plain_linear(module) -> bool:
    """A plain ``nn.Linear`` without hooks whose weight is a dense tensor (a quantizer that keeps the module class
    and swaps its weight for a tensor subclass, e.g. torchao, leaves one that is not)."""
    return type(module) is nn.Linear and not runs_own_forward(module) and dense_weight(module.weight)


def dense_weight(weight) -> bool:
    """Whether ``weight`` is a plain floating-point tensor (not a tensor subclass, not FP8): what the dense
    kernels read."""
    return (type(weight) in (torch.Tensor, nn.Parameter) and weight.is_floating_point()
            and weight.dtype != FP8_DTYPE)
