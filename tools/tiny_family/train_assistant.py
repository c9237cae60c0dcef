"""Train the tiny Gemma 4 MTP assistant by distillation from the frozen bundled target, export it in the
released checkpoint layout, and measure τ with hf_specdec's speculative loop.

    python -m tools.tiny_family.train_assistant --corpus .carry/stdlib-3.11.7.tar.gz \
        --out hf_specdec/assets/tiny-gemma4-assistant --report tools/tiny_family/results/tiny-gemma4-assistant.json
    python -m tools.tiny_family.train_assistant --measure-only --out hf_specdec/assets/tiny-gemma4-assistant \
        --report tools/tiny_family/results/tiny-gemma4-assistant.json      # τ and CPU speed of an export

What is trained is exactly what decoding runs (`mtp_drafter`): for every position p of a window (token x_p
not yet seen by the target), draft step 0 takes (x_p, the target's final-normed hidden state at p-1) and
step j takes (x_{p+j}, the previous step's `hidden_next`) — the token an accepted draft would be. Every
step queries at p and attends the producer layers' K/V of positions < p (sliding layers: the last
`draft_sliding_window` of them). Step j is scored against the target's distribution at p+j, which is
what verification checks it against:

    loss_j = KL(target(p+j) || softmax(tied LM head)) + centroid_weight * CE(centroid logits, centroid of target argmax)

All positions of a window are drafted in one batched forward per step: `WindowKVSource` gives every
query its own causal / sliding mask in one SDPA per layer.
"""

import argparse
import copy
import json
import pathlib

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_specdec.compat import cache_argument
from hf_specdec.models.gemma4 import DenseTargetKVSource, draft_sliding_window
from hf_specdec.models.gemma4.centroid_head import softcap

from . import cli, gemma4_assistant
from .data import RandomWindows, validation_windows
from .export import export_checkpoint
from .frozen_target import load_frozen_target
from .measure import measure_drafter
from .train_loop import seed_everything, train

DEFAULT_TARGET = pathlib.Path("hf_specdec/assets/tiny-gemma4")
TAU_KS = (1, 2, 4, 7)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_drafter_source_args(p, DEFAULT_TARGET)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32, help="windows per step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (>= sliding window)")
    p.add_argument("--draft-steps", type=int, default=4, help="unrolled draft steps J per position")
    p.add_argument("--centroid-weight", type=float, default=1.0)
    p.add_argument("--hidden-size", type=int, default=gemma4_assistant.HIDDEN_SIZE)
    p.add_argument("--intermediate-size", type=int, default=gemma4_assistant.INTERMEDIATE_SIZE)
    cli.add_drafter_loop_args(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# What the target gives the assistant, and the batched draft steps over it


class TargetView:
    """One frozen target forward over windows `ids` [batch, seq]: what the assistant reads and matches."""

    def __init__(self, target, ids: torch.Tensor):
        config = target.config
        with torch.no_grad():
            cache = DynamicCache()  # no config: sliding layers keep every position (no cropping)
            out = target.model(input_ids=ids, use_cache=True, **{cache_argument(target.model): cache})
            self.hidden = out.last_hidden_state  # [batch, seq, backbone_hidden], after the final norm
            logits = target.lm_head(self.hidden).float()
            self.logits = softcap(logits, config.final_logit_softcapping)  # [batch, seq, vocab], as the target's
        # The producer layers' K/V: layer type -> (keys, values), each [batch, kv_heads, seq, head_dim].
        self.kv = DenseTargetKVSource.from_cache(cache, config).kv


class WindowKVSource:
    """`TargetKVSource` for training: queries of positions `positions` [num_queries] of every window attend
    the window's K/V, each with its own mask (keys < p; sliding: the last `sliding_window` of them), in one
    SDPA per layer. Queries arrive flattened as [batch * num_queries, 1, heads, head_dim], window-major."""

    def __init__(self, kv: dict, positions: torch.Tensor, seq_len: int):
        self.kv = kv
        self.num_queries = positions.numel()
        key_pos = torch.arange(seq_len, device=positions.device)
        self.causal = key_pos[None, :] < positions[:, None]  # [num_queries, seq]
        self.distance = positions[:, None] - key_pos[None, :]  # how far back each key lies

    def attend(self, layer_type, query, *, scaling, sliding_window):
        keys, values = self.kv[layer_type]
        batch, kv_heads = keys.shape[:2]
        heads, head_dim = query.shape[-2:]
        mask = self.causal if sliding_window is None else self.causal & (self.distance <= sliding_window)
        q = query.reshape(batch, self.num_queries, heads, head_dim).transpose(1, 2).to(keys.dtype)
        groups = heads // kv_heads  # query head h reads kv head h // groups
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
                                             attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).reshape(batch * self.num_queries, 1, heads, values.shape[-1]).to(query.dtype)


