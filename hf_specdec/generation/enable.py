"""``enable(model)``: make an HF causal LM decode through hf_specdec, on that instance only."""

from __future__ import annotations

import copy
import os
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from hf_specdec.attention import ATTENTION_NAME, register
from hf_specdec.cache import KVLayout, kv_layout_from_config, split_by_device
from hf_specdec.cache.kv_layout import text_config_of
from hf_specdec.config import CacheConfig
from hf_specdec.generation.experts import restore_experts, select_experts
from hf_specdec.generation.fusion import fuse_modules, kernels_may_run, unfuse_modules
from hf_specdec.generation.generate import generate
from hf_specdec.generation.quantization import check_target_weights
from hf_specdec.generation.stats import SpecStats
from hf_specdec.runtime import GraphStore, ModelRunner, cuda_graphs_wanted
from hf_specdec.runtime.cuda_graphs import check_max_graphs
from hf_specdec.runtime.distributed import (
    RankGroup,
    key_head_splits,
    local_kv_layout,
    release_graphs_at_destroy,
    tensor_parallel_group,
)
from hf_specdec.runtime.placement import (
    gpu_devices,
    guard_devices,
    input_device,
    is_dispatched,
    layer_devices,
    unguard_devices,
)

# CUDA graphs for a tensor-parallel model (every rank captures the same forwards, transformers' NCCL all-reduces
# inside them); HF_SPECDEC_TP_GRAPHS=0 (read at import) runs its forwards eagerly
TP_GRAPHS = os.environ.get("HF_SPECDEC_TP_GRAPHS", "1") != "0"
# The fused forwards on a tensor-parallel model's shards (decoder layers, attention, MLPs, norms: they call the
# sharded projections as modules, so through transformers' TP wrappers, whose plain column- and row-parallel
# projections take the few-row GEMM on their shards); HF_SPECDEC_TP_FUSED=0 (read at import) keeps transformers'
# forwards. 31B shape at 12 layers on two H200, batch 1: 220 -> 360 tok/s (docs/perf_log.md, session 45)
TP_FUSED = os.environ.get("HF_SPECDEC_TP_FUSED", "1") != "0"


def _first_weight_at(model) -> int | None:
    """Where the model's first parameter lies (its data pointer): it moves when the whole model is moved or cast."""
    first = next(model.parameters(), None)
    try:
        return None if first is None else first.data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
        return None


