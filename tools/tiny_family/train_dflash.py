"""Train the tiny DFlash drafter of the frozen bundled target with the block objective, export it in the
z-lab checkpoint layout, and measure τ with hf_specdec's speculative loop.

    python -m tools.tiny_family.train_dflash --corpus .carry/stdlib-3.11.7.tar.gz \
        --out hf_specdec/assets/tiny-gemma4-dflash --report tools/tiny_family/results/tiny-gemma4-dflash.json
    python -m tools.tiny_family.train_dflash --measure-only --device cpu --out hf_specdec/assets/tiny-gemma4-dflash \
        --report tools/tiny_family/results/tiny-gemma4-dflash.json      # τ per block size and CPU speed

The block objective (DFlash, arXiv 2602.06036), on random windows of the target's train split:

- one frozen target forward per window gives the hidden states after the drafter's `target_layer_ids`
  (hooks, as when decoding) and the target's soft-capped logits;
- random anchors a in every window: block `[x_a, mask x (L-1)]` at positions a .. a+L-1, its context the
  fused features of positions < a (the accepted prefix); all blocks of a window are concatenated along the
  block axis and attend, in one attention per layer, over the window's context K/V and their own block
  (`ConcatenatedBlocks`: bidirectional within a block for full layers, causal for sliding ones), exactly as
  `DFlashDrafter.draft_block` runs at decode time (checked by `check_matches_draft_block`);
- draft j of a block (position a+j) is scored against the target's distribution there (its logits at
  a+j-1), with the position decay of the paper:

      loss = sum_j w_j KL(target(a+j-1) || draft_j) / sum_j w_j,   w_j = exp(-(j-1) / gamma)

  With `--hard-labels` the KL is replaced by the cross-entropy to the target's argmax there (what greedy
  verification accepts). A fraction of the steps (`--short-block-prob`) uses a shorter block, as decoding does
  for num_speculative_tokens < block_size - 1.

As the DFlash drafters are trained on their target's own responses, part of every batch
(`--generated-fraction`) can be windows whose second half the target wrote itself: a train-split prefix
continued greedily by the target (`--generated-windows`, made once before training). Validation then also
scores such continuations of validation prefixes, where the target's argmax is the next token, so the
teacher-forced `tau_estimate` there is the greedy acceptance of decoding; the kept weights are the best on it.
`--generated-cache` keeps those windows in a file that later runs load, and `--init-from` continues training an
exported drafter, so one drafter can be trained over several time-limited calls.
"""

import argparse
import copy
import json
import math
import pathlib
import time

import torch
import torch.nn.functional as F

from hf_specdec.models.dflash import DFlashDrafter, DenseDFlashContext, capture_hidden_states, dense_block_attention

from . import cli, gemma4_dflash
from .data import RandomWindows, TokenStream, validation_windows
from .export import export_checkpoint
from .frozen_target import load_frozen_target
from .measure import measure_drafter
from .train_loop import seed_everything, train

