"""The bundled tiny Gemma 4 MTP assistant: loads as hf_specdec's assistant in the released checkpoint layout
(ordered embeddings), attaches to the bundled target, drafts losslessly, and still drafts well (a broken
export, config or ordering drops τ to ~1)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

import hf_specdec
from hf_specdec.assets import asset_path, held_out_snippets
from hf_specdec.models.gemma4 import Gemma4MTPAssistant, check_compatible, draft_sliding_window
from tests.bundled import check_family_size
from tests.models.gemma4.helpers import released_layout

ASSISTANT_MAX_BYTES = 3_000_000
PROMPTS = (0, 3)  # held-out snippets: asyncio/taskgroups.py, idlelib/format.py
PROMPT_CHARS, NEW_TOKENS, K = 400, 96, 4
# τ (tokens per target forward, bonus included) of greedy MTP at k=4 on PROMPTS, measured on CPU in fp32:
# 3.05 (transformers 5.17 and 5.23). An untrained assistant gives 1.0, the trained one with an identity
# token_ordering 1.21.
TAU_BOUND = 3.05 - 0.5


@pytest.fixture(scope="module")
def assistant_dir():
    return asset_path("tiny-gemma4-assistant")


@pytest.fixture(scope="module")
def assistant(assistant_dir):
    return hf_specdec.AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def target():
    return hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    tokenizer.padding_side = "left"
    snippets = held_out_snippets()
    return tokenizer([snippets[i]["text"][:PROMPT_CHARS] for i in PROMPTS], return_tensors="pt", padding=True)


def test_loads_as_our_assistant_with_ordered_embeddings(assistant):
    config = assistant.config
    assert isinstance(assistant, Gemma4MTPAssistant)
    assert config.model_type == "gemma4_assistant" and config.use_ordered_embeddings
    assert config.text_config.vocab_size % config.num_centroids == 0
    assert config.centroid_intermediate_top_k < config.num_centroids
    assert set(config.text_config.layer_types) == {"sliding_attention", "full_attention"}
    ordering = assistant.masked_embedding.token_ordering
    assert torch.equal(ordering.sort().values, torch.arange(config.text_config.vocab_size))
    assert not torch.equal(ordering, torch.arange(ordering.numel()))  # a trained ordering, not the default


def test_checkpoint_is_in_the_released_layout(assistant_dir):
    raw = json.loads((assistant_dir / "config.json").read_text())
    assert raw["architectures"] == ["Gemma4AssistantForCausalLM"]
    assert "per_layer_config" not in raw["text_config"] and "global_head_dim" in raw["text_config"]
    with safe_open(assistant_dir / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert shapes == released_layout(raw)
    assert dtypes.pop("masked_embedding.token_ordering") == "I64"
    assert set(dtypes.values()) == {"BF16"}


def test_sizes(assistant_dir):
    assert sum(p.stat().st_size for p in assistant_dir.iterdir()) <= ASSISTANT_MAX_BYTES
    check_family_size()


def test_attaches_to_the_bundled_target(assistant, target):
    check_compatible(assistant, target)
    assert assistant.config.backbone_hidden_size == target.config.hidden_size
    assert draft_sliding_window(assistant.config.text_config) == target.config.sliding_window + 1


@pytest.fixture(scope="module")
def generations(target, assistant, prompts):
    """(plain greedy ids, MTP greedy ids at k=4, its SpecStats): generations run past the sliding window."""
    kwargs = dict(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain = target.generate(**kwargs)
    mtp = target.generate(**kwargs, assistant_model=assistant, num_speculative_tokens=K)
    return plain, mtp, hf_specdec.last_generation_stats(target)


def test_greedy_mtp_equals_plain_greedy(generations):
    plain, mtp, stats = generations
    assert stats.spec_mode == "mtp" and stats.num_speculative_tokens == K
    assert torch.equal(mtp, plain)


def test_tau_at_k4_is_above_the_bound(generations):
    _, _, stats = generations
    assert stats.mean_accepted_length >= TAU_BOUND, stats


def test_training_path_matches_the_draft_step(assistant, target, prompts):
    """The batched training view of the draft steps (tools/tiny_family) equals decode-time `draft_step`."""
    train_assistant = pytest.importorskip("tools.tiny_family.train_assistant")
    ids = prompts["input_ids"][1:][:, prompts["attention_mask"][1].bool()]  # the unpadded row
    assert ids.shape[1] > draft_sliding_window(assistant.config.text_config) + 3 + K
    assert train_assistant.check_matches_draft_step(assistant, target, ids, K) < 1e-4