def draft_states(assistant, target_embed, ids: torch.Tensor, view: TargetView, num_steps: int):
    """The final-normed assistant state of draft step j = 0..num_steps-1 at every query position
    p = 1..seq-num_steps of every window -> list of [batch * (seq - num_steps), hidden].

    The same computation as `Gemma4MTPAssistant.draft_step` (checked by `check_matches_draft_step`), minus
    its candidate selection, which training replaces by losses on the full head and the centroid logits."""
    batch, seq_len = ids.shape
    num_queries = seq_len - num_steps
    positions = torch.arange(1, num_queries + 1, device=ids.device)
    kv_source = WindowKVSource(view.kv, positions, seq_len)
    position_ids = positions.expand(batch, -1).reshape(-1, 1)
    hidden = view.hidden[:, :num_queries].reshape(batch * num_queries, -1)  # the target's state at p-1
    states = []
    for j in range(num_steps):
        embeds = target_embed(ids[:, 1 + j : 1 + j + num_queries].reshape(-1)).to(assistant.pre_projection.weight.dtype)
        x = assistant.pre_projection(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1)).unsqueeze(1)
        normed = assistant.model(x, position_ids, kv_source).squeeze(1)
        states.append(normed)
        hidden = assistant.post_projection(normed)
    return states


def step_targets(view: TargetView, num_steps: int, j: int) -> torch.Tensor:
    """The target's logits that draft step j is scored against: positions p + j -> [batch * queries, vocab]."""
    num_queries = view.logits.shape[1] - num_steps
    return view.logits[:, 1 + j : 1 + j + num_queries].reshape(-1, view.logits.shape[-1])


