"""One checkpoint in both stacks (hf_specdec/models/step3p5/step3p7.py): the key mapping, the configs
transformers' Step 3.7 cannot express, and a Step3p5ForCausalLM written as a Step 3.7 checkpoint giving the
same logits and greedy tokens in transformers' Step3p7ForConditionalGeneration (an implementation of the same
architecture written apart from this one)."""

import json

import pytest
import torch

from hf_specdec.models.step3p5 import step3p7

from .tiny_step3p5 import NUM_LAYERS, SEQ, random_ids, tiny_config, tiny_model

needs_step3p7 = pytest.mark.skipif(not step3p7.is_available(), reason="this transformers has no Step 3.7")


def test_key_mapping_dense_moe_and_mtp_layers():
    model = tiny_model()
    state = model.state_dict()
    converted = step3p7.to_step3p7_state_dict(state, NUM_LAYERS)
    assert "model.language_model.embed_tokens.weight" in converted and "lm_head.weight" in converted
    assert torch.equal(converted["model.language_model.layers.0.mlp.gate_proj.weight"],
                       state["model.layers.0.mlp.gate_proj.weight"])
    moe = "model.language_model.layers.2.mlp."
    gate_up = converted[moe + "experts.gate_up_proj"]  # [experts, 2 * width, hidden], gate rows first
    width = model.config.moe_intermediate_size
    assert torch.equal(gate_up[:, :width], state["model.layers.2.moe.gate_proj.weight"])
    assert torch.equal(gate_up[:, width:], state["model.layers.2.moe.up_proj.weight"])
    assert torch.equal(converted[moe + "experts.down_proj"], state["model.layers.2.moe.down_proj.weight"])
    assert torch.equal(converted[moe + "gate.e_score_correction_bias"], state["model.layers.2.moe.router_bias"])
    assert moe + "shared_experts.up_proj.weight" in converted
    assert not any(".moe." in k or ".share_expert." in k for k in converted)
    assert not any(k.startswith(f"model.language_model.layers.{NUM_LAYERS}.") for k in converted)  # MTP
    assert len(converted) == sum(step3p7.layer_index(k) is None or step3p7.layer_index(k) < NUM_LAYERS
                                 for k in state) - 2  # per MoE layer (2, 3): gate_proj + up_proj -> gate_up_proj


def test_text_config_keeps_rope_scaling_moe_layers_and_mtp_heads():
    fields = step3p7.step3p7_text_config(tiny_config())
    assert fields["rope_scaling"]["rope_type"] == "llama3" and "layer_rope_scaling" not in fields
    assert fields["moe_layers_enum"] == "2,3"
    assert fields["mtp_per_layer_config"] == {k: {"num_attention_heads": 4} for k in range(3)}


@pytest.mark.parametrize("override,what", [
    (dict(attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 4,
                                   "num_attention_groups": 2, "head_dim": 8}), "per-layer KV heads"),
    (dict(yarn_only_types=None), "rope_scaling on other layers"),
    (dict(use_head_wise_attn_gate=False), "no head-wise attention gate"),
])
def test_text_config_refuses_what_step3p7_cannot_express(override, what):
    with pytest.raises(ValueError, match=what):
        step3p7.step3p7_text_config(tiny_config(**override))


def _load_step3p7(model, folder):
    from transformers import Step3p7ForConditionalGeneration

    step3p7.save_as_step3p7(model, folder)
    native = Step3p7ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    native.generation_config.eos_token_id = None
    return native


@needs_step3p7
@pytest.mark.parametrize("tied", [False, True])
def test_written_checkpoint_gives_the_same_logits_and_tokens(tmp_path, tied):
    model = tiny_model(tie_word_embeddings=tied)
    model.generation_config.eos_token_id = None
    native = _load_step3p7(model, tmp_path)
    ids = random_ids(batch=1)  # SEQ tokens, past the sliding window
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert expected.shape == (1, SEQ + 8)
    assert torch.equal(native.generate(ids, max_new_tokens=8, do_sample=False), expected)


@needs_step3p7
def test_written_checkpoint_shards_and_mtp_layers(tmp_path):
    model = tiny_model()
    step3p7.save_as_step3p7(model, tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 1 + model.config.num_total_layers  # top-level + one per layer
    mtp = [k for k in weight_map if step3p7.layer_index(k) == NUM_LAYERS]
    assert "model.layers.4.eh_proj.weight" in mtp and "model.layers.4.shared_head.norm.weight" in mtp
    assert not any(k.endswith("shared_head.head.weight") for k in weight_map)  # transformers drafts with lm_head


@needs_step3p7
def test_native_mtp_generate_equals_plain_where_it_runs(tmp_path):
    model = tiny_model()
    for layer in model.model.mtp_layers:  # the head transformers' MTP drafts with
        layer.shared_head.head.weight = model.lm_head.weight
    native = _load_step3p7(model, tmp_path)
    ids = random_ids(batch=1)
    plain = native.generate(ids, max_new_tokens=8, do_sample=False)
    try:
        drafted = native.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True)
    except TypeError as err:  # 5.17 only: its Step 3.7 MTP layers call the rotary embedding without a layer type
        if "layer_type" not in str(err) or _transformers_version() >= (5, 24):
            raise
        pytest.skip(f"generate(use_mtp=True) does not run with this transformers: {err}")
    assert torch.equal(drafted, plain)


def _transformers_version() -> tuple[int, int]:
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])
