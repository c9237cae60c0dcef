"""Where a draft layer's block queries find the context K/V: the `DFlashContextSource` protocol.

A DFlash draft layer attends over `[context K/V of the row's accepted tokens, block K/V]`. The context
K/V of draft layer `l` is `rope(k_norm(k_proj_l(f)))`, `v_proj_l(f)` of the fused target features `f` of
every accepted token (`DFlashDrafter.context_kv`); it only ever grows by accepted tokens and never holds
block tokens. The block K/V is recomputed every draft step. A source owns the context K/V (dense tensors
here, pages of the drafter's paged cache) and does the attention.

Visibility, with the block's first token at position p of its row (p = number of accepted tokens) and
query j at position p + j (the z-lab reference's mask, written in positions):

    context key at position c < p:   visible iff  sliding_window is None or (p + j) - c < sliding_window
    block key i:                     visible iff  (not causal_block or i <= j)
                                             and (sliding_window is None or |i - j| < sliding_window)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class DFlashContextSource(Protocol):
    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [batch, block_len, num_heads, head_dim], RoPE at the block positions
        block_k: torch.Tensor,  # [batch, block_len, kv_heads, head_dim], RoPE at the block positions
        block_v: torch.Tensor,  # [batch, block_len, kv_heads, head_dim]
        *,
        scaling: float,
        causal_block: bool,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [batch, block_len, num_heads, head_dim]
        """Attend over draft layer `layer_idx`'s context K/V of the row's accepted tokens, then the block K/V.

        Scores are `scaling * q.k`; GQA maps query head h to kv head h // (num_heads // kv_heads);
        visibility as in the module docstring.
        """
        ...


class DenseDFlashContext:
    """`DFlashContextSource` over dense context K/V per draft layer: the CPU reference and the test oracle.

    `kv[layer_idx] = (keys, values)`, each [batch, seq, kv_heads, head_dim] on a shared seq axis;
    `valid` [batch, seq] marks entries that hold accepted tokens (False for padding); entries of a row
    hold positions 0, 1, ... in order, so a row's block starts at position `valid[b].sum()`.
    """

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor | None = None):
        self.kv = list(kv)
        keys = self.kv[0][0]
        self.valid = keys.new_ones(keys.shape[:2], dtype=torch.bool) if valid is None else valid.bool()
        self.positions = self.valid.long().cumsum(-1) - 1  # [batch, seq]; meaningful where valid
        self.block_start = self.valid.long().sum(-1)  # [batch]

    @classmethod
    def from_features(
        cls,
        drafter,
        features: torch.Tensor,  # [batch, seq, hidden]: `drafter.context_features(...)` of the accepted tokens
        valid: torch.Tensor | None = None,  # [batch, seq] bool
    ) -> DenseDFlashContext:
        """Context K/V of every draft layer, at positions 0.. of each row's valid entries."""
        valid = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device) if valid is None else valid
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return cls(drafter.context_kv_all_layers(features, positions), valid)

    def attend(self, layer_idx, query, block_k, block_v, *, scaling, causal_block, sliding_window):
        context_k, context_v = self.kv[layer_idx]
        keys = torch.cat([context_k, block_k], dim=1)
        values = torch.cat([context_v, block_v], dim=1)
        mask = block_attention_mask(self.positions, self.valid, self.block_start, query.shape[1],
                                    causal_block=causal_block, sliding_window=sliding_window)
        return dense_block_attention(query, keys, values, mask, scaling)


def block_attention_mask(
    context_positions: torch.Tensor,  # [batch, seq]
    context_valid: torch.Tensor,  # [batch, seq] bool
    block_start: torch.Tensor,  # [batch]: position of block token 0
    block_len: int,
    *,
    causal_block: bool,
    sliding_window: int | None,
) -> torch.Tensor:  # [batch, block_len, seq + block_len] bool, True = visible
    """The visibility rule of the module docstring over `[context, block]` keys."""
    offsets = torch.arange(block_len, device=block_start.device)
    query_pos = block_start[:, None] + offsets  # [batch, block_len]
    key_pos = torch.cat([context_positions, query_pos], dim=1)  # [batch, seq + block_len]
    key_valid = torch.cat([context_valid, torch.ones_like(query_pos, dtype=torch.bool)], dim=1)
    distance = query_pos[:, :, None] - key_pos[:, None, :]  # query minus key position
    visible = key_valid[:, None, :].expand_as(distance).clone()
    if causal_block:
        visible &= distance >= 0
    if sliding_window is not None:
        visible &= distance.abs() < sliding_window
    return visible


def dense_block_attention(
    query: torch.Tensor,  # [batch, q_len, num_heads, head_dim]
    keys: torch.Tensor,  # [batch, k_len, kv_heads, head_dim]
    values: torch.Tensor,  # [batch, k_len, kv_heads, head_dim]
    mask: torch.Tensor,  # [batch, q_len, k_len] bool, True = visible
    scaling: float,
) -> torch.Tensor:  # [batch, q_len, num_heads, head_dim]
    batch, q_len, num_heads, head_dim = query.shape
    kv_heads = keys.shape[2]
    q = query.reshape(batch, q_len, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("bqgrd,bkgd->bgrqk", q, keys).float() * scaling
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    weights = scores.softmax(-1).to(values.dtype)
    out = torch.einsum("bgrqk,bkgd->bqgrd", weights, values)
    return out.reshape(batch, q_len, num_heads, values.shape[-1])