class Distiller:
    """`loss_fn(assistant, batch)` for `train_loop.train`, and the validation metrics."""

    def __init__(self, target, num_steps: int, centroid_weight: float):
        self.target, self.num_steps, self.centroid_weight = target, num_steps, centroid_weight
        self.embed = target.get_input_embeddings()

    def centroid_of(self, assistant) -> torch.Tensor:
        """Centroid of each token id [vocab]: entry i of `token_ordering` belongs to centroid i // size."""
        head = assistant.masked_embedding
        ordering = head.token_ordering
        size = head.vocab_size // head.num_centroids
        centroids = torch.arange(ordering.numel(), device=ordering.device) // size
        return torch.empty_like(ordering).scatter_(0, ordering, centroids)

    def __call__(self, assistant, batch: torch.Tensor) -> torch.Tensor:
        view = TargetView(self.target, batch)
        centroid_of = self.centroid_of(assistant)
        lm_head = assistant.model.embed_tokens.weight
        loss = 0.0
        for j, normed in enumerate(draft_states(assistant, self.embed, batch, view, self.num_steps)):
            target_logits = step_targets(view, self.num_steps, j)
            log_q = F.log_softmax((normed @ lm_head.T).float(), dim=-1)
            kl = F.kl_div(log_q, F.log_softmax(target_logits, dim=-1), log_target=True, reduction="batchmean")
            centroid_logits = assistant.masked_embedding.centroids(normed).float()
            centroid_ce = F.cross_entropy(centroid_logits, centroid_of[target_logits.argmax(-1)])
            loss = loss + kl + self.centroid_weight * centroid_ce
        return loss / self.num_steps

    @torch.no_grad()
    def metrics(self, assistant, windows: list[torch.Tensor]) -> dict:
        """Per draft step: KL, centroid recall (the target argmax's centroid in the top k), accuracy of the
        candidate argmax (what decoding drafts) against the target argmax; and `tau_estimate` at k = J:
        1 + mean over positions of the number of leading steps that all match (teacher-forced on the data)."""
        totals = torch.zeros(3, self.num_steps)
        accepted, count = 0.0, 0
        for batch in windows:
            view = TargetView(self.target, batch)
            chain = None
            for j, normed in enumerate(draft_states(assistant, self.embed, batch, view, self.num_steps)):
                kl, recall, match = self._step_metrics(assistant, normed, step_targets(view, self.num_steps, j))
                totals[:, j] += torch.stack([kl.sum(), recall.sum(), match.sum()]).float().cpu()
                chain = match if chain is None else chain & match
                accepted += chain.sum().item()
            count += chain.numel()
        kl, recall, acc = (totals / count).tolist()
        return {"kl": kl, "centroid_recall": recall, "accuracy": acc, "tau_estimate": 1 + accepted / count,
                "loss": sum(kl) / self.num_steps}

    def _step_metrics(self, assistant, normed, target_logits):
        head = assistant.masked_embedding
        logits = (normed @ assistant.model.embed_tokens.weight.T).float()
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target_logits, -1), log_target=True,
                      reduction="none").sum(-1)
        best = target_logits.argmax(-1)
        top = head.centroids(normed).topk(head.top_k, dim=-1).indices  # [n, top_k]
        chosen = torch.zeros(len(normed), head.num_centroids, dtype=torch.bool, device=normed.device)
        chosen.scatter_(1, top, True)
        candidate = chosen[:, self.centroid_of(assistant)]  # [n, vocab]: token is among the candidates
        recall = candidate.gather(1, best[:, None]).squeeze(1)
        match = logits.masked_fill(~candidate, float("-inf")).argmax(-1) == best
        return kl, recall, match


@torch.no_grad()
def check_matches_draft_step(assistant, target, ids: torch.Tensor, num_steps: int, tol: float = 1e-4) -> float:
    """Raise if `draft_states` disagrees with `Gemma4MTPAssistant.draft_step` over a dense K/V source (fp32,
    one window, every draft step at a few positions, sliding window included). Returns the max difference."""
    assistant = copy.deepcopy(assistant).float()
    view = TargetView(target, ids[:1])
    seq_len = ids.shape[1]
    states = draft_states(assistant, target.get_input_embeddings(), ids[:1], view, num_steps)
    positions = torch.tensor([1, 2, draft_sliding_window(assistant.config.text_config) + 3, seq_len - num_steps],
                             device=ids.device)
    kv_mask = torch.arange(seq_len, device=ids.device)[None, :] < positions[:, None]
    source = DenseTargetKVSource({t: (k.expand(len(positions), -1, -1, -1), v.expand(len(positions), -1, -1, -1))
                                  for t, (k, v) in view.kv.items()}, kv_mask)
    hidden, worst = view.hidden[0, positions - 1].float(), 0.0
    for j in range(num_steps):
        step = assistant.draft_step(ids[0, positions + j], hidden, positions, target.get_input_embeddings(), source)
        mine = states[j][positions - 1]  # window-major flattening: query p sits at index p - 1
        got = (mine @ assistant.model.embed_tokens.weight.T).gather(1, step.logits.token_ids)
        worst = max(worst, (got - step.logits.logits).abs().max().item(),
                    (assistant.post_projection(mine) - step.hidden_next).abs().max().item())
        hidden = step.hidden_next
    if worst > tol:
        raise AssertionError(f"training draft states differ from draft_step by {worst:.2e} (> {tol})")
    return worst