DEFAULT_TARGET = pathlib.Path("hf_specdec/assets/tiny-gemma4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_drafter_source_args(p, DEFAULT_TARGET)
    p.add_argument("--steps", type=int, default=2000)
    cli.add_time_budget_arg(p)
    p.add_argument("--batch-size", type=int, default=32, help="windows per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    p.add_argument("--anchors", type=int, default=32, help="blocks per window")
    p.add_argument("--block-size", type=int, default=gemma4_dflash.BLOCK_SIZE)
    p.add_argument("--short-block-prob", type=float, default=0.25,
                   help="fraction of steps with a block of random length 2 .. block_size - 1")
    p.add_argument("--generated-windows", type=int, default=0,
                   help="train-split prefixes continued greedily by the target, made before training (0: none)")
    p.add_argument("--generated-fraction", type=float, default=0.5, help="share of each batch drawn from them")
    p.add_argument("--generated-prefix", type=int, default=256, help="data tokens before the target's continuation")
    p.add_argument("--generated-openings", type=int, default=0,
                   help="also continue the openings (first --opening-prefix tokens) of up to N train documents: file "
                        "openings, like the held-out snippets the drafter is measured on; validation then scores the "
                        "continued openings of the validation documents")
    p.add_argument("--opening-prefix", type=int, nargs="+", default=[128],
                   help="tokens of a document opening before its continuation; several values continue every "
                        "opening once per value (validation uses the first)")
    p.add_argument("--continuation-anchors", action="store_true",
                   help="anchor the blocks of a generated window in the target's continuation only (where decoding "
                        "drafts), not in its data prefix")
    p.add_argument("--generated-cache", type=pathlib.Path,
                   help="file of the generated windows: loaded when it holds the ones these options ask for (--seed "
                        "included: it draws the prefixes), else written after generating them (so several runs and "
                        "later calls share one generation)")
    p.add_argument("--generate-only", action="store_true",
                   help="make the generated windows, write them to --generated-cache and stop")
    p.add_argument("--init-from", type=pathlib.Path,
                   help="start from the weights of this exported drafter (its config too: --layer-types, "
                        "--intermediate-size and --block-size are then ignored)")
    p.add_argument("--widen-mlp", type=int, default=0,
                   help="with --init-from: grow every MLP to this intermediate size, the new units' down-projection "
                        "columns zero (the drafter computes what it did before training moves them)")
    p.add_argument("--val-continued-tokens", type=int, default=64,
                   help="validation on continued windows scores blocks anchored in the first N continued tokens "
                        "(the target's continuations turn repetitive later; 0: all)")
    p.add_argument("--gamma", type=float, default=4.0, help="position decay of the loss weights")
    p.add_argument("--hard-labels", action="store_true",
                   help="score drafts by cross-entropy to the target's argmax (what greedy verification accepts) "
                        "instead of KL to its distribution")
    p.add_argument("--layer-types", default=",".join("S" if t == gemma4_dflash.SLIDING else "F"
                                                      for t in gemma4_dflash.LAYER_TYPES),
                   help="draft layers, e.g. S,S,F (S: sliding, causal in the block; F: full, bidirectional)")
    p.add_argument("--target-layer-ids", default=",".join(map(str, gemma4_dflash.TARGET_LAYER_IDS)))
    p.add_argument("--intermediate-size", type=int, default=gemma4_dflash.INTERMEDIATE_SIZE)
    cli.add_drafter_loop_args(p)
    args = p.parse_args(argv)
    if args.generated_openings and not args.generated_windows:
        p.error("--generated-openings adds to the generated windows: give --generated-windows too")
    if args.widen_mlp and args.init_from is None:
        p.error("--widen-mlp grows the drafter of --init-from: give --init-from too")
    if args.generate_only and not (args.generated_windows and args.generated_cache):
        p.error("--generate-only writes the generated windows: give --generated-windows and --generated-cache")
    return args


# ---------------------------------------------------------------------------------------------------
# What the target gives the drafter, and all blocks of a window in one drafter forward


class TargetView:
    """One frozen target forward over windows `ids` [batch, seq]: the hidden states after `layer_ids` (one
    [batch, seq, hidden] per id, captured by hooks as when decoding) and the soft-capped logits [batch, seq, vocab]."""

    def __init__(self, target, ids: torch.Tensor, layer_ids):
        with torch.no_grad(), capture_hidden_states(target, layer_ids) as captured:
            self.logits = target(input_ids=ids, use_cache=False).logits.float()
            self.hidden = list(captured)


class ConcatenatedBlocks:
    """`DFlashContextSource` for training: the blocks of window b, anchored at `anchors[b]` [num_anchors], sit
    one after another on the block axis (block i at slots i*L .. i*L+L-1) and each attends over the window's
    context K/V of positions < its anchor and over its own block, with the decode-time visibility rule
    (`hf_specdec.models.dflash.context`)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], anchors: torch.Tensor, block_len: int):
        self.kv = kv  # per draft layer: keys, values [batch, seq, kv_heads, head_dim] at positions 0 .. seq-1
        batch, num_anchors = anchors.shape
        offsets = torch.arange(block_len, device=anchors.device)
        self.position_ids = (anchors[:, :, None] + offsets).flatten(1)  # [batch, num_anchors * L]
        self.anchor_of = anchors.repeat_interleave(block_len, dim=1)  # [batch, num_anchors * L]
        self.block_of = torch.arange(num_anchors, device=anchors.device).repeat_interleave(block_len)
        self.offset_of = offsets.repeat(num_anchors)
        self._masks: dict = {}

    def mask(self, causal_block: bool, sliding_window: int | None) -> torch.Tensor:
        """[batch, num_anchors * L, seq + num_anchors * L] bool, True = visible."""
        key = (causal_block, sliding_window)
        if key not in self._masks:
            seq_len = self.kv[0][0].shape[1]
            context_pos = torch.arange(seq_len, device=self.position_ids.device)
            context = context_pos < self.anchor_of[:, :, None]
            if sliding_window is not None:
                context &= self.position_ids[:, :, None] - context_pos < sliding_window
            distance = self.offset_of[:, None] - self.offset_of[None, :]  # query minus key offset
            block = self.block_of[:, None] == self.block_of[None, :]
            if causal_block:
                block &= distance >= 0
            if sliding_window is not None:
                block &= distance.abs() < sliding_window
            self._masks[key] = torch.cat([context, block.expand(len(context), -1, -1)], dim=-1)
        return self._masks[key]

    def attend(self, layer_idx, query, block_k, block_v, *, scaling, causal_block, sliding_window):
        context_k, context_v = self.kv[layer_idx]
        keys = torch.cat([context_k, block_k.to(context_k.dtype)], dim=1)
        values = torch.cat([context_v, block_v.to(context_v.dtype)], dim=1)
        return dense_block_attention(query.to(keys.dtype), keys, values, self.mask(causal_block, sliding_window),
                                     scaling)


def block_ids(drafter, windows: torch.Tensor, anchors: torch.Tensor, block_len: int) -> torch.Tensor:
    """`[x_a, mask x (L-1)]` of every anchor, concatenated per window -> [batch, num_anchors * L]."""
    first = windows.gather(1, anchors)  # [batch, num_anchors]
    return drafter.block_input_ids(first.flatten(), block_len - 1).view(len(windows), -1)


def draft_logits_at(drafter, target, view: TargetView, windows: torch.Tensor, anchors: torch.Tensor,
                    block_len: int) -> torch.Tensor:
    """Draft logits of every block [batch * num_anchors, L-1, vocab] (drafts at positions a+1 .. a+L-1)."""
    batch, seq_len = windows.shape
    features = drafter.context_features(view.hidden)
    positions = torch.arange(seq_len, device=windows.device).expand(batch, -1)
    source = ConcatenatedBlocks(drafter.context_kv_all_layers(features, positions), anchors, block_len)
    with torch.no_grad():
        embeds = drafter.embed_block(target, block_ids(drafter, windows, anchors, block_len))
    hidden = drafter.draft_block(embeds, source.position_ids, source)  # [batch, num_anchors * L, hidden]
    return drafter.draft_logits(target, hidden.reshape(batch * anchors.shape[1], block_len, -1))


def target_logits_at(view: TargetView, anchors: torch.Tensor, block_len: int) -> torch.Tensor:
    """The target's logits that draft j of each block is scored against: position a+j-1 -> [n_blocks, L-1, vocab]."""
    index = (anchors[:, :, None] + torch.arange(block_len - 1, device=anchors.device)).flatten(1)
    vocab = view.logits.shape[-1]
    return view.logits.gather(1, index[:, :, None].expand(-1, -1, vocab)).view(-1, block_len - 1, vocab)


class BlockObjective:
    """`loss_fn(drafter, batch)` for `train_loop.train`, and the validation metrics."""

    def __init__(self, target, *, block_size: int, num_anchors: int, gamma: float, short_block_prob: float,
                 seed: int, hard_labels: bool = False):
        self.target, self.block_size, self.num_anchors = target, block_size, num_anchors
        self.hard_labels = hard_labels
        self.gamma, self.short_block_prob = gamma, short_block_prob
        self.generator = torch.Generator().manual_seed(seed + 1)  # anchors and block lengths, on the CPU
        # () -> [batch] lowest anchor of each window of the batch just drawn (`MixedWindows.first_anchor`)
        self.first_anchor_of = None

    def weights(self, block_len: int, device) -> torch.Tensor:
        """Position decay w_j = exp(-(j-1)/gamma) of drafts j = 1 .. L-1, normalised to sum 1."""
        w = torch.exp(-torch.arange(block_len - 1, device=device, dtype=torch.float32) / self.gamma)
        return w / w.sum()

    def sample(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        block_len = self.block_size
        if self.block_size > 2 and torch.rand((), generator=self.generator) < self.short_block_prob:
            block_len = int(torch.randint(2, self.block_size, (), generator=self.generator))
        last = batch.shape[1] - block_len  # the last anchor whose block fits in the window
        if self.first_anchor_of is None:
            anchors = torch.randint(1, last + 1, (len(batch), self.num_anchors), generator=self.generator)
        else:
            first = self.first_anchor_of().clamp(1, last)[:, None]
            uniform = torch.rand((len(batch), self.num_anchors), generator=self.generator)
            anchors = first + (uniform * (last - first + 1)).long().clamp(max=last - first)
        return anchors.to(batch.device), block_len

    def __call__(self, drafter, batch: torch.Tensor) -> torch.Tensor:
        anchors, block_len = self.sample(batch)
        view = TargetView(self.target, batch, drafter.target_layer_ids)
        draft = draft_logits_at(drafter, self.target, view, batch, anchors, block_len)
        return self.block_loss(draft, target_logits_at(view, anchors, block_len))

    def block_loss(self, draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Position-weighted loss of draft logits against the target's [n_blocks, L-1, vocab]."""
        log_q = F.log_softmax(draft.float(), -1)
        if self.hard_labels:
            loss = -log_q.gather(-1, target.argmax(-1, keepdim=True)).squeeze(-1)  # [n_blocks, L-1]
        else:
            loss = F.kl_div(log_q, F.log_softmax(target, -1), log_target=True, reduction="none").sum(-1)
        return (loss.mean(0) * self.weights(draft.shape[1] + 1, loss.device)).sum()

    @torch.no_grad()
    def metrics(self, drafter, windows: list[torch.Tensor], stride: int = 8, first_anchor: int = 1,
                anchor_span: int = 0) -> dict:
        """Full blocks anchored every `stride` positions (from `first_anchor`, the next `anchor_span` positions
        only if not 0) of fixed validation windows: KL
        and accuracy (draft argmax == target argmax) per draft position, and `tau_estimate` per k = 1 .. L-1:
        1 + mean number of leading drafts that all match, at most k (teacher-forced on the windows)."""
        L = self.block_size
        kl_sum, match_sum, runs = torch.zeros(L - 1), torch.zeros(L - 1), []
        for batch in windows:
            end = batch.shape[1] - L + 1
            end = min(end, first_anchor + anchor_span) if anchor_span else end
            anchors = torch.arange(first_anchor, end, stride, device=batch.device)
            anchors = anchors.expand(len(batch), -1)
            view = TargetView(self.target, batch, drafter.target_layer_ids)
            draft = draft_logits_at(drafter, self.target, view, batch, anchors, L).float()
            target = target_logits_at(view, anchors, L)
            kl = F.kl_div(F.log_softmax(draft, -1), F.log_softmax(target, -1), log_target=True, reduction="none")
            match = draft.argmax(-1) == target.argmax(-1)  # [n_blocks, L-1]
            kl_sum += kl.sum(-1).sum(0).cpu()
            match_sum += match.sum(0).float().cpu()
            runs.append(match.long().cumprod(-1).sum(-1).cpu())
        runs = torch.cat(runs)
        n = len(runs)
        tau = {str(k): 1 + runs.clamp(max=k).float().mean().item() for k in range(1, L)}
        kl = (kl_sum / n).tolist()
        return {"kl": kl, "accuracy": (match_sum / n).tolist(), "tau_estimate": tau,
                "loss": float((torch.tensor(kl) * self.weights(L, "cpu")).sum())}


@torch.no_grad()
def check_matches_draft_block(drafter, target, ids: torch.Tensor, block_len: int, tol: float = 1e-4) -> float:
    """Raise if the training path disagrees with decode-time drafting: `draft_logits_at` (all blocks of a window
    in one forward) against `draft_block` over a `DenseDFlashContext` of each anchor's prefix (fp32, one window,
    anchors before, at and past the sliding window). Returns the max difference of the draft logits."""
    drafter, ids = copy.deepcopy(drafter).float(), ids[:1]
    view = TargetView(target, ids, drafter.target_layer_ids)
    window = drafter.config.sliding_window or 8
    anchors = torch.tensor([[1, 5, window, window + 7, ids.shape[1] - block_len]], device=ids.device)
    batched = draft_logits_at(drafter, target, view, ids, anchors, block_len)
    features = drafter.context_features(view.hidden)
    worst = 0.0
    for i, a in enumerate(anchors[0].tolist()):
        context = DenseDFlashContext.from_features(drafter, features[:, :a])
        embeds = drafter.embed_block(target, drafter.block_input_ids(ids[:, a], block_len - 1))
        hidden = drafter.draft_block(embeds, torch.arange(a, a + block_len, device=ids.device)[None], context)
        worst = max(worst, (drafter.draft_logits(target, hidden)[0] - batched[i]).abs().max().item())
    if worst > tol:
        raise AssertionError(f"training draft logits differ from draft_block by {worst:.2e} (> {tol})")
    return worst


def generate_windows(target, stream: TokenStream, count: int, prefix_len: int, seq_len: int, seed: int,
                     chunk: int = 4096) -> torch.Tensor:
    """[count, seq_len]: random `prefix_len`-token windows of `stream` (seeded), each continued by the target."""
    prefixes = RandomWindows(stream, count, prefix_len - 1, seed)()
    return torch.cat([continue_greedily(target, ids, seq_len) for ids in prefixes.split(chunk)])


def document_openings(stream: TokenStream, bos_id: int, prefix_len: int, count: int | None = None) -> torch.Tensor:
    """[n, prefix_len]: the first `prefix_len` tokens (`<bos>` included) of the first `count` documents of `stream`
    that have that many tokens, in stream order."""
    starts = (stream.ids == bos_id).nonzero().squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([stream.ids.numel()])])
    starts = starts[(ends - starts) >= prefix_len][:count]
    return stream.ids[starts[:, None] + torch.arange(prefix_len, device=starts.device)]


@torch.no_grad()
def continue_greedily(target, prefixes: torch.Tensor, seq_len: int) -> torch.Tensor:
    """prefixes [n, prefix_len] continued greedily by the target to [n, seq_len] (fp32, stock transformers
    generate, no end-of-sequence stop)."""
    new = seq_len - prefixes.shape[1]
    return target.generate(prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=target.config.pad_token_id)


class MixedWindows:
    """Training batches: `round(fraction * batch_size)` windows drawn (seeded) from `generated`, the rest from
    `data`. `first_anchor()` gives, for the batch just drawn, where each window's continuation starts
    (`continued_from` of a generated window, 1 for a data window)."""

    def __init__(self, data: RandomWindows, generated: torch.Tensor, fraction: float, seed: int,
                 continued_from: torch.Tensor | None = None):
        self.data, self.generated = data, generated
        self.continued_from = continued_from if continued_from is not None else torch.ones(len(generated))
        self.num_generated = round(fraction * data.batch_size)
        self.data.batch_size -= self.num_generated
        self.generator = torch.Generator().manual_seed(seed + 3)
        self._first = None

    def __call__(self) -> torch.Tensor:
        index = torch.randint(0, len(self.generated), (self.num_generated,), generator=self.generator)
        self._first = torch.cat([torch.ones(self.data.batch_size, dtype=torch.long),
                                 self.continued_from.long().cpu()[index]])
        return torch.cat([self.data(), self.generated[index.to(self.generated.device)]])

    def first_anchor(self) -> torch.Tensor:
        return self._first


GENERATED_KEYS = ("generated_windows", "generated_prefix", "generated_openings", "opening_prefix", "seq_len", "seed",
                  "target")


def generated_data(args, target, tokenizer, frozen, val_windows, device) -> dict:
    """The target's continuations for training and validation (made, or loaded from `--generated-cache` when it was
    made with the same options): `windows` [n, seq_len], `continued_from` [n] (index of each window's first
    continued token), `val` (batches of continued validation windows) and `val_first` (where those continue)."""
    meta = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items() if k in GENERATED_KEYS}
    cache = args.generated_cache
    if cache is not None and cache.is_file():
        saved = torch.load(cache, map_location="cpu")
        if saved["meta"] == meta:
            print(f"generated windows from {cache}", flush=True)
            return {"windows": saved["windows"].long().to(device), "continued_from": saved["continued_from"],
                    "val": [w.long().to(device) for w in saved["val"]], "val_first": saved["val_first"],
                    "seconds": saved["seconds"]}
        differ = sorted(k for k in meta.keys() | saved["meta"].keys() if meta.get(k) != saved["meta"].get(k))
        print(f"{cache} holds other generated windows ({', '.join(differ)} differ): making them again and "
              f"overwriting it", flush=True)
    start = time.perf_counter()
    train_stream = frozen.train_stream.to(device)
    windows = generate_windows(target, train_stream, args.generated_windows, args.generated_prefix, args.seq_len,
                               args.seed + 2)
    continued_from = [torch.full((len(windows),), args.generated_prefix)]
    val = [continue_greedily(target, w[:, : args.generated_prefix], args.seq_len) for w in val_windows]
    val_first = args.generated_prefix
    if args.generated_openings:
        parts = [windows]
        for prefix in args.opening_prefix:
            openings = document_openings(train_stream, tokenizer.bos_token_id, prefix, args.generated_openings)
            parts += [continue_greedily(target, ids, args.seq_len) for ids in openings.split(4096)]
            continued_from.append(torch.full((len(openings),), prefix))
        windows = torch.cat(parts)
        val_openings = document_openings(frozen.validation_stream.to(device), tokenizer.bos_token_id,
                                         args.opening_prefix[0])
        val = [continue_greedily(target, ids, args.seq_len) for ids in val_openings.split(16)]
        val_first = args.opening_prefix[0]
    data = {"windows": windows, "continued_from": torch.cat(continued_from), "val": val, "val_first": val_first,
            "seconds": round(time.perf_counter() - start, 1)}
    if cache is not None:  # token ids in 16 bits where the vocabulary fits (the family's: 4,096)
        vocab = target.config.get_text_config().vocab_size
        small = torch.int16 if vocab <= torch.iinfo(torch.int16).max else torch.int32
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"meta": meta, **data, "windows": windows.to(small).cpu(), "val": [w.to(small).cpu() for w in val]},
                   cache)
    return data


