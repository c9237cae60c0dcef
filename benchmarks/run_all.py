"""run_all: every bench at one size, then a README of the tables and the plot.

    python -m benchmarks.run_all --quick          # on a GPU: fits one 9-minute command
    python -m benchmarks.run_all --smoke          # on the CPU: seconds
    python -m benchmarks all --quick              # the same
    python -m benchmarks.run_all --quick --update-committed   # into the committed results (below)
    bash benchmarks/gpu_session.sh OUT COMMIT     # GPU tests + --quick, results under OUT (a copied checkout)

The benches are those of the registry in benchmarks/__init__.py, in its order. They run in this process one
after the other (each frees its models); a bench that fails is reported and the others still run. Before
any starts, each is checked to fit the device (benchmarks/common.py: ``check_fits``); if one does not, none
runs and the exit status is 2. Records go to ``--results-dir`` (default ./hf_specdec_bench_results)
as <bench>.jsonl tagged with one run id, and the README tables and the PNG of this run's records beside them
(``soak``, last, writes one record per call to soak.jsonl and no README table). The committed results,
benchmarks/results/*.jsonl, benchmarks/README.md and benchmarks/results/plot.png, change only with
``--update-committed``. ``--budget-s`` skips the benches that would start after that many seconds (the order
puts the decisive ones first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import time
import traceback

from benchmarks import BENCHES as REGISTRY
from benchmarks.common import DEFAULT_RESULTS_DIR, DoesNotFit, fit_problem, free_device_memory, parse_args, run_bench
from benchmarks.report import write_report

BENCHES = tuple(REGISTRY)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.run_all") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true")
    size.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", choices=BENCHES, default=None)
    parser.add_argument("--skip", nargs="+", choices=BENCHES, default=[])
    parser.add_argument("--budget-s", type=float, default=None, help="start no bench after this many seconds")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results-dir", default=None,
                       help=f"where the records, README.md and plot.png go (default ./{DEFAULT_RESULTS_DIR})")
    where.add_argument("--update-committed", action="store_true",
                       help="append the records to benchmarks/results/ and rewrite benchmarks/README.md and "
                            "benchmarks/results/plot.png (the committed results)")
    parser.add_argument("--readme", default=None, help="default: README.md of the results dir "
                                                       "(--update-committed: benchmarks/README.md)")
    parser.add_argument("--png", default=None, help="default: plot.png of the results dir "
                                                    "(--update-committed: benchmarks/results/plot.png)")
    parser.add_argument("--no-report", action="store_true", help="records only, no README/plot")
    args, extra = parser.parse_known_args(argv)
    size = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
    run_id = time.strftime("%Y%m%dT%H%M%S")
    results_dir = pathlib.Path(args.results_dir or DEFAULT_RESULTS_DIR)
    where = ["--update-committed"] if args.update_committed else ["--results-dir", str(results_dir)]
    common = size + ["--run-id", run_id] + where + extra
    names = [name for name in args.only or BENCHES if name not in args.skip]
    problems = []
    for name in names:  # up front: a shape that cannot fit is said before anything runs
        module = importlib.import_module(f"benchmarks.{name}")
        problem = fit_problem(module, parse_args(module, list(common)))
        if problem:
            problems.append(f"{name}: {problem}")
    if problems:
        for problem in problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    start, records, summary = time.perf_counter(), [], {}
    for name in names:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            summary[name] = "not started: over --budget-s"
            continue
        t0 = time.perf_counter()
        try:
            records += run_bench(importlib.import_module(f"benchmarks.{name}"), list(common))
            summary[name] = f"ok in {time.perf_counter() - t0:.0f} s"
        except DoesNotFit as err:  # the memory it had at the check went to something else meanwhile
            summary[name] = f"not run: {err.message}"[:300]
        except Exception as err:
            traceback.print_exc()
            summary[name] = f"failed after {time.perf_counter() - t0:.0f} s: {type(err).__name__}: {err}"[:300]
        free_device_memory()
        print(f"[run_all] {name}: {summary[name]}", flush=True)
    report = {}
    if not args.no_report and records:
        title = f"Run `{run_id}`: `python -m benchmarks.run_all {' '.join(size)}`"
        if args.update_committed:
            report = write_report(records, args.readme, args.png, title)
        else:
            readme = pathlib.Path(args.readme or results_dir / "README.md")
            report = write_report(records, readme, args.png or results_dir / "plot.png", title)
            if args.png is None:  # the tables' image link is relative to benchmarks/README.md: point it here
                readme.write_text(readme.read_text().replace("](results/plot.png)", "](plot.png)"))
    print(json.dumps({"bench": "run_all", "run_id": run_id, "seconds": round(time.perf_counter() - start, 1),
                      "benches": summary, **report}))
    return 0 if all(s.startswith("ok") for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
