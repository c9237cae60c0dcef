"""nf4_linear: ``x @ dequantize(weight).T`` for a few rows, reading bitsandbytes' packed 4-bit weights directly.

bitsandbytes' ``Linear4bit`` multiplies one row (a decode step at batch 1) with its 4-bit matrix-vector kernel, but
any forward of two or more rows (a verify step, a batch) first writes the whole weight out in the compute dtype and
then runs a dense GEMM: ~4.5 bytes moved per weight instead of ~0.56, so a verify step of k+1 tokens costs 2.3x a
decode step (31B shape, 12 layers, H200) and speculative decoding gains little over plain decoding. This kernel
reads the packed bytes and their scales once for every row of the forward, like :mod:`.fp8_gemm`: each program owns
16 rows (padded) and ``BLOCK_N`` output columns, walks K in ``BLOCK_K`` tiles, dequantizes each weight tile in
registers and multiplies on the tensor cores; more rows take more row tiles.

Format (bitsandbytes ``Params4bit`` with ``quant_type="nf4"``, as transformers' ``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4")`` loads it): the weight ``[N, K]`` flattened row-major, two 4-bit codes per byte (the
even element in the high nibble), ``[N * K / 2, 1]`` uint8; ``absmax`` fp32, one per ``blocksize`` consecutive
elements of the flattened weight; ``code`` the 16 NF4 values. The real weight is ``code[q] * absmax[block]``.
Supported here: NF4 codes, fp32 absmax (no double quantization: ``bnb_4bit_use_double_quant=False``), K a multiple
of the block size. Other layouts (FP4 codes, nested absmax) keep bitsandbytes' own forward.

Numerics (the contract of :func:`nf4_linear_reference`): each weight dequantized in fp32 and rounded to the
activation dtype (what bitsandbytes' dequantization writes), the product accumulated in fp32 and rounded once to the
activation dtype: bitsandbytes' own multi-row product up to the summation order. Every row is computed by a program of
the same shape with the same K order whatever the number of rows, so a row's result does not depend on the batch: a
verify step rounds each token as the one-token decode step does. More than ``MAX_KERNEL_ROWS`` rows (a prefill), fp32
activations and anything autograd tracks take bitsandbytes' own forward.
"""

import torch
import torch.nn.functional as F

from ._dispatch import check, check_same_device, interpreting, needs_grad, tl, triton, use_triton

MAX_ROWS = 16  # rows per program (tl.dot's smallest M)
MAX_KERNEL_ROWS = 128  # more rows (a prefill) take bitsandbytes' own forward
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
CODES = 16


