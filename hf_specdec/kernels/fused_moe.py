"""fused_moe: a mixture-of-experts layer that reads only the experts the forward's tokens selected.

Contract. ``fused_moe(x, w_gate, w_up, w_down, top_k_index, top_k_weights, activation=..., limit=...)`` is,
for every token t, ``sum_k weight[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = index[t, k]``,
for Gemma 4 (``activation="gelu_tanh"``: ``gelu(gate, approximate="tanh") * up``) and Step 3.5
(``activation="silu"``: ``silu(gate) * up``; with ``limit`` silu(gate) is clamped above and up on both sides).
The weights are ``[E, I, H]`` gate / up and ``[E, H, I]`` down tensors; gate and up may be views of one
stacked ``[E, 2I, H]`` parameter (Gemma 4's ``gate_up_proj[:, :I]`` / ``[:, I:]``): strides go to the
kernels, no weight is copied.

Numerics follow the reference (:func:`fused_moe_reference`, Step 3.5's MoE by its definition): per
selected expert ``F.linear`` in the model dtype (fp32 accumulation, the result rounded to the dtype), the
activation rounded to the dtype, ``F.linear`` again, the result cast to fp32 times the routing weight, the
k contributions summed in fp32 and cast back once. (transformers' ``Gemma4TextExperts.forward`` does the same
per expert but rounds each weighted contribution to the model dtype and sums in the model dtype; the fp32 sum
here is at least as accurate.) The kernels round at the same points; only the summation order inside the
GEMMs and over the k contributions differs, so fp32 agrees to ~1e-6 relative and bf16 to a bf16 rounding
or two (the tests use 1e-5 and 2e-2).

GPU design, no host sync (CUDA-graph capturable):
1. Group the ``tokens * top_k`` (token, slot) pairs by expert (``group_pairs``): per-expert counts, each
   expert's group padded to a multiple of ``BLOCK_M`` rows, each pair's row (its rank among its expert's pairs:
   a stable sort), each block's expert. Up to ``FEW_MAX_PAIRS`` pairs (decode, verify) the expert kernels do it
   themselves, with no launch before them (``block_pairs``: one block per pair; the pairs whose rank is a
   multiple of ``BLOCK_M`` lead a block, the others' programs exit at once; one token's pairs, whose experts
   differ, each lead their own). Up to ``ALIGN_MAX_PAIRS`` pairs
   one Triton program does it all (``_moe_align_kernel``); beyond, device torch ops do (``_group_pairs``: sort,
   ``scatter_add_``, cumsums, ``searchsorted``; no bincount / unique / nonzero). The host knows only an upper bound on the number
   of blocks, ``pairs // BLOCK_M + min(E, pairs)``; the grids take that bound and the programs past the real
   count (read from device memory) exit at once.
2. ``_moe_gate_up_kernel``, one program per (block, ``BLOCK_N`` columns of I): gathers the block's token rows,
   computes gate and up with ``tl.dot`` against that expert's weight tiles over H, applies the activation and
   writes the intermediate ``[blocks * BLOCK_M, I]``.
3. ``_moe_down_kernel``, one program per (block, ``BLOCK_N`` columns of H): intermediate @ ``w_down[e].T``,
   times each pair's routing weight, written in fp32 to row ``pair`` of ``[tokens * top_k, H]``.
4. ``_moe_sum_kernel``: each token's top_k rows summed in fp32 in slot order and cast to the model dtype, one
   launch. Not atomics into the output: the sum stays deterministic, needs no memset, and every row of the
   ``[pairs, H]`` buffer is written exactly once.

Each selected expert's weights are read once per forward however many of its tokens picked it as long as its
pairs fit in one block: ``BLOCK_M`` is 16 up to ``DECODE_MAX_TOKENS`` tokens, so that holds for every forward of up to
16 tokens (unless ``top_k_index`` names one expert twice for a token); a wider verify reads an expert that more than
16 of its tokens picked once per block of 16 (still faster than taller blocks, :data:`DECODE_CONFIG`). Prefill
takes the same kernels with more and taller blocks per expert. The bytes a decode step reads are the distinct
selected experts' weights, ``distinct * 3 * I * H * itemsize``; the many programs over I and H keep them streaming.

E4m3 weights (``kernels/fp8_moe.py``) take the same kernels (their ``FP8`` variants): each weight tile converted to
the activations' dtype in registers and each K tile's partial sum times its block of scales.

Not checked (it would need a host sync): every ``top_k_index`` entry lies in ``[0, E)``. Out of range, the
reference raises an IndexError; the kernels give that token an undefined output (up to ``ALIGN_MAX_PAIRS``
pairs the pair gets no row, so no weight outside ``w_*`` is read) or trip ``scatter_add_``'s device assert
(beyond: the torch grouping).

Unsupported arguments (more than ``MAX_EXPERTS`` experts or ``MAX_TOP_K`` slots, a dtype other than
fp32 / bf16 / fp16) take the torch reference, with one warning per reason. Autograd and CPU tensors take the
reference silently (the kernels have no backward).
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._dispatch import (check, check_same_device, interpreting, needs_grad, next_power_of_2, pdl_args, pdl_wait,
                        tl, triton, use_triton)
from .activations import ACTIVATIONS, GELU_TANH_CONSTANTS, gated_activation, round_to
from .fp8_gemm import E8M0_DTYPE, e4m3_bits_to_float, f16_rows, load_scale
from .gelu_mul import gelu_tanh_mul_reference, is_gelu_tanh, silu_mul_reference

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Bounds of the kernel path (tested up to 288 experts and top-8): larger routings take the reference.
MAX_EXPERTS = 1024
MAX_TOP_K = 32
# up to this many (token, slot) pairs the expert kernels group them by expert themselves (decode, verify); up to
# ALIGN_MAX_PAIRS one Triton program groups them before the kernels; torch ops beyond (prefill)
FEW_MAX_PAIRS = 64
ALIGN_MAX_PAIRS = 256
SUM_BLOCK = 1024
_warned: set[str] = set()


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters: ``block_m`` pair rows per block (a power of two >= 16: tl.dot's minimum), and
    ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` of the gate/up kernel (N over I, K over H) and of the down
    kernel (N over H, K over I)."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


# Decode / verify: memory bound; narrow N tiles make many programs so the weights stream at full bandwidth (Gemma 4
# decode: 8 experts x 22 I tiles, 8 x 44 H tiles). From `python -m benchmarks.moe_gpu_check --sweep` on an H100
# (graph-timed, tokens 1 + 4): the best of 54 configs per kernel is within 1-3% of these for both Gemma 4 26B-A4B and
# Step 3.5; the spread over the whole grid is ~10%. 16-row blocks stay the fastest up to 64 tokens (26B-A4B experts,
# H200, graph-timed: 32 tokens 335 us against 367 in 32-row blocks, 64 tokens 433 against 504 in the prefill config)
# and for e4m3 weights at every width measured (1-64 tokens: 32- and 64-row blocks take 1.5-2.7x as long there).
DECODE_CONFIG = MoeConfig(block_m=16, gate_up=(32, 128, 4, 4), down=(64, 128, 4, 4))
DECODE_MAX_TOKENS = 64
# Prefill: taller blocks share each weight tile among more rows. `--sweep --tokens 512` (H100): Step 3.5 2.85 ->
# ~2.5 ms over the first guess (64, 64, 4, 3) for both; Gemma 4 26B-A4B unchanged (~0.71 ms).
PREFILL_CONFIG = MoeConfig(block_m=64, gate_up=(64, 128, 4, 2), down=(128, 64, 4, 2))


# fp32 decode / verify (the exactness dtype; the bundled tiny Step 3.5 runs in it): fp32 dots run on the FMA units,
# and the bf16 tiles (32 x 128 weight tiles, 4 stages) spill registers there. A sweep of (BLOCK_N, BLOCK_K, warps,
# stages) at the tiny Step 3.5 experts (4 experts, top-2, hidden 160, intermediate 128; H200, graph-timed): one token
# 29.1 -> 15.0 us, 4 + 16 tokens 73.3 -> 34.3 us (docs/perf_log.md, session 27).
FP32_DECODE_CONFIG = MoeConfig(block_m=16, gate_up=(16, 16, 4, 2), down=(16, 64, 4, 2))


def config_for(tokens: int, fp8: bool = False, fp32: bool = False) -> MoeConfig:
    """Default launch parameters for a forward of ``tokens`` rows: 16-row blocks up to ``DECODE_MAX_TOKENS`` tokens
    (a decode or verify forward rounds every row in tiles of one shape; fp32 rows in narrower tiles), and for e4m3
    weights at any width; wider forwards of dense weights the prefill config."""
    if fp8 or tokens <= DECODE_MAX_TOKENS:
        return FP32_DECODE_CONFIG if fp32 and not fp8 else DECODE_CONFIG
    return PREFILL_CONFIG


# ---------------------------------------------------------------- routing


def softmax_topk_route(router_logits: torch.Tensor,  # [tokens, num_experts]
                       top_k: int, per_expert_scale: torch.Tensor | None = None,  # [num_experts]
                       *, return_probabilities: bool = False,
                       ) -> tuple[torch.Tensor, ...]:
    """Gemma 4's router after its projection (transformers' ``Gemma4TextRouter``, same arithmetic): softmax over
    all experts in fp32, top-k, the k weights renormalised to sum 1, times ``per_expert_scale[index]``.
    -> (weights [tokens, top_k] fp32, index [tokens, top_k] int64), led by the probabilities [tokens, num_experts]
    fp32 with ``return_probabilities``. No host sync. On the GPU the softmax runs in :func:`topk_route`'s launch
    (its exp and division are the GPU's approximate ones and its sum runs in another order: a probability may
    differ from torch's softmax by a few ulps, more for logits far below the row's maximum); elsewhere torch's."""
    check(router_logits.dim() == 2 and 0 < top_k <= router_logits.shape[-1],
          f"router_logits must be [tokens, num_experts] with num_experts >= top_k={top_k}, "
          f"got {tuple(router_logits.shape)}")
    _check_expert_vectors(router_logits.shape[-1], per_expert_scale=per_expert_scale)
    if _kernel_routes(router_logits, top_k):
        return _route_logits(router_logits, top_k, "softmax", renormalize=True, per_expert_scale=per_expert_scale,
                             return_scores=return_probabilities)
    probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    routed = topk_route(probabilities, top_k, renormalize=True, per_expert_scale=per_expert_scale)
    return (probabilities, *routed) if return_probabilities else routed


