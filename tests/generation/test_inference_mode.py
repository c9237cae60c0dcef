"""generate runs its loop under torch.inference_mode; what it hands back, and what it leaves behind, behave as
transformers' own: outputs editable in place, and the models still train afterwards."""

import pytest
import torch

from tests import bundled

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("mode", bundled.MODES)
def test_outputs_are_ordinary_tensors_and_the_models_still_train(mode):
    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY, **extra)
    assert not out.is_inference()
    out[out == 0] = 1  # what users do to outputs (e.g. padding -> another token) outside inference mode
    # nothing the loop left on a module (rotary tables, a drafter's buffers) may be an inference tensor: a forward
    # that autograd records would refuse it
    for module in filter(None, (model, extra.get("assistant_model"))):
        assert not any(b.is_inference() for b in module.buffers())
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


def test_per_step_scores_are_ordinary_tensors():
    model, _, _ = bundled.mode("plain")
    ids, mask = bundled.batch(1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True,
                         output_scores=True, **GREEDY)
    assert len(out.scores) == 3 and not any(s.is_inference() for s in out.scores)
    assert not out.sequences.is_inference()
    out.scores[0].add_(1.0)  # in place, outside inference mode


@pytest.mark.parametrize("mode", ["plain", "gemma_mtp"])
def test_the_loop_runs_in_inference_mode_where_every_weight_is_a_plain_tensor(mode):
    from transformers import LogitsProcessor, LogitsProcessorList

    seen = []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(torch.is_inference_mode_enabled())
            return scores

    model, extra, _ = bundled.mode(mode)
    ids, mask = bundled.batch(1)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, logits_processor=LogitsProcessorList([Record()]),
                   **GREEDY, **extra)
    assert seen and all(seen)
