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
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .skinny_gemm import skinny_linear


def stacked_weight(*linears: nn.Linear) -> torch.Tensor | None:
    """The weights of ``linears`` as one ``[sum of out_features, in_features]`` view when they lie back to back
    in one storage, in this order, without biases, and each module is a plain ``nn.Linear`` without hooks
    (a wrapped or hooked projection, e.g. an adapter, must run its own forward); otherwise None."""
    if not all(_plain_linear(linear) for linear in linears):
        return None
    first = linears[0].weight
    if first.dim() != 2 or not first.is_contiguous() or first.device.type == "meta":
        return None
    width, rows, base = first.shape[1], 0, first.untyped_storage().data_ptr()
    for linear in linears:
        weight = linear.weight
        if (linear.bias is not None or weight.dim() != 2 or weight.shape[1] != width or not weight.is_contiguous()
                or weight.dtype != first.dtype or weight.untyped_storage().data_ptr() != base
                or weight.storage_offset() != first.storage_offset() + rows * width):
            return None
        rows += weight.shape[0]
    return first.detach().as_strided((rows, width), (width, 1))


def stack_weights(*linears: nn.Linear) -> bool:
    """Move the weights of ``linears`` into one storage, back to back (same values, same ``Parameter``
    objects); returns whether they are stacked now. Projections with a bias, different input widths, dtypes
    or devices, or weights that are not plain dense tensors, are left as they are."""
    if not all(_plain_linear(linear) for linear in linears):
        return False
    if stacked_weight(*linears) is not None:
        return True
    weights = [linear.weight for linear in linears]
    first = weights[0]
    if any(linear.bias is not None or type(w) is not nn.Parameter or w.dim() != 2 or w.layout != torch.strided
           or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
           or w.device.type == "meta" for linear, w in zip(linears, weights)):
        return False
    with torch.no_grad():
        stacked = torch.cat([w.detach() for w in weights])
        row = 0
        for w in weights:
            w.data = stacked[row:row + w.shape[0]]
            row += w.shape[0]
    return True


def stacked_projections(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``: one GEMM over the stacked weights when they are stacked
    (the outputs are then column slices of one tensor), else one call per projection."""
    weight = stacked_weight(*linears)
    if weight is None:
        return tuple(linear(x) for linear in linears)
    return skinny_linear(x, weight).split([linear.weight.shape[0] for linear in linears], dim=-1)


def _plain_linear(module) -> bool:
    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and not getattr(module, "_hf_hook", None))