def sigmoid_bias_topk_route(router_logits: torch.Tensor,  # [tokens, num_experts]
                            bias: torch.Tensor,  # [num_experts]
                            top_k: int, renormalize: bool, scaling_factor: float,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3.5's router (``Step3p5MoE.route`` in ``models/step3p5/layers.py``; docs/models.md §4): experts selected by
    ``sigmoid(logits) + bias``, weighted by the selected ``sigmoid(logits)``, optionally renormalised (sum +
    1e-20), times ``scaling_factor``. -> (weights [tokens, top_k] fp32, index [tokens, top_k] int64)."""
    check(router_logits.dim() == 2 and 0 < top_k <= router_logits.shape[-1],
          f"router_logits must be [tokens, num_experts] with num_experts >= top_k={top_k}, "
          f"got {tuple(router_logits.shape)}")
    check(bias.shape == router_logits.shape[-1:],
          f"bias must be [num_experts={router_logits.shape[-1]}], got {tuple(bias.shape)}")
    if _kernel_routes(router_logits, top_k):  # the sigmoid in topk_route's launch (a few ulps from torch's)
        return _route_logits(router_logits, top_k, "sigmoid", bias=bias, renormalize=renormalize,
                             renormalize_eps=1e-20, scaling_factor=scaling_factor)
    scores = torch.sigmoid(router_logits.float())
    return topk_route(scores, top_k, bias=bias, renormalize=renormalize, renormalize_eps=1e-20,
                      scaling_factor=scaling_factor)


def topk_route(scores: torch.Tensor,  # [tokens, num_experts] fp32
               top_k: int, *, bias: torch.Tensor | None = None,  # [num_experts]: added for the selection only
               renormalize: bool = False, renormalize_eps: float = 0.0,
               per_expert_scale: torch.Tensor | None = None,  # [num_experts]
               scaling_factor: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' shared tail: the ``top_k`` experts of each token by ``scores [+ bias]`` (descending; equal
    keys: the lower expert id first), their ``scores`` as weights, optionally divided by their sum (+
    ``renormalize_eps``), times ``per_expert_scale[index]`` and ``scaling_factor``.
    -> (weights [tokens, top_k] fp32, index [tokens, top_k] int64).

    On the GPU one launch per forward (``_topk_route_kernel``, a program per token) instead of the ~8 torch
    launches (two for ``topk``) that cost a decode step ~15 us per MoE layer. The selection is exact: the
    same keys, compared in fp32. The renormalising sum adds the k weights in slot order, which may differ from
    torch's reduction order in the last bit of the weights."""
    check(scores.dim() == 2 and 0 < top_k <= scores.shape[-1],
          f"scores must be [tokens, num_experts] with num_experts >= top_k={top_k}, got {tuple(scores.shape)}")
    _check_expert_vectors(scores.shape[-1], bias=bias, per_expert_scale=per_expert_scale)
    if not _kernel_routes(scores, top_k):
        return topk_route_reference(scores, top_k, bias=bias, renormalize=renormalize,
                                    renormalize_eps=renormalize_eps, per_expert_scale=per_expert_scale,
                                    scaling_factor=scaling_factor)
    return _route_logits(scores, top_k, None, bias=bias, renormalize=renormalize, renormalize_eps=renormalize_eps,
                         per_expert_scale=per_expert_scale, scaling_factor=scaling_factor)


def _check_expert_vectors(experts: int, **vectors) -> None:
    for name, vector in vectors.items():
        check(vector is None or vector.shape == (experts,),
              f"{name} must be [num_experts={experts}], got {None if vector is None else tuple(vector.shape)}")


def _kernel_routes(scores: torch.Tensor, top_k: int) -> bool:
    """Whether ``_topk_route_kernel`` takes these scores (or logits); else the torch ops do."""
    return (use_triton(scores) and scores.shape[0] > 0 and scores.shape[-1] <= MAX_EXPERTS and top_k <= MAX_TOP_K
            and not needs_grad(scores))


def _route_logits(logits, top_k, score_function, *, bias=None, renormalize=False, renormalize_eps=0.0,
                  per_expert_scale=None, scaling_factor=None, return_scores=False):
    """One ``_topk_route_kernel`` launch. ``score_function`` None: ``logits`` are the scores; "softmax" /
    "sigmoid": the kernel makes the fp32 scores from them (also written out, first, with ``return_scores``)."""
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens, experts = rows.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=rows.device)
    index = torch.empty(tokens, top_k, dtype=torch.int64, device=rows.device)
    # a softmax always writes its probabilities: the kernel compiled without the store may sum the row in another
    # order (its layout follows the memory accesses), and the weights must not depend on what the caller asks for
    store = return_scores or score_function == "softmax"
    scores = torch.empty(tokens, experts, dtype=torch.float32, device=rows.device) if store else weights
    _topk_route_kernel[(tokens,)](
        rows, bias if bias is not None else rows, per_expert_scale if per_expert_scale is not None else rows,
        weights, index, scores, experts, rows.stride(0), float(renormalize_eps),
        float(scaling_factor if scaling_factor is not None else 1.0),
        TOP_K=top_k, SLOTS=next_power_of_2(top_k), BLOCK_E=next_power_of_2(experts), HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize, HAS_SCALE=per_expert_scale is not None, HAS_FACTOR=scaling_factor is not None,
        SCORE_FUNCTION={None: 0, "softmax": 1, "sigmoid": 2}[score_function], STORE_SCORES=store,
        num_warps=1 if experts <= 512 else 2, **pdl_args(rows))  # one warp: its reductions need no barrier
    return (scores, weights, index) if return_scores else (weights, index)


