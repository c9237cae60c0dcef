"""gather_matvec: ``logits[b, n] = weight[token_ids[b, n]] . hidden[b]`` without materialising the rows.

Gemma 4's centroid head scores a few thousand candidate tokens per row against the tied LM head. Eagerly
that is an embedding lookup that writes every candidate row ([batch, candidates, hidden], 268 MB at batch
32 for the 31B assistant) and a batched mat-vec that reads it back; here each program reads its candidates'
rows once, straight from the weight, and accumulates in fp32 (the output is rounded to hidden's dtype, as
the eager bmm rounds it).
"""

import torch

from ._dispatch import check, next_power_of_2, tl, triton, use_triton


@triton.jit
def _gather_matvec_kernel(
    weight_ptr, ids_ptr, hidden_ptr, out_ptr,  # weight [vocab, dim]; ids, out [batch, n]; hidden [batch, dim]
    stride_w, stride_ids, stride_hidden, stride_out, n, dim,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = cols < n
    ids = tl.load(ids_ptr + row * stride_ids + cols, mask=valid, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < dim
        x = tl.load(hidden_ptr + row * stride_hidden + d, mask=d_mask, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + ids[:, None] * stride_w + d[None, :], mask=valid[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


def gather_matvec(weight: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """weight [vocab, dim], token_ids [batch, n] (int), hidden [batch, dim] -> [batch, n] in hidden's dtype."""
    check(weight.dim() == 2 and token_ids.dim() == 2 and hidden.dim() == 2
          and hidden.shape == (token_ids.shape[0], weight.shape[1]),
          f"need weight [vocab, dim], token_ids [batch, n], hidden [batch, dim]; got {tuple(weight.shape)}, "
          f"{tuple(token_ids.shape)}, {tuple(hidden.shape)}")
    if not use_triton(hidden) or token_ids.numel() == 0:
        return gather_matvec_reference(weight, token_ids, hidden)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    token_ids = token_ids if token_ids.stride(1) == 1 else token_ids.contiguous()
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    batch, n = token_ids.shape
    out = torch.empty(batch, n, dtype=hidden.dtype, device=hidden.device)
    block_d = min(256, next_power_of_2(weight.shape[1]))
    block_n = 32
    _gather_matvec_kernel[(batch, triton.cdiv(n, block_n))](
        weight, token_ids, hidden, out, weight.stride(0), token_ids.stride(0), hidden.stride(0), out.stride(0),
        n, weight.shape[1], BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
    )
    return out


def gather_matvec_reference(weight: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (the centroid head's embedding lookup + bmm)."""
    rows = torch.nn.functional.embedding(token_ids, weight)  # [batch, n, dim]
    return torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
