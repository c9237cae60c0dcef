"""Model shapes the benchmarks run: real public shapes with random weights, cut in depth on request.

Targets (docs/models.md §1, §4):
- ``gemma4-31b``: 60 layers, hidden 5376, intermediate 21504, 32 q heads; sliding 16 kv x 256 (window 1024),
  full 4 kv x 512 with attention_k_eq_v; vocab 262144; no KV sharing, no per-layer inputs.
- ``gemma4-e4b``: 42 layers, hidden 2560, intermediate 10240, 8 q / 2 kv heads, 256 / 512 head dims,
  window 512, the last 18 layers KV-shared, per-layer inputs (PLE) of 256.
- ``gemma4-e2b``: 35 layers in a [4 sliding, 1 full] pattern, hidden 1536, intermediate 6144, 8 q / 1 kv head,
  256 / 512 head dims, window 512, the last 20 layers KV-shared, PLE of 256. (Every MLP is taken at 6144; a
  double-wide MLP in the KV-shared layers, ``use_double_wide_mlp``, is not modelled.)
- ``gemma4-26b-a4b``: 30 layers, hidden 2816, 16 q heads; sliding 8 kv x 256 (window 1024), full 2 kv x 512 with
  attention_k_eq_v; a dense MLP (2112) beside 128 experts (top-8, 704) in every layer; vocab 262144.
- ``step3p5``: hidden 4096, vocab 128896; full layers 64 q heads, sliding 96, 8 kv, d128, window 512;
  layers 0-2 dense (11264), later layers MoE (288 experts top-8, 1280, one shared expert); 3 sliding MTP layers.
- ``gpt-oss-20b``: 24 layers alternating [sliding, full], hidden 2880, 64 q / 8 kv heads of 64, window 128, learned
  softmax sinks; 32 experts (top-4, 2880, with biases, gpt-oss's clamped SwiGLU) in every layer; vocab 201088; the
  weights in bf16 (the published checkpoint's MXFP4 experts, dequantized as transformers loads them without its
  MXFP4 kernels).
- ``smoke-*``: the same structure at toy sizes, for CPU runs in seconds.

``layers=N`` keeps each family's layer pattern ([5 sliding, 1 full], E2B [4 sliding, 1 full]; last layer full)
at depth N; a cut Gemma 4 E2B / E4B keeps its shared fraction (20/35, 18/42) of KV-shared layers. The depth is
part of ``model_shape`` (``gemma4-31b/L12``).

Gemma 4 MTP assistants (docs/models.md §2): every layer reads its producer's K/V, so kv heads and head
dims follow the target; four layers [S, S, S, F], ordered embeddings (2048 centroids, top 32). Public
facts fix the E2B assistant (hidden 256, 4 heads); its intermediate size (2048) is as read by third-party
converters. No public config of the E4B or 31B assistant was at hand: E4B's is taken as E2B's; the 31B
one (hidden 1024, 32 heads, intermediate 8192) is inferred from its published size (~0.5B parameters,
927 MB bf16) and is marked ``assistant_shape_source="inferred"`` in records.

Random weights are created on the device in the benchmark dtype by the models' own initialisers (normal,
std 0.02): a 60 GB model is ready in seconds, no checkpoint is read.

``weights="fp8"`` then quantizes the target in place into transformers' fine-grained FP8 layers (``FP8Linear``,
and ``FP8Experts`` for Gemma 4's experts; e4m3 weights with 128 x 128 block scales, as FP8 checkpoints ship;
the LM head and the embedding stay in the bench dtype, Step 3.5's routed experts too), one layer at a time, so
the peak is the dense model plus one layer (the 31B shape: 62 GB in bf16, then 31 GB).

``weights="nf4"`` and ``weights="int4"`` quantize every linear layer but the LM head to 4 bits in place, as
transformers' quantizers leave a model at load: bitsandbytes ``Linear4bit`` with NF4 weights (blocks of 64, fp32
absmax, no double quantization: ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``), and
torchao's ``Int4WeightOnlyConfig`` (groups of 128, 32 in the smoke shapes; on CUDA the tile-packed layout of
PyTorch's int4 matmul, on the CPU ``IntxWeightOnlyConfig``'s int4 layout, which runs there). Packed expert
tensors (the MoE shapes) stay in the bench dtype, as transformers' 4-bit quantizers leave them. The floor counts
the bytes as stored (:func:`stored_bytes`: packed weights plus their scales).
"""