def topk_route_reference(scores, top_k, *, bias=None, renormalize=False, renormalize_eps=0.0,
                         per_expert_scale=None, scaling_factor=None):
    """Torch version of :func:`topk_route` (the routers' own ops): the CPU path and the test oracle."""
    if bias is None:
        weights, index = torch.topk(scores, k=top_k, dim=-1)
    else:
        index = torch.topk(scores + bias.float(), top_k, dim=-1).indices
        weights = scores.gather(-1, index)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + renormalize_eps if renormalize_eps else total)
    if per_expert_scale is not None:
        weights = weights * per_expert_scale[index]
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return weights, index


@triton.jit
def _topk_route_kernel(scores_ptr, bias_ptr, scale_ptr, weights_ptr, index_ptr, scores_out_ptr, num_experts,
                       stride_s, renormalize_eps, scaling_factor, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                       BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_FACTOR: tl.constexpr, SCORE_FUNCTION: tl.constexpr,
                       STORE_SCORES: tl.constexpr, PDL: tl.constexpr):
    """One token: its scores (SCORE_FUNCTION 0: as given; 1: fp32 softmax of the logits given; 2: their fp32
    sigmoid), then TOP_K rounds of one max each over (key, expert) packed into one int64 (the key's fp32 bits
    mapped to an order-preserving int32 in the high half, ``BLOCK_E - 1 - expert`` in the low half: the largest key,
    the lowest expert among equal keys), then the chosen experts' scores and the weights."""
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    scores = tl.load(scores_ptr + token * stride_s + experts, mask=valid, other=0.0).to(tl.float32)
    if SCORE_FUNCTION == 1:
        logits = tl.where(valid, scores, float("-inf"))
        exps = tl.exp(logits - tl.max(logits, 0))
        scores = exps / tl.sum(exps, 0)
    elif SCORE_FUNCTION == 2:
        scores = 1.0 / (1.0 + tl.exp(-scores))
    if STORE_SCORES:
        tl.store(scores_out_ptr + token * num_experts + experts, scores, mask=valid)
    keys = scores
    if HAS_BIAS:
        keys = scores + tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    bits = (keys + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0, equal keys stay equal
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of the ints = order of the floats (NaN above inf)
    packed = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - experts).to(tl.int64)
    lowest = tl.full([], -9223372036854775808, tl.int64)
    low_half = tl.full([], 4294967295, tl.int64)
    packed = tl.where(valid, packed, lowest)
    slots = tl.arange(0, SLOTS)
    chosen_index = tl.zeros([SLOTS], dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(packed, 0)
        chosen_index = tl.where(slots == slot, BLOCK_E - 1 - (best & low_half), chosen_index)
        packed = tl.where(packed == best, lowest, packed)
    in_k = slots < TOP_K
    picked = (experts[None, :] == chosen_index[:, None]) & in_k[:, None]
    chosen_weight = tl.sum(tl.where(picked, scores[None, :], 0.0), 1)  # one score per slot: exact
    total = 0.0
    for slot in tl.static_range(TOP_K):  # the sum in slot order, as the reference's
        total += tl.sum(tl.where(slots == slot, chosen_weight, 0.0), 0)
    if RENORMALIZE:
        chosen_weight = chosen_weight / (total + renormalize_eps)
    if HAS_SCALE:
        chosen_weight = chosen_weight * tl.load(scale_ptr + chosen_index, mask=in_k, other=1.0).to(tl.float32)
    if HAS_FACTOR:
        chosen_weight = chosen_weight * scaling_factor
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weight, mask=in_k)
    tl.store(index_ptr + token * TOP_K + slots, chosen_index, mask=in_k)


