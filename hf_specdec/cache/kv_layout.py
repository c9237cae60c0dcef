"""KV groups and layer sharing, derived from a model config.

A **KV group** is a set of layers whose K/V have the same shape and lifetime: (sliding window,
number of kv heads, head_dim). Each group owns one storage tensor and one block table per sequence.
A **producer layer** owns K/V pages; a KV-shared layer (Gemma 4's last ``num_kv_shared_layers``
layers, or an MTP assistant layer) reads the pages of its producer and writes none.

    Gemma-4-31B-like: group 0 = sliding (16 kv heads x 256, window 1024): layers 0-4, 6-10, ...
                      group 1 = full    (4 kv heads x 512):               layers 5, 11, ...
    E2B-like:         the last 20 layers own nothing; each maps to the last earlier layer of its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class KVGroup:
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]  # producer layers, in storage order

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


@dataclass
class KVLayout:
    """Where each layer's K/V lives: ``layer_slot[layer] = (group, index within the group's storage)``."""

    groups: list[KVGroup]
    layer_slot: dict[int, tuple[int, int]]
    producer: dict[int, int] = field(default_factory=dict)  # layer -> producer layer (itself if it owns K/V)

    @property
    def num_layers(self) -> int:
        return len(self.layer_slot)

    def group_of(self, layer_idx: int) -> KVGroup:
        return self.groups[self.layer_slot[layer_idx][0]]

    @classmethod
    def from_layers(cls, specs: list[tuple[int, int, int | None]], producer: dict[int, int]) -> "KVLayout":
        """Build from per-layer ``(num_kv_heads, head_dim, sliding_window)`` and a producer map."""
        keys: list[tuple[int, int, int | None]] = []
        members: dict[tuple, list[int]] = {}
        for layer, spec in enumerate(specs):
            if producer[layer] != layer:
                continue
            if spec not in members:
                keys.append(spec)
                members[spec] = []
            members[spec].append(layer)
        groups = [KVGroup(*key, layers=tuple(members[key])) for key in keys]
        owned = {layer: (g, i) for g, grp in enumerate(groups) for i, layer in enumerate(grp.layers)}
        layer_slot = {layer: owned[producer[layer]] for layer in range(len(specs))}
        return cls(groups=groups, layer_slot=layer_slot, producer=dict(producer))


def text_config_of(config):
    """The decoder config of a (possibly multimodal) model config."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def kv_layout_from_config(config) -> KVLayout:
    """Derive the KV layout of a decoder-only HF model from its config (Gemma 4, Llama, Qwen3, ...)."""
    config = text_config_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("hf_specdec supports decoder-only causal LMs; this model is an encoder-decoder.")
    if config.model_type in ("gemma4_text", "gemma4"):
        return _gemma4_layout(config)
    return _generic_layout(config)


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        return [FULL] * config.num_hidden_layers
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(
            f"hf_specdec's paged cache handles full and sliding attention layers; this model has {unknown}. "
            "Use the model without hf_specdec.enable()."
        )
    return list(types)


def _generic_layout(config) -> KVLayout:
    if hasattr(config, "layer_num_kv_heads"):  # configs with per-layer accessors (Step 3.5)
        specs = [(config.layer_num_kv_heads(i), config.layer_head_dim(i), config.layer_sliding_window(i))
                 for i in range(config.num_hidden_layers)]
        return KVLayout.from_layers(specs, {i: i for i in range(len(specs))})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    specs = [(kv_heads, head_dim, window if t == SLIDING else None) for t in _layer_types(config)]
    return KVLayout.from_layers(specs, {i: i for i in range(len(specs))})


def gemma4_layer_shape(config, layer_idx: int) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a Gemma 4 layer, on every supported transformers version."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:  # transformers >= 5.2x folds heterogeneous shapes here
        layer = per_layer[layer_idx]
        return layer.num_key_value_heads, layer.head_dim
    if config.layer_types[layer_idx] == SLIDING:
        return config.num_key_value_heads, config.head_dim
    global_kv = getattr(config, "num_global_key_value_heads", None)
    kv_heads = global_kv if (config.attention_k_eq_v and global_kv) else config.num_key_value_heads
    return kv_heads, getattr(config, "global_head_dim", None) or config.head_dim


def gemma4_producers(config) -> dict[int, int]:
    """Layer -> producer layer: the last ``num_kv_shared_layers`` reuse the last earlier layer of their type."""
    types = _layer_types(config)
    first_shared = len(types) - (getattr(config, "num_kv_shared_layers", 0) or 0)
    producer = {}
    for layer, layer_type in enumerate(types):
        if layer < first_shared:
            producer[layer] = layer
        else:
            candidates = [i for i in range(first_shared) if types[i] == layer_type]
            if not candidates:
                raise ValueError(f"Gemma 4 layer {layer} ({layer_type}) shares K/V but no earlier layer produces it.")
            producer[layer] = candidates[-1]
    return producer


def _gemma4_layout(config) -> KVLayout:
    types = _layer_types(config)
    specs = []
    for layer, layer_type in enumerate(types):
        kv_heads, head_dim = gemma4_layer_shape(config, layer)
        specs.append((kv_heads, head_dim, config.sliding_window if layer_type == SLIDING else None))
    return KVLayout.from_layers(specs, gemma4_producers(config))
