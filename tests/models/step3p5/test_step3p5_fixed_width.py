"""Fixed-shape Step 3.5 MTP drafting (k + 1 right-aligned slots per row and layer after the first round, inputs
gathered on the device) against the per-row variable-width oracle, inside real generation on the bundled tiny
Step 3.5: the same drafts every round, and the same q (sampling) and MTP K/V after every commit up to fp32
rounding (a matmul over another width rounds differently), for a batch whose rows accept different numbers of
drafts and stop inside their chunks at different steps. With graphs, each layer's forward goes through the
drafter's graph path (inputs padded to the batch's bucket, metadata rebuilt from the static inputs) with a CPU
stand-in for the CUDA graph."""

import contextlib

import pytest
import torch
from transformers import AutoTokenizer

from hf_specdec.assets import asset_path, held_out_snippets
from hf_specdec.generation.drafter import Drafter
from hf_specdec.runtime import drafter_graphs
from hf_specdec.runtime.cuda_graphs import GraphStore, table_width_bucket
from hf_specdec.models.step3p5.mtp_drafter import Step3p5MTPDraftRunner
from tests.bundled import step
from tests.models.step3p5.per_row_drafter import PerRowMTPDrafter


class Twin(Drafter):
    """Drafts with the fixed-shape drafter and checks each round against the oracle on the same inputs (the oracle
    draws its samples from the same random state)."""

    spec_mode = "mtp"

    def __init__(self, model, k, graphs=False, schedule=()):
        self.drafter, self.oracle = Step3p5MTPDraftRunner(model, k), PerRowMTPDrafter(model, k)
        self.graphs = graphs
        self.schedule = list(schedule)  # the k of the rounds, in turn (then the last one's): "auto" k falling
        self.num_speculative_tokens = k
        self.layers = model.mtp_layer_indices[:k]
        self.accepted_rows: list[list[int]] = []  # per round: accepted drafts of the rows that kept tokens

    @contextlib.contextmanager
    def capture(self, target):
        with self.drafter.capture(target) as captured:
            try:
                yield captured
            finally:
                for cache in self.oracle.caches:
                    cache.free()

    def begin(self, context, captured):
        self.oracle.begin(context, captured)
        if self.graphs:  # what the runner sets on CUDA (the target itself runs eagerly here)
            blocks = -(-(max(context.prompt_lens) + context.max_new_tokens + context.lookahead)
                       // context.cache.block_size) + 1
            context.graph_store, context.graph_table_width = GraphStore(), table_width_bucket(blocks)
        self.drafter.begin(context, captured)

    def propose(self, last_tokens, context, selector):
        if self.schedule:
            self.drafter.num_speculative_tokens = self.oracle.num_speculative_tokens = self.schedule.pop(0)
        state = torch.get_rng_state()
        expected = self.oracle.propose(last_tokens, context, selector)
        torch.set_rng_state(state)
        got = self.drafter.propose(last_tokens, context, selector)
        assert torch.equal(got.tokens, expected.tokens)
        if expected.probs is not None:
            torch.testing.assert_close(got.probs, expected.probs)
        self._assert_same_mtp_kv()
        return got

    def commit(self, context, captured, num_accepted, kept):
        self.oracle.commit(context, captured, num_accepted, kept)
        self.drafter.commit(context, captured, num_accepted, kept)
        self.accepted_rows.append([a for a, k in zip(num_accepted.tolist(), kept) if k])
        self._assert_same_mtp_kv()

    def _assert_same_mtp_kv(self):
        for layer, ours, theirs in zip(self.layers, self.drafter.caches, self.oracle.caches):
            assert ours.seq_lens == theirs.seq_lens
            for row in range(ours.batch_size):
                k, v, start = ours.gather(row, layer)
                k_ref, v_ref, start_ref = theirs.gather(row, layer)
                assert start == start_ref
                torch.testing.assert_close(k, k_ref)
                torch.testing.assert_close(v, v_ref)


class ReplayedCall:
    """A CPU stand-in for CallGraph: a call copies its inputs into static ones of the captured shapes (the forward
    metadata is derived into them by DrafterGraphs, as on CUDA) and runs the function eagerly over them."""

    replays = 0

    def __init__(self, fn, inputs, devices=()):
        self.fn, self.inputs = fn, [t.clone() for t in inputs]
        self.outputs = fn(*self.inputs)  # the capture runs it again over the same inputs

    def __call__(self, *inputs):
        for static, new in zip(self.inputs, inputs):
            assert new.shape[1:] == static.shape[1:] and new.shape[0] <= static.shape[0]
            static[:new.shape[0]].copy_(new)
        ReplayedCall.replays += 1
        return self.fn(*self.inputs)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-step3p5"))
    tokenizer.padding_side = "left"
    texts = [s["text"][:n] for s, n in zip(held_out_snippets(), (300, 80, 170))]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_fixed_width_drafts_and_mtp_kv_equal_the_per_row_drafter(prompts, k, sampled, graphs, monkeypatch):
    model = step()[0]
    twin = Twin(model, k, graphs)
    monkeypatch.setattr(drafter_graphs, "CallGraph", ReplayedCall)
    monkeypatch.setattr(ReplayedCall, "replays", 0)
    sampling = dict(do_sample=True, temperature=0.8, top_k=50) if sampled else dict(do_sample=False)
    torch.manual_seed(0)
    model.generate(**prompts, assistant_model=twin, max_new_tokens=40, pad_token_id=0, **sampling)
    assert len(twin.accepted_rows) > 5
    assert any(len(set(rows)) > 1 for rows in twin.accepted_rows), "rows accepted the same counts every round"
    assert any(len(rows) < len(twin.accepted_rows[0]) for rows in twin.accepted_rows), "no row stopped early"
    if graphs:  # for the bucket of 4, replayed every round after the one that captured it: greedy rounds one graph
        # of every layer, sampled rounds one graph per layer
        calls = twin.drafter.graphs.store.calls
        names = ["greedy_round"] if not sampled else [f"layer{j}" for j in range(k)]
        assert sorted(key[1] for key in calls) == names
        assert {key[4] for key in calls} == {4}
        assert ReplayedCall.replays == len(names) * (len(twin.accepted_rows) - 2)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_path"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_rounds_whose_k_falls_draft_and_keep_the_mtp_kv_of_the_per_row_drafter(prompts, sampled, graphs,
                                                                                 monkeypatch):
    """"auto" k falling within a call (3, 3, 2, 2, 1, ...): each round runs MTP layers 0..k-1 at the fixed width of
    k=3, the layers it leaves out keep their K/V; drafts, q and the MTP K/V equal the per-row drafter's run at the
    same k every round, greedy rounds replay one graph per k."""
    model = step()[0]
    twin = Twin(model, 3, graphs, schedule=[3, 3, 2, 2, 1])
    monkeypatch.setattr(drafter_graphs, "CallGraph", ReplayedCall)
    sampling = dict(do_sample=True, temperature=0.8, top_k=50) if sampled else dict(do_sample=False)
    torch.manual_seed(0)
    model.generate(**prompts, assistant_model=twin, max_new_tokens=40, pad_token_id=0, **sampling)
    assert len(twin.accepted_rows) > 5 and twin.drafter.ran == 1
    if graphs and not sampled:
        assert [key[1] for key in twin.drafter.graphs.store.calls] == ["greedy_round"] * 3  # k = 3, 2 and 1
