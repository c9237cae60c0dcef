"""The tiny Gemma 4 target: stock `Gemma4ForCausalLM` keeping every structural quirk of the real models.

Quirks kept (docs/models.md §1), at ~5.5 M parameters:
- layer types `[S, S, S, F] × 2`, the last layer full; sliding window 64 tokens;
- sliding layers: 2 KV heads of head_dim 64; full layers: `global_head_dim` 128 with
  `attention_k_eq_v` (no v_proj) and a single KV head (`num_global_key_value_heads` < `num_key_value_heads`);
- RoPE θ=1e4 on sliding layers, proportional RoPE θ=1e6 with partial factor 0.25 on full layers;
- the last 2 layers (one sliding, one full) are KV-shared, reading layers 5 and 3;
- per-layer inputs (PLE) of width 16 over the whole vocabulary, as in E2B/E4B;
- final-logit soft-cap 30, tied embeddings scaled by sqrt(hidden_size).
"""

from transformers import Gemma4ForCausalLM, Gemma4TextConfig, PreTrainedTokenizerFast

SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_gemma4_config(tokenizer: PreTrainedTokenizerFast) -> Gemma4TextConfig:
    vocab_size = len(tokenizer)
    return Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=352,
        num_hidden_layers=8,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL] * 2,
        sliding_window=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=128,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> Gemma4ForCausalLM:
    return Gemma4ForCausalLM(tiny_gemma4_config(tokenizer))


def write_real_checkpoint_keys(config: dict) -> dict:
    """config.json in the layout of the published Gemma 4 checkpoints.

    transformers folds `global_head_dim` / `num_global_key_value_heads` into `per_layer_config` when it
    parses a config; writing the published keys instead keeps the file loadable by every supported
    version (5.17 through 5.23) and by tools that read the real checkpoints.
    """
    config = dict(config)
    per_layer = config.pop("per_layer_config")
    full_layers = [str(i) for i, kind in enumerate(config["layer_types"]) if kind == FULL]
    overrides = {tuple(sorted(per_layer[i].items())) for i in full_layers}
    if len(overrides) != 1 or set(per_layer) != set(full_layers):
        raise ValueError(f"per_layer_config is not one override shared by the full layers: {per_layer}")
    override = dict(overrides.pop())
    config["global_head_dim"] = override["head_dim"]
    config["num_global_key_value_heads"] = override["num_key_value_heads"]
    return config
