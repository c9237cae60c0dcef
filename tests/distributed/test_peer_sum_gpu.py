"""peer_sum between two GPUs (skipped on machines with fewer): two NCCL ranks sum tensors of the sizes a decode or
verify step sums (and odd ones) through ``all_reduce_sum`` with HF_SPECDEC_TP_PEER_SUM on, eagerly and replayed in a
CUDA graph many times (more calls than the slots it takes in turn); every result is NCCL's all-reduce of the same
values, bit for bit, on both ranks. A size past a slot takes NCCL's, and so does every sum of a group whose ranks'
settings differ."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from tests.distributed import tp_worker

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                                reason="needs two GPUs and NCCL")

SIZES = [5376, 1, 4 * 5376, 8 * 8 * 5376, 3000, 2816]  # 31B rows (1, 4, a batch-8 verify of 8), odd, 26B-A4B


def _rank(rank: int, port: int) -> None:
    import os

    os.environ.pop("HF_SPECDEC_TP_PEER_SUM", None)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from hf_specdec.runtime import distributed

        distributed.PEER_SUM = True
        group = dist.group.WORLD
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for i, numel in enumerate(SIZES):
                torch.manual_seed(100 * rank + i)
                x = torch.randn(numel, device="cuda").to(dtype)
                expected = x.clone()
                dist.all_reduce(expected, group=group)
                got = distributed.all_reduce_sum(x.clone(), group)
                assert torch.equal(got, expected), (dtype, numel)
        state = distributed._PEER_STATES[(group.group_name, f"cuda:{rank}")]
        fit = sum(numel * torch.empty((), dtype=dtype).element_size() <= distributed.PEER_SUM_SLOT_BYTES
                  for dtype in (torch.bfloat16, torch.float32, torch.float16) for numel in SIZES)
        assert state is not None and state.calls == fit == 3 * len(SIZES) - 1  # fp32's largest goes to NCCL
        # in a graph: three sums a replay (slots taken at capture), replayed more times than there are slots
        xs = [torch.randn(5376, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        static = [x.clone() for x in xs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs = [distributed.all_reduce_sum(s.clone(), group) for s in static]  # warm-up (eager)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [distributed.all_reduce_sum(s.clone() * 1, group) for s in static]
        for replay in range(9):
            for s in static:
                s.copy_(torch.randn_like(s))
            expected = [s.clone() for s in static]
            for e in expected:
                dist.all_reduce(e, group=group)
            graph.replay()
            for out, e in zip(outs, expected):
                assert torch.equal(out, e), replay
        torch.cuda.synchronize()
        del graph
        calls = state.calls
        big = torch.ones(distributed.PEER_SUM_SLOT_BYTES // 2 + 1, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(distributed.all_reduce_sum(big, group), torch.full_like(big, 2))  # NCCL's
        assert state.calls == calls
        # ranks whose settings differ agree on NCCL's sums (none waits for a peer that never pushes)
        distributed.PEER_SUM = rank == 0
        other = dist.new_group([0, 1])
        x = torch.full((5376,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(distributed.all_reduce_sum(x, other), torch.full_like(x, 3))
        assert distributed._PEER_STATES[(other.group_name, f"cuda:{rank}")] is None
    finally:
        dist.destroy_process_group()


def test_peer_sums_are_nccls_all_reduce_bit_for_bit_eagerly_and_in_graphs():
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(tp_worker._free_port(),), nprocs=2, join=True, start_method="spawn")
