"""transformers' Step 3.7 beside ``Step3p5ForCausalLM``: one checkpoint in both, for comparing the two.

transformers (5.17 and later) ships Step 3.7 (``transformers.models.step3p7``), a vision-language model whose
text model is the Step 3.5 architecture; its text config ``Step3p7TextConfig`` answers to model_type
``step3p5``, and ``generate(use_mtp=True)`` drafts with the checkpoint's MTP layers. ``save_as_step3p7``
writes a ``Step3p5ForCausalLM`` as a Step 3.7 checkpoint folder that transformers loads with
``Step3p7ForConditionalGeneration.from_pretrained``, so both stacks run the same weights (the
``hf_native_step_mtp`` benchmark, the tests).

Main model, checkpoint layout (this package's module tree) -> transformers' Step 3.7 module tree
(``to_step3p7_state_dict``, ``i < num_hidden_layers``)::

    model.embed_tokens.weight / model.norm.weight        model.language_model.embed_tokens.weight / .norm.weight
    lm_head.weight                                       lm_head.weight (left out when tied to the embedding)
    model.layers.{i}.self_attn.*, *_layernorm.weight     model.language_model.layers.{i}.<same>
    model.layers.{i}.mlp.{gate,up,down}_proj.weight      model.language_model.layers.{i}.mlp.<same>   (dense)
    model.layers.{i}.moe.gate.weight                     ....mlp.gate.weight
    model.layers.{i}.moe.router_bias                     ....mlp.gate.e_score_correction_bias
    model.layers.{i}.moe.{gate,up}_proj.weight [E,I,H]   ....mlp.experts.gate_up_proj [E,2I,H] (gate rows first)
    model.layers.{i}.moe.down_proj.weight [E,H,I]        ....mlp.experts.down_proj
    model.layers.{i}.share_expert.*                      ....mlp.shared_experts.*

The MTP layers ``model.layers.{L+k}.*`` are not part of that tree: ``generate(use_mtp=True)`` reads them from
the checkpoint files in this layout, as ``layers.{k}.mtp_block.*`` beside ``enorm``/``hnorm``/``eh_proj``,
with ``shared_head.norm`` as ``post_norm``; it drafts with ``lm_head`` and never reads ``shared_head.head``
(not written). Its drafting also differs from this package's (docs/models.md §4): step 0 takes the target's
hidden state after the final norm, and each step hands the next one its ``shared_head.norm`` output.

A Step 3.5 config transformers' text config cannot express raises ``ValueError`` (``step3p7_text_config``):
per-layer KV heads or head dims, layers without RoPE, RoPE parameters that differ within an attention type,
``rope_scaling`` on other layers than the full-attention ones, no head-wise gate, unnormalised expert weights.
Its MTP layers need ``mtp_per_layer_config``, which is written: without it they take the main head count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_specdec.models.step3p5.configuration import FULL, Step3p5Config

_RENAMES = (
    (re.compile(r"^model\.(embed_tokens|norm|layers)\."), r"model.language_model.\1."),
    (re.compile(r"\.moe\.gate\.weight$"), ".mlp.gate.weight"),
    (re.compile(r"\.moe\.router_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.moe\.down_proj\.weight$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.share_expert\."), ".mlp.shared_experts."),
)
_EXPERT_HALF = re.compile(r"\.moe\.(gate|up)_proj\.weight$")
_CONFIG_KEYS_NOT_WRITTEN = ("model_type", "architectures", "transformers_version", "_name_or_path")
# The vision tower Step3p7ForConditionalGeneration cannot be built without; text-only prompts never run it.
MINIMAL_VISION_CONFIG = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             image_size=28, patch_size=14)


def is_available() -> bool:
    """Whether the installed transformers has Step 3.7."""
    try:
        import transformers.models.step3p7.modeling_step3p7  # noqa: F401
    except ImportError:
        return False
    return True


def layer_index(key: str) -> int | None:
    """``i`` of a ``model.layers.{i}.`` key, else None."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else None


def _rename(key: str) -> str:
    for pattern, replacement in _RENAMES:
        key = pattern.sub(replacement, key)
    return key


