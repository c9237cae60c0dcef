"""The frozen target a drafter member learns from: the bundled target, its tokenizer, and the target's own
train / validation token streams (same corpus and split as the target was trained on)."""

import json
import pathlib
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from .corpus import load_corpus
from .data import TokenStream
from .tokenizer import encode_documents


@dataclass
class FrozenTarget:
    model: PreTrainedModel  # fp32, eval mode, no gradients
    tokenizer: PreTrainedTokenizerFast
    train_stream: TokenStream  # on the CPU
    validation_stream: TokenStream
    data: dict  # the report's "data" section: corpus summary and token counts


def load_frozen_target(target_dir: pathlib.Path, corpus_source: pathlib.Path | None, device) -> FrozenTarget:
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    corpus = load_corpus(corpus_source)
    train_stream = TokenStream.from_documents(encode_documents(tokenizer, [d.text for d in corpus.train]))
    validation_stream = TokenStream.from_documents(encode_documents(tokenizer, [d.text for d in corpus.validation]))
    data = corpus.summary() | {"train_tokens": train_stream.ids.numel(),
                               "validation_tokens": validation_stream.ids.numel()}
    print("data", json.dumps(data), flush=True)
    return FrozenTarget(target, tokenizer, train_stream, validation_stream, data)
