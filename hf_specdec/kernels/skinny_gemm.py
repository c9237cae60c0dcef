"""skinny_linear: ``x @ weight.T`` for a few rows (decode, verify and draft steps) at the weights' streaming rate.

A decode or verify step multiplies a few rows by each weight matrix, so its GEMMs are bound by reading the
weights once. On an H100 cuBLAS streams the Gemma-4-31B shapes at 2.4-2.85 TB/s (a device copy moves 3.0);
this kernel streams them at 2.85-3.1 (``docs/perf_log.md``, session 7): each program owns ``BLOCK_N`` output
columns, walks the whole K dimension in ``BLOCK_K`` tiles through a deep software pipeline, and multiplies
the rows, padded to 16, on the tensor cores. Narrow outputs (few column blocks: the o and down projections of the
smaller targets) also split K, so that every SM streams: each part writes an fp32 partial and a second launch sums
the parts in their order (:func:`split_k_for`; no atomics, no memset).

Every row is computed by the same dot (16 or 32 rows, the warp-level MMA) over the same tiles in the same K
order whatever the number of rows, so a row's result does not depend on the batch: a verify step's k+1 rows
per sequence get the bits a one-row decode step gets (batch invariance: bf16 greedy speculative output equals
plain greedy output) while a forward has at most ``MAX_KERNEL_ROWS`` rows. Wider forwards (prefill, a verify of
a large batch), fp32 weights and anything autograd tracks keep the torch GEMM: fp32 tiles must multiply in full
fp32 (``ieee``: the tensor cores would round them to tf32), where this kernel took ~20 us per small weight against
cuBLAS's 2-10 us (perf log, session 13; an H200). ``skinny_matmul`` itself takes fp32 rows that way. A few fp32
rows on a small weight (the bundled tiny family's default dtype) take :func:`fp32_rows_matmul` instead: fp32
multiply-adds without the tensor cores, in one launch (:data:`FP32_ROWS`).
"""

import os

import torch
import torch.nn.functional as F

from ._dispatch import needs_grad, pdl_args, pdl_wait, tl, triton, use_triton

# HF_SPECDEC_SKINNY_GEMM=0 keeps cuBLAS for every shape (read at import), e.g. to compare the two
ENABLED = os.environ.get("HF_SPECDEC_SKINNY_GEMM", "1") != "0"
MAX_ROWS = 16  # rows per program (tl.dot's smallest M)
# Wider forwards take cuBLAS: prefill, and verify steps of more than 32 rows (batch x (k+1)), where the
# warp-level MMA of 64+ rows ran ~1.45x slower than cuBLAS on the 31B shape (perf log, session 11).
MAX_KERNEL_ROWS = 32
SHARED_MEMORY_BYTES = 200 << 10  # for the pipeline's stages (an H100 SM has 227 KB)
# Every weight of a decode or verify step takes the kernel, small ones too: cuBLAS picks its algorithm (split-K
# included) by the number of rows, so a verify row would not round like a decode row. On small weights the two
# are within a few percent (perf log, session 10). HF_SPECDEC_SKINNY_MIN_BYTES (read at import) keeps cuBLAS
# below that many bytes, e.g. to compare them; batch invariance then holds only for the larger weights.
MIN_WEIGHT_BYTES = int(os.environ.get("HF_SPECDEC_SKINNY_MIN_BYTES", 0))


@triton.jit
def load_k_tile(w_rows, x_rows, k0, K, col_ok, row_ok, BLOCK_K: tl.constexpr):
    """The weight tile ``[BLOCK_N, BLOCK_K]`` and the rows' tile ``[BLOCK_M, BLOCK_K]`` at ``k0`` (zero past K). The
    weights are read once: they are loaded evict-first, so they do not push the rows (or anything else) out of L2."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
    x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return w, x


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, stride_split,
                        bias_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr, HAS_BIAS: tl.constexpr = False):
    # one dot of 16 or 32 rows per K tile: the warp-level MMA (never Hopper's 64-row warpgroup one) for any rows;
    # PRECISION "fma": fp32 multiply-adds instead, no tensor cores (fp32_rows_matmul);
    # split-K: program_id(1) takes K in [k_lo, k_hi) (a multiple of BLOCK_K from 0) and writes its own partial;
    # HAS_BIAS (one part only): the bias joins the fp32 sums before they are rounded, as cuBLAS's epilogue adds it
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w, x = load_k_tile(w_rows, x_rows, k0, k_hi, col_ok, row_ok, BLOCK_K)
        if PRECISION == "fma":
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = (y_ptr + tl.program_id(1).to(tl.int64) * stride_split + rows.to(tl.int64)[:, None] * stride_ym
           + cols[None, :])
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, numel, splits, bias_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       HAS_BIAS: tl.constexpr = False):
    """y = the sum of ``splits`` fp32 partials, one after the other (a fixed order: rows stay batch-invariant),
    plus (HAS_BIAS) the bias of each of the ``n`` columns, before the sum is rounded."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