@dataclass
class EnabledState:
    """What ``enable`` attached to a model (``model._hf_specdec``)."""

    layout: KVLayout
    cache_config: CacheConfig
    original_attention: str
    cuda_graphs: bool = True  # capture decode/verify forwards on CUDA devices (cuda_graphs.py)
    graph_store: GraphStore = field(default_factory=GraphStore)  # graphs + pooled K/V kept between calls
    last_stats: SpecStats | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one generate at a time per model
    owner: int | None = None  # thread id of the generate call holding the lock
    original_experts: dict | None = None  # the MoE experts implementation before enable (None: no such experts)
    ranks: RankGroup | None = None  # the tensor-parallel group the model is sharded over (runtime/distributed.py)
    head_shard: RankGroup | None = None  # ``ranks`` when they split the KV heads (the layout holds this rank's)
    dispatched: bool = False  # accelerate placed the model over several devices or offloads part of it
    # "auto" k: timed rounds per (drafter, draft model, batch size), kept between calls (generation/adaptive_k.py)
    round_costs: dict = field(default_factory=dict)
    fused: bool = False  # the kernels-only fused forwards are installed (generation/fusion.py)
    fused_at: int | None = None  # where the model's first weight lay when they were (fuse_where_kernels_run)

    def __deepcopy__(self, memo):
        """A copied model gets its own state: a fresh lock and an empty graph store (graphs and pooled storage
        point at the original's memory), the same settings."""
        copied = EnabledState(copy.deepcopy(self.layout, memo), copy.deepcopy(self.cache_config, memo),
                              self.original_attention, self.cuda_graphs,
                              GraphStore(self.graph_store.max_graphs), copy.deepcopy(self.last_stats, memo))
        copied.original_experts = copy.deepcopy(self.original_experts, memo)
        copied.ranks, copied.head_shard, copied.dispatched = self.ranks, self.head_shard, self.dispatched
        copied.graph_store.devices = self.graph_store.devices
        copied.fused = self.fused
        copied.fused_at = None  # (the copy's weights lie elsewhere: its first call stacks them if need be)
        copied.hold_collectives()
        return copied

    def __getstate__(self):
        """An enabled model is not pickled (``torch.save(model)``): its ``generate`` and fused forwards are methods
        bound to it, which pickle looks up again by name on the loaded model and so finds transformers' own; the
        loaded model would be half enabled. Say what to do instead."""
        raise TypeError("an enabled model cannot be pickled (torch.save(model), pickle): its generate and "
                        "forwards are hf_specdec's, bound to this instance. Call hf_specdec.disable(model) before "
                        "saving it and hf_specdec.enable(model) after loading it, or save it with "
                        "model.save_pretrained(path) (copy.deepcopy(model) keeps it enabled).")

    def hold_collectives(self) -> None:
        """A tensor-parallel model's graphs will hold NCCL collectives: have destroying its process group release
        them first (runtime/distributed.py). Called where a state gets its graph store (``enable``, a copy)."""
        if self.ranks is not None and TP_GRAPHS:
            release_graphs_at_destroy(self.graph_store)

    def fuse_where_kernels_run(self, model) -> None:
        """Install the kernels-only fused forwards on ``model`` (this state's model) while it has weights where
        the kernels run, remove them while it has none: at ``enable``, and at each ``generate``, since
        ``model.to(...)`` moves an enabled model. A sharded model keeps transformers' tensor-parallel forwards unless
        TP_FUSED."""
        if self.ranks is not None and not TP_FUSED:
            return
        wanted = kernels_may_run(model)
        if wanted != self.fused or (wanted and _first_weight_at(model) != self.fused_at):
            # (fused, but the weights moved since, e.g. model.half(): their stacked storages came apart)
            if wanted:
                fuse_modules(model, restack=self.fused)
            else:
                unfuse_modules(model, kernels_only=True)
            self.fused, self.fused_at = wanted, _first_weight_at(model)

    def graph_store_for(self, device: torch.device) -> GraphStore | None:
        """The GraphStore a call on ``device`` uses: when graphs are asked for, on CUDA, and not switched off; never
        for a model accelerate offloads in part (its hooks move weights, see runtime/placement.py). A model placed
        over several GPUs has graphs that span them (``graph_store.devices``); a tensor-parallel model's graphs hold
        its NCCL collectives (released before its process group is destroyed: :meth:`hold_collectives`)."""
        wanted = (cuda_graphs_wanted(self.cuda_graphs, device) and (self.ranks is None or TP_GRAPHS)
                  and (not self.dispatched or bool(self.graph_store.devices)))
        return self.graph_store if wanted else None

    def runner(self, model) -> ModelRunner:
        """A ModelRunner for one call on ``model`` (this state's model)."""
        device = input_device(model)
        return ModelRunner(model, self.layout, self.cache_config, self.graph_store_for(device), self.ranks,
                           self.head_shard)


def enable(model, cache_config: CacheConfig | None = None, *, cuda_graphs: bool | None = None,
           max_cuda_graphs: int | None = None):
    """Route ``model``'s attention and ``generate`` through hf_specdec; returns the same object.

    Scoped to the instance and reversible (:func:`disable`). Plain forwards keep the model's behaviour.
    ``cuda_graphs`` (default True) replays decode and verify forwards as CUDA graphs on CUDA devices; the
    environment variable ``HF_SPECDEC_CUDA_GRAPHS=0`` turns them off everywhere. ``max_cuda_graphs``
    (default 64) bounds the graphs the model keeps between calls (each holds its own activations and
    logits; one is kept per batch bucket, k and context bucket): beyond it the least recently used is dropped."""
    if max_cuda_graphs is not None:
        check_max_graphs(max_cuda_graphs)
    cache_config = _cache_config(cache_config)
    state = getattr(model, "_hf_specdec", None)
    if state is not None:
        with _held(state, "enable"):  # a generate call running in another thread finishes first
            _update(model, state, cache_config, cuda_graphs, max_cuda_graphs)
        return model
    _check_supported(model)
    ranks = tensor_parallel_group(model)
    layout = kv_layout_from_config(model.config)
    split = ranks is not None and bool(key_head_splits(model))
    if split:  # each rank's cache holds the KV heads of its shard
        layout = local_kv_layout(model, layout)
    dispatched = is_dispatched(model)
    if dispatched:  # each layer's pages beside it (runtime/placement.py)
        layout = split_by_device(layout, {layer: str(d) for layer, d in layer_devices(model).items()})
    register()
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    model._hf_specdec = EnabledState(layout, cache_config or CacheConfig(), original,
                                     cuda_graphs=True if cuda_graphs is None else cuda_graphs, ranks=ranks,
                                     head_shard=ranks if split else None, dispatched=dispatched)
    if max_cuda_graphs is not None:
        model._hf_specdec.graph_store.max_graphs = max_cuda_graphs
    model._hf_specdec.hold_collectives()
    if dispatched:  # kernels launch on each layer's GPU; graphs span the GPUs where nothing is offloaded
        guard_devices(model)
        model._hf_specdec.graph_store.devices = gpu_devices(model)
    model.generate = types.MethodType(generate, model)
    if ranks is None or TP_FUSED:
        fuse_modules(model, kernels=False)  # what every device needs (the FP8 layers' forwards)
        model._hf_specdec.fuse_where_kernels_run(model)
    if ranks is None:  # a sharded model's experts keep transformers' tensor-parallel forward
        model._hf_specdec.original_experts = select_experts(model)
    return model


