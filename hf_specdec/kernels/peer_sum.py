"""peer_sum: the sum of a small tensor over the ranks of a tensor-parallel group, in one launch that pushes.

A decode or verify step of a tensor-parallel model ends each attention and each MLP in an all-reduce of a few rows of
the hidden size (10.7 KB a row on the 31B). NCCL's all-reduce of that size took ~14.6 us in a CUDA graph on two H200,
and ~6 us more around it: it takes no part in programmatic dependent launch, so the kernel after it cannot be
launched early and it waits for the whole of the one before. Here one launch of a few programs does the exchange over
NVLink, launched early like every kernel of the step (:func:`._dispatch.pdl_wait`):

1. each program reads its block of this rank's values and writes it into every rank's buffer (this rank's own
   included), at this rank's place in the call's slot;
2. after a barrier of the program, it raises its flag on every rank (compare-and-swap 0 -> 1, release, system scope;
   it would spin while that flag were still raised, which the slots below rule out);
3. it waits for the flag of every rank on its own side (compare-and-swap 1 -> 0, acquire, system scope: the flags are
   back to zero after each call);
4. it sums the ranks' blocks in rank order, in fp32, and writes the result: every rank computes the same sum from the
   same values in the same order, so every rank gets the same bits.

The buffers and flags live in memory every rank of the group maps (torch's symmetric memory: runtime/distributed.py
sets it up); the kernel reaches rank p's buffer as a base pointer plus ``rel[p]`` elements (its own buffer and 0 for
itself on GPUs; one tensor holding every rank's buffer in the interpreter's tests). Calls take slots in
turn (``RING`` of them), each program counting its own calls on the device (the same count on every rank, graphs
replayed or not; kept below RING), each program in its own region of a slot whatever its block size: two calls in a
row never share a slot, and a rank writes a program's region of a slot again only after a later call's exchange of
that program, which every rank reaches only once it has read the region, so no write lands on values still to be
read. The calls of a rank must run in order on one stream (each program reads, then writes its count), as a model's
row-parallel sums do. A rank whose peer never arrives (a dead process) spins in the kernel: no watchdog aborts it, as
none aborts NCCL's kernels inside a CUDA graph replay either.

``phase`` splits the launch into its push (steps 1-2) and its wait (3-4) for the interpreter's tests, which run the
ranks one after the other in one process (a rank waiting on a flag no other rank can raise would spin forever).
"""

import torch

from ._dispatch import check, next_power_of_2, pdl_args, pdl_wait, tl, triton

