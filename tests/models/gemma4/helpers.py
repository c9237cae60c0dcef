"""Tiny Gemma 4 assistants in the released checkpoint format, derived from the tiny targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma4TextConfig

from hf_specdec.models.gemma4 import HFSpecGemma4AssistantConfig, producer_layer_for, target_text_config

S, F = "sliding_attention", "full_attention"
ASSISTANT_LAYER_TYPES = [S, S, F]  # released assistants: 3 sliding + 1 full


def assistant_text_dict(target_config, **overrides) -> dict:
    """`text_config` of config.json as released (global_head_dim, not per_layer_config), matching the target."""
    target = target_text_config(target_config)
    sliding = target.per_layer_config[producer_layer_for(target, S)]
    full = target.per_layer_config[producer_layer_for(target, F)]
    text = dict(
        model_type="gemma4_text", vocab_size=target.vocab_size, hidden_size=24, intermediate_size=40,
        num_hidden_layers=len(ASSISTANT_LAYER_TYPES), layer_types=list(ASSISTANT_LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim, global_head_dim=full.head_dim,
        attention_k_eq_v=target.attention_k_eq_v, num_kv_shared_layers=len(ASSISTANT_LAYER_TYPES),
        sliding_window=target.sliding_window, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        final_logit_softcapping=None, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    )
    if target.attention_k_eq_v:
        text["num_global_key_value_heads"] = full.num_key_value_heads
    text.update(overrides)
    return text


def assistant_config_dict(target_config, ordered: bool, num_centroids: int = 8, top_k: int = 3, **text) -> dict:
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target_text_config(target_config).hidden_size,
        "use_ordered_embeddings": ordered,
        "num_centroids": num_centroids,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "text_config": assistant_text_dict(target_config, **text),
    }


def assistant_config(target_config, ordered: bool, **kwargs) -> HFSpecGemma4AssistantConfig:
    fields = assistant_config_dict(target_config, ordered, **kwargs)
    fields.pop("architectures"), fields.pop("model_type")
    return HFSpecGemma4AssistantConfig(**fields)


def released_layout(config_dict: dict) -> dict[str, tuple[int, ...]]:
    """Every key and shape of a released assistant checkpoint (docs/models.md §2), from the config alone."""
    text, backbone = config_dict["text_config"], config_dict["backbone_hidden_size"]
    h, vocab, heads = text["hidden_size"], text["vocab_size"], text["num_attention_heads"]
    layout = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i, layer_type in enumerate(text["layer_types"]):
        d = text["global_head_dim"] if layer_type == F else text["head_dim"]
        p = f"model.layers.{i}."
        layout |= {p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.q_norm.weight": (d,),
                   p + "self_attn.o_proj.weight": (h, heads * d), p + "layer_scalar": (1,)}
        inter = text["intermediate_size"]
        layout |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            layout[p + f"{norm}_layernorm.weight"] = (h,)
    layout |= {"pre_projection.weight": (h, 2 * backbone), "post_projection.weight": (backbone, h)}
    if config_dict["use_ordered_embeddings"]:
        layout |= {"masked_embedding.centroids.weight": (config_dict["num_centroids"], h),
                   "masked_embedding.token_ordering": (vocab,)}
    return layout


def random_state_dict(layout: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the structure of trained ones: norms near 1, layer_scalar != 1, a shuffled ordering."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in layout.items():
        if name.endswith("token_ordering"):
            state[name] = torch.randperm(shape[0], generator=gen)
        elif name.endswith("layer_scalar"):
            state[name] = torch.full(shape, 0.7)
        elif "norm" in name:
            state[name] = torch.rand(shape, generator=gen) + 0.5
        else:
            state[name] = torch.randn(shape, generator=gen) * 0.3
    return state


def write_checkpoint(path: Path, config_dict: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def hf_assistant(config_dict: dict, monkeypatch):
    """transformers' own `Gemma4AssistantForCausalLM` for this config, or skip with the reason.

    transformers 5.2x raises while building it: `Gemma4TextConfig.kv_sharing_modes` rejects an all-shared
    config. If plain construction fails, retry with that property patched (for this test only) to 5.17's
    rule "every layer reuses"; the modeling code under test is still the installed version's.
    """
    try:
        from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM
    except ImportError as err:
        pytest.skip(f"transformers has no gemma4_assistant: {err}")
    fields = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    try:
        return Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**fields)).eval()
    except Exception as plain_error:
        original = Gemma4TextConfig.kv_sharing_modes
        all_reuse = property(lambda c: ["reuse"] * c.num_hidden_layers if c.num_kv_shared_layers == c.num_hidden_layers
                             else original.fget(c))
        with monkeypatch.context() as patch:
            patch.setattr(Gemma4TextConfig, "kv_sharing_modes", all_reuse)
            try:
                return Gemma4AssistantForCausalLM(Gemma4AssistantConfig(**fields)).eval()
            except Exception as patched_error:
                pytest.skip(f"Gemma4AssistantForCausalLM cannot be built: {plain_error!r}; patched: {patched_error!r}")
