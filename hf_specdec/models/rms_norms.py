"""RMSNorms of transformers' Llama-family and gpt-oss models in one kernel each, where the kernels run.

Eager torch runs such a norm as ~7 kernels (cast, pow, mean, add, rsqrt, products, casts); in a decode step of a
model whose layers hf_specdec does not fuse as a whole (gpt-oss, Llama, Qwen, Mistral: DFlash's targets) those
launches, not the bytes, are the norms' cost. Two arithmetics, the module's own:

- Llama's form (``LLAMA_FORM``): the fp32 rows times ``rsqrt(mean(x^2) + eps)``, rounded to the input's dtype, then
  times the weight in that dtype: :func:`rms_norm` with ``then_mul=weight``. Only where the weight has the input's
  dtype (an fp32 weight would promote the module's output to fp32).
- gpt-oss's (``GptOssRMSNorm``): the weight times the fp32 normalised rows, rounded once: :func:`rms_norm` with the
  weight.

Each forward runs the module's own elsewhere (the CPU, autograd); ``FUSED = False`` runs it everywhere (to compare
the two in one process).
"""

from __future__ import annotations

import importlib

import torch

from hf_specdec.generation.registry import FusedForward, register_fused_forwards
from hf_specdec.kernels import use_triton
from hf_specdec.kernels._dispatch import needs_grad
from hf_specdec.kernels.rms_norm import rms_norm

# (transformers model module, class) of the norms whose forward is LlamaRMSNorm's, line for line
LLAMA_FORM = (("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
              ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
              ("qwen3_moe", "Qwen3MoeRMSNorm"))
GPT_OSS_FORM = (("gpt_oss", "GptOssRMSNorm"),)
FUSED = True


def _kernels_take(self, x: torch.Tensor) -> bool:
    return FUSED and use_triton(x) and not needs_grad(x) and x.shape[-1] == self.weight.shape[-1]


def llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _kernels_take(self, hidden_states) or self.weight.dtype != hidden_states.dtype:
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, None, self.variance_epsilon, then_mul=self.weight)


def gpt_oss_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if not _kernels_take(self, hidden_states):
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def norm_classes(names) -> list[type]:
    """The classes of ``names`` this transformers version has."""
    found = []
    for model, name in names:
        try:
            module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        except ImportError:  # pragma: no cover - a model this version lacks
            continue
        if isinstance(getattr(module, name, None), type):
            found.append(getattr(module, name))
    return found


def register() -> None:
    register_fused_forwards(*(FusedForward(cls, llama_rms_norm_forward) for cls in norm_classes(LLAMA_FORM)),
                            *(FusedForward(cls, gpt_oss_rms_norm_forward) for cls in norm_classes(GPT_OSS_FORM)))


register()
