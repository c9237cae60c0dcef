"""The bundled tiny family, loaded once per test session (fp32), and the decoding modes tests run them in.

Tests that change a model's CacheConfig restore it (:func:`cache_config`); every call here uses the same
model objects, so a test that leaves state behind shows up in the next one.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec.assets import asset_path, available_assets
from hf_specdec.cache import sizing
from hf_specdec.generation import registry

SPEC_MODES = ["gemma_mtp", "step_mtp", "gemma_dflash"]
MODES = ["plain"] + SPEC_MODES


@functools.lru_cache(maxsize=None)
def gemma():
    """(enabled tiny-gemma4, its MTP assistant, a stock transformers copy of the target)."""
    path = asset_path("tiny-gemma4")
    target = hf_specdec.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                                dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return target, assistant, reference


@functools.lru_cache(maxsize=None)
def step():
    """(enabled tiny-step3p5 with its 3 MTP layers, a stock copy)."""
    path = asset_path("tiny-step3p5")
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))


def dflash_registered() -> bool:
    return any(b.spec_mode == "dflash" for b in registry._BUILDERS)


@functools.lru_cache(maxsize=None)
def dflash():
    """The DFlash drafter of tiny-gemma4: the bundled one, else a random one (acceptance near 0); skips while
    no builder serves spec_mode="dflash"."""
    if not dflash_registered():
        pytest.skip("no DFlash drafter is registered for spec_mode='dflash' yet (hf_specdec.models.dflash)")
    if "tiny-gemma4-dflash" in available_assets():
        return hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"), dtype=torch.float32)
    from tests.models.dflash.helpers import random_drafter

    return random_drafter(gemma()[0])


def mode(name: str):
    """(enabled model, generate kwargs, stock reference model) of a decoding mode. Speculative modes get a fixed k
    (DFlash: its default, the block's width - 1): a greedy call without one chooses k per round, from its timings."""
    if name.startswith("step"):
        model, reference = step()
        return model, ({} if name == "step_plain" else dict(spec_mode="mtp", num_speculative_tokens=3)), reference
    target, assistant, reference = gemma()
    if name == "gemma_dflash":
        drafter = dflash()
        return target, dict(assistant_model=drafter, spec_mode="dflash",
                            num_speculative_tokens=drafter.block_size - 1), reference
    extra = {"plain": {}, "gemma_mtp": dict(assistant_model=assistant, num_speculative_tokens=4)}[name]
    return target, extra, reference


@contextlib.contextmanager
def cache_config(model, config: hf_specdec.CacheConfig):
    saved = model._hf_specdec.cache_config
    hf_specdec.enable(model, config)
    try:
        yield
    finally:
        hf_specdec.enable(model, saved)


@contextlib.contextmanager
def recorded_caches(monkeypatch):
    """Every PagedKVCache a request builds (the target's and a drafter's), for checking they were freed."""
    made = []
    build = sizing.cache_for_request

    def record(*args, **kwargs):
        made.append(build(*args, **kwargs))
        return made[-1]

    with monkeypatch.context() as patch:
        patch.setattr(sizing, "cache_for_request", record)
        yield made


def prompts(n: int, chars: int = 120) -> list[str]:
    """The first ``chars`` characters of n held-out snippets (code no family member was trained on)."""
    from hf_specdec.assets import held_out_snippets

    snippets = held_out_snippets()
    return [snippets[i % len(snippets)]["text"][:chars] for i in range(n)]


def batch(n: int = 2, chars: int = 120):
    """input_ids, attention_mask of n left-padded held-out prompts of different lengths."""
    tok = tokenizer()
    tok.padding_side = "left"
    texts = [p[: chars - 17 * i] for i, p in enumerate(prompts(n, chars))]
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def fresh_token(reference, ids, mask, row: int, at: int, new_tokens: int) -> int:
    """A token that plain decoding (``reference``, ``new_tokens`` of them) emits at new position ``at`` of ``row`` or
    after it, and not before in that row: an EOS that stops the row there while the other rows go on."""
    new = reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None)[row, ids.shape[1]:].tolist()
    for position in range(at, len(new)):
        if new[position] not in new[:position]:
            return new[position]
    raise AssertionError(f"row {row} repeats itself: no fresh token to stop it")


FAMILY_MAX_WEIGHT_BYTES = 30_000_000  # docs/architecture.md: the bundled family's safetensors, all together
FAMILY_MAX_OTHER_BYTES = 1_000_000  # its tokenizers, held-out snippets, README and loader beside them (0.58 MB)


def check_family_size() -> None:
    """The bundled family stays small: its weights within the documented cap, and the files beside them too."""
    from hf_specdec.assets import ASSETS_DIR

    files = [p for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    weights = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    others = sum(p.stat().st_size for p in files if p.suffix != ".safetensors")
    assert weights <= FAMILY_MAX_WEIGHT_BYTES, f"the family's safetensors take {weights:,} B"
    assert others <= FAMILY_MAX_OTHER_BYTES, f"the family's other files take {others:,} B"
