"""Export a trained member as a standard Hugging Face checkpoint (bf16 safetensors + tokenizer).

Also writes the bundled held-out snippets that tests and the demo use as prompts.
"""

import json
import os
import pathlib
from collections.abc import Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from .corpus import Document
from .tokenizer import SPECIAL_TOKENS

ConfigFixup = Callable[[dict], dict]  # rewrites config.json, e.g. for older transformers versions


def export_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None, out_dir: pathlib.Path,
    fix_config: ConfigFixup | None = None,
) -> dict[str, int]:
    """Casts `model` to bf16 in place and writes config, `model.safetensors` and, given a tokenizer, its
    files and a generation config with its bos/eos/pad ids (drafters without a tokenizer pass None).
    Returns the size of every file written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    model.to(torch.bfloat16).save_pretrained(out_dir)
    if fix_config is not None:
        config_path = out_dir / "config.json"
        config = fix_config(json.loads(config_path.read_text()))
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        # Older loaders and some tools look for this file; save_pretrained no longer always writes it.
        (out_dir / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2) + "\n")
    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    for path in files:
        path.chmod(0o644)  # save_pretrained may write 0600 files; package data must be world-readable
    return {p.name: p.stat().st_size for p in files}


def select_snippets(documents: list[Document], num_snippets: int, max_bytes: int) -> list[Document]:
    """Leading lines (at most `max_bytes`, cut at a line end) of held-out files, in corpus order.

    Library modules come first, then tests; generated codec tables (`encodings/`) come last, since
    they make dull prompts and flatter the loss.
    """
    def rank(doc: Document) -> tuple[int, str]:
        kind = 2 if doc.path.startswith("encodings/") else 1 if "test" in doc.path else 0
        return kind, doc.path

    ranked = sorted(documents, key=rank)
    snippets = []
    for doc in ranked[:num_snippets]:
        text = doc.text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
        snippets.append(Document(doc.path, text))
    return snippets


def write_snippets(snippets: list[Document], path: pathlib.Path, source: str) -> None:
    payload = {"source": source, "snippets": [{"path": s.path, "text": s.text} for s in snippets]}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")  # runs of a sweep write the same file
    partial.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    partial.replace(path)
