"""The bundled tiny DFlash drafter: a z-lab checkpoint (model_type qwen3, DFlashDraftModel, released key layout,
bf16) that hf_specdec loads as its drafter, attaches to the bundled target, drafts losslessly, and still drafts
well (a broken export, config, mask id or target layer list drops τ to ~1)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

import hf_specdec
from hf_specdec.assets import asset_path, held_out_snippets
from hf_specdec.models.dflash import DFlashDrafter, check_compatible, is_dflash_checkpoint
from tests.bundled import check_family_size
from tests.models.dflash.helpers import released_layout

DRAFTER_MAX_BYTES = 5_800_000  # what the family's cap leaves beside the other members
PROMPTS = (0, 3)  # held-out snippets: asyncio/taskgroups.py, idlelib/format.py
PROMPT_CHARS, NEW_TOKENS = 400, 96
# τ (tokens per target forward, bonus included) of greedy DFlash at k=7 (the drafter's block) on PROMPTS, measured on
# CPU in fp32 (transformers 5.24): 3.25 (the drafter shipped before the widened stages: 3.20; before the retrain: 2.46).
# An untrained drafter gives 1.0.
TAU_BOUND = 3.25 - 0.5


@pytest.fixture(scope="module")
def drafter_dir():
    return asset_path("tiny-gemma4-dflash")


@pytest.fixture(scope="module")
def drafter(drafter_dir):
    return hf_specdec.AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def target():
    return hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def prompts(tokenizer):
    snippets = held_out_snippets()
    return tokenizer([snippets[i]["text"][:PROMPT_CHARS] for i in PROMPTS], return_tensors="pt", padding=True)


def test_checkpoint_is_in_the_zlab_layout(drafter_dir, tokenizer):
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["DFlashDraftModel"]
    assert is_dflash_checkpoint(drafter_dir)
    assert raw["dflash_config"]["mask_token_id"] == tokenizer.convert_tokens_to_ids("<mask>")
    with safe_open(drafter_dir / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert shapes == released_layout(raw)  # no embedding, no lm_head: both are the target's
    assert dtypes == {"BF16"}


def test_sizes(drafter_dir):
    assert sum(p.stat().st_size for p in drafter_dir.iterdir()) <= DRAFTER_MAX_BYTES
    check_family_size()


def test_loads_as_our_drafter_and_attaches_to_the_bundled_target(drafter, target):
    assert isinstance(drafter, DFlashDrafter)
    check_compatible(drafter, target)
    text = target.config.get_text_config()
    # the last target layer is KV-shared: the prefill capture must still see every prompt position
    assert max(drafter.target_layer_ids) >= text.num_hidden_layers - text.num_kv_shared_layers


@pytest.fixture(scope="module")
def generations(target, drafter, prompts):
    """(plain greedy ids, DFlash greedy ids at k=7, its SpecStats): generations pass the sliding window. k is given:
    a greedy call without one chooses k per round from timed rounds (``"auto"``), so its τ would depend on the
    machine's speed."""
    kwargs = dict(**prompts, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain = target.generate(**kwargs)
    dflash = target.generate(**kwargs, assistant_model=drafter, num_speculative_tokens=drafter.block_size - 1)
    return plain, dflash, hf_specdec.last_generation_stats(target)


def test_greedy_dflash_equals_plain_greedy(generations, drafter):
    plain, dflash, stats = generations
    assert stats.spec_mode == "dflash" and stats.num_speculative_tokens == drafter.block_size - 1
    assert torch.equal(dflash, plain)


def test_tau_is_above_the_bound(generations):
    _, _, stats = generations
    assert stats.mean_accepted_length >= TAU_BOUND, stats


def test_training_path_matches_the_draft_block(drafter, target, prompts):
    """The batched training view of the block objective (tools/tiny_family) equals decode-time `draft_block`."""
    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    ids = prompts["input_ids"][1:][:, prompts["attention_mask"][1].bool()]  # the unpadded row
    assert train_dflash.check_matches_draft_block(drafter, target, ids, drafter.block_size) < 1e-4


def test_document_openings_are_the_first_tokens_of_long_enough_documents():
    """The retraining tool's file openings (tools/tiny_family): each long enough document's first tokens, <bos>
    included, in order; a document shorter than the prefix is skipped, never joined to the next one."""
    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    data = pytest.importorskip("tools.tiny_family.data")
    bos = 2
    stream = data.TokenStream.from_documents([[bos, 10, 11, 12, 1], [bos, 20, 1], [bos, 30, 31, 32, 33, 1]])
    assert train_dflash.document_openings(stream, bos, 4).tolist() == [[bos, 10, 11, 12], [bos, 30, 31, 32]]
    assert train_dflash.document_openings(stream, bos, 4, count=1).tolist() == [[bos, 10, 11, 12]]
    assert train_dflash.document_openings(stream, bos, 7).shape == (0, 7)


def test_continuation_anchors_stay_in_each_windows_continuation():
    """`--continuation-anchors` (tools/tiny_family): a generated window's blocks are anchored at or after its first
    continued token, a data window's anywhere from 1, and every block fits in the window."""
    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    data = pytest.importorskip("tools.tiny_family.data")
    stream = data.TokenStream(torch.arange(200), 1)
    generated = torch.arange(6 * 40).view(6, 40)
    continued_from = torch.tensor([30, 30, 10, 10, 35, 35])
    batches = train_dflash.MixedWindows(data.RandomWindows(stream, 8, 39, seed=0), generated, 0.5, seed=0,
                                        continued_from=continued_from)
    objective = train_dflash.BlockObjective(None, block_size=8, num_anchors=16, gamma=7.0, short_block_prob=0.0,
                                            seed=0)
    objective.first_anchor_of = batches.first_anchor
    seen_low = False
    for _ in range(20):
        batch = batches()
        first = batches.first_anchor()
        anchors, block_len = objective.sample(batch)
        assert block_len == 8 and anchors.shape == (8, 16)
        assert (anchors >= first.clamp(max=40 - 8)[:, None]).all() and (anchors <= 40 - 8).all()
        assert (first[:4] == 1).all() and set(first[4:].tolist()) <= {10, 30, 35}
        seen_low |= bool((anchors[:4] < 10).any())
    assert seen_low  # data windows are anchored in their beginning too


def test_hard_labels_score_the_targets_argmax():
    """`--hard-labels` (tools/tiny_family): the block loss is the position-weighted cross-entropy of each draft to the
    target's argmax, not the KL to its distribution."""
    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    torch.manual_seed(0)
    draft, target = torch.randn(5, 7, 11), torch.randn(5, 7, 11)
    objective = train_dflash.BlockObjective(None, block_size=8, num_anchors=1, gamma=7.0, short_block_prob=0.0,
                                            seed=0, hard_labels=True)
    expected = (torch.nn.functional.cross_entropy(draft.transpose(1, 2), target.argmax(-1), reduction="none").mean(0)
                * objective.weights(8, "cpu")).sum()
    assert torch.allclose(objective.block_loss(draft, target), expected)
    objective.hard_labels = False
    assert not torch.allclose(objective.block_loss(draft, target), expected)


def test_generated_cache_is_reused_only_for_the_same_options(target, tmp_path, capsys):
    """`--generated-cache` (tools/tiny_family): a second run with the same options loads the windows the first one
    made; a run with another --seed (it draws the prefixes) makes its own, says which options differ, and overwrites
    the file."""
    import types

    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    data = pytest.importorskip("tools.tiny_family.data")
    stream = data.TokenStream(torch.arange(3, 300), 1)
    frozen = types.SimpleNamespace(train_stream=stream, validation_stream=stream)
    args = types.SimpleNamespace(generated_windows=3, generated_prefix=4, generated_openings=0, opening_prefix=[4],
                                 seq_len=7, seed=0, target="tiny-gemma4", generated_cache=tmp_path / "gen.pt")
    val_windows = [torch.arange(10, 24).view(2, 7)]

    def generated(**changed):
        made = train_dflash.generated_data(types.SimpleNamespace(**{**vars(args), **changed}), target, None, frozen,
                                           val_windows, "cpu")
        return made, capsys.readouterr().out

    first, out = generated()
    assert first["windows"].shape == (3, 7) and "making them again" not in out and args.generated_cache.is_file()
    again, out = generated()
    assert "generated windows from" in out and torch.equal(again["windows"], first["windows"])
    assert torch.equal(again["val"][0], first["val"][0])
    other, out = generated(seed=1)
    assert "(seed differ): making them again" in out and not torch.equal(other["windows"], first["windows"])
    reloaded, out = generated(seed=1)
    assert "generated windows from" in out and torch.equal(reloaded["windows"], other["windows"])


def test_widened_drafter_drafts_what_it_drafted_before(drafter, target, prompts):
    """`--widen-mlp` grows every MLP with units whose down-projection columns are zero: before training moves them
    the wider drafter's draft block is the old one's, and its MLPs really are wider."""
    train_dflash = pytest.importorskip("tools.tiny_family.train_dflash")
    old = drafter.config.intermediate_size
    wider = train_dflash.widen_mlp(drafter, old + 64)
    assert wider.config.intermediate_size == old + 64 and drafter.config.intermediate_size == old
    hidden = drafter.config.hidden_size
    assert all(layer.mlp.down_proj.weight.shape == (hidden, old + 64) for layer in wider.layers)
    assert all(layer.mlp.gate_proj.weight[old:].abs().sum() > 0 for layer in wider.layers)
    ids = prompts["input_ids"][1:][:, prompts["attention_mask"][1].bool()][:, :48]
    view = train_dflash.TargetView(target, ids, drafter.target_layer_ids)
    anchors = torch.tensor([[1, 20, 40]])
    with torch.no_grad():
        before = train_dflash.draft_logits_at(drafter, target, view, ids, anchors, drafter.block_size)
        after = train_dflash.draft_logits_at(wider, target, view, ids, anchors, drafter.block_size)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)  # fp32 sums over more units: a few ulps of ~20
    with torch.no_grad():  # the check can fail: new units that reach the output move the drafts
        for layer in wider.layers:
            layer.mlp.down_proj.weight[:, old:].normal_(std=0.02)
        moved = train_dflash.draft_logits_at(wider, target, view, ids, anchors, drafter.block_size)
    assert (moved - before).abs().max() > 1e-2
    with pytest.raises(ValueError, match="does not grow"):
        train_dflash.widen_mlp(drafter, old)
