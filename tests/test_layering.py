"""The package's layers import one way — kernels <- cache <- attention <- runtime <- generation <- models <- the
public API — and nothing below ``models/`` names a model class: models plug in by registering."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_specdec"
# a module may import from its own layer and every layer before it; config and compat sit under all but kernels
LAYERS = ["kernels", "config", "compat", "cache", "attention", "runtime", "generation", "models", "api"]
MODEL_CLASS = re.compile(r"\b(Gemma\d\w*|Step3p\d\w*|DFlash\w*|Qwen\d\w*|Llama\w*)\b")
MODEL_PREFIX = re.compile(r"(gemma\d|step3p\d|qwen\d|llama)", re.IGNORECASE)  # in function and variable names


def _layer(module: str) -> str:
    """The layer of a dotted module name inside hf_specdec ("api" for the top-level modules)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return top if top in LAYERS else "api"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text())


def _imports(name: str, path: Path, tree: ast.AST):
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package[: len(package) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module


@pytest.mark.parametrize("name,path,tree", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_run_one_way(name, path, tree):
    layer = LAYERS.index(_layer(name))
    for target in _imports(name, path, tree):
        if target and target.startswith("hf_specdec") and target != "hf_specdec":
            assert LAYERS.index(_layer(target)) <= layer, f"{name} ({LAYERS[layer]}) imports {target}"
        if _layer(name) == "kernels":
            assert not (target or "").startswith("transformers"), f"{name}: kernels import no transformers"


@pytest.mark.parametrize("name,path,tree", [m for m in _modules() if _layer(m[0]) not in ("models", "api")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_nothing_below_models_names_a_model_class(name, path, tree):
    """Identifiers, and string constants that are names (docstrings, comments and messages may cite the models
    they serve)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Name)):
            defined = node.id if isinstance(node, ast.Name) else node.name
            assert not MODEL_PREFIX.search(defined), f"{name}:{node.lineno} defines {defined!r}"
        text = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.isidentifier() and id(node) not in docstrings else None)
        assert not (text and MODEL_CLASS.search(text)), f"{name}:{getattr(node, 'lineno', '?')} names {text!r}"


def test_the_loop_does_not_probe_drafters():
    """The speculative loop calls the Drafter base's declared methods; it never asks a drafter what it has."""
    source = (PACKAGE / "generation" / "speculative.py").read_text()
    assert not re.search(r"(getattr|hasattr)\([^)]*drafter", source)