def probe_steps(drafter, objective, batches, budget_s: float, device, probe: int = 8) -> tuple[int, float]:
    """Steps that fit in `budget_s`, from the time of `probe` steps on a copy (after 3 warm-up steps)."""
    model = copy.deepcopy(drafter)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samplers = [objective, batches, getattr(batches, "data", None)]  # put back after: training draws the same
    states = [s.generator.get_state() for s in samplers if s is not None]
    for i in range(3 + probe):
        if i == 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = objective(model, batches())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / probe
    for sampler, state in zip([s for s in samplers if s is not None], states):
        sampler.generator.set_state(state)
    return max(200, int(budget_s / per_step)), per_step


# ---------------------------------------------------------------------------------------------------


def measure(args, device) -> dict:
    """τ per block size (k = 1 .. block_size - 1) on `device`; on CPU also plain vs DFlash tokens/s (one
    thread) at the default k and at the k of the highest τ."""
    def speed_ks(tau: dict) -> list[int]:
        best_k = max(tau, key=lambda k: tau[k]["tau"])  # the first of equals, in order of k
        return sorted({int(best_k), int(list(tau)[-1])})

    return measure_drafter(args.target, args.out, device, method="dflash", new_tokens=args.tau_new_tokens,
                           prompt_chars=args.tau_prompt_chars, ks=lambda drafter: tuple(range(1, drafter.block_size)),
                           speed_ks=speed_ks)


