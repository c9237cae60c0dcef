"""Tiny random Step 3.5 models and checkpoints in the real config.json / safetensors layout.

Keeps the structural quirks: full + sliding layers with different query-head counts, partial RoPE
with llama3 scaling on full layers only, dense and MoE layers (3 experts, shared expert, router bias),
SwiGLU clamps, head-wise gate, 3 sliding MTP layers, sliding window 5 < test sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hf_specdec.models.step3p5 import Step3p5Config, Step3p5ForCausalLM

S, F = "sliding_attention", "full_attention"
NUM_LAYERS, NUM_MTP = 4, 3
MAIN_TYPES = [F, S, S, F]


SEQ = 12  # test sequence length, > sliding window 5


def random_ids(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids avoiding the special ids 0-2."""
    return torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def real_config_dict(num_mtp: int = NUM_MTP, **overrides) -> dict:
    """config.json as StepFun ships it: per-layer lists cover main + MTP layers, raw key names."""
    types = MAIN_TYPES + [S] * num_mtp
    raw = dict(
        model_type="step3p5", architectures=["Step3p5ForCausalLM"], torch_dtype="float32",
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2, num_attention_groups=1, head_dim=8,
        attention_other_setting={"attention_type": S, "num_attention_heads": 4, "num_attention_groups": 1,
                                 "head_dim": 8},
        layer_types=types, sliding_window=5,
        rope_theta=[5e6 if t == F else 1e4 for t in types],
        partial_rotary_factors=[0.5 if t == F else 1.0 for t in types],
        rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 16,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        yarn_only_types=[F], use_head_wise_attn_gate=True,
        moe_layers_enum="2,3", moe_num_experts=3, moe_top_k=2, moe_intermediate_size=16,
        moe_router_scaling_factor=2.5, moe_router_activation="sigmoid", use_moe_router_bias=True,
        need_fp32_gate=True, norm_expert_weight=True, share_expert_dim=16,
        swiglu_limits=[0.0, 0.0, 0.0, 0.5] + [0.0] * num_mtp,
        swiglu_limits_shared=[0.0, 0.0, 0.7, 0.0] + [0.0] * num_mtp,
        num_nextn_predict_layers=num_mtp, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2, att_impl_type="GQA",
    )
    raw.update(overrides)
    return raw


def tiny_config(**overrides) -> Step3p5Config:
    return Step3p5Config(**real_config_dict(**overrides))


def tiny_model(seed: int = 0, **overrides) -> Step3p5ForCausalLM:
    """fp32, eval mode, weights ~N(0, 0.3) (norm weights ~N(0, 0.1)) so greedy choices are decisive."""
    torch.manual_seed(seed)
    model = Step3p5ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1 if name.endswith("norm.weight") or "router_bias" in name else 0.3)
    return model


def _attention_keys(config: Step3p5Config, i: int) -> dict[str, tuple[int, ...]]:
    h, d = config.hidden_size, config.layer_head_dim(i)
    q, kv = config.layer_num_heads(i), config.layer_num_kv_heads(i)
    return {
        "self_attn.q_proj.weight": (q * d, h), "self_attn.k_proj.weight": (kv * d, h),
        "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, q * d),
        "self_attn.g_proj.weight": (q, h), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }


def _ffn_keys(config: Step3p5Config, i: int) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    if not config.is_moe_layer(i):
        inter = config.intermediate_size
        return {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                "mlp.down_proj.weight": (h, inter)}
    e, inter, shared = config.moe_num_experts, config.moe_intermediate_size, config.share_expert_dim
    return {
        "moe.gate.weight": (e, h), "moe.router_bias": (e,),
        "moe.gate_proj.weight": (e, inter, h), "moe.up_proj.weight": (e, inter, h),
        "moe.down_proj.weight": (e, h, inter),
        "share_expert.gate_proj.weight": (shared, h), "share_expert.up_proj.weight": (shared, h),
        "share_expert.down_proj.weight": (h, shared),
    }


def real_layout_shapes(config: Step3p5Config, head_name: str = "head", with_mtp: bool = True) -> dict:
    """Checkpoint key -> shape, written from the published layout (not from our module tree)."""
    h, v = config.hidden_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    last = config.num_total_layers if with_mtp else config.num_hidden_layers
    for i in range(last):
        block = {**_attention_keys(config, i), **_ffn_keys(config, i)}
        if i >= config.num_hidden_layers:
            block.update({"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                          "shared_head.norm.weight": (h,), f"shared_head.{head_name}.weight": (v, h)})
        shapes.update({f"model.layers.{i}.{k}": s for k, s in block.items()})
    return shapes


def write_checkpoint(path: Path, raw_config: dict, head_name: str = "head", with_mtp: bool = True,
                     seed: int = 1) -> dict[str, torch.Tensor]:
    """Write config.json + model.safetensors with random tensors under the real key names; returns them."""
    config = Step3p5Config(**raw_config)
    gen = torch.Generator().manual_seed(seed)
    shapes = real_layout_shapes(config, head_name, with_mtp)
    tensors = {key: torch.randn(shape, generator=gen) * 0.3 for key, shape in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw_config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return tensors
