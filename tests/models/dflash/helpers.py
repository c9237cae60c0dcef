"""Tiny DFlash drafters in the z-lab checkpoint format, sized for the tiny targets of `tests/tiny_models.py`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from hf_specdec.models.dflash import DenseDFlashContext, DFlashConfig, DFlashDrafter
from tests.tiny_models import gemma4_e2b_style

S, F = "sliding_attention", "full_attention"
MASK_TOKEN_ID = 96  # the last id of the tiny targets' 97-token vocabulary


def gemma4_conditional_generation() -> Gemma4ForConditionalGeneration:
    """A text-only Gemma4ForConditionalGeneration around the E2B-style tiny text model."""
    text = gemma4_e2b_style().config
    torch.manual_seed(0)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    return Gemma4ForConditionalGeneration(config).eval()


def drafter_config_dict(target, *, nested_block_size: bool = False, block_size: int = 4, **overrides) -> dict:
    """config.json of a z-lab drafter for `target`: model_type qwen3, architectures DFlashDraftModel."""
    text = target.config.get_text_config()
    layers = text.num_hidden_layers
    dflash = {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": sorted({0, layers // 2, layers - 1})}
    config = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=text.hidden_size, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=512, vocab_size=text.vocab_size, tie_word_embeddings=False,
        num_target_layers=text.num_hidden_layers, dflash_config=dflash, dtype="float32",
    )
    if nested_block_size:
        dflash["block_size"] = block_size
    else:
        config["block_size"] = block_size
    for key in ("mask_token_id", "target_layer_ids"):
        if key in overrides:
            dflash[key] = overrides.pop(key)
    config.update(overrides)
    return config


def drafter_config(target, **kwargs) -> DFlashConfig:
    fields = drafter_config_dict(target, **kwargs)
    fields.pop("model_type")
    return DFlashConfig(**fields)


def random_drafter(target, seed: int = 0, **kwargs) -> DFlashDrafter:
    """A drafter with random weights; norm weights are randomised too, so swapped norms show up in tests."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(drafter_config(target, **kwargs)).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3)
            else:
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return drafter


def released_layout(config: dict) -> dict[str, tuple[int, ...]]:
    """Every key and shape of a z-lab DFlash checkpoint (docs/models.md §3), from config.json alone."""
    hidden, heads, kv_heads, head_dim = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim"))
    layout = {"fc.weight": (hidden, hidden * len(config["dflash_config"]["target_layer_ids"])),
              "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        layout |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (config["intermediate_size"], hidden),
            p + "mlp.up_proj.weight": (config["intermediate_size"], hidden),
            p + "mlp.down_proj.weight": (hidden, config["intermediate_size"]),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return layout


def random_state_dict(layout: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in layout.items()}


def write_checkpoint(path: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def greedy_continuations(target, prompts: list[torch.Tensor], max_new_tokens: int) -> torch.Tensor:
    """[len(prompts), prompt_len + max_new_tokens]: each prompt [1, prompt_len] and its greedy continuation."""
    return torch.cat([target.generate(p, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
                      for p in prompts])


def fit_drafter(target, drafter: DFlashDrafter, sequences: torch.Tensor, steps: int = 200, seed: int = 0):
    """Distil `drafter` on the target's own greedy `sequences` [n, len] with the DFlash block objective
    (random anchors, block `[token, mask...]`, cross-entropy on the block's drafts), so acceptance in the
    tests is neither all-0 nor all-k. A few seconds on CPU. Freezes the target's parameters."""
    target.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    num, length = sequences.shape
    k = drafter.block_size - 1
    with torch.no_grad():
        hidden_states = target(sequences, output_hidden_states=True).hidden_states
        target_hidden = [hidden_states[i + 1] for i in drafter.target_layer_ids]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        anchors = torch.randint(1, length - k, (num,), generator=gen)  # block token 0 = sequence[anchor]
        context = DenseDFlashContext.from_features(drafter, drafter.context_features(target_hidden),
                                                   torch.arange(length)[None] < anchors[:, None])
        positions = anchors[:, None] + torch.arange(k + 1)
        with torch.no_grad():
            embeds = drafter.embed_block(target, drafter.block_input_ids(sequences[torch.arange(num), anchors]))
        logits = drafter.draft_logits(target, drafter.draft_block(embeds, positions, context))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), sequences.gather(1, positions[:, 1:]).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()