def widen_mlp(drafter: DFlashDrafter, intermediate_size: int) -> DFlashDrafter:
    """A copy of `drafter` whose MLPs have `intermediate_size` units: the old units' weights as they were, the new
    units' gate/up rows drawn as a fresh drafter's and their down-projection columns zero, so the copy's outputs
    equal the original's until training moves them."""
    old = drafter.config.intermediate_size
    if intermediate_size <= old:
        raise ValueError(f"--widen-mlp {intermediate_size} does not grow the drafter's MLPs ({old} units): give more")
    config = copy.deepcopy(drafter.config)
    config.intermediate_size = intermediate_size
    wider = DFlashDrafter(config).to(dtype=next(drafter.parameters()).dtype, device=next(drafter.parameters()).device)
    state = wider.state_dict()
    for name, tensor in drafter.state_dict().items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            state[name][:old] = tensor
        elif name.endswith("mlp.down_proj.weight"):
            state[name].zero_()
            state[name][:, :old] = tensor
        else:
            state[name].copy_(tensor)
    wider.load_state_dict(state)
    return wider


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.measure_only:
        cli.update_report(args.report, f"measured_{device.type}", measure(args, device))
        return {}
    seed_everything(args.seed)
    report: dict = {"args": cli.args_record(args)}

    # 1. The frozen target, its tokenizer, and the token streams (the target's train / validation split).
    frozen = load_frozen_target(args.target, args.corpus, device)
    target, tokenizer, train_stream = frozen.model, frozen.tokenizer, frozen.train_stream
    report["data"] = frozen.data

    # 2. The drafter; the training path is checked against decode-time drafting before anything is trained.
    layer_types = [{"S": gemma4_dflash.SLIDING, "F": gemma4_dflash.FULL}[t] for t in args.layer_types.split(",")]
    if args.init_from is not None:
        drafter = DFlashDrafter.from_pretrained(args.init_from, dtype=torch.float32).to(device)
        args.block_size = drafter.block_size
        report["init_from"] = str(args.init_from)
        if args.widen_mlp:
            drafter = widen_mlp(drafter, args.widen_mlp).to(device)
            report["widened_mlp_to"] = args.widen_mlp
    else:
        drafter = gemma4_dflash.build_model(
            target, tokenizer.convert_tokens_to_ids(gemma4_dflash.MASK_TOKEN), layer_types=layer_types,
            intermediate_size=args.intermediate_size, block_size=args.block_size,
            target_layer_ids=[int(i) for i in args.target_layer_ids.split(",")]).to(device)
    report["num_parameters"] = sum(p.numel() for p in drafter.parameters())
    report["config"] = drafter.config.to_dict()
    val_windows = validation_windows(frozen.validation_stream.to(device), args.eval_windows, args.seq_len, device)
    report["draft_block_check_max_abs_diff"] = check_matches_draft_block(drafter, target, val_windows[0],
                                                                         args.block_size)
    print(f"parameters {report['num_parameters']:,}  draft_block check "
          f"{report['draft_block_check_max_abs_diff']:.1e}", flush=True)

    # 3. Training; validation metrics every `eval_every` steps, keeping the weights with the best τ estimate.
    objective = BlockObjective(target, block_size=args.block_size, num_anchors=args.anchors, gamma=args.gamma,
                               short_block_prob=args.short_block_prob, seed=args.seed, hard_labels=args.hard_labels)
    batches = RandomWindows(train_stream.to(device), args.batch_size, args.seq_len - 1, args.seed)
    val_generated, first_generated = [], 1
    if args.generated_windows:
        generated = generated_data(args, target, tokenizer, frozen, val_windows, device)
        if args.generate_only:
            print(f"{len(generated['windows'])} generated windows in {generated['seconds']} s", flush=True)
            return report
        val_generated, first_generated = generated["val"], generated["val_first"]
        batches = MixedWindows(batches, generated["windows"], args.generated_fraction, args.seed,
                               generated["continued_from"])
        if args.continuation_anchors:
            objective.first_anchor_of = batches.first_anchor
        report["generated"] = {"windows": len(generated["windows"]), "prefix": args.generated_prefix,
                               "openings": args.generated_openings, "opening_prefix": args.opening_prefix,
                               "fraction": args.generated_fraction, "continuation_anchors": args.continuation_anchors,
                               "seconds": generated["seconds"]}
        print("generated", json.dumps(report["generated"]), flush=True)
    steps = args.steps
    if args.time_budget:
        steps, per_step = probe_steps(drafter, objective, batches, args.time_budget, device)
        report["probe"] = {"time_budget_s": args.time_budget, "seconds_per_step": round(per_step, 4), "steps": steps}
        report["args"]["steps"] = steps
        print("probe", json.dumps(report["probe"]), flush=True)
    cfg = cli.train_config(args, steps=steps, seq_len=args.seq_len - 1)
    curve, best = [], {"score": -math.inf}
    full_k = str(args.block_size - 1)

    def validate(step: int | None = None) -> float:
        """Called by `train` every `eval_every` steps (no argument), and once after the last step."""
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            metrics = {"step": step or (len(curve) + 1) * args.eval_every} | objective.metrics(drafter, val_windows)
            if val_generated:
                metrics["generated"] = objective.metrics(
                    drafter, val_generated, stride=2 if args.val_continued_tokens else 8, first_anchor=first_generated,
                    anchor_span=args.val_continued_tokens)
        curve.append(cli.rounded(metrics))
        print("validation", json.dumps(curve[-1]), flush=True)
        score = (metrics.get("generated") or metrics)["tau_estimate"][full_k]
        if score > best["score"]:
            best.update(curve[-1], score=score, state=copy.deepcopy(drafter.state_dict()))
        return metrics["loss"]

    result = train(drafter, objective, batches, cfg, evaluate=validate, eval_every=args.eval_every,
                   log=lambda line: print(line, flush=True))
    final = validate(steps)
    drafter.load_state_dict(best.pop("state"))
    best.pop("score")
    report["training"] = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": args.seq_len, "anchors": args.anchors,
        "block_size": args.block_size, "kept_by": "generated tau_estimate" if val_generated else "tau_estimate",
        "short_block_prob": args.short_block_prob, "gamma": args.gamma,
        **cli.schedule_record(cfg), "target_tokens_seen": result.tokens_seen,
        **cli.curve_record(result, train_stream.ids.numel()), "final_validation_loss": final,
        "validation_curve": curve, "kept_step": best.pop("step"), "kept_validation": best,
        "device": cli.device_name(device), **cli.versions(),
    }

    # 4. Export in bf16 (z-lab layout), reload through hf_specdec, measure τ on this device.
    files = export_checkpoint(drafter, None, args.out)
    report["files"] = files | {"total": sum(files.values())}
    print("files", json.dumps(report["files"]), flush=True)
    cli.write_report(args.report, report)
    cli.update_report(args.report, f"measured_{device.type}", measure(args, device))
    return report


if __name__ == "__main__":
    main()
