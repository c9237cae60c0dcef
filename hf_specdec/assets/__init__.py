"""The bundled tiny model family (docs/architecture.md, "The bundled tiny family"): small checkpoints trained on Python source code.

Each asset is a standard Hugging Face checkpoint folder, loadable with stock
`transformers.AutoModelForCausalLM` / `AutoTokenizer`:

    from hf_specdec.assets import asset_path, held_out_snippets
    target = AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"))
    prompts = [s["text"] for s in held_out_snippets()]

How they were trained, and their measured quality, is in README.md beside this file; the training
tooling is `tools/tiny_family/` in the repository.
"""

import json
import pathlib

ASSETS_DIR = pathlib.Path(__file__).resolve().parent
# Leading lines of stdlib files that no member was trained on: test inputs and demo prompts.
HELD_OUT_SNIPPETS_FILE = ASSETS_DIR / "held_out_snippets.json"

_REBUILD_HINT = (
    "Rebuild them from a repository checkout with the commands in hf_specdec/assets/README.md "
    "(e.g. `python -m tools.tiny_family.train_target --out hf_specdec/assets/tiny-gemma4 ...`)."
)


def available_assets() -> list[str]:
    """Names of the bundled checkpoints (folders holding a config.json)."""
    return sorted(p.parent.name for p in ASSETS_DIR.glob("*/config.json"))


def asset_path(name: str) -> pathlib.Path:
    """Folder of the bundled checkpoint `name` (e.g. "tiny-gemma4"); FileNotFoundError if absent."""
    path = ASSETS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No bundled asset {name!r} in {ASSETS_DIR}; available: {available_assets() or 'none'}. {_REBUILD_HINT}"
        )
    return path


def held_out_snippets() -> list[dict[str, str]]:
    """The bundled held-out snippets: a list of `{"path": stdlib-relative path, "text": source}`."""
    if not HELD_OUT_SNIPPETS_FILE.is_file():
        raise FileNotFoundError(f"{HELD_OUT_SNIPPETS_FILE} is missing. {_REBUILD_HINT}")
    return json.loads(HELD_OUT_SNIPPETS_FILE.read_text(encoding="utf-8"))["snippets"]
