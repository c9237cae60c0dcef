"""Tensor parallelism: a model that transformers sharded over several processes (``from_pretrained(...,
tp_plan="auto")`` under ``torchrun``) decodes through hf_specdec on every rank of its group at once.

transformers shards the weights (DTensors) and wraps the sharded projections' forwards with their collectives;
every rank runs the same hf_specdec loop over the same rows, and this module keeps the ranks in step:

- **KV heads.** A column-parallel key projection gives each rank a contiguous slice of every layer's KV heads,
  so each rank's paged cache holds only those: :func:`local_kv_layout` derives the layout's head counts from the
  local shard of each layer's key projection. A layer whose KV heads do not split evenly is refused by name.
- **Drafters** stay replicated (loaded without ``tp_plan``): a DFlash drafter reads the target's hidden states,
  which are replicated after each row-parallel reduction, and the target's LM head, which gathers its output.
  A drafter that queries the target's sharded pages with its own query heads (Gemma 4's MTP assistant, through
  ``paged_query_attention``) attends with the query heads matching this rank's KV heads
  (:meth:`RankGroup.local_heads`) and gathers every rank's output heads (:meth:`RankGroup.gather_heads`): one
  all-gather of ``[batch, heads, head_dim]`` per assistant layer and draft step.
- **Tokens.** What a rank draws at random (a sampled token, a sampled draft, a rejection-sampling decision) and
  every round's drafts are broadcast from the group's rank 0 (:meth:`RankGroup.broadcast`), so every rank feeds
  the same ids to the next sharded forward and commits the same tokens. Greedy choices of the target are
  argmaxes of logits that are equal on every rank (the LM head gathers them), so they need none.
- **Cache sizes.** Each rank sizes its caches from the smallest memory budget of the group
  (:meth:`RankGroup.smallest`): the ranks allocate alike, so none runs out of blocks (and stops) alone while the
  others wait in a collective.

- **CUDA graphs.** Every rank captures the same decode and verify forwards (and drafter calls) and replays them in
  step; transformers' NCCL all-reduces are captured inside them. NCCL cannot tear down a communicator that live
  graphs still use (``destroy_process_group`` hung), so while any such graph lives,
  ``torch.distributed.destroy_process_group`` first drops the graphs of every enabled tensor-parallel model
  (:func:`release_graphs_at_destroy`; the next ``generate`` captures anew).

- **Fused forwards on the shards** (``HF_SPECDEC_TP_FUSED=0``, generation/enable.py, keeps transformers' forwards).
  The fused decoder layers, attention, MLPs and norms call the projections as modules. A projection that
  transformers wrapped with its plain column- or row-parallel style gets :func:`sharded_linear_forward` (its
  inference path with the local product on ``skinny_linear``); column-parallel shards of one input are stacked
  (:func:`stack_column_shards`) and run as one GEMM. An LM head that gathers its outputs runs its shard on the same
  GEMM and gathers the logits itself (:func:`gather_columns`), and an embedding split by vocabulary rows looks up
  its rows without the DTensor dispatch (:func:`sharded_embedding_forward`), both summed through peer_sum where the
  output fits its slot. Other styles, and experts modules, keep transformers' forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from hf_specdec.cache import KVLayout
from hf_specdec.kernels import peer_sum as peer_sum_kernel
from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV, HAS_TRITON, on_gpu
from hf_specdec.kernels.skinny_gemm import skinny_linear
from hf_specdec.kernels.stacked_linear import LOCAL_WEIGHT, adjacent, local_tensor, move_into_one_storage

_NO_BOUND = 2**62  # stands for "no memory bound" in the group's minimum


@dataclass(frozen=True)
class RankGroup:
    """The ranks that hold one tensor-parallel model's shards and run the same steps."""

    group: "dist.ProcessGroup"
    rank: int  # within the group
    size: int
    source: int  # global rank of the group's rank 0: what it draws, every rank uses
    device: torch.device  # where the collectives' tensors live (the model's device)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` with rank 0's values on every rank (in place when contiguous)."""
        out = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.broadcast(out, src=self.source, group=self.group)
        if out is not tensor:
            tensor.copy_(out)
        return tensor

    def smallest(self, value: int | None) -> int | None:
        """The smallest ``value`` over the group (None: no bound, larger than any number)."""
        mine = torch.tensor([_NO_BOUND if value is None else value], dtype=torch.int64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group)
        smallest = int(mine.item())
        return None if smallest == _NO_BOUND else smallest

    def local_heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous share of the heads on axis ``dim`` of ``x`` (the query heads that read this rank's
        KV heads: a column-parallel projection gives rank r heads ``[r * n / size, (r + 1) * n / size)``)."""
        heads = x.shape[dim]
        if heads % self.size:
            raise ValueError(f"{heads} query heads do not split over the {self.size} ranks of the tensor-parallel "
                             "group; the drafter's heads must be a multiple of the group size.")
        share = heads // self.size
        return x.narrow(dim, self.rank * share, share)

    def gather_heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's :meth:`local_heads` output, concatenated in rank order on axis ``dim``."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def tensor_parallel_group(model: torch.nn.Module) -> RankGroup | None:
    """The group ``model``'s weights are sharded over, or None when it is not tensor-parallel (a single process,
    or a process group whose model was loaded without ``tp_plan``)."""
    if not (dist.is_available() and dist.is_initialized()) or (getattr(model, "_tp_size", None) or 1) <= 1:
        return None
    mesh = _sharding_mesh(model)
    if mesh is None:
        return None
    group = mesh.get_group()
    return RankGroup(group, mesh.get_local_rank(), mesh.size(), dist.get_global_rank(group, 0),
                     next(model.parameters()).device)


def _sharding_mesh(model: torch.nn.Module):
    """The one-dimensional device mesh of the model's sharded parameters, or None."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.device_mesh.size() > 1:
            return param.device_mesh
    return None


