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


def test_the_schedule_repeats_after_one_period():
    args = soak._parsed(["--smoke", "--calls", "40", "--batches", "1", "2", "--new-tokens", "8", "16"])
    modes = ["plain", "mtp"]
    calls = list(soak._schedule(args, modes))
    period = soak._period(args, modes)
    assert period == 2 * 4  # lcm(2 batches, 2 lengths, every fourth turn sampled) turns of 2 modes
    kinds = [c[1:] for c in calls]
    assert kinds[period:2 * period] == kinds[:period]
    assert set(kinds[:period]) == set(kinds)  # every kind runs in the first period


def test_the_verdict_names_leaks_changed_answers_and_growth():
    def record(call, backend="plain", batch=1, allocated=100.0, tensors=50, graphs=3, generation=1, leaked=0,
               same=True):
        return dict(call=call, backend=backend, batch=batch, new_tokens=8, allocated_mib=allocated, period=2,
                    live_tensors=tensors, graphs=graphs, pool_generation=generation, leaked_blocks=leaked,
                    same_tokens=same)

    first = [record(0, tensors=52, allocated=90.0, graphs=2), record(1, "mtp", tensors=48)]
    steady = first + [record(2, tensors=52), record(3, "mtp", allocated=100.5, tensors=48)]
    assert soak.problems(steady, tolerance_mib=1.0) == []
    assert soak.problems([record(0), record(1, allocated=140.0)], 1.0) == []  # growth in the first period is allowed
    grew = steady + [record(4, allocated=140.0, tensors=60, graphs=4)]
    assert soak.problems(grew, 1.0) == ["call 4 (plain b1): allocated grew 100.0 -> 140.0 MiB since call 1",
                                        "call 4 (plain b1): live_tensors grew 52 -> 60 in the steady state (from call 1)",
                                        "call 4 (plain b1): graphs grew 3 -> 4 in the steady state (from call 1)"]
    broken = steady + [record(4, leaked=3, same=False)]
    assert soak.problems(broken, 1.0) == ["call 4: 3 blocks still in use", "call 4: a greedy answer changed"]


def test_the_steady_state_starts_a_period_after_the_storage_last_grew():
    def record(call, graphs, generation, allocated=100.0):
        return dict(call=call, backend="plain", batch=1, new_tokens=8, allocated_mib=allocated, period=2,
                    live_tensors=None, graphs=graphs, pool_generation=generation, leaked_blocks=0, same_tokens=True)

    # call 2 grew the storage (graphs dropped, call 3 captures its graphs again): the steady state is call 4 on
    regrown = [record(0, 2, 1), record(1, 3, 1), record(2, 1, 2, 180.0), record(3, 3, 2, 181.0), record(4, 3, 2, 181.0)]
    assert soak.problems(regrown, 1.0) == []
    assert soak.problems(regrown + [record(5, 4, 2, 181.0)], 1.0) == [
        "call 5 (plain b1): graphs grew 3 -> 4 in the steady state (from call 3)"]
    assert soak.problems(regrown[:4], 1.0) == [
        "no steady state: the pooled storage last grew at call 2, less than one period (2 calls) and one call "
        "before the end; run more calls"]
