"""Shared pieces of the benchmarks: environment facts, result records, timing, the printed table, and the
harness every bench runs under (size presets, progress, records, the last JSON line).

A bench is a module with

    NAME        the ``bench`` field of its records and the name of benchmarks/results/<NAME>.jsonl
    COLUMNS     the columns of its printed table
    PRESETS     {"smoke": {...}, "quick": {...}}: argument defaults of the two reduced sizes
    add_arguments(parser)
    run(args, progress) -> list[dict]     one dict per row (record fields beyond the environment)

and ``main = bench_main(module)``. ``--smoke`` runs on the CPU at a tiny size in seconds (what
tests/test_benchmarks_smoke.py runs); ``--quick`` is the size ``run_all`` uses on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
# Fields every record carries (issue #5); a bench adds its own.
RECORD_FIELDS = ("bench", "gpu", "commit", "torch", "transformers", "model_shape", "backend", "batch", "k",
                 "tokens_per_s")


def environment() -> dict:
    """GPU (or "cpu"), commit, torch and transformers versions: the fields every record carries.

    ``BENCH_COMMIT`` overrides the commit: a copied checkout (a lent GPU machine) may carry a stale HEAD."""
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS_DIR.parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=RESULTS_DIR.parent, check=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    commit = os.environ.get("BENCH_COMMIT", commit)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "commit": commit, "torch": torch.__version__, "transformers": transformers.__version__}


def append_records(bench: str, records: list[dict], results_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Append one JSON line per record to <results_dir>/<bench>.jsonl (default benchmarks/results/)."""
    results_dir = pathlib.Path(results_dir) if results_dir is not None else RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{bench}.jsonl"
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(result, seconds) of one call, device work included."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return result, time.perf_counter() - start


def print_table(rows: list[dict], columns: list[str]) -> None:
    if not rows:
        print("(no rows)")
        return
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "" if value is None else str(value)


# ---------------------------------------------------------------------------------------------- measuring


def copy_bandwidth_gb_s(device: str, num_bytes: int | None = None, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    num_bytes = num_bytes or (1 << 30 if device == "cuda" else 1 << 24)
    x = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _, seconds = timed(lambda: [y.copy_(x) for _ in range(repeats)])
    del x, y
    return 2 * num_bytes * repeats / seconds / 1e9


def decode_rate(generate, batch: int, new_tokens: int, stats=None, repeats: int = 1, snapshot=None) -> dict:
    """Steady-state decoding speed of ``generate(n)`` (n new tokens per row), prefill excluded:
    tokens/s = batch * (N - 1) / (t(N) - t(1)), after one warm-up call of each length; with ``repeats`` > 1
    the median of that many (t(1), t(N)) pairs.

    ``stats(result)`` may return the number of target forwards of a call; with it the result also has
    ``step_ms`` (time per target forward, from the same differencing) and ``forwards``. ``snapshot()``, called
    after each long call, is returned as ``snapshot`` for the pair the result comes from."""
    generate(1), generate(new_tokens)  # warm-up: kernels, autotuning, allocator, compile
    pairs = []
    for _ in range(max(1, repeats)):
        short, t_short = timed(lambda: generate(1))
        f_short = stats(short) if stats else None
        out, t_long = timed(lambda: generate(new_tokens))
        forwards = stats(out) - f_short if stats else None
        pairs.append(dict(elapsed=max(t_long - t_short, 1e-9), out=out, t_long=t_long, forwards=forwards,
                          snapshot=snapshot() if snapshot else None))
    pair = sorted(pairs, key=lambda p: p["elapsed"])[len(pairs) // 2]
    elapsed = pair["elapsed"]
    result = {"tokens_per_s": batch * (new_tokens - 1) / elapsed, "output": pair["out"], "seconds": pair["t_long"],
              "repeats": len(pairs), "snapshot": pair["snapshot"]}
    if stats:
        result |= {"step_ms": 1e3 * elapsed / max(pair["forwards"], 1), "forwards": pair["forwards"]}
    return result


def first_mismatch(reference: torch.Tensor, other: torch.Tensor, logits=None):
    """None if the token tensors agree, else {"step", "top2_gap"} of the first differing new token
    (top-2 gap of the reference logits there when given: bf16 near-ties may flip, DESIGN.md §3)."""
    if reference.shape == other.shape and torch.equal(reference, other):
        return None
    width = min(reference.shape[1], other.shape[1])
    diff = (reference[:, :width] != other[:, :width]).any(dim=0).nonzero()
    column = int(diff[0]) if len(diff) else width
    result = {"column": column, "top2_gap": None}
    if logits is not None:
        step = column - (reference.shape[1] - len(logits))
        if 0 <= step < len(logits):
            top2 = logits[step].float().topk(2, dim=-1).values
            result["top2_gap"] = round(float((top2[:, 0] - top2[:, 1]).min()), 4)
    return result


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- harness


class Progress:
    """What a bench reports while it runs: ``total(n)`` once, then ``step(label)`` per finished case."""

    def __init__(self, enabled: bool = False, desc: str = ""):
        self.bar = None
        self.enabled = enabled
        self.desc = desc

    def total(self, n: int) -> None:
        if self.enabled and self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=n, desc=self.desc, unit="case", file=sys.stderr)

    def step(self, label: str = "") -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def build_parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module.NAME}",
                                     description=(module.__doc__ or "").strip().splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds (what the tests run)")
    size.add_argument("--quick", action="store_true", help="the reduced GPU size run_all uses")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present; --smoke: cpu)")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/")
    parser.add_argument("--results-dir", default=None, help="where <bench>.jsonl goes (default benchmarks/results)")
    parser.add_argument("--run-id", default=None, help="tag the records with this id (run_all sets one per run)")
    module.add_arguments(parser)
    return parser


