"""Where the Triton bodies run in tests.

On a CUDA machine the `triton_device` tests run on the GPU. On CPU they need Triton's interpreter,
which `triton.jit` picks when the kernels are *imported* under ``TRITON_INTERPRET=1`` — too late
once any test module has imported hf_specdec. So on CPU those tests skip here and
`test_triton_cases_in_interpreter` re-runs them in a subprocess started with the interpreter on.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_specdec.kernels._dispatch import FORCE_TRITON_ENV, HAS_TRITON

REPO_ROOT = Path(__file__).resolve().parents[2]


def interpreter_active() -> bool:
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from hf_specdec.kernels.paged_attention import _paged_attention_kernel

    return isinstance(_paged_attention_kernel, InterpretedFunction)


@pytest.fixture
def triton_device(monkeypatch) -> str:
    """Device on which the Triton bodies run in this process; skips where they cannot."""
    if HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    if not interpreter_active():
        pytest.skip("Triton bodies run on CPU only in the TRITON_INTERPRET=1 subprocess "
                    "(test_triton_cases_in_interpreter)")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    return "cpu"


@pytest.fixture
def run_triton_cases_in_interpreter():
    return _run_triton_cases_in_interpreter


def _run_triton_cases_in_interpreter(min_passed: int, path: Path | None = None) -> None:
    """Run the `triton_` tests of tests/kernels (or of the one file ``path``) in a child process with the
    interpreter on; all must pass, none skip."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available() or interpreter_active():
        pytest.skip("the triton tests run directly in this process")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # not a worker of this run's
    env.update(TRITON_INTERPRET="1", **{FORCE_TRITON_ENV: "1"},
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton_ and not in_interpreter",
           str(path or Path(__file__).parent)]
    if path is None and importlib.util.find_spec("xdist") is not None:
        # the whole of tests/kernels in the interpreter is the suite's longest test (~15 minutes of one core under
        # load): two processes, as the README's test command runs the rest (a 2-core run: ~12 against ~16 minutes)
        cmd[3:3] = ["-n", "2", "--dist", "worksteal"]
    # ~10 minutes on a 2-core machine, more on a slower one: the limit only catches a hang
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"interpreter run failed:\n{output[-6000:]}"
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= min_passed and "skipped" not in output, output[-3000:]


def run_file_cases_in_interpreter(request, path: str, min_passed: int) -> None:
    """A kernel test file run by itself on CPU: its ``triton_`` tests in a TRITON_INTERPRET=1 child. In a session
    that collects test_paged_attention's ``test_triton_cases_in_interpreter`` (which re-runs every ``triton_`` test
    of tests/kernels), it stands down."""
    if any(item.name == "test_triton_cases_in_interpreter" for item in request.session.items):
        pytest.skip("test_triton_cases_in_interpreter re-runs this file's triton_ tests in this session")
    _run_triton_cases_in_interpreter(min_passed, Path(path))
