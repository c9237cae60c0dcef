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
