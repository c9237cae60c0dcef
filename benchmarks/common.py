"""Shared pieces of the benchmarks: environment facts, result records, timing, the printed table."""

from __future__ import annotations

import json
import pathlib
import subprocess
import time

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """GPU (or "cpu"), commit, torch and transformers versions: the fields every record carries."""
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=RESULTS_DIR.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "commit": commit, "torch": torch.__version__, "transformers": transformers.__version__}


def append_records(bench: str, records: list[dict]) -> pathlib.Path:
    """Append one JSON line per record to benchmarks/results/<bench>.jsonl."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{bench}.jsonl"
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
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
