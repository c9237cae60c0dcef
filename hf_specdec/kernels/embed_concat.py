"""embed_concat: ``cat[embedding(ids) * scale, hidden]`` in one kernel.

An MTP draft step starts from the drafted token's scaled target embedding next to the previous hidden state
(the input of the assistant's ``pre_projection``). Eagerly that is an embedding lookup, a cast of the scale,
the scaling product and the concatenation: four launches for a few kilobytes per row, on the critical path of
every draft step. The product is rounded to the weight's dtype once, as eager torch rounds it; ``scale`` is a
Python float the caller has already rounded to that dtype (as transformers casts the embedding's scale).
"""

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton


@triton.jit
def _embed_concat_kernel(
    ids_ptr, weight_ptr, hidden_ptr, out_ptr,  # ids [batch]; weight [vocab, dim]; hidden [batch, dim2]
    scale, stride_w, stride_hidden, stride_out, dim, dim2,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(ids_ptr + row).to(tl.int64)
    in_embed = cols < dim
    in_hidden = (cols >= dim) & (cols < dim + dim2)
    embed = tl.load(weight_ptr + token * stride_w + cols, mask=in_embed, other=0.0).to(tl.float32)
    embed = embed * scale
    hidden = tl.load(hidden_ptr + row * stride_hidden + (cols - dim), mask=in_hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, tl.where(in_embed, embed, hidden).to(out_ptr.dtype.element_ty),
             mask=in_embed | in_hidden)


def embed_concat(ids: torch.Tensor, weight: torch.Tensor, scale: float, hidden: torch.Tensor) -> torch.Tensor:
    """ids [batch] (int), weight [vocab, dim], hidden [batch, dim2] in weight's dtype, ``scale`` a float exact in
    that dtype -> [batch, dim + dim2]: ``cat[weight[ids] * scale, hidden]``."""
    check(ids.dim() == 1 and weight.dim() == 2 and hidden.dim() == 2 and hidden.shape[0] == ids.shape[0]
          and weight.dtype == hidden.dtype and float(torch.tensor(scale, dtype=weight.dtype)) == scale,
          f"need ids [batch], weight [vocab, dim] and hidden [batch, dim2] of one dtype, and a scale exact in it "
          f"(round it with float(torch.tensor(scale, dtype=weight.dtype))); got {tuple(ids.shape)}, "
          f"{tuple(weight.shape)} {weight.dtype}, {tuple(hidden.shape)} {hidden.dtype}, scale {scale!r}")
    if not use_triton(hidden) or ids.numel() == 0:
        return embed_concat_reference(ids, weight, scale, hidden)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    dim, dim2 = weight.shape[1], hidden.shape[1]
    out = torch.empty(ids.shape[0], dim + dim2, dtype=hidden.dtype, device=hidden.device)
    block = min(1024, next_power_of_2(dim + dim2))
    _embed_concat_kernel[(ids.shape[0], triton.cdiv(dim + dim2, block))](
        ids.contiguous(), weight, hidden, out, float(scale), weight.stride(0), hidden.stride(0), out.stride(0),
        dim, dim2, BLOCK=block, num_warps=4, **pdl_args(out),
    )
    return out


def embed_concat_reference(ids, weight, scale, hidden) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle."""
    return torch.cat([torch.nn.functional.embedding(ids, weight) * scale, hidden], dim=-1)