def to_step3p7_state_dict(state_dict: dict[str, torch.Tensor], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """The main-model entries of a Step 3.5 state dict (checkpoint layout) under transformers' Step 3.7 names
    (module docstring); MTP layers are left out. Any subset converts on its own as long as a layer's
    ``moe.gate_proj`` and ``moe.up_proj`` come together (their concatenation is the one copy made)."""
    out, halves = {}, {}
    for key, tensor in state_dict.items():
        index = layer_index(key)
        if index is not None and index >= num_hidden_layers:
            continue
        half = _EXPERT_HALF.search(key)
        if half:
            halves.setdefault(key[:half.start()], {})[half.group(1)] = tensor
        else:
            out[_rename(key)] = tensor
    for prefix, pair in halves.items():
        out[_rename(prefix + ".") + "mlp.experts.gate_up_proj"] = torch.cat([pair["gate"], pair["up"]], dim=1)
    return out


def step3p7_text_config(config: Step3p5Config) -> dict:
    """Fields of transformers' ``Step3p7TextConfig`` for the model of ``config``: its config.json keys (which
    that class parses, ``rope_scaling`` under its config.json name) plus the MTP layers' head counts."""
    problems = _not_expressible(config)
    if problems:
        raise ValueError("transformers' Step 3.7 cannot express this Step 3.5 config: " + "; ".join(problems))
    fields = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_KEYS_NOT_WRITTEN}  # (config.json's keys)
    # written out: without it Step 3.7 makes layers 3.. MoE, Step 3.5 layers 1..
    fields["moe_layers_enum"] = ",".join(str(i) for i in sorted(config.moe_layer_indices))
    fields["mtp_per_layer_config"] = {k: {"num_attention_heads": config.layer_num_heads(config.num_hidden_layers + k)}
                                      for k in range(config.num_nextn_predict_layers)}
    return fields


def _not_expressible(config: Step3p5Config) -> list[str]:
    layers = range(config.num_total_layers)
    first_of_type = {t: config.all_layer_types.index(t) for t in set(config.all_layer_types)}

    def rope(i):
        return config.layer_rope_theta(i), config.layer_partial_rotary_factor(i)

    checks = [
        (all(config.layer_num_kv_heads(i) == config.num_attention_groups for i in layers), "per-layer KV heads"),
        (all(config.layer_head_dim(i) == config.head_dim for i in layers), "per-layer head dims"),
        (all(config.layer_uses_rope(i) for i in layers), "layers without RoPE"),
        (all(rope(i) == rope(first_of_type[config.layer_type(i)]) for i in layers),
         "RoPE parameters differing within an attention type"),
        (all((config.layer_rope_scaling_params(i) is not None) == (config.layer_type(i) == FULL) for i in layers)
         or not config.layer_rope_scaling, "rope_scaling on other layers than the full-attention ones"),
        (config.use_head_wise_attn_gate, "no head-wise attention gate"),
        (config.norm_expert_weight, "expert weights not renormalised"),
    ]
    return [message for ok, message in checks if not ok]


def save_as_step3p7(model, folder: str | Path, vision_config: dict | None = None) -> Path:
    """Write ``model`` (a ``Step3p5ForCausalLM``) as a Step 3.7 checkpoint folder: config.json of a
    ``Step3p7Config`` (text config ``step3p7_text_config``, a ``vision_config`` tower, by default
    ``MINIMAL_VISION_CONFIG``), the main model in transformers' layout and the MTP layers in the checkpoint
    layout, one safetensors shard per layer (host memory holds one layer at a time). Returns the folder."""
    from transformers import Step3p7Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    text = step3p7_text_config(config)
    written = Step3p7Config(text_config=text, vision_config=vision_config or MINIMAL_VISION_CONFIG,
                            tie_word_embeddings=config.tie_word_embeddings)
    written.dtype = model.dtype
    written.save_pretrained(folder)
    weight_map = {}
    for number, shard in enumerate(_shards(model, written)):
        name = f"model-{number:05d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in shard.items()}, str(folder / name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def _shards(model, step3p7_config):
    """Groups of tensors to write: embeddings, norm, head and vision tower; then each main layer (converted);
    then each MTP layer (checkpoint layout, without ``shared_head.head``)."""
    config = model.config
    state = model.state_dict()
    by_layer: dict[int | None, dict] = {}
    for key, tensor in state.items():
        by_layer.setdefault(layer_index(key), {})[key] = tensor
    top = by_layer.pop(None)
    if config.tie_word_embeddings:
        top.pop("lm_head.weight")  # tied again on load; safetensors refuses shared storage
    yield to_step3p7_state_dict(top, config.num_hidden_layers) | _vision_tensors(step3p7_config, model.dtype)
    for i in sorted(by_layer):
        tensors = by_layer[i]
        if i < config.num_hidden_layers:
            yield to_step3p7_state_dict(tensors, config.num_hidden_layers)
        else:
            yield {k: v for k, v in tensors.items() if not k.endswith(".shared_head.head.weight")}


def _vision_tensors(step3p7_config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights of a freshly initialised vision tower and projector (fp32 on the CPU, then ``dtype``)."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionModel

    vision = Step3p7VisionModel(step3p7_config.vision_config)
    tensors = {f"model.vision_model.{k}": v for k, v in vision.state_dict().items()}
    width = step3p7_config.vision_config.hidden_size * 4  # the tower's two downsamplers double its width twice
    tensors["model.multi_modal_projector.weight"] = torch.zeros(step3p7_config.text_config.hidden_size, width)
    return {k: v.to(dtype) for k, v in tensors.items()}


__all__ = ["MINIMAL_VISION_CONFIG", "is_available", "layer_index", "save_as_step3p7", "step3p7_text_config",
           "to_step3p7_state_dict"]
