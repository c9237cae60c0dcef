import subprocess
import sys

from hf_specdec.cli import main


def test_demo_runs_on_the_bundled_models_and_matches_transformers(capsys):
    assert main(["demo", "--max-new-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "hf_specdec plain" in out and "transformers generate" in out
    assert main(["demo", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_generate_streams_a_completion(capsys):
    from hf_specdec.assets import asset_path

    assert main(["generate", str(asset_path("tiny-gemma4")), "--prompt", "import os\n", "--max-new-tokens", "5"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_module_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "hf_specdec", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "generate" in result.stdout