from __future__ import annotations

import torch

S, F = "sliding_attention", "full_attention"
WEIGHTS = ("bf16", "fp8", "nf4", "int4")  # bf16: dense in the bench dtype (fp32 for --smoke on the CPU)
INT4_GROUP = 128
FP8_BLOCK = (128, 128)

GEMMA4_TARGETS = {
    "gemma4-31b": dict(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=1024, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
    ),
    "gemma4-e4b": dict(
        vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512, num_kv_shared_layers=18,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
    ),
    "gemma4-e2b": dict(
        vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, layer_period=5,
    ),
    "gemma4-26b-a4b": dict(
        vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
        attention_k_eq_v=True, sliding_window=1024, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    ),
    "smoke-26b-a4b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=16, num_kv_shared_layers=0, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=8, top_k_experts=2, moe_intermediate_size=32,
    ),
    "smoke-31b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=16, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
    ),
    "smoke-e4b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=16, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
    ),
}

# (assistant text-config fields, where they come from)
GEMMA4_ASSISTANTS = {
    "gemma4-31b": (dict(hidden_size=1024, intermediate_size=8192, num_attention_heads=32), "inferred"),
    "gemma4-e4b": (dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4), "e2b-assistant"),
    "gemma4-e2b": (dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4), "e2b-assistant"),
    "gemma4-26b-a4b": (dict(hidden_size=1024, intermediate_size=8192, num_attention_heads=32), "inferred"),
    "smoke-26b-a4b": (dict(hidden_size=32, intermediate_size=64, num_attention_heads=4), "toy"),
    "smoke-31b": (dict(hidden_size=32, intermediate_size=64, num_attention_heads=4), "toy"),
    "smoke-e4b": (dict(hidden_size=32, intermediate_size=64, num_attention_heads=4), "toy"),
}
ASSISTANT_LAYER_TYPES = [S, S, S, F]

STEP3P5 = {
    "step3p5": dict(hidden_size=4096, vocab_size=128896, heads=64, other_heads=96, kv=8, head_dim=128, window=512,
                    intermediate=11264, experts=288, top_k=8, expert_size=1280, num_layers=45),
    "smoke-step3p5": dict(hidden_size=64, vocab_size=512, heads=4, other_heads=6, kv=2, head_dim=16, window=16,
                          intermediate=128, experts=4, top_k=2, expert_size=32, num_layers=5),
}


GPT_OSS = {
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128),
    "smoke-gpt-oss": dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=16),
}


def gpt_oss_config(shape: str, layers: int | None = None):
    """GptOssConfig of a (cut) gpt-oss shape: layers alternate sliding and full attention."""
    from transformers import GptOssConfig

    fields = dict(GPT_OSS[shape])
    num_layers = layers or fields["num_hidden_layers"]
    fields.update(num_hidden_layers=num_layers, layer_types=[S if i % 2 == 0 else F for i in range(num_layers)],
                  pad_token_id=0, eos_token_id=None, bos_token_id=2)
    return GptOssConfig(**fields)


def shape_name(shape: str, layers: int | None) -> str:
    return f"{shape}/L{layers}" if layers else shape


def gemma4_layer_types(num_layers: int, period: int = 6) -> list[str]:
    types = [F if (i + 1) % period == 0 else S for i in range(num_layers)]
    types[-1] = F
    return types


def gemma4_config(shape: str, layers: int | None = None):
    """Gemma4TextConfig of a target shape, cut to ``layers`` when given."""
    from transformers import Gemma4TextConfig

    fields = dict(GEMMA4_TARGETS[shape])
    period = fields.pop("layer_period", 6)
    full_depth = fields["num_hidden_layers"]
    num_layers = layers or full_depth
    shared = round(fields["num_kv_shared_layers"] * num_layers / full_depth)
    if num_layers - shared < 6:  # the producers (last owning sliding and full layer) must stay
        shared = 0
    fields.update(num_hidden_layers=num_layers, num_kv_shared_layers=shared,
                  layer_types=gemma4_layer_types(num_layers, period), final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=None, bos_token_id=2)
    return Gemma4TextConfig(**fields)


