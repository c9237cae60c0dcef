"""Configuration of the Gemma 4 MTP assistant, and how it attaches to a Gemma 4 target.

`HFSpecGemma4AssistantConfig` reads the `config.json` of `google/gemma-4-*-it-assistant` checkpoints
(model_type `gemma4_assistant`) on every transformers version we support. It does not use transformers'
own `Gemma4AssistantConfig`: in 5.2x that config builds a text config whose `kv_sharing_modes` raises
for an all-shared assistant, so the stock assistant cannot even be instantiated.

The attachment rules live here too, because they are pure config arithmetic:
- `producer_layer_for(target_config, layer_type)`: which target layer's K/V an assistant layer reads;
- `check_compatible(assistant_config, target_config)`: a `ValueError` naming the fix for a wrong pair.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import Gemma4TextConfig, PreTrainedConfig

LAYER_TYPES = ("sliding_attention", "full_attention")
TARGET_MODEL_TYPES = ("gemma4_text", "gemma4")


class HFSpecGemma4AssistantConfig(PreTrainedConfig):
    """Config of a Gemma 4 MTP assistant (drafter), validated once in `__post_init__`.

    Keys (as in the released checkpoints): `text_config` (a `gemma4_text` config of the assistant's own
    decoder), `backbone_hidden_size` (hidden size of the target it was trained with),
    `use_ordered_embeddings` (centroid LM head), `num_centroids`, `centroid_intermediate_top_k`,
    `tie_word_embeddings` (the LM head is `model.embed_tokens`).
    """

    model_type = "gemma4_assistant"
    # 5.17 reads `sub_configs`, 5.2x reads `sub_configs_defaults`; both only drive (de)serialisation here,
    # the dict -> config conversion is done in `__post_init__` for both.
    sub_configs = {"text_config": Gemma4TextConfig}
    sub_configs_defaults = {"text_config": Gemma4TextConfig}

    text_config: Gemma4TextConfig | dict[str, Any] | None = None
    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        self.text_config = _as_text_config(self.text_config)
        # Released checkpoints mark every layer KV-shared (it reads the target's K/V); 0 means the same.
        if not self.text_config.num_kv_shared_layers:
            self.text_config.num_kv_shared_layers = self.text_config.num_hidden_layers
        super().__post_init__(**kwargs)
        validate_assistant_config(self)

    def to_dict(self) -> dict[str, Any]:
        # Saved assistants keep the released checkpoints' architecture: transformers and other readers key on it.
        output = super().to_dict()
        output["architectures"] = ["Gemma4AssistantForCausalLM"]
        return output


def _as_text_config(text_config: Gemma4TextConfig | dict[str, Any] | None) -> Gemma4TextConfig:
    if text_config is None:
        # Only so that a default instance exists (transformers 5.17's save_pretrained builds one to diff against).
        return Gemma4TextConfig(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    if isinstance(text_config, dict):
        text_config = dict(text_config)
        model_type = text_config.pop("model_type", "gemma4_text")
        if model_type != "gemma4_text":
            raise ValueError(f"gemma4_assistant `text_config.model_type` must be 'gemma4_text', got {model_type!r}.")
        return Gemma4TextConfig(**text_config)
    if getattr(text_config, "model_type", None) != "gemma4_text":
        raise ValueError(f"gemma4_assistant `text_config` must be a gemma4_text config, got {type(text_config)}.")
    return text_config


def validate_assistant_config(config: HFSpecGemma4AssistantConfig) -> None:
    """Raise `ValueError` (naming the offending key) for configs this drafter cannot run."""
    text = config.text_config
    _require(config.backbone_hidden_size > 0, f"backbone_hidden_size must be > 0, got {config.backbone_hidden_size}.")
    _require(config.tie_word_embeddings, "tie_word_embeddings must be True: the LM head is model.embed_tokens.")
    _require(not text.hidden_size_per_layer_input, "text_config.hidden_size_per_layer_input must be 0 (no PLE).")
    _require(not text.enable_moe_block, "text_config.enable_moe_block must be False.")
    _require(not text.use_double_wide_mlp, "text_config.use_double_wide_mlp must be False.")
    _require(
        text.num_kv_shared_layers == text.num_hidden_layers,
        f"every assistant layer reads the target's K/V: text_config.num_kv_shared_layers must equal "
        f"num_hidden_layers ({text.num_hidden_layers}) or be 0, got {text.num_kv_shared_layers}.",
    )
    unknown = sorted(set(text.layer_types) - set(LAYER_TYPES))
    _require(not unknown, f"text_config.layer_types may only contain {LAYER_TYPES}, got {unknown}.")
    if config.use_ordered_embeddings:
        _validate_centroids(config)


def _validate_centroids(config: HFSpecGemma4AssistantConfig) -> None:
    vocab, centroids, top_k = config.text_config.vocab_size, config.num_centroids, config.centroid_intermediate_top_k
    _require(
        centroids > 0 and vocab % centroids == 0, f"vocab_size {vocab} must be divisible by num_centroids {centroids}."
    )
    _require(
        0 < top_k <= centroids, f"centroid_intermediate_top_k must be in [1, num_centroids={centroids}], got {top_k}."
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def module_config(text_config: Gemma4TextConfig) -> Gemma4TextConfig:
    """A copy of the assistant's text config for building stock transformers modules.

    The assistant owns no K/V at all (it reads the target's through a `TargetKVSource`), so intra-model KV
    sharing is switched off: stock modules such as `Gemma4TextMLP` read `config.kv_sharing_modes`, which
    raises for an all-shared config in transformers 5.2x.
    """
    config = copy.deepcopy(text_config)
    config.num_kv_shared_layers = 0
    return config


def target_text_config(target: Any) -> PreTrainedConfig:
    """The `gemma4_text` config of a target model or config (`Gemma4ForCausalLM` or `...ForConditionalGeneration`)."""
    config = getattr(target, "config", target)
    model_type = getattr(config, "model_type", None)
    if model_type not in TARGET_MODEL_TYPES:
        raise ValueError(
            f"the Gemma 4 MTP assistant needs a Gemma 4 target (model_type in {TARGET_MODEL_TYPES}), got "
            f"{model_type!r}; use a DFlash drafter or plain decoding for other targets."
        )
    return config.text_config if model_type == "gemma4" else config


def producer_layer_for(target_config: Any, layer_type: str) -> int:
    """Index of the target layer whose K/V assistant layers of `layer_type` read.

    It is the last layer of that type that owns K/V: the last `num_kv_shared_layers` target layers only
    reuse K/V (E2B/E4B), so the producer is the last non-shared one; with no shared layers (31B, 26B-A4B)
    it is simply the last layer of that type.
    """
    text = target_text_config(target_config)
    first_shared = text.num_hidden_layers - (text.num_kv_shared_layers or 0)
    owners = [i for i, t in enumerate(text.layer_types[:first_shared]) if t == layer_type]
    if not owners:
        raise ValueError(f"the target has no {layer_type} layer that owns K/V for the assistant to read.")
    return owners[-1]


def check_compatible(assistant_config: Any, target_config: Any) -> None:
    """Raise `ValueError` naming the fix when this assistant cannot draft for this target (configs or models)."""
    assistant_config = getattr(assistant_config, "config", assistant_config)
    target = target_text_config(target_config)
    if assistant_config.backbone_hidden_size != target.hidden_size:
        raise ValueError(
            f"this assistant was built for a target with hidden_size {assistant_config.backbone_hidden_size}, but the "
            f"target has hidden_size {target.hidden_size}; load the assistant built for this target "
            f"(google/gemma-4-<size>-it-assistant for google/gemma-4-<size>-it)."
        )
    text = assistant_config.text_config
    if text.vocab_size != target.vocab_size:
        raise ValueError(
            f"vocab mismatch: assistant vocab_size {text.vocab_size} != target vocab_size {target.vocab_size}; "
            f"load the assistant built for this target."
        )
    for layer_idx, layer_type in enumerate(text.layer_types):
        _check_layer_matches_producer(text, layer_idx, target, producer_layer_for(target, layer_type))


def _check_layer_matches_producer(text, layer_idx: int, target, producer: int) -> None:
    mine, theirs = text.per_layer_config[layer_idx], target.per_layer_config[producer]
    got = (mine.head_dim, mine.num_key_value_heads)
    want = (theirs.head_dim, theirs.num_key_value_heads)
    if got != want or mine.num_attention_heads % theirs.num_key_value_heads:
        raise ValueError(
            f"assistant layer {layer_idx} ({text.layer_types[layer_idx]}) has (head_dim, kv heads) {got} but its "
            f"producer, target layer {producer}, has {want}; load the assistant built for this target."
        )
