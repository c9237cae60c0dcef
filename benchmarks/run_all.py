"""run_all: every bench at one size, then benchmarks/README.md and the plot.

    python -m benchmarks.run_all --quick          # on a GPU: fits one 9-minute command
    python -m benchmarks.run_all --smoke          # on the CPU: seconds
    python -m benchmarks all --quick              # the same
    bash benchmarks/gpu_session.sh OUT COMMIT     # GPU tests + --quick, results under OUT (a copied checkout)

Benches run in this process one after the other (each frees its models); a bench that fails is reported
and the others still run. Records go to benchmarks/results/<bench>.jsonl tagged with one run id; the
README tables and the PNG are written from this run's records (``soak``, last, writes one record per call
to soak.jsonl and no README table). ``--budget-s`` skips the benches that
would start after that many seconds (the order puts the decisive ones first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback

from benchmarks.common import free_device_memory, run_bench
from benchmarks.report import write_report

BENCHES = ("decode", "verify_cost", "draft_cost", "e2e_synthetic", "hf_native_assisted", "e2e_tiny", "soak")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true")
    size.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=None)
    parser.add_argument("--skip", nargs="+", choices=BENCHES, default=[])
    parser.add_argument("--budget-s", type=float, default=None, help="start no bench after this many seconds")
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--readme", default=None, help="default benchmarks/README.md")
    parser.add_argument("--png", default=None, help="default benchmarks/results/plot.png")
    parser.add_argument("--no-report", action="store_true", help="records only, no README/plot")
    args, extra = parser.parse_known_args(argv)
    size = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
    run_id = time.strftime("%Y%m%dT%H%M%S")
    common = size + ["--run-id", run_id] + (["--results-dir", args.results_dir] if args.results_dir else []) + extra
    start, records, summary = time.perf_counter(), [], {}
    for name in args.only or BENCHES:
        if name in args.skip:
            continue
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            summary[name] = "not started: over --budget-s"
            continue
        t0 = time.perf_counter()
        try:
            records += run_bench(importlib.import_module(f"benchmarks.{name}"), list(common))
            summary[name] = f"ok in {time.perf_counter() - t0:.0f} s"
        except Exception as err:
            traceback.print_exc()
            summary[name] = f"failed after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}"[:300]
        free_device_memory()
        print(f"[run_all] {name}: {summary[name]}", flush=True)
    report = {}
    if not args.no_report and records:
        title = f"Run `{run_id}`: `python -m benchmarks.run_all {' '.join(size)}`"
        report = write_report(records, args.readme, args.png, title)
    print(json.dumps({"bench": "run_all", "run_id": run_id, "seconds": round(time.perf_counter() - start, 1),
                      "benches": summary, **report}))
    return 0 if all(s.startswith("ok") for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
