"""The decoding cases of the tensor-parallel tests, run alike by every rank of a group and by one plain process.

Models (fp32):
- ``step``: the bundled tiny Step 3.5 as it is (2 KV heads in every layer, 4 experts, 3 MTP layers);
- ``gemma``: the bundled tiny Gemma 4 with its full layers' single KV head stored twice
  (:func:`write_shardable_gemma`): the same function (each pair of query heads reads an identical copy of the
  head), but two KV heads that split over two ranks; its MTP assistant (whose config then says two full-layer KV
  heads) and its DFlash drafter load unchanged;
- ``gemma_replicated_attention``: the bundled tiny Gemma 4 itself, whose one full-layer KV head cannot split:
  loaded with a tp_plan that keeps the attention projections replicated (the fix hf_specdec's error names), so
  only its MLPs and embedding are sharded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import shutil
from dataclasses import dataclass

import torch
import transformers
from safetensors.torch import load_file, save_file

import hf_specdec
from hf_specdec.assets import asset_path

MAX_NEW_TOKENS = 12
SEED = 1234


@dataclass(frozen=True)
class Case:
    family: str  # "gemma", "gemma_replicated_attention" or "step"
    mode: str  # "plain", "mtp", "dflash" or "mtp_auto" (num_speculative_tokens="auto")
    do_sample: bool

    @property
    def name(self) -> str:
        return f"{self.family}_{self.mode}_{'sampled' if self.do_sample else 'greedy'}"


CASES = [
    Case(family, mode, sample)
    for family, modes in (("gemma", ("plain", "mtp", "dflash")), ("step", ("plain", "mtp")))
    for mode in modes for sample in (False, True)
] + [Case("gemma_replicated_attention", "mtp", False), Case("gemma", "mtp_auto", False)]


def write_shardable_gemma(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The bundled tiny Gemma 4 family under ``root``, its target's full-layer KV head stored twice; returns the
    directories of the target, its assistant and its DFlash drafter."""
    target, assistant = root / "tiny-gemma4-2kv", root / "tiny-gemma4-2kv-assistant"
    shutil.copytree(asset_path("tiny-gemma4"), target)
    shutil.copytree(asset_path("tiny-gemma4-assistant"), assistant)
    config = json.loads((target / "config.json").read_text())
    weights = load_file(target / "model.safetensors")
    for layer, kind in enumerate(config["layer_types"]):
        key = f"model.layers.{layer}.self_attn.k_proj.weight"
        if kind == "full_attention" and key in weights:  # KV-shared layers have no projection
            weights[key] = weights[key].repeat(2, 1)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config["num_global_key_value_heads"] = 2
    (target / "config.json").write_text(json.dumps(config, indent=2))
    assistant_config = json.loads((assistant / "config.json").read_text())
    assistant_config["text_config"]["num_global_key_value_heads"] = 2
    (assistant / "config.json").write_text(json.dumps(assistant_config, indent=2))
    return {"target": target, "assistant": assistant, "dflash": asset_path("tiny-gemma4-dflash")}


@functools.lru_cache(maxsize=None)
def load(path: str, placement: str):
    """A model (enabled if it is a target) loaded for one process ("single" on the CPU, "single:cuda:0" on that GPU),
    sharded by its own tp_plan ("tp"), or sharded with its attention projections replicated
    ("tp_replicated_attention"); sharded models go where transformers puts each rank's (cuda:r with NCCL)."""
    kwargs = dict(dtype=torch.float32)
    if placement.startswith("single:"):
        kwargs["device_map"] = {"": placement.split(":", 1)[1]}
    elif placement == "tp":
        kwargs["tp_plan"] = "auto"
    elif placement == "tp_replicated_attention":
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=torch.distributed.get_world_size(),
                                                         tp_plan=replicated_attention_plan())
    return hf_specdec.AutoModelForCausalLM.from_pretrained(path, **kwargs)


def replicated_attention_plan() -> dict[str, str]:
    """The bundled Gemma 4's tp_plan with its attention projections replicated (the fix hf_specdec's error names)."""
    from hf_specdec.runtime.distributed import replicated_attention_plan as plan

    return plan(transformers.Gemma4ForCausalLM)


