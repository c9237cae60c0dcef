"""The tiny DFlash drafter of the bundled target `tiny-gemma4`: hf_specdec's `DFlashDrafter` in the z-lab
checkpoint layout (config.json with model_type `qwen3`, `architectures=["DFlashDraftModel"]`,
`dflash_config.{mask_token_id, target_layer_ids}`; keys `fc`, `hidden_norm`, `norm`, `layers.i.*`).

Shape, kept small so that one block forward costs a fraction of a target step on CPU (these are the defaults of
`train_dflash`; the bundled drafter was built with `--layer-types F,F,F,F,F,F --intermediate-size 256` and widened
to 320 later, `--widen-mlp`: hf_specdec/assets/README.md):
- hidden 256 (= the target's: the block is embedded with the target's scaled embedding and drafts are read
  through its tied, soft-capped head, both of width 256);
- 3 full-attention draft layers, bidirectional within the block (`--layer-types S,S,F` gives the sliding +
  full mix of the Gemma 4 DFlash drafters: sliding layers, window 64 as the target's, causal within the block;
  it drafted slightly worse here: hf_specdec/assets/README.md);
- `fc` fuses the target's hidden states after layers `target_layer_ids` (default 1, 4, 7: early, middle,
  and the last one, which is KV-shared in the target and read after its final norm);
- block_size 8: up to 7 drafts per target forward; `<mask>` (id 4) fills the block.
"""

from transformers import Gemma4ForCausalLM

from hf_specdec.models.dflash import DFlashConfig, DFlashDrafter

from .gemma4_target import FULL, SLIDING

LAYER_TYPES = [FULL, FULL, FULL]
HIDDEN_LAYERS = len(LAYER_TYPES)
INTERMEDIATE_SIZE = 640
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 8
TARGET_LAYER_IDS = (1, 4, 7)
MASK_TOKEN = "<mask>"


def tiny_dflash_config(target_config, mask_token_id: int, *, layer_types=tuple(LAYER_TYPES),
                       intermediate_size: int = INTERMEDIATE_SIZE, block_size: int = BLOCK_SIZE,
                       target_layer_ids=TARGET_LAYER_IDS) -> DFlashConfig:
    """The drafter's config for `target_config` (a `gemma4_text` config)."""
    return DFlashConfig(
        architectures=["DFlashDraftModel"], hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=NUM_ATTENTION_HEADS, num_key_value_heads=NUM_KEY_VALUE_HEADS, head_dim=HEAD_DIM,
        use_sliding_window=SLIDING in layer_types, sliding_window=target_config.sliding_window,
        rms_norm_eps=target_config.rms_norm_eps, rope_theta=10000.0,
        max_position_embeddings=target_config.max_position_embeddings, vocab_size=target_config.vocab_size,
        tie_word_embeddings=False, num_target_layers=target_config.num_hidden_layers, block_size=block_size,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )


def build_model(target: Gemma4ForCausalLM, mask_token_id: int, **config_kwargs) -> DFlashDrafter:
    """A fresh drafter for `target` (Qwen3-style initialisation; embedding and head stay the target's)."""
    return DFlashDrafter(tiny_dflash_config(target.config, mask_token_id, **config_kwargs))
