"""DFlash block-diffusion drafters (z-lab format), for any HF decoder target.

z-lab checkpoints say model_type `qwen3` with `architectures=["DFlashDraftModel"]`, so transformers'
`AutoConfig` reads them as Qwen3 models; `is_dflash_checkpoint` tells them apart and
`load_dflash_drafter` loads ours. Importing this package maps `DFlashConfig` to `DFlashDrafter` for
`transformers.AutoModelForCausalLM.from_config` / `from_pretrained(path, config=DFlashConfig...)`, and
registers the "dflash" speculative mode: `target.generate(assistant_model=drafter)` drafts with
`DFlashDraftRunner`.
"""

from transformers import AutoModelForCausalLM

from hf_specdec.generation.registry import DrafterBuilder, register_drafter

from . import drafter
from .configuration import DFlashConfig, DFlashSettings, build_target_layer_ids, is_dflash_checkpoint
from .context import DenseDFlashContext, DFlashContextSource, block_attention_mask, dense_block_attention
from .drafter import DFlashDraftRunner, PagedDFlashContext
from .modeling import CHECKPOINT_KEY_MAPPING, DFlashDrafter, DraftLayerSpec, load_dflash_drafter
from .target import (
    capture_hidden_states,
    check_compatible,
    head_logits,
    target_block_embeddings,
    target_final_softcap,
    target_head_logits,
    target_layer_hidden_modules,
    text_decoder,
)


def register_auto_classes() -> None:
    """Map `DFlashConfig` to `DFlashDrafter` in `AutoModelForCausalLM` (idempotent). No AutoConfig entry:
    the checkpoints' model_type is Qwen3's."""
    AutoModelForCausalLM.register(DFlashConfig, DFlashDrafter, exist_ok=True)


register_auto_classes()
register_drafter(DrafterBuilder("dflash", drafter.matches, drafter.build,
                                "a DFlash drafter (DFlashDraftModel, z-lab format) trained for this target",
                                misloaded=drafter.misloaded))

__all__ = [
    "CHECKPOINT_KEY_MAPPING", "DFlashConfig", "DFlashContextSource", "DFlashDraftRunner", "DFlashDrafter",
    "DFlashSettings", "DenseDFlashContext", "DraftLayerSpec", "PagedDFlashContext", "block_attention_mask",
    "build_target_layer_ids", "capture_hidden_states", "check_compatible", "dense_block_attention", "head_logits",
    "is_dflash_checkpoint", "load_dflash_drafter", "register_auto_classes", "target_block_embeddings",
    "target_final_softcap", "target_head_logits", "target_layer_hidden_modules", "text_decoder",
]