def holds_shards(module: torch.nn.Module) -> bool:
    """Whether a parameter of ``module`` itself (not of its submodules) is a DTensor: a projection or experts
    module that a tensor-parallel plan sharded, whose forward transformers wrapped to read the shards."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters(recurse=False))


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (sharded or placed by a tensor-parallel plan)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


# Names transformers' models give the projection whose output holds a layer's keys (fused ones included).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def key_head_splits(model: torch.nn.Module) -> dict[int, int]:
    """Layer index -> over how many ranks the layer's key heads are split (layers whose key projection is a
    column-parallel DTensor; layers absent keep all their heads). Attention modules are found by their
    ``layer_idx`` (what transformers' attention modules, and hf_specdec's paged attention, key layers by)."""
    if not dist.is_available():
        return {}
    from torch.distributed.tensor import DTensor, Shard

    splits = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            continue
        for name in _KEY_PROJECTIONS:
            weight = getattr(getattr(module, name, None), "weight", None)
            if isinstance(weight, DTensor):
                rows = weight.ndim - 2  # the output features of a [out, in] weight
                if any(isinstance(p, Shard) and p.dim in (rows, -2) for p in weight.placements):
                    splits[layer_idx] = weight.device_mesh.size()
    return splits


def local_kv_layout(model: torch.nn.Module, layout: KVLayout) -> KVLayout:
    """``layout`` with each KV group's head count reduced to this rank's share: the heads of the layers that
    ``model``'s column-parallel key projections split (unchanged for a model that is not sharded). Raises a
    ``ValueError`` naming the fix for heads that do not split evenly, or layers of one group split differently."""
    splits = key_head_splits(model)
    if not splits:
        return layout
    groups = []
    for group in layout.groups:
        ways = {splits.get(layer, 1) for layer in group.layers}
        if len(ways) > 1:
            raise ValueError(f"layers {list(group.layers)} share one KV group but their key projections are split "
                             f"over different numbers of ranks ({sorted(ways)}); shard them alike in the tp_plan.")
        split = ways.pop()
        if group.num_kv_heads % split:
            layer = group.layers[0]
            raise ValueError(
                f"layer {layer} has {group.num_kv_heads} KV heads, which do not split over the {split} ranks of the "
                f"tensor-parallel group: every rank must hold whole KV heads. Run with a tensor-parallel size that "
                f"divides every layer's KV-head count (at most {group.num_kv_heads} here), or load the model with a "
                f"tp_plan that keeps the attention projections replicated "
                f"(hf_specdec.runtime.distributed.replicated_attention_plan(type(model)) gives one)."
            )
        groups.append(dataclasses.replace(group, num_kv_heads=group.num_kv_heads // split))
    return KVLayout(groups=groups, layer_slot=dict(layout.layer_slot), producer=dict(layout.producer))


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def replicated_attention_plan(causal_lm_class) -> dict[str, str]:
    """A tp_plan for ``causal_lm_class`` (a transformers causal LM class) that keeps the attention projections whole on
    every rank: the fix for KV heads the group size does not divide. Where transformers merges a given plan into the
    model's own and has the style "replicate" (5.24), an override of those projections with it; else (5.17, which
    replaces the model's plan with the given one and has no such style) the model's own plan without them. Pass it
    as ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, tp_plan=plan))``."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    own = {f"model.{key}": style for key, style in (causal_lm_class.config_class.base_model_tp_plan or {}).items()}
    own |= getattr(causal_lm_class, "_tp_plan", None) or {}
    attention = {key for key in own if key.rsplit(".", 1)[-1] in ATTENTION_PROJECTIONS}
    if "replicate" in ALL_PARALLEL_STYLES:
        return dict.fromkeys(attention, "replicate")
    return {key: style for key, style in own.items() if key not in attention}


