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
    device: str | None = None  # where its pages live; None: the cache's device (set when layers run on several)

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


def split_by_device(layout: KVLayout, devices: dict[int, str]) -> KVLayout:
    """``layout`` with each group split by the device its producer layers run on (``devices[layer]``, from
    accelerate's placement), so every layer's pages live beside it; the layout itself when they all run on one
    device. Layers missing from ``devices`` stay with the first device named."""
    if len(set(devices.values())) <= 1:
        return layout
    fallback = next(iter(devices.values()))
    groups: list[KVGroup] = []
    slot: dict[int, tuple[int, int]] = {}
    for group in layout.groups:
        for device in dict.fromkeys(devices.get(layer, fallback) for layer in group.layers):
            members = tuple(layer for layer in group.layers if devices.get(layer, fallback) == device)
            slot.update({layer: (len(groups), i) for i, layer in enumerate(members)})
            groups.append(KVGroup(group.num_kv_heads, group.head_dim, group.sliding_window, members, device))
    layer_slot = {layer: slot[layout.groups[g].layers[i]] for layer, (g, i) in layout.layer_slot.items()}
    return KVLayout(groups=groups, layer_slot=layer_slot, producer=dict(layout.producer))


def text_config_of(config):
    """The decoder config of a (possibly multimodal) model config."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def kv_layout_from_config(config) -> KVLayout:
    """Derive the KV layout of a decoder-only HF model from its config: each layer's (kv heads, head_dim,
    window) and its producer layer, from the config's attributes (per-layer accessors or ``per_layer_config``
    where the model has heterogeneous layers; ``num_kv_shared_layers`` for layers that reuse K/V)."""
    config = text_config_of(config)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("hf_specdec supports decoder-only causal LMs; this model is an encoder-decoder.")
    types = _layer_types(config)
    specs = [(*layer_shape(config, i), config.sliding_window if t == SLIDING else None) for i, t in enumerate(types)]
    return KVLayout.from_layers(specs, kv_producers(config))


def _layer_types(config) -> list[str]:
    """Each layer's attention type: the config's ``layer_types``, else every layer sliding when the config has a
    ``sliding_window`` (Mistral-style configs apply it to every layer) unless ``use_sliding_window`` is False,
    else every layer full."""
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        return [SLIDING if sliding else FULL] * config.num_hidden_layers
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(
            f"hf_specdec's paged cache handles full and sliding attention layers; this model has {unknown}. "
            "Use the model without hf_specdec.enable()."
        )
    return list(types)


def layer_shape(config, layer_idx: int) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a layer, on every supported transformers version: per-layer accessors
    (``layer_num_kv_heads``), else ``per_layer_config`` (transformers >= 5.2x folds heterogeneous shapes there),
    else the global attributes, with ``global_head_dim`` / ``num_global_key_value_heads`` for full layers of
    configs that give full layers their own shape."""
    if hasattr(config, "layer_num_kv_heads"):
        return config.layer_num_kv_heads(layer_idx), config.layer_head_dim(layer_idx)
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None and getattr(config, "is_heterogeneous", True):  # 5.24 gives every config a view
        layer = per_layer[layer_idx]
        return layer.num_key_value_heads or layer.num_attention_heads, _head_dim(layer)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = _head_dim(config)
    if _layer_types(config)[layer_idx] == SLIDING:
        return kv_heads, head_dim
    global_kv = getattr(config, "num_global_key_value_heads", None)
    kv_heads = global_kv if (getattr(config, "attention_k_eq_v", False) and global_kv) else kv_heads
    return kv_heads, getattr(config, "global_head_dim", None) or head_dim


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_producers(config) -> dict[int, int]:
    """Layer -> producer layer: the last ``num_kv_shared_layers`` layers own no K/V and reuse the last earlier
    layer of their attention type; every other layer produces its own."""
    types = _layer_types(config)
    first_shared = len(types) - (getattr(config, "num_kv_shared_layers", 0) or 0)
    producer = {}
    for layer, layer_type in enumerate(types):
        if layer < first_shared:
            producer[layer] = layer
        else:
            candidates = [i for i in range(first_shared) if types[i] == layer_type]
            if not candidates:
                raise ValueError(f"layer {layer} ({layer_type}) shares K/V but no earlier layer produces it.")
            producer[layer] = candidates[-1]
    return producer
