"""Configuration of a DFlash block-diffusion drafter in the z-lab checkpoint format.

z-lab releases (`z-lab/Qwen3-8B-DFlash-b16`, `z-lab/gemma-4-31B-it-DFlash`, ...) ship a Qwen3-style text
config with model_type `qwen3` and `architectures=["DFlashDraftModel"]`, plus the drafting keys:

    block_size                      top level, or inside dflash_config (dflash_config wins, default 16)
    dflash_config.mask_token_id     id of the mask token filling block slots 1..block_size-1
    dflash_config.target_layer_ids  target layers whose outputs feed `fc` (HF `hidden_states[i + 1]`)
    num_target_layers               depth of the target the drafter was trained on
    layer_types / sliding_window    optional; sliding draft layers are causal within the block
    is_causal                       optional; overrides the per-layer causality for every layer
    dflash_config.{input_embedding_scale, output_multiplier, final_logit_softcapping}   optional

Every drafting key is read from `dflash_config` first and from the top level second, as the reference
does (`_draft_value` in z-lab's `dflash/model.py`). `DFlashConfig` subclasses `Qwen3Config` so the text
keys parse exactly as the reference parses them (e.g. `sliding_window` is None unless
`use_sliding_window`), and keeps model_type `qwen3`, so a saved drafter is a z-lab checkpoint again.
Because that model_type belongs to Qwen3, transformers' `AutoConfig` cannot tell a drafter from a
Qwen3 model: `is_dflash_checkpoint` looks at `architectures` instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig, Qwen3Config

LAYER_TYPES = ("sliding_attention", "full_attention")
SUPPORTED_ARCHITECTURES = ("DFlashDraftModel", "DFlashDrafter")
DEFAULT_BLOCK_SIZE = 16  # the reference's default when neither level sets block_size
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision", "subfolder",
              "_commit_hash")


@dataclass(frozen=True)
class DFlashSettings:
    """The drafting keys, resolved from `dflash_config` or the top level (`DFlashConfig.dflash`)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float | None  # None: embed with the target's own input embedding module
    output_multiplier: float
    final_logit_softcapping: float | None  # None: use the target's final soft-cap