def check_replicated(module: torch.nn.Module, role: str) -> None:
    """Refuse a drafter loaded with a tensor-parallel plan: drafters run replicated on every rank."""
    if is_sharded(module):
        raise ValueError(f"the {role} is sharded (loaded with tp_plan), but hf_specdec runs drafters replicated on "
                         f"every rank of the target's tensor-parallel group; load it without tp_plan (and with "
                         f"device_map set to this rank's device).")


# ---------------------------------------------------------------- sharded projections on the few-row GEMM


COLUMN, ROW, GATHER = "column", "row", "gather"


def _tp_style(module: torch.nn.Module):
    """The tensor-parallel style whose wrapper is ``module``'s forward (transformers 5.17 through 5.24 install
    ``tp_forward(*args, **kwargs)``, closing over the style, as the instance's ``forward``), or None."""
    forward = vars(module).get("forward")
    if getattr(forward, "__name__", None) != "tp_forward" or not getattr(forward, "__closure__", None):
        return None
    return dict(zip(forward.__code__.co_freevars, (cell.cell_contents for cell in forward.__closure__))).get("self")


def local_linear_kind(module: torch.nn.Module) -> str | None:
    """:data:`COLUMN` or :data:`ROW` for a bias-free ``nn.Linear`` whose forward transformers' tensor-parallel plan
    wrapped with its plain column-parallel style (replicated input, this rank's slice of the outputs kept local:
    "colwise") or its plain row-parallel style (this rank's slice of the inputs, outputs summed over the group:
    "rowwise"); :data:`GATHER` for a column-parallel one that gathers its outputs ("colwise_gather_output": an LM
    head, its rows split as Shard(0) splits them, :func:`row_shard`); None for any other module or style (a
    packed or quantized projection), which keeps transformers' forward."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    try:
        from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel
    except ImportError:  # pragma: no cover - every supported version has them
        return None
    if (type(module) is not torch.nn.Linear or module.bias is not None or not isinstance(module.weight, DTensor)
            or module.weight.device_mesh.ndim != 1):
        return None
    style = _tp_style(module)
    last = lambda layout: isinstance(layout, Shard) and layout.dim == -1  # noqa: E731
    if type(style) is ColwiseParallel and style.use_local_output and isinstance(style.input_layouts, Replicate):
        if last(style.output_layouts):
            return COLUMN
        if isinstance(style.output_layouts, Replicate) and row_shard(module.weight) is not None:
            return GATHER
    if (type(style) is RowwiseParallel and style.use_local_output and last(style.input_layouts)
            and isinstance(style.output_layouts, Replicate)):
        return ROW
    return None


def row_shard(weight) -> tuple[int, int] | None:
    """(first row, rows) of this rank's shard of a DTensor ``weight`` split on its first axis over a one-dimensional
    mesh, as ``Shard(0)`` splits it (torch's own rule); None for any other placement, and where some rank would hold
    no row (a table smaller than the group: every rank decides alike, from the global shape). A local shard of
    another size than the rule gives is refused with an error (the ranks would otherwise disagree)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    if (not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or len(weight.placements) != 1
            or not isinstance(weight.placements[0], Shard) or weight.placements[0].dim not in (0, -weight.ndim)):
        return None
    total, ranks, rank = weight.shape[0], weight.device_mesh.size(), weight.device_mesh.get_local_rank()
    shares = [_shard_size_and_offset(total, ranks, r) for r in range(ranks)]
    if any(rows == 0 for rows, _ in shares):
        return None
    rows, first = shares[rank]
    if weight.to_local().shape[0] != rows:
        raise ValueError(f"this rank's shard of a [{total}, ...] weight has {weight.to_local().shape[0]} rows where "
                         f"Shard(0) over {ranks} ranks gives {rows}; hf_specdec cannot place its rows (run with "
                         f"HF_SPECDEC_TP_FUSED=0 to keep transformers' forwards)")
    return first, rows


def _shard_size_and_offset(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """(rows, first row) of ``rank``'s share of ``total`` rows under ``Shard(0)``: torch's rule where it names it,
    else torch.chunk's (the first ranks take ``ceil(total / ranks)`` rows each)."""
    from torch.distributed.tensor.placement_types import Shard

    rule = getattr(Shard, "local_shard_size_and_offset", None) or getattr(Shard, "_local_shard_size_and_offset", None)
    if rule is not None:
        rows, first = rule(total, ranks, rank)
        return int(rows), int(first)
    chunk = -(-total // ranks)
    first = min(rank * chunk, total)
    return max(0, min(chunk, total - first)), first


def sharded_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The forward of a projection :func:`local_linear_kind` accepts: transformers' own inference path (the local
    input times the local shard; a row-parallel one then summed over the group by one all-reduce, a gathering one's
    outputs gathered: :func:`gather_columns`), with the product on :func:`skinny_linear` (the decode and verify steps'
    few rows stream the shard faster than cuBLAS does). Under autograd, or for a DTensor input, transformers' wrapper
    runs."""
    if torch.is_grad_enabled() or type(x) is not torch.Tensor:
        return vars(self)[TP_FORWARD](x)
    out = skinny_linear(x, local_tensor(self.weight))
    kind = vars(self)[SHARD_KIND]
    if kind == ROW:
        return all_reduce_sum(out, self.weight.device_mesh.get_group())
    if kind == GATHER:
        first, _ = vars(self)[ROW_SHARD]
        return gather_columns(out, first, self.out_features, self.weight.device_mesh.get_group())
    return out


# (all_gather_single from torch 2.13, where all_gather_into_tensor is deprecated)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_columns(local: torch.Tensor, first: int, width: int, group) -> torch.Tensor:
    """Every rank's ``local`` (this rank's columns ``[first, first + local.shape[-1])`` of an output ``width`` wide,
    split as ``Shard(0)`` splits it), gathered along the last axis in rank order. Where the whole output fits
    peer_sum's slot, each rank places its columns in zeros and the ranks sum (one early launch: an LM head's logits at
    batch 1); else one all-gather where the columns split evenly, or the same sum through NCCL."""
    ranks = dist.get_world_size(group)
    shape = (*local.shape[:-1], width)
    if _peer_sum_state(local.device, local.dtype, local.numel() // max(1, local.shape[-1]) * width, group) is None \
            and width % ranks == 0:
        parts = local.new_empty(ranks * local.numel())
        _all_gather_flat(parts, local.reshape(-1), group=group)
        return torch.movedim(parts.view(ranks, *local.shape), 0, -2).reshape(shape)
    full = local.new_zeros(shape)
    full[..., first:first + local.shape[-1]] = local
    return all_reduce_sum(full, group)


# where a gathering projection or a vocabulary-parallel embedding keeps its rows' place: (first row, rows) of its shard
ROW_SHARD = "_hf_specdec_row_shard"


def vocab_parallel_embedding(module: torch.nn.Module) -> tuple[int, int] | None:
    """(first row, rows) for an ``nn.Embedding`` whose table transformers' plan split by vocabulary rows (``Shard(0)``,
    a tied LM head's or "embedding_rowwise") and whose forward its wrapper sums over the group (transformers 5.17's
    row-parallel style, 5.24's embedding style); None for any other (a table split by columns, a max_norm
    renormalising rows in place)."""
    from torch.distributed.tensor.placement_types import Replicate

    if not isinstance(module, torch.nn.Embedding) or module.max_norm is not None:
        return None
    style = _tp_style(module)
    name = type(style).__name__
    if not getattr(style, "use_local_output", False) or not (
            (name == "EmbeddingParallel" and getattr(style, "shard_dim", None) == 0)
            or (name == "RowwiseParallel" and isinstance(getattr(style, "input_layouts", None), Replicate)
                and isinstance(getattr(style, "output_layouts", None), Replicate))):
        return None
    return row_shard(module.weight)


def install_sharded_embedding(module: torch.nn.Module) -> bool:
    """Give an embedding :func:`vocab_parallel_embedding` accepts :func:`sharded_embedding_forward` (instance-scoped;
    undone by :func:`remove_sharded_forward`); returns whether it has it now."""
    if TP_FORWARD in vars(module):
        return True
    shard = vocab_parallel_embedding(module)
    if shard is None:
        return False
    vars(module)[ROW_SHARD] = shard
    _replace_forward(module, sharded_embedding_forward)
    return True


def _replace_forward(module: torch.nn.Module, forward) -> None:
    """Give ``module`` ``forward`` (instance-scoped), keeping transformers' wrapper (:data:`TP_FORWARD`)."""
    import types

    vars(module)[TP_FORWARD] = module.forward
    module.forward = types.MethodType(forward, module)