def gemma4_assistant_config(shape: str, target_config):
    """HFSpecGemma4AssistantConfig of the MTP assistant for a target shape (see the module docstring)."""
    from hf_specdec.models.gemma4 import HFSpecGemma4AssistantConfig, producer_layer_for

    own, _ = GEMMA4_ASSISTANTS[shape]
    sliding = target_config.per_layer_config[producer_layer_for(target_config, S)]
    full = target_config.per_layer_config[producer_layer_for(target_config, F)]
    vocab = target_config.vocab_size
    text = dict(
        model_type="gemma4_text", vocab_size=vocab, num_hidden_layers=len(ASSISTANT_LAYER_TYPES),
        layer_types=list(ASSISTANT_LAYER_TYPES), num_key_value_heads=sliding.num_key_value_heads,
        head_dim=sliding.head_dim, global_head_dim=full.head_dim, attention_k_eq_v=target_config.attention_k_eq_v,
        num_kv_shared_layers=len(ASSISTANT_LAYER_TYPES), sliding_window=target_config.sliding_window,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", **own,
    )
    if target_config.attention_k_eq_v:
        text["num_global_key_value_heads"] = full.num_key_value_heads
    centroids = 2048 if vocab % 2048 == 0 and vocab >= 2048 * 32 else 16
    # the 26B-A4B assistant has a tied dense head (no centroids)
    ordered = not getattr(target_config, "enable_moe_block", False)
    return HFSpecGemma4AssistantConfig(text_config=text, backbone_hidden_size=target_config.hidden_size,
                                       use_ordered_embeddings=ordered, num_centroids=centroids,
                                       centroid_intermediate_top_k=32 if centroids == 2048 else 4,
                                       tie_word_embeddings=True)


def step3p5_config(shape: str, layers: int | None = None):
    """Step3p5Config of a (cut) Step 3.5 shape with its 3 MTP layers."""
    from hf_specdec.models.step3p5 import Step3p5Config

    s = STEP3P5[shape]
    num_layers = layers or s["num_layers"]
    types = [F if i % 4 == 0 else S for i in range(num_layers)] + [S] * 3
    dense = min(3, num_layers - 1) if num_layers > 1 else 1
    return Step3p5Config(
        model_type="step3p5", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate"], num_hidden_layers=num_layers, num_attention_heads=s["heads"],
        num_attention_groups=s["kv"], head_dim=s["head_dim"],
        attention_other_setting={"attention_type": S, "num_attention_heads": s["other_heads"],
                                 "num_attention_groups": s["kv"], "head_dim": s["head_dim"]},
        layer_types=types, sliding_window=s["window"], rope_theta=[5e6 if t == F else 1e4 for t in types],
        partial_rotary_factors=[0.5 if t == F else 1.0 for t in types],
        rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 4096,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        yarn_only_types=[F], use_head_wise_attn_gate=True,
        moe_layers_enum=",".join(str(i) for i in range(dense, num_layers)), moe_num_experts=s["experts"],
        moe_top_k=s["top_k"], moe_intermediate_size=s["expert_size"], moe_router_scaling_factor=3.0,
        moe_router_activation="sigmoid", use_moe_router_bias=True, need_fp32_gate=True, norm_expert_weight=True,
        share_expert_dim=s["expert_size"], num_nextn_predict_layers=3, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=65536, pad_token_id=0, eos_token_id=None, bos_token_id=2,
    )


