"""`hf-specdec bench`: help, a smoke run, and the error of an install without benchmarks/."""

import subprocess
import sys

from hf_specdec import cli


def test_bench_help_lists_every_benchmark():
    from benchmarks.run_all import BENCHES

    result = subprocess.run([sys.executable, "-m", "hf_specdec", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for name in BENCHES + ("all",):
        assert name in result.stdout
    assert set(cli.BENCHES) == set(BENCHES) | {"all"}


def test_bench_name_help_shows_the_benchmarks_options(capsys):
    try:
        cli.main(["bench", "verify_cost", "--help"])
    except SystemExit as done:
        assert done.code == 0
    out = capsys.readouterr().out
    assert "--smoke" in out and "--k" in out


def test_bench_smoke_run_writes_record_and_plot(tmp_path, capsys):
    assert cli.main(["bench", "verify_cost", "--smoke", "--results-dir", str(tmp_path)]) == 0
    assert (tmp_path / "verify_cost.jsonl").read_text().count("\n") >= 3
    assert '"bench": "verify_cost"' in capsys.readouterr().out.strip().splitlines()[-1]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "verify_cost.png").stat().st_size > 0


def test_bench_without_benchmarks_folder_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_import_benchmarks", lambda: None)
    assert cli.main(["bench", "decode", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "benchmarks/" in err