def sharded_embedding_forward(self, ids: torch.Tensor) -> torch.Tensor:
    """A vocabulary-parallel lookup as transformers' wrapper computes it (each rank looks up the ids of its rows, in
    the module's own forward with its local table, zeros for the others, and the ranks sum), without the DTensor
    dispatch, the sum through :func:`all_reduce_sum` (peer_sum's early launch on GPUs). An id outside the vocabulary
    is on no rank's rows: its vector is zeros (no check on the device, which would wait for the GPU). Under
    autograd, or for a DTensor input, transformers' wrapper runs."""
    if torch.is_grad_enabled() or type(ids) is not torch.Tensor:
        return vars(self)[TP_FORWARD](ids)
    first, rows = vars(self)[ROW_SHARD]
    local_ids = ids - first
    outside = (local_ids < 0) | (local_ids >= rows)
    # padding_idx only shapes gradients (none here), and a global one may lie past the local table, which F.embedding
    # refuses
    padding_idx, self.padding_idx = self.padding_idx, None
    try:
        with _local_parameters(self):
            out = type(self).forward(self, local_ids.masked_fill(outside, 0))
    finally:
        self.padding_idx = padding_idx
    return all_reduce_sum(out.masked_fill(outside.unsqueeze(-1), 0), self.weight.device_mesh.get_group())


