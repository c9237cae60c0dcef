"""What users call: pipelines (with an assistant, batch_size > 1), stop strings, streamers."""

import pytest
import torch
from transformers import TextIteratorStreamer, pipeline

import hf_specdec
from tests.generation.toy_drafters import CopyDrafter
from tests.models.gemma4.helpers import assistant_config_dict, random_state_dict, released_layout, write_checkpoint
from tests.tiny_models import char_tokenizer, gemma4_e2b_style, left_padded_batch

VOCAB = 96
PROMPTS = ["def f(x):", "import os", "class A:\n    pass", "x"]


def _models():
    ref = gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)
    return ref, hf_specdec.enable(gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB))


def _assistant(tmp_path, target):
    config = assistant_config_dict(target.config, True)
    path = write_checkpoint(tmp_path / "assistant", config, random_state_dict(released_layout(config)))
    return hf_specdec.AutoModelForCausalLM.from_pretrained(path)


def test_pipeline_plain_and_with_an_assistant_matches_transformers(tmp_path):
    ref, ours = _models()
    tok = char_tokenizer(VOCAB)
    expected = pipeline("text-generation", model=ref, tokenizer=tok)(PROMPTS, max_new_tokens=12, do_sample=False,
                                                                    batch_size=4)
    plain = pipeline("text-generation", model=ours, tokenizer=tok)(PROMPTS, max_new_tokens=12, do_sample=False,
                                                                  batch_size=4)
    assert plain == expected
    assistant = _assistant(tmp_path, ours)
    pipe = pipeline("text-generation", model=ours, tokenizer=tok, assistant_model=assistant)
    spec = pipe(PROMPTS, spec_mode="mtp", max_new_tokens=12, do_sample=False, batch_size=4)
    assert spec == expected
    assert hf_specdec.last_generation_stats(ours).spec_mode == "mtp"


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_strings_cut_inside_the_chunk(speculative):
    ref, ours = _models()
    tok = char_tokenizer(VOCAB)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    free = ref.generate(**batch, max_new_tokens=16, do_sample=False, eos_token_id=None)
    text = tok.decode(free[0, batch["input_ids"].shape[1]:])
    stop = text[5:7]  # a string the first row produces mid-generation
    kwargs = dict(max_new_tokens=16, do_sample=False, stop_strings=[stop], tokenizer=tok, pad_token_id=0)
    expected = ref.generate(**batch, **kwargs)
    extra = dict(assistant_model=CopyDrafter(gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB),
                                             4)) if speculative else {}
    got = ours.generate(**batch, **kwargs, **extra)
    assert torch.equal(got, expected)
    assert tok.decode(got[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).endswith(stop)


def test_streamer_receives_exactly_the_returned_tokens_in_multi_token_chunks(tmp_path):
    _, ours = _models()
    tok = char_tokenizer(VOCAB)
    ids, mask = left_padded_batch([9], vocab=VOCAB)
    chunks = []

    class Recorder:
        def put(self, value):
            chunks.append(value.reshape(-1).tolist())

        def end(self):
            chunks.append("end")

    out = ours.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=None,
                        streamer=Recorder(), assistant_model=CopyDrafter(
                            gemma4_e2b_style(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB), 3))
    assert chunks[0] == ids[0].tolist() and chunks[-1] == "end"
    streamed = [t for c in chunks[1:-1] for t in c]
    assert streamed == out[0, 9:].tolist()
    assert max(len(c) for c in chunks[1:-1]) > 1  # accepted drafts arrive together
    text_streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=None,
                        streamer=text_streamer, assistant_model=_assistant(tmp_path, ours))
    assert "".join(text_streamer) == tok.decode(out[0, 9:])
