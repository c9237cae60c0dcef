"""gpt-oss: what its experts' own gate computes, registered so that its experts run through the fused MoE kernels.

``GptOssExperts._apply_gate`` takes the stacked projection's columns interleaved (gate at even, up at odd columns) and
computes ``g = gate.clamp(max=limit)``, ``(up.clamp(-limit, limit) + 1) * g * sigmoid(g * alpha)``: the kernels'
``"swiglu_oai"`` activation with the module's ``limit`` and ``alpha``. Its biases go to the kernels' bias terms. Its
attention's learned softmax sinks are computed by the paged attention (``attention/paged.py``), which needs nothing
model-specific.
"""

from __future__ import annotations

from hf_specdec.generation.registry import register_expert_gate

try:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
except ImportError:  # pragma: no cover - every supported transformers version has gpt-oss
    GptOssExperts = None


def swiglu_oai_terms(experts) -> dict:
    return dict(activation="swiglu_oai", limit=float(experts.limit), alpha=float(experts.alpha), interleaved=True)


if GptOssExperts is not None and "_apply_gate" in vars(GptOssExperts):
    register_expert_gate(GptOssExperts._apply_gate, swiglu_oai_terms)
