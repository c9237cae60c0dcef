"""benchmarks/README.md tables and the PNG plot, from benchmark records (benchmarks/results/*.jsonl).

    python -m benchmarks.report [--results-dir benchmarks/results] [--run-id ID] [--also-run-id ID ...]

Every table row names the GPU, the commit and the command that produced it. The plot (matplotlib, the
``dev`` extra) shows tokens/s vs k and tokens/s vs batch; without matplotlib it is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from benchmarks.common import RESULTS_DIR, _fmt

BENCH_DIR = pathlib.Path(__file__).resolve().parent
# the columns each bench's README table shows besides GPU, commit and command
TABLE_COLUMNS = {
    "decode": ["model_shape", "backend", "batch", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor",
               "speedup_vs_hf_dynamic", "same_tokens", "skipped"],
    "verify_cost": ["model_shape", "backend", "batch", "k", "step_ms", "ratio_to_decode"],
    "draft_cost": ["model_shape", "backend", "batch", "k", "draft_step_ms", "target_step_ms", "ratio",
                   "assistant_shape_source", "skipped"],
    "e2e_synthetic": ["model_shape", "backend", "batch", "k", "alpha", "tau", "tokens_per_s", "speedup_vs_plain",
                      "vs_floor_tau", "lossless"],
    "hf_native_assisted": ["model_shape", "backend", "k", "tokens_per_s", "tau", "speedup_vs_native", "same_tokens",
                           "skipped"],
    "e2e_tiny": ["model_shape", "backend", "batch", "k", "tokens_per_s", "tau", "speedup", "same_tokens"],
    "hf_native_step_mtp": ["model_shape", "backend", "k", "tokens_per_s", "tau", "speedup_vs_plain",
                           "speedup_vs_hf_dynamic", "same_tokens", "skipped"],
    "multi_gpu": ["model_shape", "placement", "gpus", "spec_mode", "batch", "tokens_per_s", "speedup_vs_plain",
                  "speedup_vs_single_gpu", "same_tokens", "skipped", "settings"],
}


def load_records(results_dir=None, run_id: str | None = None, also: list[str] = ()) -> list[dict]:
    """Records of one run: ``run_id``, or per bench the records of its latest run id; then those of the
    runs in ``also`` (e.g. a full-depth run made apart from ``run_all``), after them in each table."""
    records = []
    for path in sorted(pathlib.Path(results_dir or RESULTS_DIR).glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("run_id")]
        if not rows:
            continue
        wanted = run_id or max(r["run_id"] for r in rows)
        records += [r for r in rows if r["run_id"] == wanted]
        records += [r for r in rows if r["run_id"] in also and r["run_id"] != wanted]
    return records


def markdown(records: list[dict], title: str = "") -> str:
    lines = ["# Benchmark results", "",
             "Written by `python -m benchmarks.run_all` (or `python -m benchmarks.report`) from the records in "
             "`benchmarks/results/*.jsonl`; every row names the GPU, the commit and the command that produced it. "
             "What each bench measures and how: the docstring of `benchmarks/<bench>.py`; results and "
             "predictions over time: `docs/perf_log.md`.", ""]
    if title:
        lines += [title, ""]
    if (BENCH_DIR / "results" / "plot.png").exists() or records:
        lines += ["![tokens/s vs k and vs batch](results/plot.png)", ""]
    for bench, columns in TABLE_COLUMNS.items():
        rows = [r for r in records if r.get("bench") == bench]
        if not rows:
            continue
        header = ["gpu", "commit"] + columns + ["command"]
        lines += [f"## {bench}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in rows:
            cells = [_cell(r.get(c)) for c in header[:-1]] + [f"`{r.get('command', '')}`"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    text = _fmt(value)
    return text.replace("|", "/").replace("\n", " ")[:120]


# the benches whose tokens/s the run_all plot shows (verify/draft cost rows run random drafts: their tokens/s
# is that of a step committing one token, not a speculative speed)
K_BENCHES = ("e2e_tiny", "e2e_synthetic")
BATCH_BENCHES = ("decode", "e2e_synthetic")


def plot(records: list[dict], path, k_benches=None, batch_benches=None) -> pathlib.Path | None:
    """tokens/s vs k and vs batch of the records of ``k_benches`` / ``batch_benches`` (default: every bench);
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): no plot written")
        return None
    fig, (by_k, by_batch) = plt.subplots(1, 2, figsize=(13, 5))
    # an "auto" k has no place on the k axis (it is one line per batch in the other plot)
    _lines(by_k, records, x="k",
           where=lambda r: isinstance(r.get("k"), int) and r["bench"] in (k_benches or [r["bench"]]))
    by_k.set(xlabel="k (drafts per step)", ylabel="tokens/s", title="speculative decoding: tokens/s vs k")
    _lines(by_batch, records, x="batch", where=lambda r: r["bench"] in (batch_benches or [r["bench"]]))
    by_batch.set(xlabel="batch", ylabel="tokens/s", title="tokens/s vs batch", xscale="log", yscale="log")
    gpu = next((r["gpu"] for r in records if r.get("gpu")), "")
    commits = ", ".join(sorted({r["commit"] for r in records if r.get("commit")}))
    fig.suptitle(f"hf_specdec benchmarks on {gpu} ({commits})")
    for ax in (by_k, by_batch):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lines(ax, records, x: str, where) -> None:
    """One line per series (bench, shape, backend, alpha, the other axis); where several runs measured the same
    point, the latest run's."""
    series: dict[str, dict] = {}
    for r in records:
        if not where(r) or not r.get("tokens_per_s"):
            continue
        other = "k" if x == "batch" else "batch"
        label = f"{r['bench']} {r['model_shape']} {r['backend']}"
        label += f" a={r['alpha']}" if r.get("alpha") is not None else ""
        label += f" {other}={r.get(other)}" if r.get(other) is not None else ""
        points = series.setdefault(label, {})
        if r[x] not in points or r.get("run_id", "") > points[r[x]].get("run_id", ""):
            points[r[x]] = r
    for label, points in sorted(series.items()):
        xs = sorted(points)
        ax.plot(xs, [points[v]["tokens_per_s"] for v in xs], marker="o", label=label)


def write_report(records: list[dict], readme=None, png=None, title: str = "") -> dict:
    readme = pathlib.Path(readme or BENCH_DIR / "README.md")
    png = pathlib.Path(png or BENCH_DIR / "results" / "plot.png")
    written = plot(records, png, K_BENCHES, BATCH_BENCHES)
    readme.write_text(markdown(records, title))
    return {"readme": str(readme), "plot": str(written) if written else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--run-id", default=None, help="default: each bench's latest run")
    parser.add_argument("--also-run-id", nargs="+", default=[], help="add the records of these runs too")
    parser.add_argument("--readme", default=None, help="default benchmarks/README.md")
    parser.add_argument("--png", default=None, help="default benchmarks/results/plot.png")
    args = parser.parse_args(argv)
    records = load_records(args.results_dir, args.run_id, args.also_run_id)
    title = ""
    if args.also_run_id:
        title = f"Besides each bench's latest run, the rows of run(s) {', '.join(f'`{r}`' for r in args.also_run_id)}."
    print(json.dumps(write_report(records, args.readme, args.png, title)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