def build_on_device(model_class, config, device: str, dtype: torch.dtype, seed: int = 0):
    """``model_class(config)`` created directly on ``device`` in ``dtype`` (its own random init), eval mode."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None  # random weights: never stop early, every row runs to the end
        model.generation_config.pad_token_id = 0
    return model.eval()


def gemma4_target(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    from transformers import Gemma4ForCausalLM

    return build_on_device(Gemma4ForCausalLM, gemma4_config(shape, layers), device, dtype)


def gemma4_assistant(shape: str, target, device: str, dtype: torch.dtype):
    from hf_specdec.models.gemma4 import Gemma4MTPAssistant

    config = gemma4_assistant_config(shape, target.config)
    assistant = build_on_device(Gemma4MTPAssistant, config, device, dtype, seed=1)
    if assistant.masked_embedding is None:  # a dense head
        return assistant
    with torch.no_grad():  # a shuffled ordering, as trained checkpoints have (the identity would be a special case)
        ordering = assistant.masked_embedding.token_ordering
        ordering.copy_(torch.randperm(ordering.numel(), generator=torch.Generator().manual_seed(1)).to(ordering.device))
    return assistant


def step3p5_target(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    from hf_specdec.models.step3p5 import Step3p5ForCausalLM

    return build_on_device(Step3p5ForCausalLM, step3p5_config(shape, layers), device, dtype)


def gpt_oss_target(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    from transformers import GptOssForCausalLM

    return build_on_device(GptOssForCausalLM, gpt_oss_config(shape, layers), device, dtype)


def target_for(shape: str, layers: int | None, device: str, dtype: torch.dtype, weights: str = "bf16"):
    """The target of any shape above (Gemma 4, Step 3.5, gpt-oss), its weights in ``weights`` (:data:`WEIGHTS`)."""
    build = step3p5_target if shape in STEP3P5 else gpt_oss_target if shape in GPT_OSS else gemma4_target
    return with_weights(build(shape, layers, device, dtype), weights)


def with_weights(model, weights: str):
    """``model`` with its weights as ``weights`` says: as built ("bf16"), or quantized in place (module docstring)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "fp8":
        from hf_specdec.generation.quantization import fp8_quantize_model

        fp8_quantize_model(model, FP8_BLOCK)
    elif weights == "nf4":
        _nf4_quantize(model)
    elif weights == "int4":
        _int4_quantize(model)
    if weights != "bf16" and model.device.type == "cuda":
        torch.cuda.empty_cache()  # the dense weights' blocks go back to the device for the KV cache
    return model


def _quantized_linears(model):
    """(name, module) of the nn.Linear layers transformers' quantizers convert: all but the LM head."""
    head = model.get_output_embeddings()
    return [(name, module) for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and module is not head]


def _nf4_quantize(model) -> None:
    import bitsandbytes as bnb

    for name, dense in _quantized_linears(model):
        layer = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=dense.bias is not None,
                                  compute_dtype=dense.weight.dtype, compress_statistics=False, quant_type="nf4",
                                  device="meta")
        weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, compress_statistics=False,
                                   quant_type="nf4", blocksize=64)
        layer.weight = weight._quantize(dense.weight.device) if dense.weight.is_cuda else weight.to("cpu")
        if dense.bias is not None:
            layer.bias = dense.bias
        model.set_submodule(name, layer)


def _int4_quantize(model) -> None:
    from torchao.quantization import Int4WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    linears = _quantized_linears(model)
    group = INT4_GROUP if all(m.in_features % INT4_GROUP == 0 for _, m in linears) else 32  # 32: the smoke shapes
    linears = [(name, m) for name, m in linears if m.in_features % group == 0]  # narrower ones stay dense
    if model.device.type == "cuda":
        config = Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d")
    else:
        config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))
    convert = {id(module) for _, module in linears}
    quantize_(model, config, filter_fn=lambda module, _name: id(module) in convert)


def stored_bytes(p: torch.Tensor) -> int:
    """Bytes ``p`` occupies as stored: a tensor subclass (torchao) by its inner tensors, a bitsandbytes 4-bit
    parameter by its packed bytes plus its quantization state (absmax, and the nested state if any)."""
    if hasattr(p, "__tensor_flatten__") and type(p) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = p.__tensor_flatten__()
        return sum(stored_bytes(getattr(p, name)) for name in names)
    total = p.numel() * p.element_size()
    state = getattr(p, "quant_state", None)
    while state is not None:
        total += state.absmax.numel() * state.absmax.element_size()
        state = getattr(state, "state2", None)
    return total


