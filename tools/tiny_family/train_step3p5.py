"""Train the tiny Step 3.5 with its 3 MTP layers (one joint loss) and export it; measure it on CPU.

    # GPU: train, export into the package, score validation / held-out files on the device
    python -m tools.tiny_family.train_step3p5 --corpus .carry/stdlib-3.11.7.tar.gz --steps 1600 \
        --out hf_specdec/assets/tiny-step3p5 --report tools/tiny_family/results/tiny-step3p5.json
    # CPU, one thread: held-out bits/byte, τ per k and tokens/s of the exported asset, added to the report
    python -m tools.tiny_family.train_step3p5 --measure --corpus .carry/stdlib-3.11.7.tar.gz \
        --out hf_specdec/assets/tiny-step3p5 --report tools/tiny_family/results/tiny-step3p5.json

The tokenizer is the family's (`--tokenizer`, default the bundled tiny-gemma4); its files are copied
into the asset unchanged. Seeded like `train_target`: init and batch order depend only on `--seed`.
"""

import argparse
import json
import os
import pathlib
import shutil
import time

import torch
from transformers import PreTrainedTokenizerFast

import hf_specdec
from hf_specdec.assets import asset_path, held_out_snippets

from . import cli, step3p5_model
from .corpus import load_corpus
from .data import RandomWindows, TokenStream
from .evaluate import CausalLMScorer, split_scores
from .export import export_checkpoint
from .tokenizer import encode_documents
from .train_loop import seed_everything, train

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint folder to write (or measure)")
    p.add_argument("--report", type=pathlib.Path, help="JSON file for config, loss curves, metrics")
    cli.add_corpus_arg(p)
    p.add_argument("--tokenizer", type=pathlib.Path, default=None, help="default: the bundled tiny-gemma4")
    p.add_argument("--steps", type=int, default=1600)
    cli.add_time_budget_arg(p)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    cli.add_optimizer_args(p, warmup_steps=200)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of each MTP layer's loss")
    p.add_argument("--router-bias-rate", type=float, default=1e-3, help="load-balancing bias step")
    cli.add_run_args(p, eval_every=500, evaluated="validation loss")
    cli.add_device_arg(p)
    p.add_argument("--measure", action="store_true", help="no training: measure the asset in --out on CPU")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--measure: tokens per held-out prompt")
    return p.parse_args(argv)


class LossParts:
    """Per-step [main, mtp_0, ...] losses, kept on the device; summarised at each log line."""

    def __init__(self):
        self.pending: list[torch.Tensor] = []
        self.curve: list[tuple[int, list[float]]] = []
        self.step = 0

    def add(self, parts: torch.Tensor) -> None:
        self.pending.append(parts.detach())
        self.step += 1

    def flush(self) -> str:
        if not self.pending:
            return ""
        means = torch.stack(self.pending).mean(0).tolist()
        self.pending.clear()
        self.curve.append((self.step, means))
        return "  main {:.4f}  mtp ".format(means[0]) + " ".join(f"{m:.4f}" for m in means[1:])


def probe_steps(model, batch_size: int, seq_len: int, vocab: int, budget_s: float, device) -> tuple[int, float]:
    """Steps that fit `budget_s`: the median of 5 timed forward/backward passes (after 2 warm-ups) + 8% for
    the optimizer. Weights are restored after. It underestimates the loop (no router-balancing hooks, no
    logging): on the H100 it timed 0.087 s, the loop ran at 0.108 s per step."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randint(5, vocab, (batch_size, seq_len + 1), device=device)
    model.train()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            step3p5_model.joint_losses(model, batch).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    model.load_state_dict(saved)
    per_step = sorted(times[2:])[2] * 1.08  # median, + the optimizer step
    return int(budget_s / per_step), per_step


@torch.no_grad()
def mtp_validation(model, stream: TokenStream, seq_len: int, batch_size: int, device, max_windows: int = 256):
    """Per MTP layer on non-overlapping validation windows: loss, top-1 accuracy on the data, and
    agreement with the main model's greedy choice for the same token (a proxy for greedy acceptance)."""
    ids = stream.ids
    starts = list(range(0, ids.numel() - seq_len - 1, seq_len))[:max_windows]
    totals = torch.zeros(model.num_mtp_layers, 3, dtype=torch.float64)
    for first in range(0, len(starts), batch_size):
        batch = torch.stack([ids[s: s + seq_len + 1] for s in starts[first: first + batch_size]]).to(device)
        out = model(input_ids=batch[:, :-1], use_cache=False, output_pre_norm_hidden_states=True)
        main_choice = out.logits.argmax(-1)  # [batch, T]: predicts t[p+1] at p
        below = out.pre_norm_hidden_state
        for j in range(model.num_mtp_layers):
            n = seq_len - 1 - j
            step = model.mtp_step(j, batch[:, 1 + j: 1 + j + n], below[:, :n],
                                  position_ids=torch.arange(n, device=device)[None])
            target = batch[:, 2 + j: 2 + j + n]
            loss = torch.nn.functional.cross_entropy(step.logits.float().transpose(1, 2), target, reduction="sum")
            choice = step.logits.argmax(-1)
            totals[j] += torch.tensor([loss.item(), (choice == target).sum().item(),
                                       (choice == main_choice[:, 1 + j: 1 + j + n]).sum().item()], dtype=torch.float64)
            below = step.hidden_state
    count = len(starts) * torch.tensor([seq_len - 1 - j for j in range(model.num_mtp_layers)], dtype=torch.float64)
    return [{"loss": round(t[0].item() / c.item(), 4), "accuracy": round(t[1].item() / c.item(), 4),
             "agreement_with_main": round(t[2].item() / c.item(), 4)} for t, c in zip(totals, count)]


