"""Tiny random models that keep each architecture's structural quirks (fp32, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma4ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

S, F = "sliding_attention", "full_attention"


def gemma4_e2b_style(**overrides) -> Gemma4ForCausalLM:
    """E2B-like: per-layer inputs (PLE), the last 2 layers KV-shared, sliding window 8."""
    config = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, layer_types=[S, S, F, S, S, F],
        final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    config.update(overrides)
    return _build(Gemma4ForCausalLM, Gemma4TextConfig(**config))


def gemma4_31b_style(**overrides) -> Gemma4ForCausalLM:
    """31B-like: attention_k_eq_v with fewer full-layer kv heads (4 sliding / 1 full), no KV sharing."""
    config = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=8, num_kv_shared_layers=0, hidden_size_per_layer_input=0, layer_types=[S, S, F, S, S, F],
        final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    config.update(overrides)
    return _build(Gemma4ForCausalLM, Gemma4TextConfig(**config))


def gemma4_26b_style(**overrides) -> Gemma4ForCausalLM:
    """26B-A4B-like: the 31B-style attention, and a mixture of experts (8 experts, top-2) beside each dense MLP."""
    config = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)
    config.update(overrides)
    return gemma4_31b_style(**config)


def llama(**overrides) -> LlamaForCausalLM:
    config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.update(overrides)
    return _build(LlamaForCausalLM, LlamaConfig(**config))


def chi_square_pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A target of 8 tokens for chi-square tests over many rows, and a model of another distribution to draft with
    (its weights moved by noise)."""
    target = llama(vocab_size=8, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    other = llama(vocab_size=8, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return target, other


def mistral(**overrides) -> MistralForCausalLM:
    """Mistral-style: a ``sliding_window`` on every layer and no ``layer_types``."""
    config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.update(overrides)
    return _build(MistralForCausalLM, MistralConfig(**config))


def qwen3(**overrides) -> Qwen3ForCausalLM:
    config = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.update(overrides)
    return _build(Qwen3ForCausalLM, Qwen3Config(**config))


def gpt_oss(**overrides) -> GptOssForCausalLM:
    """gpt-oss-style: learned softmax sinks on every layer (spread widely, so they move the scores), alternating
    sliding and full layers, experts with biases and a clamped SwiGLU (transformers' experts run them)."""
    config = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  layer_types=[S, F], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.update(overrides)
    model = _build(GptOssForCausalLM, GptOssConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 2.0)
    return model


def _build(cls, config):
    torch.manual_seed(0)
    model = cls(config).eval()
    # Random init gives near-uniform logits; a larger scale makes greedy choices decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0, 0.3)
    return model


def left_padded_batch(lengths: list[int], vocab: int = 97, pad: int = 0, seed: int = 0):
    """input_ids, attention_mask of a left-padded batch of random prompts with the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def char_tokenizer(vocab_size: int = 96):
    """A character-level fast tokenizer over printable ASCII (ids 3..), with pad=0, eos=1, bos=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][: vocab_size - 3]
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {ch: i + 3 for i, ch in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   padding_side="left")
