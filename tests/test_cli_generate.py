"""``hf-specdec generate``: every mode on the bundled models, prompt or file, sampling options, streaming, stop
strings, and invalid input answered with exit status 2 and the error naming the fix. The CLI's output must
be what the Python API returns for the same arguments."""

import io
import pathlib
import re
import sys

import pytest
import torch

from hf_specdec.cli import main
from tests import bundled

PROMPT = "import os\n\n\ndef walk(root):\n"


def _api_completion(mode: str, max_new_tokens: int, **kwargs) -> str:
    model, extra, _ = bundled.mode(mode)
    tok = bundled.tokenizer()
    ids = tok([PROMPT], return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, **extra, **kwargs)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def _cli(capsys, *argv):
    """(exit status, stdout, stderr) of `hf-specdec generate ...`, fp32 like the API side."""
    code = main(["generate", *argv, "--dtype", "float32"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("mode,options", [
    ("plain", []),
    ("gemma_mtp", ["--assistant", "tiny-gemma4-assistant", "-k", "4"]),
    ("step_mtp", ["--mode", "mtp", "--num-speculative-tokens", "3"]),
])
def test_streamed_completion_is_the_api_completion(capsys, mode, options):
    model = "tiny-step3p5" if mode.startswith("step") else "tiny-gemma4"
    code, out, err = _cli(capsys, model, "--prompt", PROMPT, "--max-new-tokens", "24", *options)
    assert code == 0
    assert out == _api_completion(mode, 24, do_sample=False) + "\n"
    assert "24 tokens" in err and ("tau" in err) == (mode != "plain")


def test_k_auto_on_the_command_line(capsys):
    """-k auto is generate()'s "auto" (k chosen per round), also for a sampled call, whose default is the drafter's
    own k; a -k that is neither a number nor auto is refused by the parser with what it takes."""
    code, out, err = _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, "--max-new-tokens", "16", "--assistant",
                          "tiny-gemma4-assistant", "-k", "auto", "--do-sample", "--seed", "1")
    assert code == 0 and "(mtp, k=7)" in err  # "auto" drafts up to the assistant's 7; the default here is 4
    with pytest.raises(SystemExit) as stop:
        _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, "--assistant", "tiny-gemma4-assistant", "-k", "fast")
    assert stop.value.code == 2 and "takes a whole number of drafts or 'auto', got 'fast'" in capsys.readouterr().err


def test_a_dflash_drafter_checkpoint(capsys, tmp_path):
    if not bundled.dflash_registered():
        pytest.skip("no DFlash drafter is registered for spec_mode='dflash' yet")
    from tests.models.dflash import helpers

    target = bundled.gemma()[0]
    config = helpers.drafter_config_dict(target)
    state = helpers.random_state_dict(helpers.released_layout(config))
    path = helpers.write_checkpoint(tmp_path / "dflash", config, state)
    code, out, err = _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, "--max-new-tokens", "12", "--assistant", str(path),
                          "--mode", "dflash")
    assert code == 0 and "(dflash, k=3)" in err
    assert out == _api_completion("plain", 12, do_sample=False) + "\n"  # greedy: lossless whatever the drafter


def test_prompt_file_stdin_sampling_options_and_no_stream(capsys, tmp_path, monkeypatch):
    path = tmp_path / "prompt.py"
    path.write_text(PROMPT)
    sampling = ["--do-sample", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--repetition-penalty",
                "1.2", "--seed", "0"]
    code, out, _ = _cli(capsys, "tiny-step3p5", "--file", str(path), "--mode", "mtp", "--max-new-tokens", "16",
                        "--no-stream", *sampling)
    expected = _api_completion("step_mtp", 16, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                               repetition_penalty=1.2)
    assert code == 0 and out == expected + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    code, again, _ = _cli(capsys, "tiny-step3p5", "--file", "-", "--mode", "mtp", "--max-new-tokens", "16",
                          "--no-stream", *sampling)
    assert code == 0 and again == out


def test_stop_string_ends_the_streamed_completion(capsys):
    full = _api_completion("gemma_mtp", 24, do_sample=False)
    stop = full.strip().split()[2]
    code, out, _ = _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, "--max-new-tokens", "24", "--assistant",
                        "tiny-gemma4-assistant", "--stop", stop)
    assert code == 0 and out.rstrip("\n").endswith(stop) and len(out) < len(full)
    assert full.startswith(out.rstrip("\n"))


@pytest.mark.parametrize("options,message", [
    (["--assistant", "tiny-gemma4-assistant", "--mode", "dflash"], "Pass spec_mode='mtp'"),
    (["-k", "3"], "num_speculative_tokens=3 without a drafter"),
    (["--assistant", "tiny-gemma4-assistant", "-k", "0"], "num_speculative_tokens must be a positive integer"),
    (["--max-new-tokens", "0"], "`max_new_tokens` must be greater than 0"),
])
def test_invalid_input_exits_2_with_the_fix(capsys, options, message):
    code, out, err = _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, *options)
    assert code == 2 and out.strip() == ""  # (a failing call ends its streamer: a newline at most)
    assert "hf-specdec generate: error: " in err and message in err
    if "-k" in options:
        assert "num_speculative_tokens is -k" in err  # the option that sets it


