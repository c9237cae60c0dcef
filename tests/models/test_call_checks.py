"""Calls whose masks or positions the paged loop does not reproduce (hf_specdec/models/call_checks.py) decode through
transformers' own loop, with its tokens, and are refused with a drafter; text-only calls of the same models run the
paged loop. Without the checks these calls decoded silently otherwise: image tokens attended causally only, rotary
positions ignored the image's grid."""

import copy
import pathlib
import types

import pytest
import torch
import transformers

import hf_specdec
from hf_specdec.models.call_checks import attention_both_ways, grid_positions, token_types
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.tiny_models import gemma4_31b_style

IMG, BOI, EOI = 90, 88, 89
GREEDY = dict(do_sample=False, max_new_tokens=8)


def _scaled(model):
    """Weights large enough that masks and positions change the greedy tokens."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def _gemma4_with_images(bidirectional):
    text = gemma4_31b_style().config.to_dict()
    text["use_bidirectional_attention"] = bidirectional
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2, position_embedding_size=16)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=IMG,
                                       boi_token_id=BOI, eoi_token_id=EOI, video_token_id=91, audio_token_id=92,
                                       boa_token_id=93, eoa_token_index=94)
    torch.manual_seed(0)
    return _scaled(transformers.Gemma4ForConditionalGeneration(config))


def _image_call():
    ids = torch.tensor([[2, 67, 57, 47, BOI, IMG, IMG, IMG, IMG, EOI, 6, 44, 11]])
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    image = dict(pixel_values=torch.rand(1, 16, 12, generator=torch.Generator().manual_seed(5)),
                 image_position_ids=torch.stack([xs.flatten(), ys.flatten()], -1)[None])
    return ids, dict(attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMG).long(), **image)


def test_gemma4_image_tokens_attended_both_ways_decode_in_transformers_loop_and_are_refused_with_drafts(tmp_path):
    reference = _gemma4_with_images("vision")
    model = hf_specdec.enable(copy.deepcopy(reference))
    ids, image = _image_call()
    expected = reference.generate(ids, **image, **GREEDY)
    assert not torch.equal(expected, reference.generate(ids, **{**image, "mm_token_type_ids": None}, **GREEDY))
    assert torch.equal(model.generate(ids, **image, **GREEDY), expected)
    assert hf_specdec.last_generation_stats(model) is None  # transformers' loop ran it
    config = assistant_config_dict(model.config, False)
    assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(
        write_checkpoint(pathlib.Path(tmp_path) / "assistant", config, random_state_dict(released_layout(config))))
    with pytest.raises(ValueError, match=r"does not support image or video tokens that attend to each other both "
                                         r"ways .*drop the assistant_model / spec_mode"):
        model.generate(ids, **image, **GREEDY, assistant_model=assistant)
    text = torch.tensor([[2, 67, 57, 47, 6, 44, 11]])  # a text-only call runs the paged loop, drafted too
    kwargs = dict(attention_mask=torch.ones_like(text), mm_token_type_ids=torch.zeros_like(text), **GREEDY)
    expected = reference.generate(text, **kwargs)
    assert torch.equal(model.generate(text, **kwargs), expected)
    assert hf_specdec.last_generation_stats(model) is not None
    assert torch.equal(model.generate(text, **kwargs, assistant_model=assistant), expected)


def test_a_text_model_attending_both_ways_decodes_in_transformers_loop():
    reference = _scaled(gemma4_31b_style(use_bidirectional_attention="all"))
    model = hf_specdec.enable(copy.deepcopy(reference))
    ids = torch.tensor([[2, 67, 57, 47, 6, 44, 11]])
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY),
                       reference.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY))
    assert hf_specdec.last_generation_stats(model) is None


def test_rotary_positions_from_an_images_grid_decode_in_transformers_loop():
    """Qwen2-VL numbers an image's tokens by rows and columns (image_grid_thw): transformers' loop decodes it."""
    vs, ve = 88, 89
    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG,
                                        video_token_id=91, vision_start_token_id=vs, vision_end_token_id=ve)
    torch.manual_seed(0)
    reference = _scaled(transformers.Qwen2VLForConditionalGeneration(config))
    model = hf_specdec.enable(copy.deepcopy(reference))
    ids = torch.tensor([[2, 40, 41, 42, vs, IMG, IMG, IMG, IMG, ve, 43, 44, 45]])
    call = dict(attention_mask=torch.ones_like(ids), pixel_values=torch.randn(16, 24, generator=torch.Generator()
                                                                                .manual_seed(0)),
                image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == IMG).long(), **GREEDY)
    assert torch.equal(model.generate(ids, **call), reference.generate(ids, **call))
    assert hf_specdec.last_generation_stats(model) is None
    text = torch.tensor([[2, 40, 41, 42, 43]])
    assert torch.equal(model.generate(text, **GREEDY), reference.generate(text, **GREEDY))
    assert hf_specdec.last_generation_stats(model) is not None


def test_the_checks_name_only_calls_that_need_them():
    def model(model_type="gemma4", bidirectional=None):
        text = types.SimpleNamespace(use_bidirectional_attention=bidirectional)
        return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type, get_text_config=lambda: text))

    images = torch.tensor([[0, 1, 1, 0]])
    assert attention_both_ways(model(bidirectional="vision"), dict(mm_token_type_ids=images))
    assert attention_both_ways(model(bidirectional="vision"), dict(mm_token_type_ids=images * 2))  # video tokens
    assert not attention_both_ways(model(bidirectional="vision"), dict(mm_token_type_ids=images * 3))  # audio
    assert not attention_both_ways(model(), dict(mm_token_type_ids=images))  # smaller Gemma 4: causal
    assert attention_both_ways(model(bidirectional=True), {}) and attention_both_ways(model(bidirectional="all"), {})
    assert attention_both_ways(model("gemma3"), dict(token_type_ids=images))
    assert not attention_both_ways(model("gemma3"), dict(token_type_ids=torch.zeros_like(images)))
    assert not attention_both_ways(model("llava"), dict(token_type_ids=images))
    assert token_types(model("gpt2"), dict(token_type_ids=torch.zeros_like(images)))  # embedded every step
    assert not token_types(model("gemma3"), dict(token_type_ids=images))  # its mask: attention_both_ways
    assert not token_types(model("gpt2"), dict(token_type_ids=None))
    assert grid_positions(None, dict(image_grid_thw=torch.tensor([[1, 2, 2]])))
    assert grid_positions(None, dict(video_grid_thw=torch.tensor([[1, 2, 2]])))
    assert not grid_positions(None, dict(image_grid_thw=None))