class DFlashConfig(Qwen3Config):
    """Config of a DFlash drafter (see the module docstring for the keys), validated once in `__post_init__`."""

    # model_type stays "qwen3" (the checkpoints' own), so DFlashConfig is never registered with AutoConfig.
    has_no_defaults_at_init = True  # 5.17's save_pretrained would otherwise build a (mask-less) default instance

    block_size: int | None = None
    dflash_config: dict | None = None
    num_target_layers: int | None = None
    is_causal: bool | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        validate_dflash_config(self)

    @property
    def dflash(self) -> DFlashSettings:
        return DFlashSettings(
            block_size=int(self.draft_value("block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=self.draft_value("mask_token_id"),
            target_layer_ids=tuple(self.draft_value("target_layer_ids") or self._default_target_layer_ids()),
            input_embedding_scale=_optional_float(self.draft_value("input_embedding_scale")),
            output_multiplier=float(self.draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=_optional_float(self.draft_value("final_logit_softcapping")) or None,
        )

    def draft_value(self, name: str, default: Any = None) -> Any:
        """A drafting key from `dflash_config`, else from the top level, else `default` (z-lab's rule)."""
        nested = self.dflash_config or {}
        if nested.get(name) is not None:
            return nested[name]
        value = getattr(self, name, None)
        return default if value is None else value

    def layer_causal(self, layer_idx: int) -> bool:
        """Whether draft layer `layer_idx` is causal within the block: sliding layers are, unless `is_causal` says."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == "sliding_attention"

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def _default_target_layer_ids(self) -> list[int] | None:
        if self.num_target_layers is None:
            return None
        return build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        # Saved drafters are z-lab checkpoints: the reference and serving engines key on this architecture.
        output = super().to_dict()
        output["architectures"] = ["DFlashDraftModel"]
        return output


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default target layers: one per draft layer, evenly from layer 1 to layer `num_target_layers - 3`."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def validate_dflash_config(config: DFlashConfig) -> None:
    """Raise `ValueError` naming the key to fix for configs this drafter cannot run."""
    architectures = config.architectures or []
    unsupported = [a for a in architectures if a.startswith("DFlash") and a not in SUPPORTED_ARCHITECTURES]
    _require(not unsupported, f"architectures {unsupported} are not supported (DFlash2 adds convolutions and a "
                              f"candidate selector); use a DFlashDraftModel checkpoint.")
    _require(config.num_attention_heads % config.num_key_value_heads == 0,
             f"num_attention_heads ({config.num_attention_heads}) must be a multiple of num_key_value_heads "
             f"({config.num_key_value_heads}).")
    _validate_layer_types(config)
    mask = config.draft_value("mask_token_id")
    _require(isinstance(mask, int) and mask >= 0,
             f"dflash_config.mask_token_id must be a non-negative int (the target's mask token), got {mask!r}.")
    block_size = config.draft_value("block_size", DEFAULT_BLOCK_SIZE)
    _require(isinstance(block_size, int) and block_size >= 2,
             f"block_size (top level or dflash_config.block_size) must be an int >= 2, got {block_size!r}.")
    _validate_target_layer_ids(config)


def _validate_layer_types(config: DFlashConfig) -> None:
    types = list(config.layer_types)
    _require(len(types) == config.num_hidden_layers,
             f"layer_types has {len(types)} entries but num_hidden_layers is {config.num_hidden_layers}.")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    _require(not unknown, f"layer_types may only contain {LAYER_TYPES}, got {unknown}.")
    window = config.sliding_window
    _require(window is None or (isinstance(window, int) and window >= 1),
             f"sliding_window must be a positive int or null, got {window!r}.")


def _validate_target_layer_ids(config: DFlashConfig) -> None:
    ids = config.draft_value("target_layer_ids")
    if ids is None:
        _require(config.num_target_layers is not None,
                 "set dflash_config.target_layer_ids (or num_target_layers for z-lab's default spread).")
        ids = config._default_target_layer_ids()
    _require(isinstance(ids, (list, tuple)) and ids and all(isinstance(i, int) and i >= 0 for i in ids),
             f"dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}.")
    _require(len(set(ids)) == len(ids), f"dflash_config.target_layer_ids has duplicates: {list(ids)}.")
    if config.num_target_layers is not None:
        _require(max(ids) < config.num_target_layers,
                 f"dflash_config.target_layer_ids {list(ids)} index past num_target_layers "
                 f"({config.num_target_layers}).")


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_dflash_checkpoint(path_or_config: str | os.PathLike | PretrainedConfig | dict, **hub_kwargs) -> bool:
    """Whether a checkpoint (directory, hub id, config or config dict) is a DFlash drafter.

    Keys on `architectures` (any `DFlash*DraftModel`, so an unsupported DFlash2 checkpoint reaches
    `DFlashConfig`'s clear error instead of loading as a random Qwen3 model) or a `dflash_config` entry.
    Takes `from_pretrained`'s kwargs as they are; the hub ones (revision, token, cache_dir,
    local_files_only, subfolder, ...) reach the config download, the rest are ignored.
    """
    hub_kwargs = {k: v for k, v in hub_kwargs.items() if k in HUB_KWARGS}
    config = _config_dict(path_or_config, hub_kwargs)
    if config is None:
        return False
    architectures = config.get("architectures") or []
    named = any(a.startswith("DFlash") and a.endswith(("DraftModel", "Drafter")) for a in architectures)
    return named or isinstance(config.get("dflash_config"), dict)


def _config_dict(path_or_config, hub_kwargs) -> dict | None:
    if isinstance(path_or_config, dict):
        return path_or_config
    if isinstance(path_or_config, PretrainedConfig):
        return path_or_config.to_dict()
    if os.path.isdir(path_or_config):
        config_file = os.path.join(path_or_config, hub_kwargs.get("subfolder") or "", "config.json")
        if not os.path.isfile(config_file):
            return None
        with open(config_file, encoding="utf-8") as f:
            return json.load(f)
    try:
        config, _ = PretrainedConfig.get_config_dict(path_or_config, **hub_kwargs)
    except (OSError, ValueError):
        return None
    return config
