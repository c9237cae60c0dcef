"""The family's byte-level BPE tokenizer, trained with the `tokenizers` library.

Ids 0..4 are special and match Gemma's conventions (pad 0, eos 1, bos 2); `<mask>` is reserved for
DFlash drafters (their `dflash_config.mask_token_id`). Encoding prepends `<bos>`; every training
document is `<bos> text <eos>`. Byte-level pre-tokenization makes decode(encode(text)) == text for
any Unicode text, indentation included.
"""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>",
                  "mask_token": "<mask>"}


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains the byte-level BPE on `texts` and wraps it for `save_pretrained`/`AutoTokenizer`."""
    specials = list(SPECIAL_TOKENS.values())
    bpe = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
    )
    return wrap_for_transformers(bpe)


def wrap_for_transformers(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    # No clean-up of spaces: decoding must give back source code byte for byte.
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        clean_up_tokenization_spaces=False,
        padding_side="left",  # batched generation pads on the left
        model_max_length=4096,
        **SPECIAL_TOKENS,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Token ids of each text as `[bos, ..., eos]` (batched through the Rust tokenizer)."""
    raw = tokenizer.backend_tokenizer
    encodings = raw.encode_batch(texts, add_special_tokens=False)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [[bos, *enc.ids, eos] for enc in encodings]