def _single(device: str) -> str:
    return "single" if device == "cpu" else f"single:{device}"


def target_of(family: str, gemma_dirs: dict[str, pathlib.Path], tp: bool, device: str = "cpu"):
    """``device``: where the one-process model goes (ignored for sharded ones)."""
    if family == "step":
        return load(str(asset_path("tiny-step3p5")), "tp" if tp else _single(device))
    if family == "gemma":
        return load(str(gemma_dirs["target"]), "tp" if tp else _single(device))
    return load(str(asset_path("tiny-gemma4")), "tp_replicated_attention" if tp else _single(device))


def drafter_kwargs(case: Case, gemma_dirs: dict[str, pathlib.Path], device: str = "cpu") -> dict:
    """The generate() arguments of the case's speculative mode; drafters load replicated on every rank (on
    ``device``: this process's)."""
    if case.mode == "plain":
        return {}
    if case.family == "step":
        return dict(spec_mode="mtp", num_speculative_tokens=3)
    if case.mode == "dflash":
        return dict(assistant_model=load(str(gemma_dirs["dflash"]), _single(device)), spec_mode="dflash",
                    num_speculative_tokens=4)
    assistant = gemma_dirs["assistant"] if case.family == "gemma" else asset_path("tiny-gemma4-assistant")
    return dict(assistant_model=load(str(assistant), _single(device)),
                num_speculative_tokens="auto" if case.mode == "mtp_auto" else 3)


@functools.lru_cache(maxsize=None)
def prompts(family: str):
    """input_ids, attention_mask: two left-padded prompts of different lengths."""
    tok = transformers.AutoTokenizer.from_pretrained(asset_path("tiny-step3p5" if family == "step" else "tiny-gemma4"))
    tok.padding_side = "left"
    texts = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "import os\n\nclass Path"]
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def run_case(case: Case, gemma_dirs: dict[str, pathlib.Path], tp: bool, device: str = "cpu") -> dict:
    """The tokens ``case`` generates and its stats (every rank of a tensor-parallel group runs it alike when
    ``tp``; ``device``: this process's, a rank's own GPU under NCCL)."""
    model = target_of(case.family, gemma_dirs, tp, device)
    input_ids, attention_mask = (t.to(device) for t in prompts(case.family))
    sampling = dict(do_sample=True, temperature=0.8, top_k=50) if case.do_sample else dict(do_sample=False)
    # each rank draws from its own random stream: only what rank 0 drew (as one process seeded alike) may count
    torch.manual_seed(SEED + (torch.distributed.get_rank() if tp else 0))
    with _rank_dependent_round_costs(tp and case.mode == "mtp_auto"):
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, **sampling,
                             **drafter_kwargs(case, gemma_dirs, device))
    stats = hf_specdec.last_generation_stats(model)
    return dict(tokens=out.tolist(), target_forwards=stats.num_target_forwards,
                accepted=stats.num_accepted_tokens)


@contextlib.contextmanager
def _rank_dependent_round_costs(on: bool):
    """While open (``on``), round timings that differ by rank, as measured ones would: drafts nearly free on rank 0,
    dear on the others. "auto" k that read them would choose the most drafts on rank 0 and one elsewhere."""
    if not on:
        yield
        return
    from hf_specdec.generation import adaptive_k

    curve = [(1, 1.0), (2, 1.001)] if torch.distributed.get_rank() == 0 else [(1, 1.0), (2, 11.0)]
    original = adaptive_k.RoundCosts.curve
    adaptive_k.RoundCosts.curve = lambda self: curve
    try:
        yield
    finally:
        adaptive_k.RoundCosts.curve = original


def run_cases(gemma_dirs: dict[str, pathlib.Path], tp: bool, device: str = "cpu") -> dict[str, dict]:
    return {case.name: run_case(case, gemma_dirs, tp, device) for case in CASES}


def kv_heads(gemma_dirs: dict[str, pathlib.Path], tp: bool) -> dict[str, list[int]]:
    """The KV heads each KV group of every target's paged cache holds in this process."""
    families = ("gemma", "step", "gemma_replicated_attention")
    return {f: [g.num_kv_heads for g in target_of(f, gemma_dirs, tp)._hf_specdec.layout.groups] for f in families}