# A decode or verify step's row-parallel sums (and the packed experts' sums, _AllReduceSum) are small (rows x hidden):
# NCCL's ring all-reduce took 14.6 us a call in a CUDA graph on two H200 (5376 bf16 values), a one-shot all-reduce
# over symmetric memory (torch's
# ``symm_mem.one_shot_all_reduce_copy``: every rank reads its peers' buffers over NVLink and sums them in rank order)
# 6.2 us, with the same values (scratch probe, not kept). HF_SPECDEC_TP_SYMM_ALL_REDUCE=1 (read at import) sends
# bf16 and fp32 sums (the op's dtypes) of at most SYMM_MAX_BYTES through it; anything else, and any group where
# symmetric memory cannot be set up on every rank, takes NCCL's. Off: end to end it gained nothing (31B cut to 12
# layers, two H200, batch 1: 1.48x one GPU against NCCL's 1.46x; docs/perf_log.md, session 46): its kernels take no
# programmatic dependent launch either, and wait on a barrier each call.
# peer_sum (below, on by default) takes every sum this could: it runs only with HF_SPECDEC_TP_PEER_SUM=0.
SYMM_ALL_REDUCE = os.environ.get("HF_SPECDEC_TP_SYMM_ALL_REDUCE", "0") == "1"
SYMM_MAX_BYTES = 1 << 20
SYMM_DTYPES = (torch.bfloat16, torch.float32)
_SYMM_BUFFERS: dict = {}  # (group name, device, dtype) -> the rank's symmetric buffer, or None where it failed


# Sums of at most PEER_SUM_SLOT_BYTES (bf16, fp16 or fp32, contiguous, CUDA, a group of at most 8 ranks) go through
# kernels/peer_sum.py: one launch that pushes this rank's values into every rank's symmetric buffer over NVLink, raises
# a flag on each, waits for theirs and sums in rank order, launched early as the step's other kernels are (NCCL's
# kernel is not: ~6 us of launch gap around each of its ~14.6 us calls). On (HF_SPECDEC_TP_PEER_SUM=0, read at
# import, keeps NCCL's): 31B cut to 12 layers on two H200, batch 1, 1.569x one GPU against NCCL's 1.507x in one call,
# batch 4 1.661x against 1.577x (docs/perf_log.md, session 47); every rank's first eligible sum asks the others
# whether all want it and could set it up (one small all-reduce, whatever the setting), else all take NCCL's.
PEER_SUM = os.environ.get("HF_SPECDEC_TP_PEER_SUM", "1") == "1"
PEER_SUM_ASKED = "HF_SPECDEC_TP_PEER_SUM" in os.environ  # warned where set and unavailable (else NCCL's, quietly)
PEER_SUM_SLOT_BYTES = 1 << 20
_PEER_STATES: dict = {}  # (group name, device) -> _PeerState, or None where symmetric memory failed on some rank