def parse_args(module, argv: list[str] | None):
    parser = build_parser(module)
    first, _ = parser.parse_known_args(argv)
    preset = "smoke" if first.smoke else "quick" if first.quick else None
    if preset:
        parser.set_defaults(**module.PRESETS.get(preset, {}))
    args = parser.parse_args(argv)
    args.preset = preset or "full"
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return args


def run_bench(module, argv: list[str] | None = None, progress: bool = False, quiet: bool = False) -> list[dict]:
    """Run one bench: rows -> records (environment + command), table, results file, one JSON line last."""
    args = parse_args(module, argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads cost more than they give
    bar = Progress(progress, desc=module.NAME)
    try:
        rows = module.run(args, bar)
    finally:
        bar.close()
    env = environment()
    command = " ".join(["python -m benchmarks." + module.NAME] + [shlex.quote(a) for a in _reproducing(argv or [])])
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    records = [{"bench": module.NAME, **env, **row, "command": command, "preset": args.preset, "run_id": run_id}
               for row in rows]
    for record in records:
        for field in RECORD_FIELDS:
            record.setdefault(field, None)
    if not quiet:
        print_table(records, module.COLUMNS)
    if not args.no_record:
        append_records(module.NAME, records, args.results_dir)
    print(json.dumps({"bench": module.NAME, **env, "command": command, "rows": rows}, default=str))
    return records


def _reproducing(argv: list[str]) -> list[str]:
    """argv without the options that only say where records go (they do not change what is measured)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--run-id", "--results-dir"):
            skip = True
        elif a != "--no-record" and not a.startswith(("--run-id=", "--results-dir=")):
            out.append(a)
    return out


def bench_main(module):
    def main(argv: list[str] | None = None) -> int:
        records = run_bench(module, argv if argv is not None else sys.argv[1:])
        # a bench that checks tokens fails when a check failed outright (near-ties are reported, not failed)
        return 1 if any(r.get("same_tokens") is False and not r.get("near_tie") for r in records) else 0

    return main
