"""A tensor-parallel model's CUDA graphs hold captured NCCL collectives, and NCCL does not tear down a communicator
that live graphs use: ``destroy_process_group`` releases them first (runtime/distributed.py). On fake stores and a
fake destroy (the two-GPU run of the real thing: tests/distributed/test_tensor_parallel_gpu.py)."""

from __future__ import annotations

import gc

import torch.distributed as dist

from hf_specdec.runtime import distributed


class _Store:
    def __init__(self, log: list):
        self.log = log

    def release(self):
        self.log.append("release")


def test_destroy_releases_every_registered_store_first_and_a_dropped_store_drops_out(monkeypatch):
    log = []
    from torch.distributed import distributed_c10d

    def destroy(group=None):
        log.append(("destroy", group))
    for module in (dist, distributed_c10d):  # torch's two names of the function: both wrapped
        monkeypatch.setattr(module, "destroy_process_group", destroy)
    monkeypatch.setattr(distributed, "_STORES_WITH_COLLECTIVES", type(distributed._STORES_WITH_COLLECTIVES)())
    first, second = _Store(log), _Store(log)
    distributed.release_graphs_at_destroy(first)
    distributed.release_graphs_at_destroy(first)  # installed once, registered once
    distributed.release_graphs_at_destroy(second)
    assert dist.destroy_process_group._hf_specdec_releases_graphs
    assert distributed_c10d.destroy_process_group._hf_specdec_releases_graphs
    dist.destroy_process_group("group")
    assert log == ["release", "release", ("destroy", "group")]
    del second
    gc.collect()
    log.clear()
    distributed_c10d.destroy_process_group()
    assert log == ["release", ("destroy", None)]
