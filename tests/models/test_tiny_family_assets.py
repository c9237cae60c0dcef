"""The bundled tiny Gemma 4 target: loads with stock transformers, keeps the real models' quirks,
fits the size budget, and still models held-out Python (guards against a broken export)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec.assets import asset_path, available_assets, held_out_snippets

MAX_ASSET_BYTES = 12_000_000
MAX_PARAMETERS = 16_000_000
# Mean next-token loss over the bundled snippets, fp32 on CPU: 2.399 nats/token measured on the
# exported bf16 weights (transformers 5.17 and 5.23 agree). A broken export (wrong keys, config,
# tokenizer) lands far above the bound; an untrained model scores ~8.3.
SNIPPET_LOSS_BOUND = 2.399 + 0.3


@pytest.fixture(scope="module")
def target_dir():
    return asset_path("tiny-gemma4")


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def test_missing_asset_names_available_ones():
    with pytest.raises(FileNotFoundError, match="tiny-gemma4"):
        asset_path("no-such-model")
    assert "tiny-gemma4" in available_assets()


def test_size_and_bf16_weights(target_dir):
    assert sum(p.stat().st_size for p in target_dir.iterdir()) <= MAX_ASSET_BYTES
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}


def test_config_keeps_gemma4_quirks(target, target_dir):
    config = target.config
    types = config.layer_types
    assert type(target).__name__ == "Gemma4ForCausalLM"
    assert {"sliding_attention", "full_attention"} == set(types) and types[-1] == "full_attention"
    assert config.sliding_window <= 128
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    layer = config.per_layer_config
    assert {layer[i].head_dim for i in sliding} != {layer[i].head_dim for i in full}
    assert config.attention_k_eq_v
    assert max(layer[i].num_key_value_heads for i in full) < min(layer[i].num_key_value_heads for i in sliding)
    assert config.num_kv_shared_layers >= 2
    shared = set(range(config.num_hidden_layers - config.num_kv_shared_layers, config.num_hidden_layers))
    assert {types[i] for i in shared} == {"sliding_attention", "full_attention"}
    assert config.hidden_size_per_layer_input > 0 and config.vocab_size_per_layer_input == config.vocab_size
    assert config.final_logit_softcapping == 30.0
    assert config.tie_word_embeddings
    # The published checkpoints' keys, which every supported transformers version parses.
    raw = json.loads((target_dir / "config.json").read_text())
    assert raw["global_head_dim"] == layer[full[0]].head_dim
    assert raw["num_global_key_value_heads"] == layer[full[0]].num_key_value_heads


def test_weights_follow_the_quirks(target):
    config, layers = target.config, target.model.layers
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in target.parameters()) <= MAX_PARAMETERS
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        owns_kv = i < first_shared
        assert hasattr(attn, "k_proj") == owns_kv
        if owns_kv:
            assert (attn.v_proj is None) == (config.layer_types[i] == "full_attention")


def test_generation_config_ids(target, tokenizer):
    gen = target.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert tokenizer.padding_side == "left"


@pytest.mark.parametrize("source", [
    "def f(x):\n    return x  + 1  # trailing spaces   \n",
    "\tif a:\n\t\tpass\r\n",
    'name = "ünïcødé ✓"\nprint(f"{name!r:>10}")\n',
])
def test_tokenizer_round_trips_python_source(tokenizer, source):
    ids = tokenizer(source)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == source


def test_tokenizer_round_trips_snippets(tokenizer):
    for snippet in held_out_snippets():
        ids = tokenizer(snippet["text"])["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == snippet["text"]


def test_held_out_snippet_loss_under_bound(target, tokenizer):
    total_nats, num_tokens = 0.0, 0
    for snippet in held_out_snippets():
        ids = tokenizer(snippet["text"], return_tensors="pt").input_ids
        with torch.no_grad():
            logits = target(input_ids=ids[:, :-1]).logits
        total_nats += F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
        num_tokens += ids.shape[1] - 1
    assert total_nats / num_tokens < SNIPPET_LOSS_BOUND
