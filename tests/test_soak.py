"""benchmarks/soak.py: its CPU smoke runs and records one line per call; its verdict catches leaks and growth."""

import json

from benchmarks import soak


def test_smoke_records_every_call_and_finds_nothing_wrong(tmp_path, capsys):
    argv = ["--smoke", "--calls", "6", "--batches", "2", "--modes", "plain", "step_mtp", "--results-dir", str(tmp_path)]
    assert soak.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "soak.jsonl").read_text().splitlines()]
    assert [r["call"] for r in records] == list(range(6))
    assert {r["backend"] for r in records} == {"plain", "step_mtp"}
    assert all(r["leaked_blocks"] == 0 and r["live_tensors"] > 0 and r["gpu"] == "cpu" for r in records)
    assert [r["same_tokens"] for r in records[2:]] == [True] * 4  # calls 2.. repeat calls 0, 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == "soak"


def test_the_verdict_names_leaks_changed_answers_and_growth():
    def record(call, backend="plain", batch=1, allocated=100.0, tensors=50, leaked=0, same=True):
        return dict(call=call, backend=backend, batch=batch, new_tokens=8, allocated_mib=allocated,
                    live_tensors=tensors, leaked_blocks=leaked, same_tokens=same)

    steady = [record(0), record(1, batch=3), record(2, "mtp", tensors=48), record(3), record(4, "mtp", tensors=48)]
    assert soak.problems(steady, tolerance_mib=1.0) == []
    grew = steady + [record(5, allocated=140.0, tensors=60)]
    assert soak.problems(grew, 1.0) == ["plain: allocated grew 100.0 -> 140.0 MiB (calls 3 -> 5)",
                                        "plain: live tensors grew 50 -> 60 (calls 3 -> 5)"]
    broken = steady + [record(5, leaked=3, same=False)]
    assert soak.problems(broken, 1.0) == ["call 5: 3 blocks still in use", "call 5: a greedy answer changed"]