def test_a_missing_prompt_file_or_model_exits_2(capsys, tmp_path):
    code, _, err = _cli(capsys, "tiny-gemma4", "--file", str(tmp_path / "missing.txt"))
    assert code == 2 and "No such file" in err
    code, _, err = _cli(capsys, str(tmp_path / "no-model"), "--prompt", "x")
    assert code == 2 and "error:" in err


@pytest.mark.parametrize("drafter", ["tiny-gemma4-dflash", "tiny-gemma4-assistant"])
def test_a_drafter_as_the_model_exits_2_naming_the_fix(capsys, drafter):
    code, out, err = _cli(capsys, drafter, "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and out.strip() == ""
    assert f"hf-specdec generate: error: {drafter} is a drafter" in err and "as --assistant" in err


def test_a_loader_error_other_than_value_or_os_errors_exits_2_naming_the_checkpoint(capsys, monkeypatch):
    """transformers raises ImportError for a missing quantization library, RuntimeError for weights of other
    shapes: one line naming the checkpoint, not a traceback."""
    import hf_specdec

    def missing_library(*args, **kwargs):
        raise ImportError("compressed-tensors>=0.15.0 is required for compressed-tensors quantization")

    monkeypatch.setattr(hf_specdec.AutoModelForCausalLM, "from_pretrained", classmethod(missing_library))
    code, _, err = _cli(capsys, "tiny-gemma4", "--prompt", "x")
    assert code == 2 and "error: loading tiny-gemma4: compressed-tensors>=0.15.0 is required" in err


def test_prompt_and_file_are_exclusive_and_one_is_required(capsys):
    for argv in (["tiny-gemma4"], ["tiny-gemma4", "--prompt", "x", "--file", "y"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", *argv])
        assert exit_info.value.code == 2
    assert "--prompt" in capsys.readouterr().err


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--prompt", "--file", "--chat", "--assistant", "--mode {mtp,dflash}", "--num-speculative-tokens",
                   "--max-new-tokens", "--do-sample", "--temperature", "--top-k", "--top-p", "--repetition-penalty",
                   "--stop", "--seed", "--dtype", "--device", "--threads", "--no-stream"):
        assert option in text


def _unavailable_devices() -> list[str]:
    devices = ["meta", "foo", "0"]
    if not torch.cuda.is_available():
        devices += ["cuda", "cuda:1"]
    else:
        devices += [f"cuda:{torch.cuda.device_count()}"]  # one past the last GPU
    if not torch.backends.mps.is_available():
        devices.append("mps")
    return devices


@pytest.mark.parametrize("options,message", [
    (["--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--threads", "-3"], "--threads must be an integer >= 1, got -3"),
    *[(["--device", device], f"--device {device}" if device not in ("foo", "0") else f"--device {device!r}")
      for device in _unavailable_devices()],
    (["--do-sample", "--temperature", "0"], "--temperature must be > 0"),
    (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--do-sample", "--top-k", "-1"], "--top-k must be >= 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--stop", ""], "--stop needs a non-empty STRING"),
])
def test_a_bad_option_exits_2_with_one_line_before_any_model_loads(capsys, monkeypatch, options, message):
    import hf_specdec

    monkeypatch.setattr(hf_specdec.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    code, out, err = _cli(capsys, "tiny-gemma4", "--prompt", PROMPT, *options)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"hf-specdec generate: error: {message}")


@pytest.mark.parametrize("options", [["--threads", "0"], ["--device", "cuda:999"]])
def test_the_reported_commands_exit_2_without_a_traceback(options):
    """`hf-specdec generate tiny-gemma4 --prompt x --threads 0` (or a device this torch has not) printed a
    traceback and exited 1."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "hf_specdec", "generate", "tiny-gemma4", "--prompt", "x",
                             *options], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    # the one line is ours; anything before it is import-time noise of third-party packages (transformers imports
    # an installed torchao, which logs the extensions it cannot load), not a traceback of ours
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("hf-specdec generate: error: ")
    noise = re.compile(r"^Failed to load .*torchao|^(\[rank\d+\]:)?W\d{4} .*torch/utils/_pytree\.py:\d+\]")
    assert all(noise.search(line) for line in lines[:-1]), lines[:-1]


def test_a_checkpoint_folder_without_a_tokenizer_exits_2_saying_so(capsys, tmp_path):
    """transformers named a missing sentencepiece converter, or built an empty tokenizer ("no tokens")."""
    from hf_specdec.assets import asset_path

    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        source = pathlib.Path(asset_path("tiny-gemma4")) / name
        if source.exists():
            (folder / name).write_bytes(source.read_bytes())
    code, out, err = _cli(capsys, str(folder), "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and out.strip() == ""
    assert "has no tokenizer files" in err and "tokenizer.save_pretrained" in err