# ---------------------------------------------------------------------------------------------------


def measure(args, device) -> dict:
    """τ per k in `TAU_KS` on `device`; on CPU also plain vs MTP tokens/s (one thread) at k = 4."""
    return measure_drafter(args.target, args.out, device, method="mtp", new_tokens=args.tau_new_tokens,
                           prompt_chars=args.tau_prompt_chars, ks=lambda assistant: TAU_KS, speed_ks=lambda tau: [4])


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
    target, train_stream = frozen.model, frozen.train_stream
    report["data"] = frozen.data

    # 2. The assistant, initialised from the target (ordering, LM head, centroids); the training path
    #    is checked against the decode-time draft step before anything is trained.
    assistant = gemma4_assistant.build_model(target, hidden_size=args.hidden_size,
                                             intermediate_size=args.intermediate_size).to(device)
    report["num_parameters"] = sum(p.numel() for p in assistant.parameters())
    report["config"] = assistant.config.to_dict()
    val_windows = validation_windows(frozen.validation_stream.to(device), args.eval_windows, args.seq_len, device)
    report["draft_step_check_max_abs_diff"] = check_matches_draft_step(assistant, target, val_windows[0],
                                                                       args.draft_steps)
    print(f"parameters {report['num_parameters']:,}  draft_step check {report['draft_step_check_max_abs_diff']:.1e}",
          flush=True)

    # 3. Distillation; validation metrics every `eval_every` steps, keeping the weights with the best τ estimate.
    cfg = cli.train_config(args, steps=args.steps, seq_len=args.seq_len - 1)
    distiller = Distiller(target, args.draft_steps, args.centroid_weight)
    curve, best = [], {"tau_estimate": 0.0}

    def validate(step: int | None = None) -> float:
        """Called by `train` every `eval_every` steps (no argument), and once after the last step."""
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            metrics = {"step": step or (len(curve) + 1) * args.eval_every} | distiller.metrics(assistant, val_windows)
        curve.append(cli.rounded(metrics))
        print("validation", json.dumps(curve[-1]), flush=True)
        if metrics["tau_estimate"] > best["tau_estimate"]:
            best.update(curve[-1], state=copy.deepcopy(assistant.state_dict()))
        return metrics["loss"]

    batches = RandomWindows(train_stream.to(device), cfg.batch_size, cfg.seq_len, cfg.seed)
    result = train(assistant, distiller, batches, cfg, evaluate=validate, eval_every=args.eval_every,
                   log=lambda line: print(line, flush=True))
    final = validate(args.steps)
    assistant.load_state_dict(best.pop("state"))
    report["training"] = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": args.seq_len, "draft_steps": args.draft_steps,
        "query_positions_per_window": args.seq_len - args.draft_steps, "centroid_weight": args.centroid_weight,
        **cli.schedule_record(cfg), "target_tokens_seen": result.tokens_seen,
        **cli.curve_record(result, train_stream.ids.numel()), "final_validation_loss": final,
        "validation_curve": curve, "kept_step": best.pop("step"), "kept_validation": best,
        "device": cli.device_name(device), **cli.versions(),
    }

    # 4. Export in bf16 (released config layout), reload through hf_specdec, measure τ on this device.
    files = export_checkpoint(assistant, None, args.out, gemma4_assistant.write_released_config)
    report["files"] = files | {"total": sum(files.values())}
    print("files", json.dumps(report["files"]), flush=True)
    cli.write_report(args.report, report)
    cli.update_report(args.report, f"measured_{device.type}", measure(args, device))
    return report


if __name__ == "__main__":
    main()
