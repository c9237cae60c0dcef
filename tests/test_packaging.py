"""Installing hf_specdec: triton is required only where it has wheels (Linux x86_64 / aarch64), and the package
imports and decodes without it (the kernels' torch references; macOS, Windows)."""

import pathlib
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _dependencies() -> list[Requirement]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [Requirement(line) for line in tomllib.load(f)["project"]["dependencies"]]


@pytest.mark.parametrize("system,machine,needs_triton", [
    ("Linux", "x86_64", True),
    ("Linux", "aarch64", True),
    ("Darwin", "arm64", False),
    ("Darwin", "x86_64", False),
    ("Windows", "AMD64", False),
    ("Linux", "ppc64le", False),  # no triton wheel there either
])
def test_triton_is_a_dependency_only_where_it_installs(system, machine, needs_triton):
    (triton,) = [r for r in _dependencies() if r.name == "triton"]
    environment = {"platform_system": system, "platform_machine": machine, "sys_platform": system.lower()}
    assert (triton.marker is None or triton.marker.evaluate(environment)) == needs_triton


# Hides triton as if it were not installed: `import triton` fails and importlib.util.find_spec("triton") is
# None (what torch checks), for triton and its submodules.
NO_TRITON = """
import importlib.machinery, sys

class _NoTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [_NoTriton if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert "triton" not in sys.modules
"""

GENERATE = """
import importlib.util
try:
    import triton
    raise SystemExit("triton is still importable")
except ImportError:
    pass
assert importlib.util.find_spec("triton") is None

import torch, hf_specdec
from hf_specdec.assets import asset_path
from hf_specdec.kernels import _dispatch
from transformers import AutoTokenizer

assert not _dispatch.HAS_TRITON
torch.manual_seed(0)
model = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32)
assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"), dtype=torch.float32)
inputs = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))(["def fibonacci(n):\\n"], return_tensors="pt")
plain = model.generate(**inputs, max_new_tokens=8, do_sample=False)
speculative = model.generate(**inputs, max_new_tokens=8, do_sample=False, assistant_model=assistant)
hf_specdec.disable(model)
reference = model.generate(**inputs, max_new_tokens=8, do_sample=False)
assert torch.equal(plain, reference) and torch.equal(speculative, reference)
assert "triton" not in sys.modules
print("ok without triton")
"""


def test_hf_specdec_imports_and_generates_without_triton():
    result = subprocess.run([sys.executable, "-c", NO_TRITON + GENERATE], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok without triton")
