"""The engine under the generation loop: the model runner, the request context handed to drafters, CUDA
graphs (target forwards and drafter calls), asynchronous read-back of device results, and what keeps the ranks
of a tensor-parallel model in step. Knows no model."""

from hf_specdec.runtime.context import RequestContext
from hf_specdec.runtime.cuda_graphs import GraphStore, cuda_graphs_wanted
from hf_specdec.runtime.distributed import RankGroup, tensor_parallel_group
from hf_specdec.runtime.drafter_graphs import DrafterGraphs
from hf_specdec.runtime.model_runner import ModelRunner, Select, check_mask_shape, exhausted, real_token_counts
from hf_specdec.runtime.readback import Readback, ReadbackClock

__all__ = [
    "DrafterGraphs", "GraphStore", "ModelRunner", "RankGroup", "Readback", "ReadbackClock", "RequestContext", "Select",
    "check_mask_shape", "cuda_graphs_wanted", "exhausted", "real_token_counts", "tensor_parallel_group",
]
