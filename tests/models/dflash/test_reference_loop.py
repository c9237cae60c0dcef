"""The reference DFlash loop is lossless, and our drafter API driven densely reproduces its acceptance sequence.

The drafters are distilled for a few seconds on the targets' own greedy outputs (`fit_drafter`), so the
acceptance sequences mix full, partial and zero acceptance; prompts 0-5 are the distillation prompts,
prompt 20 is held out (mostly rejections). Prompts are longer than the Gemma targets' sliding window (8)
and the Gemma drafters' own (6).
"""

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.compat import cache_argument
from hf_specdec.models.dflash import DenseDFlashContext, capture_hidden_states, check_compatible
from tests.models.dflash.helpers import (
    F,
    S,
    fit_drafter,
    gemma4_conditional_generation,
    greedy_continuations,
    random_drafter,
)
from tests.models.dflash.reference_loop import crop_to, done, emit, reference_dflash_generate
from tests.tiny_models import gemma4_31b_style, gemma4_e2b_style, left_padded_batch, llama

BLOCK_SIZE, NEW_TOKENS, PROMPT_LEN = 5, 40, 12
GEMMA_DRAFTER = dict(layer_types=[S, F], use_sliding_window=True, sliding_window=6)  # as Gemma 4 DFlash drafters
CASES = {
    "gemma4_e2b": (gemma4_e2b_style, GEMMA_DRAFTER),
    "gemma4_31b": (gemma4_31b_style, GEMMA_DRAFTER),
    "llama": (llama, {}),
}


def prompt(seed: int) -> torch.Tensor:
    return left_padded_batch([PROMPT_LEN], seed=seed)[0]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    make_target, drafter_kwargs = CASES[request.param]
    target = make_target()
    drafter = random_drafter(target, block_size=BLOCK_SIZE, **drafter_kwargs)
    check_compatible(drafter, target)
    sequences = greedy_continuations(target, [prompt(s) for s in range(6)], NEW_TOKENS)
    return target, fit_drafter(target, drafter, sequences)


def hf_greedy(target, ids, eos_token_id=None):
    return target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_token_id)[0].tolist()


@torch.inference_mode()
def dense_api_generate(target, drafter, input_ids, max_new_tokens, num_speculative_tokens, eos_token_id=None):
    """The reference loop driven through our API: hooks capture the target layers during its own forwards,
    each draft layer's context K/V is appended for accepted tokens only, `DenseDFlashContext` attends."""
    cache = DynamicCache()  # config-less, as in the reference loop
    k, start = num_speculative_tokens, input_ids.shape[1]
    with capture_hidden_states(target, drafter.target_layer_ids) as captured:
        logits = target(input_ids, **{cache_argument(target): cache}).logits
        tokens, acceptance = input_ids[0].tolist() + [int(logits[0, -1].argmax())], []
        kv = context_kv(drafter, captured, torch.arange(start), start)
        while not done(tokens, input_ids.shape[1], max_new_tokens, eos_token_id):
            block = drafter.block_input_ids(torch.tensor([tokens[start]]), k)
            positions = torch.arange(start, start + k + 1)[None]
            hidden = drafter.draft_block(drafter.embed_block(target, block), positions, DenseDFlashContext(kv))
            verify = torch.cat([block[:, :1], drafter.draft_logits(target, hidden).argmax(-1)], dim=1)
            posterior = target(verify, position_ids=positions, **{cache_argument(target): cache}).logits[0].argmax(-1)
            accepted = int((verify[0, 1:] == posterior[:-1]).long().cumprod(0).sum())
            acceptance.append(accepted)
            emit(tokens, verify[0, 1:accepted + 1].tolist() + [int(posterior[accepted])], input_ids.shape[1],
                  max_new_tokens, eos_token_id)
            new = context_kv(drafter, captured, torch.arange(start, start + accepted + 1), accepted + 1)
            kv = [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1)) for (k0, v0), (k1, v1) in zip(kv, new)]
            start += accepted + 1
            crop_to(cache, start)
    return tokens, acceptance


def context_kv(drafter, captured, positions, keep):
    features = drafter.context_features([h[:, :keep] for h in captured])
    return [drafter.context_kv(i, features, positions[None]) for i in range(len(drafter.layers))]  # layer by layer


@pytest.mark.parametrize("seed", [0, 3, 20])
@pytest.mark.parametrize("k", [BLOCK_SIZE - 1, 2])
def test_reference_loop_is_lossless_and_our_api_gives_its_acceptance(pair, seed, k):
    target, drafter = pair
    ids = prompt(seed)
    reference = reference_dflash_generate(target, drafter, ids, NEW_TOKENS, num_speculative_tokens=k)
    assert reference.tokens == hf_greedy(target, ids)
    assert sum(a + 1 for a in reference.acceptance) >= NEW_TOKENS - 1
    assert dense_api_generate(target, drafter, ids, NEW_TOKENS, k) == (reference.tokens, reference.acceptance)


def test_acceptance_mixes_full_partial_and_none(pair):
    target, drafter = pair
    k = BLOCK_SIZE - 1
    seen = set()
    for seed in (0, 1, 2, 20):
        seen |= set(reference_dflash_generate(target, drafter, prompt(seed), NEW_TOKENS).acceptance)
    assert {0, k} <= seen and seen & {1, 2, 3}, seen


def test_stopping_at_eos_inside_an_accepted_chunk(pair):
    target, drafter = pair
    ids = prompt(0)
    eos = hf_greedy(target, ids)[PROMPT_LEN + 9]  # a token the target emits at step 10
    expected = hf_greedy(target, ids, eos_token_id=eos)
    reference = reference_dflash_generate(target, drafter, ids, NEW_TOKENS, eos_token_id=eos)
    assert reference.tokens == expected and reference.tokens[-1] == eos
    assert dense_api_generate(target, drafter, ids, NEW_TOKENS, BLOCK_SIZE - 1, eos_token_id=eos)[0] == expected


@pytest.mark.parametrize("make_target", [gemma4_31b_style, gemma4_conditional_generation])
def test_untrained_drafters_stay_lossless(make_target):
    target = make_target()
    drafter = random_drafter(target, block_size=8, **GEMMA_DRAFTER)
    ids = prompt(7)
    reference = reference_dflash_generate(target, drafter, ids, NEW_TOKENS)
    assert reference.tokens == hf_greedy(target, ids)
    assert dense_api_generate(target, drafter, ids, NEW_TOKENS, 7) == (reference.tokens, reference.acceptance)
