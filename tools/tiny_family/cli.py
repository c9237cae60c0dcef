"""What every member's command line shares: the options of the loop, the `TrainConfig` they make, and the
report file.

The option adders keep each CLI's `--help` as it was: argparse lists options in the order they are added,
so each adder adds one run of options that stand together in every CLI that has them.
"""

import argparse
import json
import pathlib

import torch
import transformers

from .train_loop import TrainConfig, TrainResult


def add_optimizer_args(p: argparse.ArgumentParser, *, warmup_steps: int) -> None:
    """`--lr --warmup-steps --weight-decay` (the `TrainConfig` defaults but for the warmup)."""
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=warmup_steps)
    p.add_argument("--weight-decay", type=float, default=0.1)


def add_run_args(p: argparse.ArgumentParser, *, eval_every: int, evaluated: str) -> None:
    """`--seed --log-every --eval-every`; `evaluated` names what runs every `--eval-every` steps."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=eval_every, help=f"{evaluated} every N steps (0: never)")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def add_time_budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: sets --steps from the time of a few probe steps (recorded)")


def add_drafter_source_args(p: argparse.ArgumentParser, default_target: pathlib.Path) -> None:
    """`--out --report --target --corpus` of a drafter CLI (`--out` is also what `--measure-only` measures)."""
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint folder to write (or measure)")
    p.add_argument("--report", type=pathlib.Path, help="JSON file for config, loss curves, metrics, τ")
    p.add_argument("--target", type=pathlib.Path, default=default_target, help="the frozen target (and tokenizer)")
    add_corpus_arg(p)


def add_corpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=pathlib.Path, help="stdlib folder or corpus .tar.gz (default: this stdlib)")


def add_drafter_loop_args(p: argparse.ArgumentParser) -> None:
    """The options a drafter CLI ends with: the loop's, `--eval-windows`, the τ options, `--measure-only`
    and `--device`."""
    add_optimizer_args(p, warmup_steps=100)
    add_run_args(p, eval_every=250, evaluated="validation metrics")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--tau-new-tokens", type=int, default=256, help="new tokens per prompt when measuring τ")
    p.add_argument("--tau-prompt-chars", type=int, default=400, help="leading characters of each held-out snippet")
    p.add_argument("--measure-only", action="store_true", help="only measure τ and speed of the checkpoint at --out")
    add_device_arg(p)


def train_config(args: argparse.Namespace, *, steps: int, seq_len: int) -> TrainConfig:
    """The loop's configuration from the options above and `--batch-size`."""
    return TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=seq_len, lr=args.lr,
                       warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, log_every=args.log_every,
                       seed=args.seed)


# ---------------------------------------------------------------------------------------------------
# The report: one JSON file per member, written at the end of a run; `--measure*` runs add a section.


def args_record(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}


def schedule_record(cfg: TrainConfig) -> dict:
    return {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio,
            "weight_decay": cfg.weight_decay, "betas": cfg.betas, "grad_clip": cfg.grad_clip}


def curve_record(result: TrainResult, train_tokens: int) -> dict:
    """Epochs over a train stream of `train_tokens`, time and the train loss curve of a finished run."""
    return {"epochs": round(result.tokens_seen / train_tokens, 2), "wall_time_s": round(result.wall_time_s, 1),
            "final_train_loss": result.losses[-1][1], "train_loss_curve": result.losses}


def versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_report(path: pathlib.Path | None, report: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def update_report(path: pathlib.Path | None, section: str, value) -> None:
    """Sets one section of the report at `path` (created if missing), keeping the others."""
    if path is None:
        return
    report = json.loads(path.read_text()) if path.is_file() else {}
    report[section] = value
    write_report(path, report)


def rounded(value):
    """`value` with every float (in lists and dicts too) rounded to 4 places, for curves in the report."""
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round(v, 4) for v in value]
    return round(value, 4) if isinstance(value, float) else value