def sum_splits(parts: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``parts`` ([splits, rows, n] fp32 partials of split-K) summed in split order, plus ``bias`` [n] when given, in
    ``dtype`` ([rows, n])."""
    splits, rows, n = parts.shape
    summed = torch.empty(rows, n, dtype=dtype, device=parts.device)
    _sum_splits_kernel[(triton.cdiv(rows * n, SUM_BLOCK),)](parts, summed, rows * n, splits,
                                                              parts if bias is None else bias, n, BLOCK=SUM_BLOCK,
                                                              HAS_BIAS=bias is not None, **pdl_args(parts))
    return summed


# Wide weights of a short K (E2B's and E4B's gate/up, K 1536 and 2560) stream 128-deep K tiles in programs small
# enough that several stay resident on an SM: 32-column programs of 4 stages (4 an SM by shared memory) until the
# 64-column ones of 3 stages fill two programs an SM (SHORT_K_WIDE_PROGRAMS), then those. The 256-deep 64-column
# config left E2B's [12288, 1536] in 1.45 waves of one program an SM. H200, graph-timed, one row
# (benchmarks/results/gemm_short_k_h200.log): [12288, 1536] 14.63 -> 11.41 us, [20480, 2560] 32.47 -> 27.96; decode
# (ab_decode, in turn): E2B batch 1 1.036x, batch 8 1.021x; E4B 1.052x / 1.040x. LM heads (LM_HEAD_TILES) stream
# 256-deep tiles instead of 512-deep: Gemma 4's [262144, K] at K = 1536 / 2560 / 2816 / 5376 221.2 -> 181.1,
# 319.9 -> 295.5, 367.0 -> 332.4 and 629.7 -> 624.8 us (same log). Either switch False (read per call: release
# captured graphs first) keeps the general configs, e.g. to compare.
SHORT_K_TILES = True
LM_HEAD_TILES = True
LM_HEAD_CONFIG = (32, 256, 4, 4)
SHORT_K = 2560
SHORT_K_NARROW = (32, 128, 4, 4)
SHORT_K_WIDE = (64, 128, 4, 3)
SHORT_K_WIDE_PROGRAMS = 2 * 132


def config_for(n: int, k: int, rows: int = 1, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a ``[n, k]`` weight, from the H100 sweeps of the perf log
    (graph-timed): up to 16 rows, ~1 program per 64 columns keeps 84+ programs streaming on narrow outputs, and
    narrow outputs (< 4096 columns) stream 512-deep K tiles in 32-column programs; LM heads (:data:`LM_HEAD_CONFIG`)
    and wide weights of a short K (:data:`SHORT_K`) take the H200 sweeps' configs (above); 17-32 rows stream
    256-deep K tiles in 32-column programs (within 1-3% of cuBLAS on the E4B shapes, session 11). A weight that
    splits K (:func:`split_k_for`) takes :data:`SPLIT_CONFIG` at every row count, so that a row's parts and tiles
    never depend on the batch. Stages are capped so that tiles of ``element_size`` bytes fit in shared memory."""
    if split_k_for(n, k) > 1:
        block_n, block_k, warps, stages = SPLIT_CONFIG
    elif rows > MAX_ROWS:
        block_n, block_k, warps, stages = 32, 256, 4, 4
    elif LM_HEAD_TILES and n >= 65536:
        block_n, block_k, warps, stages = LM_HEAD_CONFIG
    elif SHORT_K_TILES and k <= SHORT_K and n >= 4096:
        block_n, block_k, warps, stages = (SHORT_K_WIDE if _cdiv(n, SHORT_K_WIDE[0]) >= SHORT_K_WIDE_PROGRAMS
                                           else SHORT_K_NARROW)
    elif n >= 65536 or n < 4096:
        block_n, block_k, warps, stages = 32, 512, 4, 4
    elif n >= 32768:  # e.g. a stacked gate/up: one more stage in flight
        block_n, block_k, warps, stages = 64, 256, 4, 5
    else:
        block_n, block_k, warps, stages = 64, 256, 4, 4
    per_stage = element_size * block_k * (block_n + block_rows(rows))
    return block_n, block_k, warps, max(2, min(stages, SHARED_MEMORY_BYTES // per_stage))


# Split-K (HF_SPECDEC_SKINNY_SPLIT_K=0, read at import, turns it off; SPLIT_K may be set at run time, with the
# graphs captured before released). A weight of fewer SPLIT_CONFIG column blocks than SPLIT_K_BELOW_PROGRAMS (one per
# SM) leaves SMs idle, and each program streams a long row of K alone: such a weight with K >= SPLIT_MIN_K, or of
# fewer than FEW_PROGRAMS column blocks (a router), cuts K into parts of at least MIN_TILES_PER_SPLIT tiles until the
# launch has about SPLIT_PROGRAMS programs (at most MAX_SPLIT_K parts); the fp32 partials are summed in split order
# by a second launch. H200, graph-timed, one and four rows (benchmarks/results/skinny_split_sweep_h200.log): the
# E4B down projection [2560, 10240] 23.6 -> 19.1 us, E2B's [1536, 6144] 13.5 -> 9.2, the 26B-A4B's o [2816, 4096]
# 10.9 -> 9.8 and router [128, 2816] 6.4 -> 4.3; shorter K (the q/k/v of E2B and E4B, the 26B-A4B's dense down) gained
# nothing or lost up to 0.5 us split. A long-K weight of fewer than SPLIT_PROGRAMS split-config blocks, whose unsplit
# config (64-column programs) would not fill the SMs, splits too (in 2 parts): the 31B's o and down, [5376, 8192] and
# [5376, 21504], and their shards under tensor parallelism; one row, H200, gemm_tp_shapes_h200.log in
# benchmarks/results: 26.5 -> 25.2 us, 62.0 -> 57.9, the two-rank shards [5376, 4096] 14.7 -> 13.9 and
# [5376, 10752] 33.4 -> 31.7.
SPLIT_K = os.environ.get("HF_SPECDEC_SKINNY_SPLIT_K", "1") != "0"
SPLIT_CONFIG = (32, 128, 4, 4)
SPLIT_K_BELOW_PROGRAMS = 132
SPLIT_MIN_K = 4096
FEW_PROGRAMS = 32
SPLIT_PROGRAMS = 192
MAX_SPLIT_K = 8
MIN_TILES_PER_SPLIT = 4


def split_k_for(n: int, k: int, block_n: int | None = None, block_k: int | None = None) -> int:
    """Parts of K for an ``[n, k]`` weight (in ``block_n`` x ``block_k`` tiles, default :data:`SPLIT_CONFIG`'s).
    The weight's shape alone decides, never the number of rows: a verify row is summed in the parts a decode
    row is."""
    block_n = block_n or SPLIT_CONFIG[0]
    block_k = block_k or SPLIT_CONFIG[1]
    column_blocks, tiles = _cdiv(n, block_n), _cdiv(k, block_k)
    long_k = k >= SPLIT_MIN_K
    if (not SPLIT_K or column_blocks >= (SPLIT_PROGRAMS if long_k else SPLIT_K_BELOW_PROGRAMS)
            or (not long_k and column_blocks >= FEW_PROGRAMS)):
        return 1
    return max(1, min(MAX_SPLIT_K, _cdiv(SPLIT_PROGRAMS, column_blocks), tiles // MIN_TILES_PER_SPLIT))


def block_rows(rows: int) -> int:
    """Rows of the kernel's dot for ``rows`` rows: 16, or 32 past 16."""
    return MAX_ROWS if rows <= MAX_ROWS else 2 * MAX_ROWS


def skinny_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` runs the kernel for these arguments (else ``F.linear``)."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return (ENABLED and use_triton(x) and x.device == weight.device and x.dtype in (torch.bfloat16, torch.float16)
            and type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.layout == torch.strided  # no subclass
            and weight.dtype == x.dtype and 0 < rows <= MAX_KERNEL_ROWS and weight.stride(1) == 1
            and weight.numel() * weight.element_size() >= MIN_WEIGHT_BYTES
            and not needs_grad(x) and not needs_grad(weight))


# fp32 rows of this many, on weights of fewer output columns, take cuBLAS through the transposed product: for 7-16
# rows cuBLAS picked kernels of 25-52 us for F.linear on small fp32 weights (n <= 768, k 256-640) where w @ x.T took
# 6-8 us (H200, benchmarks/results/fp32_small_rows_gemm_h200.log; at 1-6 and 17-32 rows, and on a 4096-column
# weight, F.linear was as fast or faster; at 12-16 rows on some weights by up to 4 us)
FP32_TRANSPOSED_ROWS = range(7, 17)
FP32_TRANSPOSED_MAX_COLUMNS = 4095
# fp32 rows of this many on small weights (at most FP32_ROWS_MAX_COLUMNS outputs and FP32_ROWS_MAX_WEIGHT elements)
# take fp32_rows_matmul instead: fp32 multiply-adds in one launch (w @ x.T is three: the GEMM, cuBLAS's split-K sum
# and the transposing copy). H200, graph-timed, the tiny family's weights (n 160-1024, k 160-512;
# benchmarks/results/fp32_rows_kernel_sweep_h200.log): 1.5-2.7 us at 1-8 rows and 4.1-7.4 at 16, against cuBLAS's
# 2.1-2.7 (one row), 5-53 (F.linear, 2-16 rows) and 7-11 (w @ x.T); a 4096-column LM head was faster in cuBLAS.
# HF_SPECDEC_FP32_ROWS_KERNEL=0 (read at import) keeps the torch products, e.g. to compare the two.
FP32_ROWS_KERNEL = os.environ.get("HF_SPECDEC_FP32_ROWS_KERNEL", "1") != "0"
FP32_ROWS = range(1, 17)
FP32_ROWS_MAX_COLUMNS = 1024
FP32_ROWS_MAX_WEIGHT = 1 << 21
FP32_ROWS_CONFIG = (8, 256, 4)  # BLOCK_N, BLOCK_K, warps: the sweep's best at nearly every shape and row count


def fp32_rows_matmul(x: torch.Tensor, weight: torch.Tensor,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T`` for fp32 ``x`` [rows, K] (rows <= 16) and an fp32 [N, K] weight with contiguous rows: the
    few-row kernel in fp32 multiply-adds (each program owns BLOCK_N output columns of every row; no tensor cores,
    fp32 stays fp32; ``config``: BLOCK_N, BLOCK_K, warps, default :data:`FP32_ROWS_CONFIG`)."""
    rows, k = x.shape
    n = weight.shape[0]
    if (not 0 < rows <= MAX_ROWS or weight.shape[1] != k or weight.stride(1) != 1
            or x.dtype != torch.float32 or weight.dtype != torch.float32):
        raise ValueError(f"fp32_rows_matmul takes fp32 [1..{MAX_ROWS}, K] rows and an fp32 [N, K] weight with "
                         f"contiguous rows, got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_n, block_k, warps = config or FP32_ROWS_CONFIG
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), 1)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(0), k, 0, out,
        BLOCK_M=max(2, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="fma",
        num_warps=warps, **pdl_args(x))
    return out


# False: layers with a bias keep F.linear (to compare the two in one process)
BIASED = True


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: the kernel when :func:`skinny_eligible` (and a bias, if any, is a plain [N]
    tensor of x's dtype, added to the fp32 sums before they are rounded, as cuBLAS adds it), else torch."""
    if bias is not None and not (BIASED and _plain_bias(bias, x, weight)):
        return F.linear(x, weight, bias)
    if not skinny_eligible(x, weight):
        if bias is None and _fp32_rows(x, weight):
            rows = x.reshape(-1, x.shape[-1])
            return fp32_rows_matmul(rows, weight).view(*x.shape[:-1], weight.shape[0])
        if bias is None and _fp32_transposed(x, weight):
            rows = x.reshape(-1, x.shape[-1])
            return torch.mm(weight, rows.t()).t().contiguous().view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    return skinny_matmul(x.reshape(-1, x.shape[-1]), weight, bias=bias).view(*x.shape[:-1], weight.shape[0])


def _plain_bias(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (type(bias) in (torch.Tensor, torch.nn.Parameter) and bias.shape == (weight.shape[0],)
            and bias.dtype == x.dtype and bias.device == x.device and bias.stride(0) == 1 and not needs_grad(bias))


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())`` (e.g. a router's fp32 logits): for half-precision operands that
    :func:`skinny_eligible` takes, the kernel's fp32 sums of their products (exact in fp32), so the weight is read
    as stored and never cast; the two differ only in the order of the sums."""
    if skinny_eligible(x, weight):
        rows = x.reshape(-1, x.shape[-1])
        return skinny_matmul(rows, weight, out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float())


def _fp32_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an fp32 product of a few rows takes :func:`fp32_rows_matmul` (see FP32_ROWS)."""
    return (FP32_ROWS_KERNEL and _fp32_few_rows(x, weight, FP32_ROWS) and use_triton(x)
            and weight.shape[0] <= FP32_ROWS_MAX_COLUMNS and weight.numel() <= FP32_ROWS_MAX_WEIGHT
            and weight.stride(1) == 1)


def _fp32_few_rows(x: torch.Tensor, weight: torch.Tensor, rows: range) -> bool:
    """fp32 ``x`` of ``rows`` rows and a plain fp32 weight on CUDA, outside autograd (under autograd: exactly the
    module's own product)."""
    return (x.dtype == torch.float32 and x.is_cuda and weight.dtype == torch.float32 and weight.dim() == 2
            and type(weight) in (torch.Tensor, torch.nn.Parameter) and x.dim() > 0 and x.shape[-1] == weight.shape[1]
            and x.numel() // max(1, x.shape[-1]) in rows and not needs_grad(x) and not needs_grad(weight))


def _fp32_transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an fp32 product of a few rows on CUDA takes ``weight @ rows.T`` (see FP32_TRANSPOSED_ROWS)."""
    return _fp32_few_rows(x, weight, FP32_TRANSPOSED_ROWS) and weight.shape[0] <= FP32_TRANSPOSED_MAX_COLUMNS


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None,
                  split_k: int | None = None, out_dtype: torch.dtype | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` by the kernel for ``x`` of [rows <= MAX_KERNEL_ROWS, K] (any float dtype; the launcher
    does not choose, :func:`skinny_linear` does). ``split_k``: parts of K (default :func:`split_k_for`, from the
    weight's shape and ``config``'s tiles). ``out_dtype`` (default x's): the fp32 sums rounded to it, e.g. fp32
    for ``F.linear(x.float(), weight.float())`` of bf16 operands (a router's logits) without casting the weight.
    ``bias`` ([N], contiguous): added to the fp32 sums before they are rounded (in the last part's launch: the
    kernel's, or the sum of the parts)."""
    rows, k = x.shape
    n = weight.shape[0]
    if not 0 < rows <= MAX_KERNEL_ROWS or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"skinny_matmul takes [1..{MAX_KERNEL_ROWS}, K] rows and a [N, K] weight with contiguous "
                         f"rows, got {tuple(x.shape)} and {tuple(weight.shape)} (strides {weight.stride()})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    (block_n, block_k, warps, stages), split, k_per_split = launch_plan(n, k, rows, x.element_size(), config, split_k)
    out_dtype = out_dtype or x.dtype
    out = torch.empty(split, rows, n, dtype=out_dtype if split == 1 else torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, out, rows, n, k, x.stride(0), weight.stride(0), out.stride(1), k_per_split, out.stride(0),
        out if bias is None else bias,
        BLOCK_M=block_rows(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 inputs: no tf32 rounding
        HAS_BIAS=bias is not None and split == 1, **pdl_args(x))
    return out[0] if split == 1 else sum_splits(out, out_dtype, bias)


def launch_plan(n: int, k: int, rows: int, element_size: int = 2, config: tuple[int, int, int, int] | None = None,
                split_k: int | None = None) -> tuple[tuple[int, int, int, int], int, int]:
    """(config, parts of K, K per part) of a launch for ``rows`` rows on an ``[n, k]`` weight. By default the
    weight's shape alone decides the parts (:func:`split_k_for`), and a weight that splits takes one config at every
    row count: a verify row is summed in the parts and tiles of a decode row. An explicit ``config`` splits K as
    its own tiles would (``split_k`` overrides both)."""
    if config is None:
        config = config_for(n, k, rows, element_size)
        split = split_k_for(n, k) if split_k is None else split_k
    else:
        split = split_k_for(n, k, config[0], config[1]) if split_k is None else split_k
    if not (isinstance(split, int) and split >= 1):
        raise ValueError(f"split_k must be a positive int, got {split!r}")
    block_k = config[1]
    k_per_split = _cdiv(_cdiv(k, split), block_k) * block_k  # whole tiles
    return config, _cdiv(k, k_per_split), k_per_split  # no empty part


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through :func:`skinny_linear`, bias included (instance-scoped swap)."""
    return skinny_linear(x, self.weight, self.bias)