# ---------------------------------------------------------------- kernels


@triton.jit
def _moe_align_kernel(index_ptr, row_pair_ptr, block_expert_ptr, num_blocks_ptr, row_start_ptr,
                      num_pairs, num_experts, num_rows,
                      BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, FILL: tl.constexpr,
                      PDL: tl.constexpr):
    """One program: `_group_pairs` in one launch (same outputs) for at most PAIRS pairs."""
    pdl_wait(PDL)
    p = tl.arange(0, PAIRS)
    p_ok = p < num_pairs
    expert_of = tl.load(index_ptr + p, mask=p_ok, other=num_experts).to(tl.int32)
    # padding, and ids out of range (never read past the weights), go to bin num_experts: no row
    expert_of = tl.where((expert_of >= 0) & (expert_of < num_experts), expert_of, num_experts)
    p_ok = p_ok & (expert_of < num_experts)
    e = tl.arange(0, EXPERTS)
    e_ok = e < num_experts
    counts = tl.where(e_ok, tl.histogram(expert_of, EXPERTS), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_start = tl.cumsum(blocks, 0) - blocks
    tl.store(row_start_ptr + e, block_start * BLOCK_M, mask=e_ok)
    tl.store(num_blocks_ptr, tl.sum(blocks, 0))
    for b in range(0, tl.cdiv(num_pairs, BLOCK_M)):  # each expert's b-th block
        tl.store(block_expert_ptr + block_start + b, e, mask=e_ok & (b < blocks))
    for r0 in range(0, num_rows, FILL):
        rows = r0 + tl.arange(0, FILL)
        tl.store(row_pair_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=rows < num_rows)
    # a pair's rank among the earlier pairs of its expert (the stable sort's order)
    earlier_same = (expert_of[:, None] == expert_of[None, :]) & (p[None, :] < p[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), 1)
    tl.debug_barrier()  # the row starts and the padding fill are visible to every thread
    dest = tl.load(row_start_ptr + expert_of, mask=p_ok, other=0) + rank
    tl.store(row_pair_ptr + dest, p, mask=p_ok)


@triton.jit
def block_pairs(block, row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts,
                BLOCK_M: tl.constexpr, FEW_PAIRS: tl.constexpr):
    """(lead, expert, rows, pair) of block ``block``: whether the block holds pairs (else its program exits), its
    expert, its rows of the intermediate and each row's pair (``num_pairs`` on padding rows).

    FEW_PAIRS = 0: the pairs grouped beforehand (``group_pairs``: ``row_pair_ptr``, ``block_expert_ptr``, the real
    block count at ``num_blocks_ptr``). FEW_PAIRS = 1 (one token): block b is pair b alone. FEW_PAIRS > 1 (a power
    of two >= the pairs): the grouping done here, no launch before the expert kernels. Block b is pair b's: ``block_expert_ptr`` is the routing itself; pair b
    leads a block when its rank among its expert's pairs (their order in the routing) is a multiple of BLOCK_M,
    and the block holds the pairs of ranks rank .. rank + BLOCK_M - 1, in rank order (the stable sort's). A pair
    whose expert is out of range leads nothing (and no weight outside the tensors is read)."""
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    if FEW_PAIRS == 1:  # one token: its pairs' experts differ, each pair a block of its own, nothing to scan
        mine = tl.load(block_expert_ptr + block)
        lead = (mine >= 0) & (mine < num_experts)
        pair = tl.where((tl.arange(0, BLOCK_M) == 0) & lead, block.to(tl.int64), num_pairs)
        expert = tl.where(lead, mine, 0).to(tl.int64)
    elif FEW_PAIRS > 0:
        p = tl.arange(0, FEW_PAIRS)
        ids = tl.load(block_expert_ptr + p, mask=p < num_pairs, other=-1)
        mine = tl.load(block_expert_ptr + block)
        in_range = (mine >= 0) & (mine < num_experts)
        same = ((ids == mine) & (p < num_pairs)).to(tl.int32)
        rank = tl.cumsum(same, 0) - 1  # each pair's rank among its expert's pairs (where same)
        first = tl.sum(tl.where(p == block, rank, 0), 0)
        lead = in_range & (first % BLOCK_M == 0)
        match = (same[None, :] != 0) & (rank[None, :] == (first + tl.arange(0, BLOCK_M))[:, None])
        held = tl.sum(match.to(tl.int32), 1) > 0
        pair = tl.where(held, tl.sum(tl.where(match, p[None, :], 0), 1), num_pairs).to(tl.int64)
        expert = tl.where(in_range, mine, 0).to(tl.int64)
    else:
        lead = block < tl.load(num_blocks_ptr)  # the grid is an upper bound on the blocks
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        pair = tl.load(row_pair_ptr + rows).to(tl.int64)
    return lead, expert, rows, pair


@triton.jit
def program_rows(block, row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, top_k, n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FEW_PAIRS: tl.constexpr):
    """(lead, expert, rows, pair, row_ok, token, cols, col_ok) of an expert kernel's program: whether its block holds
    pairs (:func:`block_pairs`), the block's expert and rows of the intermediate, each row's pair, which rows hold
    one and their tokens (0 on padding rows), its ``BLOCK_N`` columns of the ``n`` outputs."""
    lead, expert, rows, pair = block_pairs(block, row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs,
                                           num_experts, BLOCK_M, FEW_PAIRS)
    row_ok = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return lead, expert, rows, pair, row_ok, tl.where(row_ok, pair // top_k, 0), cols, cols < n


@triton.jit
def _weight_tile(w, x, FP8: tl.constexpr, NATIVE_FP8: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """(x, w) ready for ``tl.dot``: FP8 weights in x's dtype (exact: every e4m3 value is a bf16 / fp16 value);
    under the interpreter, bf16 and FP8 tiles as fp32 (it multiplies bf16 tiles as their raw bits)."""
    if FP8:
        if NATIVE_FP8:
            w = w.to(tl.float32) if EMULATE_BF16 else w.to(x.dtype)
        else:
            w = e4m3_bits_to_float(w) if EMULATE_BF16 else e4m3_bits_to_float(w).to(x.dtype)
    if EMULATE_BF16:
        return x.to(tl.float32), w.to(tl.float32)
    return x, w


@triton.jit
def _scaled(part, s_cols, k0, col_ok, stride_sk, scale_bk, FP8: tl.constexpr, SCALE_PER_K: tl.constexpr,
            SCALE_E8M0: tl.constexpr):
    """A K tile's fp32 partial sum times its block of scales (FP8 weights with scales per K block; the tile lies in
    one block): ``s_cols`` are its columns' rows of scales."""
    if FP8:
        if SCALE_PER_K:
            return part * load_scale(s_cols + (k0 // scale_bk) * stride_sk, col_ok, SCALE_E8M0)[None, :]
    return part


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, inter_ptr, row_pair_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, num_experts, top_k, hidden, inter_size, limit,
    stride_xt, stride_xh, stride_ge, stride_gn, stride_gk, stride_ue, stride_un, stride_uk,
    s_ptr, stride_se, stride_sn, stride_sk, scale_bn, scale_bk, up_row0, inv_ptr,
    bg_ptr, bu_ptr, stride_bge, stride_bgn, stride_bue, stride_bun, alpha,
    ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr, FEW_PAIRS: tl.constexpr,
    K_BETA: tl.constexpr, K_KAPPA: tl.constexpr, FP8: tl.constexpr = False, NATIVE_FP8: tl.constexpr = True,
    SCALE_PER_K: tl.constexpr = False, SCALE_E8M0: tl.constexpr = False, F16_ROWS: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """FP8: e4m3 gate and up weights (views of one stacked [E, 2I, H] tensor), their scales at ``s_ptr`` [E, sn,
    sk] (gate column c takes scale row ``c // scale_bn``, up column c row ``(up_row0 + c) // scale_bn``).
    F16_ROWS: ``x`` holds the bf16 token rows as fp16 times powers of two (``fp8_gemm.f16_rows``), the inverse
    powers at ``inv_ptr``: the weights convert to fp16 in one instruction per two, the sums are scaled back exactly."""
    pdl_wait(PDL)
    lead, expert, rows, _, row_ok, token, cols, col_ok = program_rows(
        tl.program_id(0), row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, top_k, inter_size,
        BLOCK_M, BLOCK_N, FEW_PAIRS)
    if not lead:
        return
    x_rows = x_ptr + token[:, None] * stride_xt
    g_rows = wg_ptr + expert * stride_ge + cols.to(tl.int64)[:, None] * stride_gn
    u_rows = wu_ptr + expert * stride_ue + cols.to(tl.int64)[:, None] * stride_un
    sg_cols = s_ptr + expert * stride_se + (cols // scale_bn).to(tl.int64) * stride_sn  # FP8: the scales' rows
    su_cols = s_ptr + expert * stride_se + ((up_row0 + cols) // scale_bn).to(tl.int64) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        w_mask = col_ok[:, None] & k_ok[None, :]
        x = tl.load(x_rows + ks[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # the weights are read once: keep them from evicting the token rows from L2
        g = tl.load(g_rows + ks[None, :] * stride_gk, mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_rows + ks[None, :] * stride_uk, mask=w_mask, other=0.0, eviction_policy="evict_first")
        xg, g = _weight_tile(g, x, FP8, NATIVE_FP8, EMULATE_BF16)
        xu, u = _weight_tile(u, x, FP8, NATIVE_FP8, EMULATE_BF16)
        acc_g += _scaled(tl.dot(xg, tl.trans(g), input_precision=PRECISION), sg_cols, k0, col_ok, stride_sk,
                         scale_bk, FP8, SCALE_PER_K, SCALE_E8M0)
        acc_u += _scaled(tl.dot(xu, tl.trans(u), input_precision=PRECISION), su_cols, k0, col_ok, stride_sk,
                         scale_bk, FP8, SCALE_PER_K, SCALE_E8M0)
    if FP8:
        if not SCALE_PER_K:  # one scale per column (or per tensor): on the finished sums
            acc_g = acc_g * load_scale(sg_cols, col_ok, SCALE_E8M0)[None, :]
            acc_u = acc_u * load_scale(su_cols, col_ok, SCALE_E8M0)[None, :]
    if F16_ROWS:  # undo the rows' powers of two (exact)
        inverse = tl.load(inv_ptr + token, mask=row_ok, other=1.0)[:, None]
        acc_g, acc_u = acc_g * inverse, acc_u * inverse
    dtype: tl.constexpr = inter_ptr.dtype.element_ty
    # F.linear rounds gate and up to the model dtype before the activation
    gate, up = round_to(acc_g, dtype, EMULATE_BF16), round_to(acc_u, dtype, EMULATE_BF16)
    if HAS_BIAS:  # the product, then its bias, each rounded (gpt-oss's eager ``x @ w + b``)
        b_g = tl.load(bg_ptr + expert * stride_bge + cols * stride_bgn, mask=col_ok, other=0.0).to(tl.float32)
        b_u = tl.load(bu_ptr + expert * stride_bue + cols * stride_bun, mask=col_ok, other=0.0).to(tl.float32)
        gate, up = round_to(gate + b_g[None, :], dtype, EMULATE_BF16), round_to(up + b_u[None, :], dtype, EMULATE_BF16)
    h = gated_activation(gate, up, limit, alpha, dtype, ACTIVATION, HAS_LIMIT, EMULATE_BF16, K_BETA, K_KAPPA)
    tl.store(inter_ptr + rows[:, None] * inter_size + cols[None, :], h, mask=col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, wd_ptr, out_ptr, weights_ptr, row_pair_ptr, block_expert_ptr, num_blocks_ptr,
    num_pairs, num_experts, hidden, inter_size, stride_de, stride_dn, stride_dk,
    s_ptr, stride_se, stride_sn, stride_sk, scale_bn, scale_bk, bd_ptr, stride_bde, stride_bdn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE_BF16: tl.constexpr, FEW_PAIRS: tl.constexpr, FP8: tl.constexpr = False, NATIVE_FP8: tl.constexpr = True,
    SCALE_PER_K: tl.constexpr = False, SCALE_E8M0: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    lead, expert, rows, pair, row_ok, _, cols, col_ok = program_rows(
        tl.program_id(0), row_pair_ptr, block_expert_ptr, num_blocks_ptr, num_pairs, num_experts, 1, hidden,
        BLOCK_M, BLOCK_N, FEW_PAIRS)
    if not lead:
        return
    a_rows = inter_ptr + rows[:, None] * inter_size
    w_rows = wd_ptr + expert * stride_de + cols.to(tl.int64)[:, None] * stride_dn
    s_cols = s_ptr + expert * stride_se + (cols // scale_bn).to(tl.int64) * stride_sn  # FP8: the scales' rows
    out_dtype: tl.constexpr = inter_ptr.dtype.element_ty  # the activations' (the weights' unless FP8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(a_rows + ks[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :] * stride_dk, mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        a, w = _weight_tile(w, a, FP8, NATIVE_FP8, EMULATE_BF16)
        acc += _scaled(tl.dot(a, tl.trans(w), input_precision=PRECISION), s_cols, k0, col_ok, stride_sk, scale_bk,
                       FP8, SCALE_PER_K, SCALE_E8M0)
    if FP8:
        if not SCALE_PER_K:
            acc = acc * load_scale(s_cols, col_ok, SCALE_E8M0)[None, :]
    # F.linear's output in the model dtype, then .float() * the routing weight
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = round_to(acc, out_dtype, EMULATE_BF16)
    if HAS_BIAS:  # the product, then its bias, each rounded
        b_d = tl.load(bd_ptr + expert * stride_bde + cols * stride_bdn, mask=col_ok, other=0.0).to(tl.float32)
        y = round_to(y + b_d[None, :], out_dtype, EMULATE_BF16)
    y = y * weight[:, None]
    tl.store(out_ptr + pair[:, None] * hidden + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(parts_ptr, out_ptr, top_k, hidden, add1_ptr, add2_ptr, stride_add1, stride_add2,
                    BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr, ADDENDS: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over k of parts[t * top_k + k] in fp32 (slot order), rounded to out's dtype; then plus each of
    ``ADDENDS`` (0-2) tensors' row t in turn, each sum rounded to out's dtype (eager torch's adds after the MoE)."""
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, top_k):
        acc += tl.load(parts_ptr + (token * top_k + k) * hidden + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    y = round_to(acc, dtype, EMULATE_BF16)
    if ADDENDS >= 1:
        y = round_to(y + tl.load(add1_ptr + token * stride_add1 + cols, mask=mask, other=0.0).to(tl.float32), dtype,
                     EMULATE_BF16)
    if ADDENDS >= 2:
        y = round_to(y + tl.load(add2_ptr + token * stride_add2 + cols, mask=mask, other=0.0).to(tl.float32), dtype,
                     EMULATE_BF16)
    tl.store(out_ptr + token * hidden + cols, y, mask=mask)


# ---------------------------------------------------------------- launcher


def fused_moe(
    hidden_states: torch.Tensor,  # [tokens, hidden]
    w_gate: torch.Tensor,  # [num_experts, inter, hidden]
    w_up: torch.Tensor,  # [num_experts, inter, hidden]
    w_down: torch.Tensor,  # [num_experts, hidden, inter]
    top_k_index: torch.Tensor,  # [tokens, top_k] int
    top_k_weights: torch.Tensor,  # [tokens, top_k] float
    *,
    activation: str,
    limit: float | None = None,
    alpha: float | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    config: MoeConfig | None = None,
    addends: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:  # [tokens, hidden] in hidden_states' dtype
    """The routed experts' weighted sum per token (see the module docstring); ``config`` overrides the launch
    parameters (:func:`config_for`), e.g. for a tuning sweep. ``addends`` (up to two [tokens, hidden] tensors in
    hidden_states' dtype, e.g. a shared expert's output and the residual): added to the sum in turn, each result
    rounded as eager torch's ``moe + shared``, ``residual + ...`` round it, in the sum's launch. ``biases``: the
    experts' ``(gate [E, I], up [E, I], down [E, H])`` biases (any strides), each added to its product (gpt-oss);
    ``alpha``: the sigmoid's slope of ``activation="swiglu_oai"``."""
    _check_args(hidden_states, w_gate, w_up, w_down, top_k_index, top_k_weights, activation, limit, alpha, biases)
    _check_addends(hidden_states, addends)
    args = (hidden_states, w_gate, w_up, w_down, top_k_index, top_k_weights)
    terms = dict(activation=activation, limit=limit, alpha=alpha, biases=biases)
    if (not use_triton(hidden_states) or hidden_states.shape[0] == 0
            or any(needs_grad(t) for t in (hidden_states, w_gate, w_up, w_down, top_k_weights, *addends,
                                           *(biases or ())))):
        return add_in_turn(fused_moe_reference(*args, **terms), addends)
    reason = _unsupported(hidden_states, w_gate, top_k_index)
    if reason is not None:
        _warn_once(reason)
        return add_in_turn(fused_moe_reference(*args, **terms), addends)
    config = config or config_for(hidden_states.shape[0], fp32=hidden_states.dtype == torch.float32)
    check(config.block_m >= 16 and config.block_m == next_power_of_2(config.block_m),
          f"config.block_m must be a power of two >= 16, got {config.block_m}")
    return launch(*args, activation, limit, config, addends=addends, alpha=alpha, biases=biases)


def _check_addends(x: torch.Tensor, addends: tuple[torch.Tensor, ...]) -> None:
    check(len(addends) <= 2, f"addends takes at most 2 tensors, got {len(addends)}")
    for i, a in enumerate(addends):
        check(a.shape == x.shape and a.dtype == x.dtype and a.device == x.device,
              f"addends[{i}] must be like hidden_states ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
              f"{tuple(a.shape)}, {a.dtype}, {a.device}")


def add_in_turn(out: torch.Tensor, addends: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``out + a0 + a1 ...``, each sum rounded to the dtype (the torch path of ``addends``)."""
    for a in addends:
        out = out + a
    return out


def _check_args(x, w_gate, w_up, w_down, top_k_index, top_k_weights, activation, limit, alpha=None,
                biases=None) -> None:
    check(x.dim() == 2, f"hidden_states must be [tokens, hidden] (reshape(-1, hidden)), got {tuple(x.shape)}")
    tokens, hidden = x.shape
    check(w_gate.dim() == 3 and w_gate.shape[2] == hidden,
          f"w_gate must be [num_experts, inter, hidden={hidden}], got {tuple(w_gate.shape)}")
    experts, inter, _ = w_gate.shape
    check(w_up.shape == w_gate.shape, f"w_up must be [num_experts, inter, hidden] like w_gate "
          f"{tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    check(w_down.shape == (experts, hidden, inter),
          f"w_down must be [num_experts={experts}, hidden={hidden}, inter={inter}], got {tuple(w_down.shape)}")
    check(w_gate.dtype == w_up.dtype == w_down.dtype == x.dtype,
          f"the expert weights must share hidden_states' dtype {x.dtype}, got {w_gate.dtype}, {w_up.dtype}, "
          f"{w_down.dtype}")
    check(top_k_index.dim() == 2 and top_k_index.shape[0] == tokens and top_k_weights.shape == top_k_index.shape,
          f"top_k_index and top_k_weights must both be [tokens={tokens}, top_k], got {tuple(top_k_index.shape)} "
          f"and {tuple(top_k_weights.shape)}")
    check(not top_k_index.is_floating_point() and not top_k_index.is_complex() and top_k_index.dtype != torch.bool,
          f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    check(top_k_weights.is_floating_point(), f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu_oai":
        check(limit is not None and limit > 0 and alpha is not None,
              f"activation 'swiglu_oai' needs its limit (> 0) and alpha, got limit={limit!r}, alpha={alpha!r}")
    else:
        check(limit is None or (activation == "silu" and limit > 0),
              f"limit clamps the silu activation only and must be > 0 (None for no clamp), got {limit!r} "
              f"with {activation!r}")
        check(alpha is None, f"alpha is the slope of activation 'swiglu_oai' only, got alpha={alpha!r} with "
              f"{activation!r}")
    if biases is not None:
        check(len(biases) == 3, f"biases must be (gate, up, down), got {len(biases)} tensors")
        for name, b, width in zip(("gate", "up", "down"), biases, (inter, inter, hidden)):
            check(b.shape == (experts, width) and b.dtype == x.dtype,
                  f"the {name} bias must be [num_experts={experts}, {width}] in {x.dtype}, got {tuple(b.shape)} "
                  f"{b.dtype}")
            check_same_device(hidden_states=x, **{f"{name}_bias": b})
    check_same_device(hidden_states=x, w_gate=w_gate, w_up=w_up, w_down=w_down, top_k_index=top_k_index,
                      top_k_weights=top_k_weights)


def _unsupported(x: torch.Tensor, w_gate: torch.Tensor, top_k_index: torch.Tensor) -> str | None:
    """Why the kernels do not take these arguments (None: they do)."""
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take fp32, bf16 and fp16)"
    if w_gate.shape[0] > MAX_EXPERTS:
        return f"more than MAX_EXPERTS={MAX_EXPERTS} experts"
    if top_k_index.shape[1] > MAX_TOP_K:
        return f"top_k above MAX_TOP_K={MAX_TOP_K}"
    return None


def activation_name(act) -> str | None:
    """The ``activation`` argument that computes the activation module ``act`` (transformers' tanh-GELU, SiLU), or
    None."""
    if is_gelu_tanh(act):
        return "gelu_tanh"
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    return None


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("fused_moe: %s: running the torch reference", reason)


def group_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """`_group_pairs` by one Triton launch (`_moe_align_kernel`) up to ALIGN_MAX_PAIRS pairs (decode, verify: the
    ~20 small torch launches cost as much as reading the experts there), by torch ops beyond."""
    pairs = top_k_index.numel()
    if pairs > ALIGN_MAX_PAIRS:
        return _group_pairs(top_k_index, num_experts, block_m)
    device = top_k_index.device
    max_blocks = pairs // block_m + min(num_experts, pairs)
    row_pair = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    row_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](
        top_k_index.reshape(-1), row_pair, block_expert, num_blocks, row_start, pairs, num_experts,
        row_pair.numel(), BLOCK_M=block_m, PAIRS=max(16, next_power_of_2(pairs)),
        EXPERTS=next_power_of_2(num_experts + 1), FILL=1024, num_warps=4,
        **pdl_args(row_pair))
    return row_pair, block_expert, num_blocks, max_blocks


def _group_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """Group the (token, slot) pairs by expert into ``block_m``-row blocks, on the device and without a host sync.

    -> (row_pair [max_blocks * block_m]: the pair (``token * top_k + slot``) of each block row, ``pairs`` on
    padding rows; block_expert [max_blocks]: each block's expert; num_blocks [1]: the real block count;
    max_blocks: the host-side bound the grids take). An expert's rows keep their pairs' order (stable sort).
    """
    flat = top_k_index.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    max_blocks = pairs // block_m + min(num_experts, pairs)
    sorted_expert, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    row_start = (block_end - blocks) * block_m  # first padded row of each expert
    pair_start = counts.cumsum(0) - counts  # first sorted position of each expert
    position = torch.arange(pairs, device=device)
    dest = row_start[sorted_expert] + position - pair_start[sorted_expert]
    row_pair = torch.full((max_blocks * block_m,), pairs, dtype=torch.long, device=device).scatter_(0, dest, order)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    return row_pair, block_expert, block_end[-1:], max_blocks


def _tile(config: tuple[int, int, int, int], n: int, k: int) -> tuple[int, int, int, int]:
    """A kernel's (BLOCK_N, BLOCK_K, warps, stages) with the tiles no wider than the (padded) dimensions."""
    block_n, block_k, warps, stages = config
    return min(block_n, max(16, next_power_of_2(n))), min(block_k, max(16, next_power_of_2(k))), warps, stages


@dataclass(frozen=True)
class Fp8Weights:
    """What the kernels read besides e4m3 weights: each weight's scales [E, sn, sk] and their blocks ``(bn, bk)``
    (weight ``[e, i, j]`` takes ``scale[e, i // bn, j // bk]``), the row of the stacked gate/up weight where up
    starts, whether Triton loads e4m3 natively on this device (else bytes, converted by integer ops)."""

    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    gate_up_blocks: tuple[int, int]
    down_blocks: tuple[int, int]
    up_row0: int
    native: bool
    fp16_dots: bool = False  # bf16 token rows go to fp16 first (fp8_gemm.f16_rows) for the gate/up dots


def _scale_args(scale: torch.Tensor | None, blocks: tuple[int, int], native: bool, x: torch.Tensor):
    """(kernel arguments, constexprs) of one weight's scales; None: dense weights (unread placeholders)."""
    if scale is None:
        return (x, 0, 0, 0, 1, 1), {}
    e8m0 = scale.dtype == E8M0_DTYPE
    return ((scale.view(torch.uint8) if e8m0 else scale, *scale.stride(), *blocks),
            dict(FP8=True, NATIVE_FP8=native, SCALE_PER_K=scale.shape[2] > 1, SCALE_E8M0=e8m0))


def _k_tile(block_k: int, fp8: Fp8Weights | None, scale: torch.Tensor | None, bk: int) -> int:
    """A K tile inside one block of scales (FP8 weights with scales per K block), else ``block_k``."""
    if fp8 is None or scale.shape[2] == 1:
        return block_k
    return min(block_k, bk & -bk)


def launch(x, w_gate, w_up, w_down, top_k_index, top_k_weights, activation, limit, config: MoeConfig,
            fp8: Fp8Weights | None = None, addends: tuple[torch.Tensor, ...] = (), alpha: float | None = None,
            biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    tokens, hidden = x.shape
    experts, inter, _ = w_gate.shape
    top_k = top_k_index.shape[1]
    pairs = tokens * top_k
    few_pairs, row_pair, block_expert, num_blocks, max_blocks = route_blocks(top_k_index, experts, config.block_m)
    # Triton's CPU interpreter (3.9) multiplies bf16 tiles as their raw uint16 bits and truncates fp32 -> bf16
    # casts: there the kernels upcast the tiles and round by integer ops
    emulate = x.dtype == torch.bfloat16 and interpreting(_moe_gate_up_kernel)
    precision = "ieee" if x.dtype == torch.float32 or emulate else "tf32"  # fp32 stays fp32 (no tf32 rounding)
    if fp8 is not None and not fp8.native:  # e4m3 bytes, converted in the kernels
        w_gate, w_up, w_down = (w.view(torch.uint8) for w in (w_gate, w_up, w_down))
    native = fp8 is None or fp8.native
    gate_up_scale = None if fp8 is None else fp8.gate_up_scale
    down_scale = None if fp8 is None else fp8.down_scale
    gate_up_args, gate_up_fp8 = _scale_args(gate_up_scale, fp8 and fp8.gate_up_blocks, native, x)
    down_args, down_fp8 = _scale_args(down_scale, fp8 and fp8.down_blocks, native, x)
    intermediate = torch.empty(max_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
    fp16_dots = fp8 is not None and fp8.fp16_dots
    b_gate, b_up, b_down = biases if biases is not None else (x, x, x)  # unread placeholders without biases
    rows_in, inverse = f16_rows(x) if fp16_dots else (x, x)  # inverse: unread without fp16 dots
    block_n, block_k, warps, stages = _tile(config.gate_up, inter, hidden)
    block_k = _k_tile(block_k, fp8, gate_up_scale, gate_up_args[-1])
    _moe_gate_up_kernel[(max_blocks, triton.cdiv(inter, block_n))](
        rows_in, w_gate, w_up, intermediate, row_pair, block_expert, num_blocks,
        pairs, experts, top_k, hidden, inter, float(limit or 0.0),
        *rows_in.stride(), *w_gate.stride(), *w_up.stride(), *gate_up_args, 0 if fp8 is None else fp8.up_row0,
        inverse, b_gate, b_up, *b_gate.stride(), *b_up.stride(), float(alpha or 0.0),
        ACTIVATION=activation, HAS_LIMIT=limit is not None, BLOCK_M=config.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=precision, EMULATE_BF16=emulate, FEW_PAIRS=few_pairs,
        **GELU_TANH_CONSTANTS, num_warps=warps, num_stages=stages, F16_ROWS=fp16_dots, HAS_BIAS=biases is not None,
        **gate_up_fp8, **pdl_args(intermediate))
    weights = top_k_weights.reshape(-1).float()
    parts = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, block_k, warps, stages = _tile(config.down, hidden, inter)
    block_k = _k_tile(block_k, fp8, down_scale, down_args[-1])
    _moe_down_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        intermediate, w_down, parts, weights, row_pair, block_expert, num_blocks,
        pairs, experts, hidden, inter, *w_down.stride(), *down_args, b_down, *b_down.stride(),
        BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, EMULATE_BF16=emulate,
        FEW_PAIRS=few_pairs, num_warps=warps, num_stages=stages, HAS_BIAS=biases is not None, **down_fp8,
        **pdl_args(parts))
    return sum_parts(parts, tokens, top_k, x.dtype, emulate, addends)


def route_blocks(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """(few_pairs, row_pair, block_expert, num_blocks, max_blocks) of the expert kernels. Up to
    ``FEW_MAX_PAIRS`` pairs (decode, verify) the kernels group the pairs themselves (``few_pairs``: the power of
    two their programs scan; the routing stands for the three tensors; one block per pair, most exit at once);
    wider forwards :func:`group_pairs` (``few_pairs`` 0)."""
    pairs = top_k_index.numel()
    if top_k_index.shape[0] == 1 or pairs <= FEW_MAX_PAIRS:
        flat = top_k_index.reshape(-1)
        few = 1 if top_k_index.shape[0] == 1 else max(16, next_power_of_2(pairs))
        return few, flat, flat, flat, pairs
    return 0, *group_pairs(top_k_index, num_experts, block_m)


def sum_parts(parts: torch.Tensor,  # [tokens * top_k, hidden] fp32: each pair's weighted expert output
              tokens: int, top_k: int, dtype: torch.dtype, emulate: bool,
              addends: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """Each token's ``top_k`` parts summed in fp32 in slot order, rounded to ``dtype``, plus ``addends`` in turn
    (``_moe_sum_kernel``, one launch)."""
    hidden = parts.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=parts.device)
    block = min(SUM_BLOCK, next_power_of_2(hidden))
    adds = [a if a.stride(-1) == 1 else a.contiguous() for a in addends] + [out] * (2 - len(addends))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block))](
        parts, out, top_k, hidden, *adds, adds[0].stride(0), adds[1].stride(0), BLOCK=block, EMULATE_BF16=emulate,
        ADDENDS=len(addends), num_warps=4, **pdl_args(out))
    return out


# ---------------------------------------------------------------- reference


def gated_activation_reference(gate: torch.Tensor, up: torch.Tensor, activation: str,
                               limit: float | None = None, alpha: float | None = None) -> torch.Tensor:
    """Gemma 4's ``gelu_tanh(gate) * up``, Step 3.5's ``clamped_swiglu(gate, up, limit)`` or gpt-oss's
    ``swiglu_oai`` (``(up.clamp(-limit, limit) + 1) * g * sigmoid(g * alpha)``, ``g = gate.clamp(max=limit)``), in
    the inputs' dtype."""
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == "gelu_tanh":
        return gelu_tanh_mul_reference(gate, up)
    return silu_mul_reference(gate, up, limit)


def fused_moe_reference(hidden_states: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, activation: str,
                        limit: float | None = None, alpha: float | None = None,
                        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch version of :func:`fused_moe` (the same arguments and shapes): the CPU path and the test oracle. One
    pass per selected expert (``unique`` is a host sync), each contribution in fp32, summed in fp32, cast back.
    A bias is added to its product in the dtype, after the product (as gpt-oss's eager ``x @ w + b``)."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == e)
        x = hidden_states[token]
        gate, up = F.linear(x, w_gate[e]), F.linear(x, w_up[e])
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[1][e]
        y = F.linear(gated_activation_reference(gate, up, activation, limit, alpha), w_down[e])
        if biases is not None:
            y = y + biases[2][e]
        out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)