def train_and_export(args: argparse.Namespace, report: dict) -> dict:
    device = torch.device(args.device)
    seed_everything(args.seed)

    # 1. Corpus and the family tokenizer; token streams.
    corpus = load_corpus(args.corpus)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    train_stream = TokenStream.from_documents(encode_documents(tokenizer, [d.text for d in corpus.train]))
    validation_ids = encode_documents(tokenizer, [d.text for d in corpus.validation])
    held_out_ids = encode_documents(tokenizer, [d.text for d in corpus.held_out])
    report["data"] = corpus.summary() | {"train_tokens": train_stream.ids.numel(),
                                         "held_out_tokens": sum(map(len, held_out_ids))}
    print("data", json.dumps(report["data"]), flush=True)

    # 2. Model; with --time-budget, as many steps as fit.
    model = step3p5_model.build_model(tokenizer).to(device)
    report["num_parameters"] = sum(p.numel() for p in model.parameters())
    print(f"parameters {report['num_parameters']:,}", flush=True)
    steps = args.steps
    if args.time_budget:
        steps, per_step = probe_steps(model, args.batch_size, args.seq_len, len(tokenizer), args.time_budget, device)
        report["probe"] = {"time_budget_s": args.time_budget, "seconds_per_step": round(per_step, 4), "steps": steps}
        report["args"]["steps"] = steps  # `--steps` with this value and no `--time-budget` repeats the run
        print("probe", json.dumps(report["probe"]), flush=True)
    cfg = cli.train_config(args, steps=steps, seq_len=args.seq_len)
    scorer = CausalLMScorer(args.seq_len, args.batch_size, tokenizer.pad_token_id, device)
    autocast = torch.bfloat16 if device.type == "cuda" else None

    # 3. Train: main loss + mtp_weight × each MTP layer's loss; router biases balanced after each step.
    balancer = step3p5_model.RouterBalancer(model, args.router_bias_rate)
    parts = LossParts()
    weights = torch.tensor([1.0] + [args.mtp_weight] * model.num_mtp_layers, device=device)

    def loss_fn(model, batch):
        balancer.update()  # the previous step's loads (the loop has no after-step hook)
        losses = step3p5_model.joint_losses(model, batch)
        parts.add(losses)
        return (weights * losses).sum()

    batches = RandomWindows(train_stream.to(device), cfg.batch_size, cfg.seq_len, cfg.seed)
    result = train(model, loss_fn, batches, cfg, evaluate=lambda: scorer.loss(model, validation_ids, autocast),
                   eval_every=args.eval_every, log=lambda line: print(line + parts.flush(), flush=True))
    balancer.update()
    balancer.remove()
    report["training"] = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, **cli.schedule_record(cfg),
        "mtp_weight": args.mtp_weight, "router_bias_rate": args.router_bias_rate, "tokens_seen": result.tokens_seen,
        **cli.curve_record(result, train_stream.ids.numel()),
        "train_loss_parts_curve": [[s, [round(m, 4) for m in means]] for s, means in parts.curve],
        "loss_parts": ["main"] + [f"mtp_{j}" for j in range(model.num_mtp_layers)],
        "validation_loss_curve": result.eval_losses,
        "router_bias": {f"layer_{i}": [round(b, 4) for b in layer.moe.router_bias.tolist()]
                        for i, layer in enumerate(model.model.layers) if hasattr(layer, "moe")},
        "device": cli.device_name(device), **cli.versions(),
    }

    # 4. Export in bf16 (the family's tokenizer files copied unchanged), then score the exported weights in fp32.
    files = export_checkpoint(model, tokenizer, args.out, step3p5_model.write_real_config(tokenizer))
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.tokenizer / name, args.out / name)
    model.float()
    validation, held_out = scorer.scores(model, validation_ids), scorer.scores(model, held_out_ids)
    report["validation"] = split_scores(validation, corpus.validation) | {
        "mtp": mtp_validation(model, TokenStream.from_documents(validation_ids), args.seq_len, args.batch_size, device)}
    report["held_out"] = split_scores(held_out, corpus.held_out)
    report["files"] = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    report["files"]["total"] = sum(report["files"].values())
    for key in ("validation", "held_out", "files"):
        print(key, json.dumps(report[key]), flush=True)
    return report