def random_prompt(batch: int, length: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """[batch, length] token ids, avoiding the special ids 0-2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).to(device)


# packed expert weights [num_experts, ...] of the MoE shapes (Gemma 4 experts, Step 3.5 routed experts), and the
# block scales of FP8 experts
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj", "moe.gate_proj.weight", "moe.up_proj.weight",
                  "moe.down_proj.weight", "experts.gate_up_proj_scale_inv", "experts.down_proj_scale_inv",
                  "experts.gate_up_proj_bias", "experts.down_proj_bias")


def expected_active_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a forward of ``tokens`` tokens reads, in expectation, when each token picks ``top_k`` of
    ``num_experts`` uniformly (random weights route close to that): ``E * (1 - (1 - k/E)^tokens)``; top_k for
    one token, the union of the tokens' experts for a batch or a verify step."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def streamed_bytes_per_step(model, batch: int, context: int, tokens_per_row: int = 1) -> dict:
    """Bytes a decode step must read: every weight once as stored (FP8: one byte per weight plus its block
    scales; 4-bit: the packed weights and their scales; lookup tables: one row per token), of an MoE layer's
    experts only those the step's ``batch * tokens_per_row`` tokens select (:func:`expected_active_experts`), plus
    the K/V of ``context`` tokens (the window on sliding layers) per row in each layer that owns K/V. A target's own
    MTP layers (Step 3.5) are not counted: only drafting runs them, never a decode or verify step."""
    config = model.config.get_text_config()
    lookups = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    unread = _drafting_only_parameters(model)
    weight_bytes = 0
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        if id(p) in unread:
            continue
        if any(p is w for w in lookups) and p is not head_weight:
            weight_bytes += batch * p.shape[-1] * p.element_size()
        elif name.endswith(EXPERT_WEIGHTS):
            active = expected_active_experts(p.shape[0], _top_k(config), batch * tokens_per_row)
            weight_bytes += round(p.numel() * p.element_size() * active / p.shape[0])
        else:
            weight_bytes += stored_bytes(p)
    kv_bytes = 0
    element = model.get_input_embeddings().weight.element_size()  # the activation dtype (weights may be FP8)
    for heads, dim, window in _kv_layers(config):
        kv_bytes += 2 * batch * min(context, window or context) * heads * dim * element
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes_per_step": weight_bytes + kv_bytes}


def _drafting_only_parameters(model) -> set[int]:
    """Ids of the parameters only a target's own MTP layers hold (``model.model.mtp_layers``: Step 3.5's layers past
    ``num_hidden_layers``, each with its own head); one the main model shares too is read by decoding."""
    mtp_layers = getattr(getattr(model, "model", None), "mtp_layers", None) or []
    if not mtp_layers:
        return set()
    prefixes = tuple(f"model.layers.{layer.layer_idx}." for layer in mtp_layers)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {i for i, owners in names.items() if all(n.startswith(prefixes) for n in owners)}


def _top_k(config) -> int:
    return (getattr(config, "top_k_experts", None) or getattr(config, "num_experts_per_tok", None)
            or getattr(config, "moe_top_k"))


def _kv_layers(config):
    """(kv heads, head dim, window) of each layer that owns K/V."""
    if hasattr(config, "layer_num_kv_heads"):  # Step 3.5 (main layers)
        for i in range(config.num_hidden_layers):
            yield config.layer_num_kv_heads(i), config.layer_head_dim(i), config.layer_sliding_window(i)
    elif getattr(config, "model_type", None) == "gemma4_text":  # per-layer head dims and KV heads
        owners = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
        for i in range(owners):
            layer = config.per_layer_config[i]
            window = config.sliding_window if config.layer_types[i] == S else None
            yield layer.num_key_value_heads, layer.head_dim, window
    else:
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        types = getattr(config, "layer_types", None) or [S] * config.num_hidden_layers
        for i in range(config.num_hidden_layers):  # a window only on sliding layers (gpt-oss alternates)
            yield heads, dim, getattr(config, "sliding_window", None) if types[i] == S else None


def floor_tokens_per_s(model, batch: int, context: int, bandwidth_gb_s: float, tokens_per_row: int = 1) -> dict:
    """The memory-bandwidth floor of plain decoding (``tokens_per_row`` > 1: of a verify step's forward, in steps
    per second times the batch): measured copy bandwidth / bytes streamed per step."""
    streamed = streamed_bytes_per_step(model, batch, context, tokens_per_row)
    return {**streamed, "floor_tokens_per_s": bandwidth_gb_s * 1e9 / streamed["bytes_per_step"] * batch}
