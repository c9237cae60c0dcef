"""The tiny Step 3.5: hf_specdec's `Step3p5ForCausalLM` with 3 MTP layers, trained jointly with them.

Quirks kept (docs/models.md §4), at ~5.3 M parameters:
- 5 main layers `[F, S, S, S, F]` (full layers at 0, 4 as in the real 0, 4, ..., 44) + 3 MTP layers,
  all sliding; sliding window 128 (the training windows are 512 tokens);
- full layers 4 query heads, sliding layers (MTP blocks included) 6, through `attention_other_setting`;
  2 KV heads (`num_attention_groups`), head_dim 32, per-head q/k norms, head-wise sigmoid gate;
- RoPE: full θ=5e6, partial 0.5, llama3 scaling ×2 (`yarn_only_types`); sliding θ=1e4, full rotary;
- layer 0 dense, layers 1-4 MoE: 4 experts top-2, sigmoid router with `router_bias` for selection only,
  renormalised weights × 3.0, one shared expert; SwiGLU clamps on the last main layer;
- MTP layer j: `enorm`/`hnorm`/`eh_proj` + a sliding dense block + its own `shared_head` (not tied);
- zero-centred RMSNorm everywhere. Unlike the released model, the embedding is tied to `lm_head`
  (it saves 1.3 MB of the 12 MB budget; the MTP heads stay untied).

config.json is written with the real keys (`real_config_dict`): per-layer lists cover main + MTP
layers, `rope_scaling` rather than the parsed `layer_rope_scaling`.

Training objective (DeepSeek-V3 §2.2 style, as Step 3.5's MTP layers are used at decode time): the
main model's next-token loss plus `mtp_weight` × each MTP layer's loss, where MTP layer j at position i
reads token t[i+1+j] and the layer below's output at i (the main model's pre-final-norm hidden state for
j = 0) and predicts t[i+2+j] — exactly how `Step3p5MTPDraftRunner` runs the layers when drafting. The router
bias is learned without gradients (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2): after every step
each bias moves by `rate` towards equal expert loads.
"""

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from hf_specdec.models.step3p5 import Step3p5Config, Step3p5ForCausalLM
from hf_specdec.models.step3p5.layers import Step3p5MoE

SLIDING, FULL = "sliding_attention", "full_attention"
MAIN_LAYER_TYPES = [FULL, SLIDING, SLIDING, SLIDING, FULL]
NUM_MTP_LAYERS = 3


def real_config_dict(tokenizer: PreTrainedTokenizerFast) -> dict:
    """config.json as StepFun ships it: raw keys, per-layer lists over main + MTP layers."""
    types = MAIN_LAYER_TYPES + [SLIDING] * NUM_MTP_LAYERS
    last_main = len(MAIN_LAYER_TYPES) - 1
    return dict(
        model_type="step3p5", architectures=["Step3p5ForCausalLM"],
        vocab_size=len(tokenizer), hidden_size=160, intermediate_size=384,
        num_hidden_layers=len(MAIN_LAYER_TYPES), num_nextn_predict_layers=NUM_MTP_LAYERS,
        num_attention_heads=4, num_attention_groups=2, head_dim=32,
        attention_other_setting={"attention_type": SLIDING, "num_attention_heads": 6, "num_attention_groups": 2,
                                 "head_dim": 32},
        layer_types=types, sliding_window=128,
        rope_theta=[5e6 if t == FULL else 1e4 for t in types],
        partial_rotary_factors=[0.5 if t == FULL else 1.0 for t in types],
        rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 2048,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        yarn_only_types=[FULL], max_position_embeddings=4096,
        use_head_wise_attn_gate=True, use_qk_norm=True, zero_centered=True, att_impl_type="GQA",
        moe_layers_enum=",".join(str(i) for i in range(1, len(MAIN_LAYER_TYPES))),
        moe_num_experts=4, moe_top_k=2, moe_intermediate_size=128, share_expert_dim=128,
        moe_router_activation="sigmoid", use_moe_router_bias=True, need_fp32_gate=True,
        moe_router_scaling_factor=3.0, norm_expert_weight=True,
        swiglu_limits=[7.0 if i == last_main else 0.0 for i in range(len(types))],
        swiglu_limits_shared=[16.0 if i == last_main else 0.0 for i in range(len(types))],
        rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> Step3p5ForCausalLM:
    return Step3p5ForCausalLM(Step3p5Config(**real_config_dict(tokenizer)))


def write_real_config(tokenizer: PreTrainedTokenizerFast):
    """`export_checkpoint`'s `fix_config`: the raw config.json (plus dtype / version fields of the save)."""
    def fix(saved: dict) -> dict:
        kept = {k: saved[k] for k in ("dtype", "torch_dtype", "transformers_version") if k in saved}
        return real_config_dict(tokenizer) | kept
    return fix


def mtp_layer_losses(model: Step3p5ForCausalLM, batch: torch.Tensor,
                     pre_norm_hidden_state: torch.Tensor) -> list[torch.Tensor]:
    """Mean cross-entropy of each MTP layer over a window, run causally as at decode time.

    batch [batch, T + 1] token ids t[0..T]; pre_norm_hidden_state [batch, T, hidden] of the main model on
    t[0..T-1]. Layer j's entries i = 0..T-2-j read t[i+1+j] and the layer below at i, predict t[i+2+j].
    """
    seq_len = batch.shape[1] - 1
    below, losses = pre_norm_hidden_state, []
    for j in range(model.num_mtp_layers):
        n = seq_len - 1 - j
        positions = torch.arange(n, device=batch.device)[None]
        step = model.mtp_step(j, batch[:, 1 + j: 1 + j + n], below[:, :n], position_ids=positions)
        losses.append(F.cross_entropy(step.logits.float().flatten(0, 1), batch[:, 2 + j: 2 + j + n].flatten()))
        below = step.hidden_state
    return losses


def joint_losses(model: Step3p5ForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """[1 + num_mtp_layers]: the main next-token loss, then each MTP layer's loss."""
    out = model(input_ids=batch[:, :-1], use_cache=False, output_pre_norm_hidden_states=True)
    main = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return torch.stack([main, *mtp_layer_losses(model, batch, out.pre_norm_hidden_state)])


class RouterBalancer:
    """Auxiliary-loss-free load balancing: `router_bias += rate * sign(mean load - load)` per step.

    Forward hooks on every MoE block count the experts each training token selects (the router is
    re-run on the block's input, no grad); `update()` applies and clears the counts.
    """

    def __init__(self, model: torch.nn.Module, rate: float):
        self.rate = rate
        self.loads: dict[Step3p5MoE, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._count) for m in model.modules() if isinstance(m, Step3p5MoE)]

    @torch.no_grad()
    def _count(self, module: Step3p5MoE, args, output) -> None:
        if not module.training:
            return
        _, experts = module.route(args[0].reshape(-1, args[0].shape[-1]))
        counts = torch.bincount(experts.flatten(), minlength=module.router_bias.numel())
        self.loads[module] = self.loads.get(module, 0) + counts

    @torch.no_grad()
    def update(self) -> None:
        for module, load in self.loads.items():
            load = load.float()
            module.router_bias.add_(self.rate * torch.sign(load.mean() - load))
        self.loads.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