SPEC_CONFIGS = {"plain": {}, **{f"mtp_k{k}": {"spec_mode": "mtp", "num_speculative_tokens": k} for k in (1, 2, 3)}}


def greedy_runs(model, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Greedy generation (batch 1) of every prompt under each of `SPEC_CONFIGS`, interleaved prompt by
    prompt so that load from other processes falls on every config alike; pooled τ and tokens/s."""
    runs = {name: {"outputs": [], "new_tokens": 0, "target_forwards": 0, "seconds": 0.0} for name in SPEC_CONFIGS}
    for ids in prompts:
        for name, spec in SPEC_CONFIGS.items():
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **spec)
            run = runs[name]
            run["seconds"] += time.perf_counter() - start
            run["outputs"].append(out)
            run["new_tokens"] += out.shape[1] - ids.shape[1]
            run["target_forwards"] += hf_specdec.last_generation_stats(model).num_target_forwards
    for run in runs.values():
        run["tau"] = round(run["new_tokens"] / run["target_forwards"], 3)
        run["tokens_per_s"] = round(run["new_tokens"] / run.pop("seconds"), 1)
    return runs


def measure(args: argparse.Namespace, report: dict) -> dict:
    """CPU, fp32: held-out bits/byte (2 threads), then τ and tokens/s on the bundled snippets (1 thread)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.out)
    model = hf_specdec.AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    corpus = load_corpus(args.corpus)
    held_out_ids = encode_documents(tokenizer, [d.text for d in corpus.held_out])
    start = time.perf_counter()
    scores = CausalLMScorer(seq_len=512, batch_size=8, pad_id=tokenizer.pad_token_id, device="cpu").scores(
        model, held_out_ids)
    cpu = {"held_out": split_scores(scores, corpus.held_out), "held_out_time_s": round(time.perf_counter() - start, 1)}
    print("held_out", json.dumps(cpu["held_out"]), flush=True)

    torch.set_num_threads(1)
    snippets = held_out_snippets()
    prompts = [tokenizer(s["text"], return_tensors="pt").input_ids for s in snippets]
    greedy_runs(model, prompts[:1], 8)  # warm-up
    load_before = os.getloadavg()[0]
    runs = greedy_runs(model, prompts, args.max_new_tokens)
    plain = runs.pop("plain")
    cpu |= {"prompts": [s["path"] for s in snippets], "prompt_tokens": [p.shape[1] for p in prompts],
            "max_new_tokens": args.max_new_tokens, "load_average_1min": [load_before, os.getloadavg()[0]]}
    cpu["plain"] = {k: v for k, v in plain.items() if k not in ("outputs", "tau")}
    cpu["mtp"] = {}
    for name, run in runs.items():
        lossless = all(torch.equal(a, b) for a, b in zip(run.pop("outputs"), plain["outputs"]))
        cpu["mtp"][name.removeprefix("mtp_k")] = run | {
            "speedup": round(run["tokens_per_s"] / plain["tokens_per_s"], 2), "equals_plain_greedy": lossless}
    print("plain", json.dumps(cpu["plain"]), "\nmtp", json.dumps(cpu["mtp"]), flush=True)
    cpu |= {"threads": 1, "dtype": "float32", **cli.versions()}
    report["cpu_measurement"] = cpu
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.tokenizer = args.tokenizer or asset_path("tiny-gemma4")
    previous = json.loads(args.report.read_text()) if args.measure and args.report and args.report.is_file() else {}
    report = previous or {"args": cli.args_record(args)}
    report = measure(args, report) if args.measure else train_and_export(args, report)
    cli.write_report(args.report, report)
    return report


if __name__ == "__main__":
    main()