def _update(model, state: EnabledState, cache_config, cuda_graphs, max_cuda_graphs) -> None:
    """``enable`` on an enabled model: new settings, and hf_specdec's attention back if it was changed since."""
    if model.config._attn_implementation != ATTENTION_NAME:  # set_attn_implementation was called since
        state.original_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
    if cache_config is not None:
        state.cache_config = cache_config
    if cuda_graphs is not None:
        state.cuda_graphs = cuda_graphs
        if not cuda_graphs:
            state.graph_store.release()
    if max_cuda_graphs is not None:
        state.graph_store.max_graphs = max_cuda_graphs
        state.graph_store.trim()


def disable(model):
    """Undo :func:`enable` on ``model``; returns the same object. A ``generate`` call running in another thread
    finishes first (disable waits for it); from inside a call on the same model it raises."""
    state = getattr(model, "_hf_specdec", None)
    if state is None:
        return model
    with _held(state, "disable"):
        _undo(model, state)
    return model


def _held(state: EnabledState, what: str):
    """The model's lock, for changing what a running generate call reads; from inside such a call it raises
    (waiting for itself would never end)."""
    if state.owner == threading.get_ident():
        raise RuntimeError(f"hf_specdec.{what}(model) was called from inside a generate call on the same model (a "
                           "streamer, logits processor or stopping criterion?); call it after the call returns.")
    return state.lock


def _undo(model, state: EnabledState) -> None:
    if model.config._attn_implementation == ATTENTION_NAME:  # not one the user set since (it stays)
        model.set_attn_implementation(state.original_attention)
    state.graph_store.release()
    unfuse_modules(model)
    restore_experts(model, state.original_experts)
    unguard_devices(model)
    del model.generate
    del model._hf_specdec


def last_generation_stats(model) -> SpecStats | None:
    """SpecStats of the last ``generate`` call of an enabled model (None before the first, and after a call that ran
    transformers' own loop: beam search, a cache of the user's, ...)."""
    state = getattr(model, "_hf_specdec", None)
    if state is None:
        raise ValueError("this model is not enabled; call hf_specdec.enable(model) first.")
    return state.last_stats


def _cache_config(value) -> CacheConfig | None:
    """``enable``'s cache config: a CacheConfig, a mapping of its fields, or None."""
    if value is None or isinstance(value, CacheConfig):
        return value
    if isinstance(value, Mapping):
        fields = set(CacheConfig.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise TypeError(f"unknown CacheConfig field(s) {unknown}; the fields are {sorted(fields)}.")
        return CacheConfig(**value)
    raise TypeError(f"cache_config must be a hf_specdec.CacheConfig (or a dict of its fields), got "
                    f"{type(value).__name__}: pass hf_specdec.CacheConfig(block_size=..., ...).")


def _check_attention_kind(model) -> None:
    """Attention that the paged cache and kernels do not compute is refused here, not decoded wrongly later: latent
    (MLA) caches, whose pages would hold compressed latents of other widths, and capped scores (the attention refuses
    these too, when a model hands them over). Learned softmax sinks (gpt-oss) are computed."""
    name = type(model).__name__
    text = text_config_of(model.config)
    cap = getattr(text, "attn_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"{name} caps its attention scores (attn_logit_softcapping={cap}), which hf_specdec's paged attention does "
            "not compute. Use the model without hf_specdec.enable()."
        )
    rank = getattr(text, "kv_lora_rank", None)
    if rank:
        raise ValueError(
            f"{name} uses multi-head latent attention (kv_lora_rank={rank}): its cache holds compressed latents, "
            "which hf_specdec's paged cache and attention do not store. Use the model without hf_specdec.enable()."
        )


def _check_supported(model) -> None:
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "generate"):
        raise TypeError(
            f"hf_specdec.enable needs a transformers causal LM (a PreTrainedModel with generate), got "
            f"{type(model).__name__}. A drafter (a Gemma 4 MTP assistant, a DFlash drafter) is not enabled: pass it "
            f"to its target's generate as assistant_model=...; load a target with AutoModelForCausalLM.from_pretrained."
        )
    if model.config.is_encoder_decoder:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder; hf_specdec supports decoder-only causal LMs.")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "hf_specdec cannot plug its paged attention in. Use the model without hf_specdec.enable()."
        )
    _check_attention_kind(model)
    check_target_weights(model)  # a quantization format the kernels and the loop do not take is refused
