"""Step3p5ForCausalLM: real-layout loading, cache == no cache past the window, generate, HF hooks."""

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from hf_specdec.models.step3p5 import Step3p5ForCausalLM
from hf_specdec.models.step3p5.modeling import CACHE_FIELD

from .tiny_step3p5 import (
    SEQ,
    random_ids,
    real_config_dict,
    real_layout_shapes,
    tiny_config,
    tiny_model,
    write_checkpoint,
)


def test_module_tree_is_the_checkpoint_layout():
    config = tiny_config()
    model = Step3p5ForCausalLM(config)
    expected = real_layout_shapes(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected


@pytest.mark.parametrize("head_name", ["head", "output"])
def test_load_real_checkpoint_every_tensor_lands(tmp_path, head_name):
    written = write_checkpoint(tmp_path, real_config_dict(), head_name=head_name)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, Step3p5ForCausalLM) and model.has_mtp and model.mtp_layer_indices == [4, 5, 6]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model.state_dict()
    assert len(state) == len(written)
    for key, tensor in written.items():
        assert torch.equal(state[key.replace("shared_head.output.", "shared_head.head.")], tensor), key


def test_save_load_gives_same_logits_and_fp32_router(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # RoPE buffers rebuilt after meta init
    with torch.no_grad():
        assert torch.equal(loaded(random_ids()).logits, model(random_ids()).logits)
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    moe = half.model.layers[2].moe
    assert moe.gate.weight.dtype == moe.router_bias.dtype == torch.float32
    assert moe.gate_proj.weight.dtype == torch.bfloat16


def test_checkpoint_without_mtp_weights_loads_and_decodes(tmp_path):
    written = write_checkpoint(tmp_path, real_config_dict(), with_mtp=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not model.has_mtp and model.config.num_nextn_predict_layers == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in written.items())
    reference_dir = tmp_path / "config_without_mtp"
    write_checkpoint(reference_dir, real_config_dict(num_mtp=0), with_mtp=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir)
    assert not reference.has_mtp
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (2, SEQ + 4)


def test_partial_mtp_checkpoint_keeps_loaded_prefix(tmp_path):
    raw = real_config_dict()
    tensors = write_checkpoint(tmp_path, raw)
    kept = {k: v for k, v in tensors.items() if not k.startswith(("model.layers.5.", "model.layers.6."))}
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.num_mtp_layers == 1 and model.mtp_layer_indices == [4]


def test_cached_decoding_matches_full_forward_past_window():
    model = tiny_model()
    ids = random_ids()
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        prefill = model(ids[:, :4], past_key_values=cache, use_cache=True).logits
        steps = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(4, SEQ)]
    assert torch.allclose(torch.cat([prefill, *steps], dim=1), full, atol=1e-5)
    assert cache.get_seq_length() == SEQ


def test_forward_without_a_cache_and_training_forwards():
    """use_cache=False (and training with labels) returns no cache, under either transformers' field name."""
    model = tiny_model()
    ids = random_ids()
    with torch.no_grad():
        cached = model(ids).logits
        out = model(ids, use_cache=False)
    assert torch.allclose(out.logits, cached) and getattr(out, CACHE_FIELD) is None
    assert torch.allclose(model(ids, use_cache=False, return_dict=False)[0], cached)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad is not None


def test_generate_greedy_matches_argmax_loop():
    model = tiny_model()
    ids = random_ids(batch=1, seq=6)
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, seq)


def test_pre_norm_hidden_state_feeds_the_final_norm():
    model = tiny_model()
    ids = random_ids()
    with torch.no_grad():
        out = model(ids, output_pre_norm_hidden_states=True, logits_to_keep=1)
        assert out.pre_norm_hidden_state.shape == (2, SEQ, 32) and out.logits.shape == (2, 1, 64)
        assert torch.allclose(model.lm_head(model.model.norm(out.pre_norm_hidden_state[:, -1:])), out.logits)
        assert model(ids).pre_norm_hidden_state is None


def test_hf_output_options():
    model = tiny_model()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(random_ids(), output_hidden_states=True, output_attentions=True)
        assert len(out.hidden_states) == 5 and [a.shape[1] for a in out.attentions] == [2, 4, 4, 2]
        assert torch.equal(model(random_ids(), return_dict=False)[0], out.logits)


def test_attention_goes_through_the_interface_with_forward_kwargs():
    calls = []

    def recorder(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, query.shape[1], kwargs.get("probe"), kwargs.get("sliding_window")))
        kwargs.pop("probe", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("step3p5_test_recorder", recorder)
    ALL_MASK_ATTENTION_FUNCTIONS.register("step3p5_test_recorder", sdpa_mask)  # masks as for sdpa
    model = tiny_model()
    reference = model(random_ids()).logits
    model.set_attn_implementation("step3p5_test_recorder")
    cache = model.new_cache()
    with torch.no_grad():
        out = model(random_ids(), past_key_values=cache, use_cache=True, probe="target")
        model.mtp_step(1, random_ids()[:, 1:], out.logits.new_zeros(2, SEQ - 1, 32), past_key_values=cache, probe="mtp")
    assert [c[0] for c in calls] == [0, 1, 2, 3, 5]
    assert [c[1] for c in calls] == [2, 4, 4, 2, 4]  # query heads: full 2, sliding 4, MTP (sliding) 4
    assert [c[2] for c in calls] == ["target"] * 4 + ["mtp"]
    assert [c[3] for c in calls] == [None, 5, 5, None, 5]
    assert torch.allclose(out.logits, reference, atol=1e-5)


def test_dict_attention_mask_is_used_as_given():
    model = tiny_model()
    ids = random_ids()
    full, sliding = (torch.full((SEQ, SEQ), float("-inf")).triu(1) for _ in range(2))
    sliding = sliding.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).tril(-5), float("-inf"))
    masks = {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}
    with torch.no_grad():
        assert torch.allclose(model(ids, attention_mask=masks).logits, model(ids).logits, atol=1e-5)