RING = 4  # slots calls take in turn
MAX_PROGRAMS = 64  # programs (flags per rank and slot) a call may take
MAX_WORLD = 8
PUSH, WAIT, BOTH = 1, 2, 3
SUM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _peer_sum_kernel(x_ptr, out_ptr, data_ptr, data_rel_ptr, flag_ptr, flag_rel_ptr, calls_ptr, n,
                     SLOT_STRIDE: tl.constexpr, PROGRAM_STRIDE: tl.constexpr, RANK: tl.constexpr,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, RING: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                     PHASE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    offs = pid * BLOCK + local
    ok = offs < n
    # this program's slot: its own count of calls (kept below RING), the same on every rank (they make the same
    # calls), so two calls in a row never share a slot, whatever graphs and eager calls interleave; and in a slot its
    # own region (PROGRAM_STRIDE values), whatever its block size: a program of the next call, which may run while a
    # peer still reads this one, never writes where another program of this call put its values
    calls = tl.load(calls_ptr + pid)
    slot = calls % RING
    data_base = slot * WORLD * SLOT_STRIDE + pid * PROGRAM_STRIDE + local
    flag_base = slot * MAX_PROGRAMS * WORLD
    if PHASE >= 2:
        tl.store(calls_ptr + pid, (calls + 1) % RING)
    if PHASE % 2 == 1:  # push
        x = tl.load(x_ptr + offs, mask=ok)
        for p in tl.static_range(WORLD):
            rank_data = data_ptr + tl.load(data_rel_ptr + p)
            tl.store(rank_data + data_base + RANK * SLOT_STRIDE, x, mask=ok)
        tl.debug_barrier()  # every thread's writes before the flag's release
        for p in tl.static_range(WORLD):
            flag = flag_ptr + tl.load(flag_rel_ptr + p) + flag_base + pid * WORLD + RANK
            raised = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
            while raised != 0:
                raised = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
    if PHASE >= 2:  # wait, then sum
        own_data = data_ptr + tl.load(data_rel_ptr + RANK)
        own_flags = flag_ptr + tl.load(flag_rel_ptr + RANK)
        for q in tl.static_range(WORLD):
            flag = own_flags + flag_base + pid * WORLD + q
            seen = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
            while seen != 1:
                seen = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            # another GPU wrote these values: read them past the caches
            total += tl.load(own_data + data_base + q * SLOT_STRIDE, mask=ok, other=0.0,
                             cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def block_for(numel: int) -> int:
    """Values per program: at least 1024, and few enough programs for the flags (:data:`MAX_PROGRAMS`)."""
    return max(1024, next_power_of_2(-(-numel // MAX_PROGRAMS)))


def peer_sum(x: torch.Tensor, data: torch.Tensor, data_rel: torch.Tensor, flags: torch.Tensor, flag_rel: torch.Tensor,
             calls: torch.Tensor, rank: int, world: int, slot_numel: int, out: torch.Tensor | None = None,
             phase: int = BOTH) -> torch.Tensor:
    """``x`` summed over the ``world`` ranks whose buffers ``data`` reaches (a base pointer in ``x``'s dtype, rank p's
    buffer ``data_rel[p]`` elements from it: this rank's own buffer with ``data_rel[rank]`` 0 on GPUs) with the flags
    ``flags`` (int32, likewise ``flag_rel``), ``slot_numel`` values per rank and slot, the slot of each program
    taken from its count of calls in ``calls`` (int32, :data:`MAX_PROGRAMS`, this rank's own, zeros at first; the
    wait phase counts the call): into ``out`` (``x`` itself may be ``out``), else a new tensor. Every rank of the
    group must make the same calls in the same order (:mod:`hf_specdec.kernels.peer_sum`)."""
    check(x.is_contiguous() and x.dtype in SUM_DTYPES, f"peer_sum takes a contiguous {SUM_DTYPES} tensor, got "
          f"{x.dtype} (contiguous: {x.is_contiguous()})")
    check(data.dtype == x.dtype and flags.dtype == torch.int32, "peer_sum: data in x's dtype, flags in int32")
    check(1 <= world <= MAX_WORLD and 0 <= rank < world, f"peer_sum: rank {rank} of {world} (at most {MAX_WORLD})")
    check(calls.dtype == torch.int32 and calls.numel() >= MAX_PROGRAMS, "peer_sum: an int32 count of calls per program")
    check(x.numel() <= slot_numel and data.numel() >= RING * world * slot_numel,
          f"peer_sum: {x.numel()} values do not fit a slot of {slot_numel} (buffer {data.numel()})")
    check(data_rel.numel() == world and flag_rel.numel() == world and data_rel.dtype == flag_rel.dtype == torch.int64,
          "peer_sum: one int64 offset per rank for the buffers and the flags")
    block = block_for(x.numel())
    programs = triton.cdiv(x.numel(), block)
    check(block <= slot_numel // MAX_PROGRAMS, f"peer_sum: {x.numel()} values take blocks of {block}, more than a "
          f"program's share of a slot of {slot_numel} ({slot_numel // MAX_PROGRAMS}): give slots of at least "
          f"{block * MAX_PROGRAMS} values")
    check(flags.numel() >= RING * MAX_PROGRAMS * world, "peer_sum: too few flags for the ranks and slots")
    out = torch.empty_like(x) if out is None else out
    _peer_sum_kernel[(programs,)](x, out, data, data_rel, flags, flag_rel, calls, x.numel(), SLOT_STRIDE=slot_numel,
                                  PROGRAM_STRIDE=slot_numel // MAX_PROGRAMS, RANK=rank, WORLD=world, BLOCK=block,
                                  RING=RING, MAX_PROGRAMS=MAX_PROGRAMS, PHASE=phase, num_warps=4, **pdl_args(x))
    return out