@dataclass
class _PeerState:
    """A group's symmetric buffers for :func:`peer_sum_kernel.peer_sum` on this rank: ``data`` (bytes, RING slots of
    ``world`` parts of PEER_SUM_SLOT_BYTES) and ``flags`` (int32, down), the peers' byte distances from this rank's
    (``data_bytes``, ``flag_rel`` in flags), each program's count of calls on the device (``counts``, which picks its
    slot), and the calls launched from here (graph replays not counted)."""

    data: torch.Tensor
    flags: torch.Tensor
    data_bytes: list[int]
    flag_rel: torch.Tensor
    counts: torch.Tensor
    rank: int
    world: int
    calls: int = 0
    views: dict = dataclasses.field(default_factory=dict)

    def data_as(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer as ``dtype`` and the peers' offsets in its elements (made once per dtype)."""
        if dtype not in self.views:
            size = torch.empty((), dtype=dtype).element_size()
            rel = torch.tensor([b // size for b in self.data_bytes], dtype=torch.int64, device=self.data.device)
            self.views[dtype] = (self.data.view(dtype), rel)
        return self.views[dtype]


def _peer_sum_state(device: torch.device, dtype: torch.dtype, numel: int, group) -> _PeerState | None:
    """The group's peer_sum state where a sum of ``numel`` contiguous values of ``dtype`` on ``device`` takes peer_sum,
    else None. Every rank asks (whatever its own setting): the ranks agree once per group whether peer_sum runs, and
    which sums take it depends only on what is summed, the same on every rank."""
    if (device.type == "cuda" and dtype in peer_sum_kernel.SUM_DTYPES
            and numel * dtype.itemsize <= PEER_SUM_SLOT_BYTES):
        return _peer_state(group, device)
    return None


def all_reduce_sum(out: torch.Tensor, group) -> torch.Tensor:
    """``out`` summed over ``group`` (in place through NCCL or :data:`PEER_SUM`'s launch, or a new tensor from the
    symmetric-memory one-shot all-reduce: see SYMM_ALL_REDUCE)."""
    if out.is_cuda and out.is_contiguous():
        state = _peer_sum_state(out.device, out.dtype, out.numel(), group)
        if state is not None:
            data, rel = state.data_as(out.dtype)
            state.calls += 1
            flat = out.view(-1)
            with on_gpu(out.device):  # (the kernel launches on the current GPU)
                peer_sum_kernel.peer_sum(flat, data, rel, state.flags, state.flag_rel, state.counts, state.rank,
                                         state.world, PEER_SUM_SLOT_BYTES // out.element_size(), out=flat)
            return out
    if (SYMM_ALL_REDUCE and out.is_cuda and out.dtype in SYMM_DTYPES and out.is_contiguous()
            and out.numel() * out.element_size() <= SYMM_MAX_BYTES):
        buffer = _symmetric_buffer(group, out.device, out.dtype)
        if buffer is not None:
            # the op takes a symmetric buffer of the input's size: the buffer's first elements (its own address)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[:out.numel()], out.view(-1), "sum",
                                                               group.group_name).view(out.shape)
    dist.all_reduce(out, group=group)
    return out


def _symmetric_buffer(group, device: torch.device, dtype: torch.dtype):
    """This rank's symmetric buffer of SYMM_MAX_BYTES for ``group``, or None where symmetric memory is not available
    on every rank of it (they agree, so that all take the same kind of all-reduce). Set up once per group, device and
    dtype, a collective: every rank of a tensor-parallel model reaches it at the same eager forward (a graph's warm-up
    runs before its capture)."""
    key = (group.group_name, str(device), dtype)
    if key not in _SYMM_BUFFERS:
        buffer, error = None, None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(SYMM_MAX_BYTES // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                    device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as failure:  # noqa: BLE001 - any failure: this rank says so, and the group keeps NCCL's
            buffer, error = None, failure
        _SYMM_BUFFERS[key] = _agreed(buffer, error, group, device)
    return _SYMM_BUFFERS[key]


def _agreed(value, error, group, device: torch.device, warn: bool = True):
    """``value`` where every rank of ``group`` set up its symmetric memory (each says whether it did: an all-reduce of
    a flag, so that none waits in an exchange another rank does not join), else None, with a warning (``warn``: this
    rank asked for it)."""
    ready = torch.tensor([0 if value is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
    if int(ready.item()):
        return value
    if not warn:
        return None
    import warnings

    warnings.warn(f"hf_specdec: symmetric memory is not available on every rank ({error or 'another rank'})"
                  f"; tensor-parallel sums take NCCL's all-reduce", stacklevel=4)
    return None


def _forget_symmetric_buffers(group=None) -> None:
    """Drop the symmetric buffers of ``group`` (None: of every group), which is being destroyed: a later group of the
    same name sets up its own."""
    name = None if group is None else getattr(group, "group_name", None)
    for buffers in (_SYMM_BUFFERS, _PEER_STATES):
        for key in [key for key in buffers if name is None or key[0] == name]:
            del buffers[key]


def _peer_state(group, device: torch.device) -> _PeerState | None:
    """This rank's :class:`_PeerState` for ``group`` on ``device``, or None where not every rank of it wants
    peer_sum (:data:`PEER_SUM`, kernels that run) and can set it up. A collective the first time, on every rank
    whatever its setting (so that ranks whose settings differ all take NCCL's sums rather than wait for each other):
    the ranks agree after allocating the buffers and again after mapping each other's (``rendezvous``, which waits
    for every rank), so none waits in a step another rank left. Under a CUDA graph capture (every rank captures the
    same forwards) a group not yet set up takes NCCL's sums for that capture."""
    key = (group.group_name, str(device))
    if key in _PEER_STATES:
        return _PEER_STATES[key]
    if torch.cuda.is_current_stream_capturing():
        return None
    state, error, buffers = None, None, None
    ring, programs = peer_sum_kernel.RING, peer_sum_kernel.MAX_PROGRAMS
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if PEER_SUM and HAS_TRITON and os.environ.get(FORCE_TRITON_ENV) != "0":
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if world > peer_sum_kernel.MAX_WORLD:
                raise ValueError(f"{world} ranks (peer_sum takes at most {peer_sum_kernel.MAX_WORLD})")
            data = symm_mem.empty(ring * world * PEER_SUM_SLOT_BYTES, dtype=torch.uint8, device=device)
            flags = symm_mem.empty(ring * programs * world, dtype=torch.int32, device=device)
            flags.zero_()  # down; the agreements below order it before any rank's first push
            buffers = (symm_mem, data, flags)
        except Exception as failure:  # noqa: BLE001 - any failure: this rank says so, and the group keeps NCCL's
            error = failure
    buffers = _agreed(buffers, error, group, device, warn=PEER_SUM and PEER_SUM_ASKED)
    if buffers is not None:
        symm_mem, data, flags = buffers
        try:
            data_ptrs = list(symm_mem.rendezvous(data, group.group_name).buffer_ptrs)
            flag_ptrs = list(symm_mem.rendezvous(flags, group.group_name).buffer_ptrs)
            if any((p - data_ptrs[rank]) % 4 or (f - flag_ptrs[rank]) % 4 for p, f in zip(data_ptrs, flag_ptrs)):
                raise ValueError("symmetric buffers not 4-byte aligned to each other")
            flag_rel = torch.tensor([(f - flag_ptrs[rank]) // 4 for f in flag_ptrs], dtype=torch.int64, device=device)
            counts = torch.zeros(programs, dtype=torch.int32, device=device)
            state = _PeerState(data, flags, [p - data_ptrs[rank] for p in data_ptrs], flag_rel, counts, rank, world)
        except Exception as failure:  # noqa: BLE001 - as above
            error = failure
        state = _agreed(state, error, group, device, warn=PEER_SUM and PEER_SUM_ASKED)
    _PEER_STATES[key] = state
    return state


# where the sharded projections (and embeddings) keep transformers' wrapper, and the projections their kind
TP_FORWARD, SHARD_KIND = "_hf_specdec_tp_forward", "_hf_specdec_shard_kind"


def install_sharded_linear(module: torch.nn.Module) -> bool:
    """Give a projection :func:`local_linear_kind` accepts :func:`sharded_linear_forward` (instance-scoped; undone
    by :func:`remove_sharded_forward`); returns whether it has it now. A column-parallel one is also marked as one
    whose local shard stacked projections read (``stacked_linear.LOCAL_WEIGHT``): q/k/v or gate/up shards stacked by
    :func:`stack_column_shards` run as one GEMM."""
    if TP_FORWARD in vars(module):
        return True
    kind = local_linear_kind(module)
    if kind is None:
        return False
    vars(module)[SHARD_KIND] = kind
    if kind == GATHER:
        vars(module)[ROW_SHARD] = row_shard(module.weight)
    _replace_forward(module, sharded_linear_forward)
    if kind == COLUMN:
        vars(module)[LOCAL_WEIGHT] = True
    return True


def remove_sharded_forward(module: torch.nn.Module) -> None:
    """Give the projection or embedding transformers' wrapper back (no-op where :func:`install_sharded_linear` or
    :func:`install_sharded_embedding` did not run)."""
    if TP_FORWARD in vars(module):
        module.forward = vars(module).pop(TP_FORWARD)
        for key in (SHARD_KIND, LOCAL_WEIGHT, ROW_SHARD):
            vars(module).pop(key, None)


def stack_column_shards(*linears: torch.nn.Module) -> bool:
    """Move the local shards of column-parallel projections of one input (q/k/v, gate/up) into one storage, back to
    back (``stacked_linear.move_into_one_storage``), so that the fused forwards' stacked projections run them as one
    GEMM, as they do unsharded weights; returns whether they are stacked. Others are left as they are; shards already
    stacked are not moved again (graphs captured since read them where they are)."""
    kinds = [vars(m).get(SHARD_KIND) or local_linear_kind(m) for m in linears]
    if not linears or any(kind != COLUMN for kind in kinds):
        return False
    shards = [local_tensor(m.weight) for m in linears]
    return adjacent(shards) is not None or move_into_one_storage(shards)


# ---------------------------------------------------------------- a tensor-parallel style for packed experts


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in the forward; the gradient of the replicated sum passes through unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        out = all_reduce_sum(x, group)  # in place through NCCL, or a new tensor through symmetric memory
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@contextlib.contextmanager
def _local_parameters(module: torch.nn.Module):
    """While open, every DTensor parameter of ``module`` and of its submodules is its local shard."""
    from torch.distributed.tensor import DTensor

    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if isinstance(param, DTensor):
                owner._parameters[name] = param.to_local()
                swapped.append((owner, name, param))
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


LOCAL_SHARDS_ALL_REDUCE = "local_shards_all_reduce"


def register_parallel_styles() -> None:
    """Register hf_specdec's tensor-parallel styles with transformers (idempotent), so a model's ``tp_plan`` may
    name them:

    ``"local_shards_all_reduce"``: for a module whose forward reads the weights of its submodules directly (e.g.
    packed experts ``[num_experts, out, in]`` handed to one fused kernel) and whose output is a sum over the
    sharded dimension: its forward runs on the local shards of every descendant parameter (shard them with
    ``colwise`` / ``rowwise`` entries for those parameters) and its output is summed over the group.
    """
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

    if LOCAL_SHARDS_ALL_REDUCE in ALL_PARALLEL_STYLES:
        return

    class LocalShardsAllReduce(TensorParallelLayer):
        def context_around_forward(self, module, mesh):
            return _local_parameters(module)

        def transform_output_post_forward(self, module, output, mesh):
            return _AllReduceSum.apply(output, mesh.get_group())

    ALL_PARALLEL_STYLES.register(LOCAL_SHARDS_ALL_REDUCE, LocalShardsAllReduce())


# ---------------------------------------------------------------- graphs with collectives inside


_STORES_WITH_COLLECTIVES: "weakref.WeakSet" = weakref.WeakSet()
_STORES_LOCK = threading.Lock()


def release_graphs_at_destroy(store) -> None:
    """Have ``torch.distributed.destroy_process_group`` release ``store``'s graphs (a ``GraphStore`` of a
    tensor-parallel model, whose graphs hold captured NCCL collectives) before it destroys a group: NCCL does not
    tear down a communicator that live graphs use (the call hung). Installed once (under both names torch gives the
    function), for every such store; a store whose model is gone drops out by itself."""
    with _STORES_LOCK:
        _STORES_WITH_COLLECTIVES.add(store)
        for module in (dist, distributed_c10d):
            if not getattr(module.destroy_process_group, "_hf_specdec_releases_graphs", False):
                module.destroy_process_group = _releasing_graphs(module.destroy_process_group)


def _releasing_graphs(destroy):
    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        with _STORES_LOCK:
            stores = list(_STORES_WITH_COLLECTIVES)
        for store in stores:
            store.release()
        if stores and torch.cuda.is_available():
            import gc

            gc.collect()  # (a graph kept alive by a reference cycle)
            torch.cuda.synchronize()
        _forget_symmetric_buffers(args[0] if args else kwargs.get("group"))
        return destroy(*args, **kwargs)
    destroy_process_group._hf_specdec_releases_graphs = True
    return destroy_process_group