@triton.jit
def _round_to_bf16(values):
    """fp32 values rounded to the nearest bf16 (ties to even), as fp32: the interpreter's fp32 -> bf16 cast
    truncates, a GPU's rounds."""
    bits = values.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _nf4_gemm_kernel(x_ptr, q_ptr, a_ptr, code_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                     QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row tiles of one column block run side by side
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    row_ok = rows < M
    HALF: tl.constexpr = BLOCK_K // 2
    pairs = tl.arange(0, HALF)  # byte j of a K tile holds elements 2j (high nibble) and 2j + 1 (low nibble)
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * (K // 2)
    a_rows = a_ptr + cols.to(tl.int64)[:, None] * (K // QBLOCK)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * pairs
        k_ok = even < K
        w_mask = col_ok[:, None] & k_ok[None, :]
        packed = tl.load(q_rows + (even // 2)[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
        scale = tl.load(a_rows + (even // QBLOCK)[None, :], mask=w_mask, other=0.0)
        x_even = tl.load(x_rows + even[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x_odd = tl.load(x_rows + (even + 1)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # the codes' values (a 64-byte table, served from L1), scaled, rounded to the activation dtype
        w_hi = tl.load(code_ptr + (packed >> 4).to(tl.int32)) * scale
        w_lo = tl.load(code_ptr + (packed & 15).to(tl.int32)) * scale
        if UPCAST:
            acc += tl.dot(x_even.to(tl.float32), tl.trans(_round_to_bf16(w_hi)), input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), tl.trans(_round_to_bf16(w_lo)), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(w_hi.to(x_even.dtype)))
            acc += tl.dot(x_odd, tl.trans(w_lo.to(x_odd.dtype)))
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def config_for(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an NF4 ``[n, k]`` weight."""
    return 32, 256, 4, 3


def nf4_matmul(x: torch.Tensor,  # [rows, K] bf16 / fp16
               packed: torch.Tensor,  # [N * K / 2] or [N * K / 2, 1] uint8
               absmax: torch.Tensor,  # [N * K / blocksize] fp32
               code: torch.Tensor,  # [16] fp32
               n: int, blocksize: int, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ dequantize_nf4(packed, absmax, code, (n, K), blocksize).T`` by the kernel, in ``x.dtype`` ([rows, n])."""
    _check_args(x, packed, absmax, code, n, blocksize)
    rows, k = x.shape
    block_n, block_k, warps, stages = config or config_for(n, k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    upcast = x.dtype == torch.bfloat16 and interpreting(_nf4_gemm_kernel)
    out = torch.empty(rows, n, dtype=torch.float32 if upcast else x.dtype, device=x.device)
    _nf4_gemm_kernel[(triton.cdiv(rows, MAX_ROWS), triton.cdiv(n, block_n))](
        x, packed, absmax, code, out, rows, n, k, x.stride(0), out.stride(0),
        QBLOCK=blocksize, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
        num_warps=warps, num_stages=stages)
    return out.to(x.dtype)


def _check_args(x, packed, absmax, code, n: int, blocksize: int) -> None:
    check(x.dim() == 2 and 0 < x.shape[0] <= MAX_KERNEL_ROWS,
          f"nf4_matmul takes [1..{MAX_KERNEL_ROWS}, K] rows (reshape(-1, K)), got {tuple(x.shape)}")
    check(x.dtype in ACTIVATION_DTYPES, f"activations must be bfloat16 or float16, got {x.dtype}")
    k = x.shape[1]
    check(blocksize >= 2 and blocksize & (blocksize - 1) == 0 and k % blocksize == 0,
          f"K={k} must be a multiple of the blocksize ({blocksize}, a power of two >= 2)")
    check(packed.dtype == torch.uint8 and packed.numel() == n * k // 2 and packed.is_contiguous(),
          f"packed weights must be {n * k // 2} contiguous uint8 (two codes per byte for [{n}, {k}]), got "
          f"{packed.dtype} {tuple(packed.shape)}")
    check(absmax.dtype == torch.float32 and absmax.numel() == n * k // blocksize and absmax.is_contiguous(),
          f"absmax must be {n * k // blocksize} contiguous fp32 (one per {blocksize} weights), got {absmax.dtype} "
          f"{tuple(absmax.shape)}")
    check(code.dtype == torch.float32 and code.numel() == CODES, f"code must be {CODES} fp32 values, got "
          f"{code.dtype} {tuple(code.shape)}")
    check_same_device(x=x, packed=packed, absmax=absmax, code=code)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, int],
                   blocksize: int) -> torch.Tensor:
    """The fp32 weight ``[N, K]``: ``code[q] * absmax[block]`` with the even element of each byte in its high
    nibble."""
    flat = packed.reshape(-1)
    codes = torch.stack([flat >> 4, flat & 15], dim=1).reshape(-1).long()
    return (code.float()[codes] * absmax.float().repeat_interleave(blocksize)).reshape(shape)


def nf4_linear_reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, n: int,
                         blocksize: int) -> torch.Tensor:
    """The contract: the weight dequantized in fp32 and rounded to ``x.dtype``, ``x @ w.T`` accumulated in fp32,
    rounded once to ``x.dtype`` ([..., N])."""
    weight = dequantize_nf4(packed, absmax, code, (n, x.shape[-1]), blocksize).to(x.dtype)
    return F.linear(x.float(), weight.float()).to(x.dtype)


# ---------------------------------------------------------------- bitsandbytes' Linear4bit


def nf4_layout(module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None:
    """(packed, absmax, code, N, blocksize) of a bitsandbytes ``Linear4bit`` whose weights the kernel reads, else
    None (FP4 codes, nested absmax, another storage type, a weight not quantized yet)."""
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or getattr(state, "quant_type", None) != "nf4" or getattr(state, "nested", False):
        return None
    shape = tuple(getattr(state, "shape", ()))
    if len(shape) != 2 or state.code is None or state.absmax is None:
        return None
    n, k = shape
    blocksize = state.blocksize
    if (weight.dtype != torch.uint8 or weight.numel() * 2 != n * k or not weight.is_contiguous()
            or state.absmax.dtype != torch.float32 or state.code.numel() != CODES
            or state.code.dtype != torch.float32 or k % blocksize or blocksize & (blocksize - 1)):
        return None
    return weight, state.absmax, state.code, n, blocksize


def nf4_fusible(module) -> bool:
    """Whether :func:`nf4_linear_forward` may serve ``module``: an NF4 layout the kernel reads, on a device where
    the kernels run."""
    layout = nf4_layout(module)
    return layout is not None and use_triton(layout[0])


def nf4_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``forward`` of bitsandbytes' ``Linear4bit`` with NF4 weights: the kernel for the few rows of decode and verify
    steps in the layer's compute dtype, else the layer's own forward (bitsandbytes' kernels)."""
    layout = nf4_layout(self)
    rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 0
    if (layout is None or not use_triton(x) or x.dtype != getattr(self, "compute_dtype", x.dtype)
            or x.dtype not in ACTIVATION_DTYPES or not 0 < rows <= MAX_KERNEL_ROWS or needs_grad(x)):
        return type(self).forward(self, x)
    packed, absmax, code, n, blocksize = layout
    if x.device != packed.device or x.shape[-1] * n != packed.numel() * 2:
        return type(self).forward(self, x)
    y = nf4_matmul(x.reshape(-1, x.shape[-1]), packed, absmax, code, n, blocksize).view(*x.shape[:-1], n)
    return y if self.bias is None else y + self.bias.to(y.dtype)
