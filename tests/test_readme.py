"""The README's examples on the bundled models run as written: every ```python block that starts with
"# runs as is on the bundled tiny models" and every `hf-specdec generate tiny-...` command line."""

import pathlib
import re
import shlex

import pytest

from hf_specdec.assets import available_assets
from hf_specdec.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MARKER = "# runs as is on the bundled tiny models"
PYTHON_BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if b.startswith(MARKER)]
COMMANDS = [line for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines()
            if line.startswith("hf-specdec generate tiny-")]


def _skip_unless_bundled(text: str) -> None:
    missing = sorted(set(re.findall(r"tiny-[a-z0-9-]+", text)) - set(available_assets()))
    if missing:
        pytest.skip(f"not bundled in this checkout: {missing}")


def test_every_mode_has_a_bundled_example():
    assert len(PYTHON_BLOCKS) >= 5 and len(COMMANDS) >= 3
    text = "\n".join(PYTHON_BLOCKS)
    assert "assistant_model=assistant" in text and 'spec_mode="mtp"' in text and "assistant_model=drafter" in text


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"python{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_example_runs(block, capsys):
    _skip_unless_bundled(block)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme_example"})
    assert capsys.readouterr().out.strip()  # every example prints its result


@pytest.mark.parametrize("line", COMMANDS, ids=[f"cli{i}" for i in range(len(COMMANDS))])
def test_command_line_example_runs(line, capsys):
    _skip_unless_bundled(line)
    assert main(shlex.split(line)[1:] + ["--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip()


def test_docs_linked_from_the_readme_exist():
    for target in re.findall(r"\]\(((?:docs|hf_specdec)/[^)#]+)\)", README):
        assert (ROOT / target).is_file(), target
    assert "docs/troubleshooting.md" in README and "docs/architecture.md" in README


def test_python_blocks_define_every_name_they_use():
    """Every ```python block of the README runs on its own: each name it reads is imported or assigned in it."""
    import ast
    import builtins

    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        tree = ast.parse(block)
        defined = set(dir(builtins))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        assert used <= defined, f"undefined {sorted(used - defined)} in:\n{block}"


# ---------------------------------------------------------------------------------------------- speed numbers
# The README's speed table and the numbers around it, and the troubleshooting page's, are quoted from the
# benchmark records (benchmarks/results/<bench>.jsonl). Each quoted cell or phrase is rebuilt below from the
# record it comes from (the latest run that measured it), at the precision the text prints, so changing the
# text or appending a newer run without the other fails here.

RESULTS = ROOT / "benchmarks" / "results"
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def _records(bench: str) -> list[dict]:
    import json

    return [json.loads(line) for line in (RESULTS / f"{bench}.jsonl").read_text().splitlines() if line.strip()]


def _latest(bench: str, run_id: str | None = None, gpu: str = H100, **match) -> dict:
    """The one record of ``bench`` with these fields in the latest run on ``gpu`` (the card the text names) that has
    such a record (or in ``run_id``)."""
    found = [r for r in _records(bench)
             if r.get("gpu") == gpu and all(r.get(field) == value for field, value in match.items())]
    assert found, f"no {bench} record on {gpu} with {match}"
    run = run_id or max(r["run_id"] for r in found)
    found = [r for r in found if r["run_id"] == run]
    assert len(found) == 1, f"{len(found)} {bench} records with {match} in run {run}"
    return found[0]


def _speed_section() -> str:
    return README.split("## Speed on a GPU", 1)[1].split("\n## ", 1)[0]


def _speed_table() -> dict[str, list[str]]:
    rows = [line for line in _speed_section().splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[2:]
    assert [c.strip() for c in header.strip("|").split("|")][1:] == ["all 60 layers",
                                                                    "12 of 60 layers (`run_all --quick`)"]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in body)}


def _l60(backend: str, k=None) -> dict:
    return _latest("e2e_synthetic", model_shape="gemma4-31b/L60", backend=backend, batch=1, k=k,
                   alpha=0.8 if k else None)


def _l12(backend: str, k=None, batch=1) -> dict:
    return _latest("e2e_synthetic", model_shape="gemma4-31b/L12", backend=backend, batch=batch, k=k,
                   alpha=0.8 if k else None, preset="quick")


def _speculative_60(backend: str, k: int) -> str:
    r = _l60(backend, k)
    return (f"{r['tokens_per_s']:.1f} tok/s, {r['speedup_vs_plain']:.1f}× plain "
            f"({r['vs_floor_tau']:.2f} of τ × floor)")


def _speculative_12(backend: str, k: int) -> str:
    r = _l12(backend, k)
    return f"{r['tokens_per_s']:.1f} tok/s, {r['speedup_vs_plain']:.1f}× plain"


def _decode_31b(backend: str) -> dict:
    return _latest("decode", model_shape="gemma4-31b/L12", backend=backend, batch=1, preset="quick")


def _expected_speed_table() -> dict[str, list[str]]:
    plain60 = _l60("hf_specdec")
    plain12 = _decode_31b("hf_specdec")
    batch32 = [_l12(backend, k, batch=32)["speedup_vs_plain"]
               for backend, k in [("hf_specdec_mtp_synthetic", 3), ("hf_specdec_mtp_synthetic", 7),
                                  ("hf_specdec_dflash_synthetic", 7)]]
    verify = _latest("verify_cost", model_shape="gemma4-31b/L12", backend="hf_specdec_verify", batch=1, k=7,
                     preset="quick")
    draft = _latest("draft_cost", model_shape="gemma4-31b/L12", backend="gemma4_mtp", batch=1, preset="quick")
    step = _latest("draft_cost", model_shape="step3p5/L4", backend="step3p5_mtp", batch=1, preset="quick")
    return {
        "plain decoding, share of the memory-bandwidth floor": [
            f"{plain60['tokens_per_s']:.1f} tok/s, {100 * plain60['vs_floor_tau']:.0f}%",
            f"{plain12['tokens_per_s']:.1f} tok/s, {plain12['pct_of_floor']:.0f}% (transformers: "
            f"{_decode_31b('hf_dynamic')['tokens_per_s']:.1f}; static cache + `torch.compile`: "
            f"{_decode_31b('hf_static_compile')['tokens_per_s']:.1f})"],
        "MTP, k=7, α=0.8": [_speculative_60("hf_specdec_mtp_synthetic", 7),
                            _speculative_12("hf_specdec_mtp_synthetic", 7)],
        "MTP, k=3, α=0.8": [_speculative_60("hf_specdec_mtp_synthetic", 3),
                            _speculative_12("hf_specdec_mtp_synthetic", 3)],
        "DFlash (assumed drafter shape), k=7, α=0.8": [_speculative_60("hf_specdec_dflash_synthetic", 7),
                                                       _speculative_12("hf_specdec_dflash_synthetic", 7)],
        "α=0.8, batch 32": ["",
                            "MTP k=3: {:.2f}× plain batched; k=7: {:.2f}×; DFlash k=7: {:.2f}×".format(*batch32)],
        "one verify step (k=7) ÷ one decode step": ["", f"{verify['ratio_to_decode']:.2f}×"],
        "one MTP draft step ÷ one target step": ["", f"{draft['ratio']:.3f} (Step 3.5 MTP, cut to 4 layers: "
                                                     f"{step['ratio']:.3f})"],
    }


def test_speed_table_quotes_the_benchmark_records():
    assert _speed_table() == _expected_speed_table()


def test_speed_text_quotes_the_benchmark_records():
    text = " ".join(_speed_section().split())
    e4b, tiny = (_latest("hf_native_assisted", model_shape=shape, backend="hf_specdec_mtp")["speedup_vs_native"]
                 for shape in ("gemma4-e4b/L12", "tiny-gemma4"))
    assert (f"MTP is {e4b:.0f}× faster on an E4B shape cut to 12 layers, and {tiny:.0f}× on the bundled tiny "
            f"model") in text
    floor = sorted(_latest("decode", model_shape="gemma4-e4b/L12", backend="hf_specdec", batch=batch)["pct_of_floor"]
                   for batch in (1, 8))
    assert f"Plain decoding of the E4B shape (12 layers) reaches {floor[0]:.0f}–{floor[1]:.0f}% of its floor" in text
    assert "Measured on one H100 80GB" in text


def test_the_reproduce_commands_are_those_of_the_records():
    """The 60-layer column comes from one e2e_synthetic run: the README's command is that run's; the 12-layer
    column is the --quick size of run_all."""
    text = " ".join(_speed_section().split())
    commands = {_l60(backend, k)["command"] for backend, k in [("hf_specdec", None), ("hf_specdec_mtp_synthetic", 7),
                                                               ("hf_specdec_mtp_synthetic", 3),
                                                               ("hf_specdec_dflash_synthetic", 7)]}
    assert len(commands) == 1
    assert f"the 60-layer one with `{commands.pop()}`" in text
    assert "Reproduce the 12-layer column with `python -m benchmarks.run_all --quick`" in text


TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def test_troubleshooting_speed_numbers_agree_with_the_records():
    paragraph = " ".join(TROUBLESHOOTING.split("### Speculative decoding is slower than plain decoding", 1)[1]
                         .split("\n## ", 1)[0].split())
    mtp12, mtp60 = _l12("hf_specdec_mtp_synthetic", 7), _l60("hf_specdec_mtp_synthetic", 7)
    # the tiny ratios come from one run of the whole family (runs of one member since do not replace it), on the
    # H200 the text names
    run = _latest("e2e_tiny", gpu=H200, model_shape="tiny-step3p5", backend="hf_specdec", batch=1)["run_id"]
    plain = _latest("e2e_tiny", run, H200, model_shape="tiny-gemma4", backend="hf_specdec", batch=1)

    def tiny(shape, backend, k=None, over=plain):
        return _latest("e2e_tiny", run, H200, model_shape=shape, backend=backend, batch=1, k=k)["tokens_per_s"] / \
            over["tokens_per_s"]

    step_plain = _latest("e2e_tiny", run, H200, model_shape="tiny-step3p5", backend="hf_specdec", batch=1)
    batch32 = [_l12(backend, k, batch=32)["speedup_vs_plain"]
               for backend, k in [("hf_specdec_mtp_synthetic", 3), ("hf_specdec_mtp_synthetic", 7),
                                  ("hf_specdec_dflash_synthetic", 7)]]
    claims = [
        f"MTP with k=7 is {mtp12['speedup_vs_plain']:.1f}× plain at 12 of its layers and "
        f"{mtp60['speedup_vs_plain']:.1f}× at the full 60 layers",
        f"a plain step is already short (~{1e3 / plain['tokens_per_s']:.1f} ms at batch 1",
        f"MTP with k=2 gives {tiny('tiny-gemma4', 'hf_specdec_mtp', 2):.2f}× plain hf_specdec and k=4 "
        f"{tiny('tiny-gemma4', 'hf_specdec_mtp', 4):.2f}×, DFlash (k=7) {tiny('tiny-gemma4', 'hf_specdec_dflash', 7):.2f}× and "
        f"Step 3.5 MTP (k=3) {tiny('tiny-step3p5', 'hf_specdec_mtp', 3, step_plain):.2f}×",
        f"DFlash with \"auto\" gives {tiny('tiny-gemma4', 'hf_specdec_dflash', 'auto'):.2f}× plain and Step 3.5 MTP "
        f"{tiny('tiny-step3p5', 'hf_specdec_mtp', 'auto', step_plain):.2f}×",
        "MTP with k=3 gave {:.2f}× plain, k=7 {:.2f}× and DFlash k=7 {:.2f}×".format(*batch32),
    ]
    for claim in claims:
        assert claim in paragraph
    quoted = re.findall(r"\d+(?:\.\d+)?×", paragraph)
    assert all(any(number in claim for claim in claims) for number in quoted), quoted  # no number left unchecked
    assert "eagerly" not in paragraph  # every drafter's steps run on CUDA graphs (README, Status)


def test_docs_cite_only_files_of_the_repository():
    for doc in (README, TROUBLESHOOTING, (ROOT / "hf_specdec" / "assets" / "README.md").read_text()):
        for name in set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b", doc)):
            assert (ROOT / name).is_file() or (ROOT / "docs" / name).is_file(), name


def test_asset_readme_documents_every_bundled_folder():
    """Each bundled folder has its section in the asset README, with how it was trained, what it measures and how to
    rebuild it (a section lost in an edit of another fails here)."""
    text = (ROOT / "hf_specdec" / "assets" / "README.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    for name in available_assets():
        section = next((s for s in sections if s.startswith(f"`{name}`")), None)
        assert section is not None, f"no '## `{name}`' section"
        if name != "tiny-gemma4":  # the target's training and rebuild sections are its own headings
            for part in ("### Training", "### Result", "### Rebuilding"):
                assert f"\n{part}" in section, (name, part)


def test_asset_readme_says_which_folders_stock_transformers_loads():
    """The asset README's table of what stock transformers (hf_specdec not imported) makes of each folder holds
    for the installed transformers: tiny-gemma4 loads as Gemma4ForCausalLM, tiny-step3p5 is refused."""
    import subprocess
    import sys

    text = (ROOT / "hf_specdec" / "assets" / "README.md").read_text()
    rows = {cells[0].strip("`/"): cells[1] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| `tiny-") and line.count("|") == 4)}
    assert rows["tiny-gemma4"] == "`Gemma4ForCausalLM`" and rows["tiny-step3p5"].startswith("refused")
    assert "Every folder is a standard Hugging Face checkpoint that stock" not in text
    assets = ROOT / "hf_specdec" / "assets"
    script = (
        "import sys, transformers\n"
        f"print(type(transformers.AutoModelForCausalLM.from_pretrained({str(assets / 'tiny-gemma4')!r})).__name__)\n"
        "try:\n"
        f"    transformers.AutoModelForCausalLM.from_pretrained({str(assets / 'tiny-step3p5')!r})\n"
        "    print('loaded')\n"
        "except ValueError:\n"
        "    print('refused')\n"
        "assert not [m for m in sys.modules if m.startswith('hf_specdec')]\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=assets)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Gemma4ForCausalLM", "refused"]
