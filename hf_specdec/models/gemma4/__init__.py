"""Gemma 4: the MTP assistant, its draft runner, and Gemma 4's fused forwards.

Importing this package registers the fused forwards of Gemma 4 targets with ``enable`` (``fusion.py``), the
"mtp" drafter for a Gemma 4 MTP assistant, and `HFSpecGemma4AssistantConfig` / `Gemma4MTPAssistant` for model_type
`gemma4_assistant` with transformers' `AutoConfig` / `AutoModelForCausalLM` (over transformers' own
classes, which cannot be built in 5.2x), so `from_pretrained` on an assistant directory returns ours.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from hf_specdec.generation.registry import DrafterBuilder, register_drafter

from . import fusion, mtp_drafter

from .assistant import (
    AssistantStepOutput,
    DenseTargetKVSource,
    Gemma4MTPAssistant,
    TargetKVSource,
    dense_attention,
    draft_sliding_window,
    target_embedding,
)
from .assistant_config import (
    HFSpecGemma4AssistantConfig,
    check_compatible,
    producer_layer_for,
    target_text_config,
)
from .mtp_drafter import Gemma4MTPDraftRunner, PagedTargetKVSource
from .centroid_head import (
    CandidateLogits,
    DenseLogits,
    DraftLogits,
    argmax_no_sync,
    probs,
    sample_no_sync,
)


def register_auto_classes() -> None:
    """Map model_type `gemma4_assistant` to our config and model (idempotent)."""
    AutoConfig.register("gemma4_assistant", HFSpecGemma4AssistantConfig, exist_ok=True)
    AutoModelForCausalLM.register(HFSpecGemma4AssistantConfig, Gemma4MTPAssistant, exist_ok=True)


register_auto_classes()
fusion.register()
register_drafter(DrafterBuilder("mtp", mtp_drafter.matches, mtp_drafter.build,
                                "a Gemma 4 MTP assistant (gemma4_assistant) for a Gemma 4 target",
                                auto_k_max=mtp_drafter.AUTO_K_MAX))

__all__ = [
    "AssistantStepOutput", "CandidateLogits", "DenseLogits", "DenseTargetKVSource", "DraftLogits",
    "Gemma4MTPAssistant", "Gemma4MTPDraftRunner", "PagedTargetKVSource", "HFSpecGemma4AssistantConfig",
    "TargetKVSource", "argmax_no_sync", "check_compatible", "dense_attention", "draft_sliding_window", "probs",
    "producer_layer_for", "register_auto_classes", "sample_no_sync", "target_embedding", "target_text_config",
]
