"""gather_matvec: ``logits[b, n] = weight[token_ids[b, n]] . hidden[b]`` without materialising the rows.

Gemma 4's centroid head scores a few thousand candidate tokens per row against the tied LM head. Eagerly
that is an embedding lookup that writes every candidate row ([batch, candidates, hidden], 268 MB at batch
32 for the 31B assistant) and a batched mat-vec that reads it back; here each program reads its candidates'
rows once, straight from the weight, and accumulates in fp32 (the output is rounded to hidden's dtype, as
the eager bmm rounds it). With ``softcap`` the kernel also applies Gemma's final logit soft-cap
``cap * tanh(logit / cap)`` to the fp32 sum (eagerly three more launches, each rounding to bf16).

``centroid_candidates`` is the head's other half: the top-k centroids of each row and the token ids they own,
in one launch (torch's top-k is two kernels, and the ids a third).
"""

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton, use_triton


@triton.jit
def _gather_matvec_kernel(
    weight_ptr, ids_ptr, hidden_ptr, out_ptr,  # weight [vocab, dim]; ids, out [batch, n]; hidden [batch, dim]
    stride_w, stride_ids, stride_hidden, stride_out, n, dim, cap,
    SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
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
    if SOFTCAP:  # cap * tanh(acc / cap), tanh(t) = sign(t) (1 - e) / (1 + e) with e = exp(-2|t|) <= 1
        e = tl.exp(-2.0 * tl.abs(acc) / cap)
        t = (1.0 - e) / (1.0 + e)
        acc = cap * tl.where(acc < 0, -t, t)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


def gather_matvec(weight: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """weight [vocab, dim], token_ids [batch, n] (int), hidden [batch, dim] -> [batch, n] in hidden's dtype,
    soft-capped at ``softcap`` (None: not)."""
    check(weight.dim() == 2 and token_ids.dim() == 2 and hidden.dim() == 2
          and hidden.shape == (token_ids.shape[0], weight.shape[1]),
          f"need weight [vocab, dim], token_ids [batch, n], hidden [batch, dim]; got {tuple(weight.shape)}, "
          f"{tuple(token_ids.shape)}, {tuple(hidden.shape)}")
    if not use_triton(hidden) or token_ids.numel() == 0:
        return gather_matvec_reference(weight, token_ids, hidden, softcap)
    check(softcap is None or softcap > 0, f"softcap must be > 0 or None, got {softcap}")
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    token_ids = token_ids if token_ids.stride(1) == 1 else token_ids.contiguous()
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    batch, n = token_ids.shape
    out = torch.empty(batch, n, dtype=hidden.dtype, device=hidden.device)
    block_d = min(256, next_power_of_2(weight.shape[1]))
    block_n = 32
    _gather_matvec_kernel[(batch, triton.cdiv(n, block_n))](
        weight, token_ids, hidden, out, weight.stride(0), token_ids.stride(0), hidden.stride(0), out.stride(0),
        n, weight.shape[1], float(softcap or 1.0), SOFTCAP=softcap is not None, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, **pdl_args(out),
    )
    return out


def gather_matvec_reference(weight: torch.Tensor, token_ids: torch.Tensor, hidden: torch.Tensor,
                            softcap: float | None = None) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (the centroid head's embedding lookup + bmm, then the
    soft-cap as transformers' Gemma 4 applies it)."""
    rows = torch.nn.functional.embedding(token_ids, weight)  # [batch, n, dim]
    logits = torch.bmm(rows, hidden.unsqueeze(-1)).squeeze(-1)
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@triton.jit
def _centroid_candidates_kernel(
    scores_ptr, ordering_ptr, out_ptr,  # scores [batch, num_centroids]; ordering [vocab]; out [batch, top_k * per]
    stride_scores, stride_out, num_centroids,
    TOP_K: tl.constexpr, PER: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    x = tl.load(scores_ptr + row * stride_scores + cols, mask=cols < num_centroids, other=0.0).to(tl.float32)
    # order-preserving int keys of the fp32 scores (NaN above +inf, as torch.topk ranks it), packed with the
    # complement of the index below them: one max per pick finds the best score, ties to the lower index.
    # Taken and padding entries get the smallest key, below every score, so each pick is a new centroid.
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(x != x, 0x7FC00000, key).to(tl.int64)  # every NaN (either sign) as the positive quiet NaN
    packed = (key << 32) | (BLOCK_C - 1 - cols).to(tl.int64)
    lowest = -9223372036854775807 - 1
    packed = tl.where(cols < num_centroids, packed, lowest)
    members = tl.arange(0, PER)
    for i in tl.static_range(TOP_K):  # descending
        best = tl.max(packed, 0)
        pick = BLOCK_C - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        packed = tl.where(cols == pick, lowest, packed)
        ids = tl.load(ordering_ptr + pick.to(tl.int64) * PER + members)
        tl.store(out_ptr + row * stride_out + i * PER + members, ids)


def centroid_candidates(scores: torch.Tensor, token_ordering: torch.Tensor, top_k: int) -> torch.Tensor:
    """The candidate token ids [batch, top_k * per] of the ``top_k`` best centroids of each row:
    ``token_ordering.view(num_centroids, per)[scores.topk(top_k).indices].flatten(1)``, best centroid first,
    for ``scores`` [batch, num_centroids] and ``token_ordering`` [num_centroids * per]."""
    batch, num_centroids = scores.shape
    check(token_ordering.dim() == 1 and token_ordering.numel() % num_centroids == 0
          and 0 < top_k <= num_centroids,
          f"need scores [batch, num_centroids], token_ordering [num_centroids * per] and 0 < top_k <= "
          f"num_centroids; got {tuple(scores.shape)}, {tuple(token_ordering.shape)}, top_k={top_k}")
    per = token_ordering.numel() // num_centroids
    if (not use_triton(scores) or batch == 0 or num_centroids > 16384 or top_k > 64
            or per != next_power_of_2(per)):
        return centroid_candidates_reference(scores, token_ordering, top_k)
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    out = torch.empty(batch, top_k * per, dtype=token_ordering.dtype, device=scores.device)
    block_c = next_power_of_2(num_centroids)
    _centroid_candidates_kernel[(batch,)](
        scores, token_ordering.contiguous(), out, scores.stride(0), out.stride(0), num_centroids,
        TOP_K=top_k, PER=per, BLOCK_C=block_c, num_warps=max(1, min(4, block_c // 256)),
        **pdl_args(out),
    )
    return out


def centroid_candidates_reference(scores: torch.Tensor, token_ordering: torch.Tensor, top_k: int) -> torch.Tensor:
    """Torch version: the CPU path and the test oracle (transformers' centroid selection)."""
    top = scores.topk(top_k, dim=-1).indices  # [batch, top_k]
    return token_ordering.view(scores.shape[1], -1)[top].flatten(1)
