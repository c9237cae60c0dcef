"""The tiny Gemma 4 MTP assistant: `hf_specdec`'s `Gemma4MTPAssistant` in the released checkpoint layout,
built for the bundled target `tiny-gemma4`.

Shape (docs/models.md §2), kept small so that one draft step costs a fraction of a target step on CPU:
- 2 Q-only layers `[sliding, full]` (the released ones have `[S, S, S, F]`) of hidden 128; each reads the
  K/V of the target's producer layer of its type (layers 5 and 3), so head dims (64 / 128), KV heads
  (2 / 1) and RoPE follow the target's;
- `pre_projection` [128, 2 * 256] over `cat[target_embed(token), h_prev]`, `post_projection` [256, 128];
- tied LM head [4096, 128] with ordered embeddings: 64 centroids of 64 tokens each, top 8 → 512
  candidate tokens per draft step; `token_ordering` groups tokens whose target embeddings are close
  (`balanced_kmeans_ordering`), so tokens the target weighs alike tend to share a centroid.
"""

import torch
import torch.nn.functional as F
from transformers import Gemma4ForCausalLM

from hf_specdec.models.gemma4 import Gemma4MTPAssistant, HFSpecGemma4AssistantConfig, producer_layer_for

from .gemma4_target import FULL, SLIDING, write_real_checkpoint_keys

LAYER_TYPES = [SLIDING, FULL]
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_ATTENTION_HEADS = 4
NUM_CENTROIDS = 64
CENTROID_TOP_K = 8


def tiny_assistant_config(target_config, hidden_size: int = HIDDEN_SIZE,
                          intermediate_size: int = INTERMEDIATE_SIZE) -> HFSpecGemma4AssistantConfig:
    """The assistant's config for `target_config` (a `gemma4_text` config): attention shapes, RoPE and
    sliding window are the producer layers'; the rest is the assistant's own small decoder."""
    sliding = target_config.per_layer_config[producer_layer_for(target_config, SLIDING)]
    full = target_config.per_layer_config[producer_layer_for(target_config, FULL)]
    text = dict(
        vocab_size=target_config.vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=len(LAYER_TYPES), layer_types=list(LAYER_TYPES), num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim, global_head_dim=full.head_dim,
        num_global_key_value_heads=full.num_key_value_heads, attention_k_eq_v=target_config.attention_k_eq_v,
        num_kv_shared_layers=len(LAYER_TYPES), sliding_window=target_config.sliding_window,
        rope_parameters=target_config.rope_parameters, max_position_embeddings=target_config.max_position_embeddings,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
        rms_norm_eps=target_config.rms_norm_eps, hidden_activation=target_config.hidden_activation,
        pad_token_id=target_config.pad_token_id, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
    )
    return HFSpecGemma4AssistantConfig(
        text_config=text, backbone_hidden_size=target_config.hidden_size, use_ordered_embeddings=True,
        num_centroids=NUM_CENTROIDS, centroid_intermediate_top_k=CENTROID_TOP_K, tie_word_embeddings=True,
    )


def build_model(target: Gemma4ForCausalLM, hidden_size: int = HIDDEN_SIZE,
                intermediate_size: int = INTERMEDIATE_SIZE) -> Gemma4MTPAssistant:
    """A fresh assistant for `target`, initialised from it where that helps training start:
    `token_ordering` from balanced k-means of the target's embedding rows, the tied LM head from their
    leading principal components, and the centroids from the mean LM-head row of each cluster."""
    assistant = Gemma4MTPAssistant(tiny_assistant_config(target.config, hidden_size, intermediate_size))
    target_rows = target.get_input_embeddings().weight.detach().float().cpu()  # [vocab, backbone_hidden]
    ordering = balanced_kmeans_ordering(target_rows, NUM_CENTROIDS)
    rows = principal_components(target_rows, hidden_size)
    rows = rows * (assistant.config.text_config.initializer_range / rows.std())
    head = assistant.masked_embedding
    with torch.no_grad():
        assistant.model.embed_tokens.weight.copy_(rows)
        head.token_ordering.copy_(ordering)
        head.centroids.weight.copy_(F.normalize(rows[ordering].view(NUM_CENTROIDS, -1, hidden_size).mean(1), dim=-1))
    return assistant


def balanced_kmeans_ordering(rows: torch.Tensor, num_clusters: int, iterations: int = 20,
                             seed: int = 0) -> torch.Tensor:
    """A permutation of the vocabulary in which each run of `vocab // num_clusters` consecutive entries is
    one cluster of cosine k-means over `rows` [vocab, dim], every cluster exactly that size (the layout
    `CentroidHead` reads). Deterministic for a given seed."""
    vocab = rows.shape[0]
    size = vocab // num_clusters
    points = F.normalize(rows.double(), dim=-1)
    generator = torch.Generator().manual_seed(seed)
    means = points[torch.randperm(vocab, generator=generator)[:num_clusters]]
    for _ in range(iterations):
        assignment = _balanced_assignment(points @ means.T, size)
        means = F.normalize(torch.zeros_like(means).index_add_(0, assignment, points), dim=-1)
    return torch.argsort(assignment * vocab + torch.arange(vocab), stable=True)


def _balanced_assignment(similarity: torch.Tensor, size: int) -> torch.Tensor:
    """Greedy capacity-constrained assignment: (token, cluster) pairs by decreasing similarity, each token
    taken once, each cluster filled up to `size`. similarity [vocab, clusters] -> cluster per token [vocab]."""
    vocab, clusters = similarity.shape
    assignment, room = [-1] * vocab, [size] * clusters
    for flat in torch.argsort(similarity.flatten(), descending=True, stable=True).tolist():
        token, cluster = divmod(flat, clusters)
        if assignment[token] < 0 and room[cluster]:
            assignment[token] = cluster
            room[cluster] -= 1
    return torch.tensor(assignment)


def principal_components(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """`rows` [vocab, d] projected on their `dim` leading principal directions -> [vocab, dim]."""
    centered = rows - rows.mean(0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)
    return centered @ v[:dim].T


def write_released_config(config: dict) -> dict:
    """config.json as released: the text config carries `global_head_dim` / `num_global_key_value_heads`
    instead of transformers' `per_layer_config` (every supported version parses it)."""
    config = dict(config)
    config["text_config"] = write_real_checkpoint_keys(config["text_config"])
    config["architectures"] = ["Gemma4AssistantForCausalLM"]
    return config
