"""Train several runs of one member side by side on one GPU and keep the best by validation loss.

A tiny model leaves most of an H100 idle, so a few runs that differ in length (the corpus is small:
how many epochs help before over-fitting is the open question) cost little more than one. Each run
is the member's own CLI; the winner's checkpoint and report are copied to `--out` / `--report`, the
report gaining a `sweep` table of every run. Held-out files play no part in the choice.

    python -m tools.tiny_family.sweep --member tools.tiny_family.train_target --steps 2000 3500 5500 \
        --out hf_specdec/assets/tiny-gemma4 --report tools/tiny_family/results/tiny-gemma4.json \
        --work /tmp/sweep -- --corpus .carry/stdlib-3.11.7.tar.gz --snippets hf_specdec/assets/held_out_snippets.json
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time


def launch(member: str, steps: int, run_dir: pathlib.Path, extra: list[str]) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-u", "-m", member, "--steps", str(steps), "--out", str(run_dir / "checkpoint"),
           "--report", str(run_dir / "report.json"), *extra]
    return subprocess.Popen(cmd, stdout=open(run_dir / "log.txt", "w"), stderr=subprocess.STDOUT)


def summarize(steps: int, run_dir: pathlib.Path, returncode: int) -> dict:
    row = {"steps": steps, "returncode": returncode}
    report_path = run_dir / "report.json"
    if returncode == 0 and report_path.is_file():
        report = json.loads(report_path.read_text())
        row |= {"epochs": report["training"]["epochs"], "wall_time_s": report["training"]["wall_time_s"],
                "final_train_loss": report["training"]["final_train_loss"],
                "validation_loss": report["validation"]["loss_nats_per_token"],
                "held_out_bits_per_byte": report["held_out"]["bits_per_byte"]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--member", required=True, help="module of the member's training CLI")
    p.add_argument("--steps", type=int, nargs="+", required=True, help="one run per value")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--report", type=pathlib.Path, required=True)
    p.add_argument("--work", type=pathlib.Path, required=True, help="folder for the runs")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which unfinished runs are stopped")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments passed to every run")
    args = p.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra

    runs = [(steps, args.work / f"steps{steps}") for steps in args.steps]
    deadline = time.monotonic() + (args.timeout or float("inf"))
    procs = [launch(args.member, steps, run_dir, extra) for steps, run_dir in runs]
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic()) if args.timeout else None))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    table = [summarize(steps, run_dir, code) for (steps, run_dir), code in zip(runs, codes)]
    for row in table:
        print("run", json.dumps(row), flush=True)
    finished = [(row, run_dir) for row, (_, run_dir) in zip(table, runs) if "validation_loss" in row]
    if not finished:
        raise SystemExit("no run finished; see the logs under " + str(args.work))
    best_row, best_dir = min(finished, key=lambda item: item[0]["validation_loss"])

    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(best_dir / "checkpoint", args.out)
    report = json.loads((best_dir / "report.json").read_text()) | {"sweep": table, "chosen_steps": best_row["steps"]}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    print("chosen", json.dumps(best_row), flush=True)


if __name__ == "__main__":
    main()
