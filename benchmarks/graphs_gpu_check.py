"""CUDA graphs on the GPU: same tokens as eager (invariant 5), and what they buy at 31B shapes.

    PYTHONPATH=. python -m benchmarks.graphs_gpu_check [--layers 12] [--new-tokens 64]

1. Exactness, fp32, the bundled tiny family on the GPU, batch 4 left-padded: plain greedy, Gemma 4 MTP
   (k=4), Step 3.5 MTP-3 and sampled MTP with a fixed seed, each decoded eagerly (cuda_graphs=False) and with
   graphs; the tokens must be equal (and equal to transformers' greedy generate).
2. Speed, bf16, a Gemma-4-31B-shaped model (benchmarks.decode_gpu_check.build_model) at batch 1 and 8:
   transformers generate, hf_specdec eager, hf_specdec with graphs, beside the bandwidth floor.
Prints two tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the exactness part (no graphs)


def _tiny_family_rows() -> list[dict]:
    from transformers import AutoTokenizer

    import hf_specdec
    from hf_specdec.assets import asset_path, held_out_snippets

    tokenizer = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
    tokenizer.padding_side = "left"
    batch = tokenizer([s["text"][:200] for s in held_out_snippets()[:4]], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"].to(DEVICE), batch["attention_mask"].to(DEVICE)
    load = lambda name: hf_specdec.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        asset_path(name), dtype=torch.float32).to(DEVICE).eval()
    gemma, assistant, step = load("tiny-gemma4"), load("tiny-gemma4-assistant"), load("tiny-step3p5")
    cases = [
        ("gemma4 plain", gemma, {}),
        ("gemma4 MTP k=4", gemma, dict(assistant_model=assistant, num_speculative_tokens=4)),
        ("gemma4 MTP k=4 sampled", gemma, dict(assistant_model=assistant, num_speculative_tokens=4,
                                               do_sample=True, temperature=0.8)),
        ("step3.5 plain", step, {}),
        ("step3.5 MTP-3", step, dict(spec_mode="mtp", num_speculative_tokens=3)),
    ]
    rows = []
    for name, model, extra in cases:
        kwargs = {**dict(attention_mask=mask, max_new_tokens=160, do_sample=False, eos_token_id=None), **extra}
        hf_specdec.disable(model)
        reference = None if kwargs["do_sample"] else model.generate(
            ids, attention_mask=mask, max_new_tokens=160, do_sample=False, eos_token_id=None)
        results = {}
        for graphs in (False, True):
            hf_specdec.enable(model, cuda_graphs=graphs)
            torch.manual_seed(0)
            model.generate(ids, **kwargs)  # warm-up: Triton compiles, graph captures (kept for the next call)
            torch.manual_seed(1)
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            stats = hf_specdec.last_generation_stats(model)
            results[graphs] = (out, stats, time.perf_counter() - start)
        (eager, s_eager, t_eager), (graphed, s_graph, t_graph) = results[False], results[True]
        rows.append(dict(case=name, same_as_eager=bool(torch.equal(eager, graphed)),
                         same_as_transformers=None if reference is None else bool(torch.equal(reference, graphed)),
                         tau=round(s_graph.mean_accepted_length, 2) if s_graph.spec_mode else None,
                         eager_tokens_per_s=round(eager.shape[0] * 160 / t_eager, 1),
                         graphs_tokens_per_s=round(graphed.shape[0] * 160 / t_graph, 1)))
        hf_specdec.disable(model)
    return rows


def _speed_rows(layers: int, prompt: int, new_tokens: int) -> tuple[list[dict], dict]:
    import hf_specdec
    from benchmarks.decode_gpu_check import build_model, copy_bandwidth_gb_s, first_mismatch, timed_generate

    model = build_model(layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth_gb_s()
    rows = []
    for batch in (1, 8):
        ids = torch.randint(3, 262144, (batch, prompt), device="cuda")
        hf_out, hf_tps = timed_generate(model, ids, new_tokens)
        hf_specdec.enable(model, cuda_graphs=False)
        eager, eager_tps = timed_generate(model, ids, new_tokens)
        hf_specdec.enable(model, cuda_graphs=True)
        graphed, graph_tps = timed_generate(model, ids, new_tokens)
        hf_specdec.disable(model)
        floor = bandwidth * 1e9 / weight_bytes * batch
        rows.append(dict(batch=batch, hf_dynamic=round(hf_tps, 1), hf_specdec_eager=round(eager_tps, 1),
                         hf_specdec_graphs=round(graph_tps, 1), floor=round(floor, 1),
                         graphs_vs_floor=round(graph_tps / floor, 3),
                         graphs_same_as_eager=bool(torch.equal(eager.sequences, graphed.sequences)),
                         first_mismatch_vs_hf=first_mismatch(hf_out.sequences, graphed.sequences, hf_out.logits)))
    return rows, dict(weight_gb=round(weight_bytes / 1e9, 2), copy_gb_s=round(bandwidth, 1))


def _print(rows: list[dict]) -> None:
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths)))
    print()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    import transformers

    exact = _tiny_family_rows()
    print("tiny family, fp32, batch 4, 160 new tokens: eager vs CUDA graphs")
    _print(exact)
    speed, facts = ([], {}) if args.skip_speed or DEVICE == "cpu" else _speed_rows(args.layers, args.prompt, args.new_tokens)
    if speed:
        print(f"gemma-4-31B shapes, {args.layers} layers, bf16, prompt {args.prompt}, {args.new_tokens} new tokens "
              f"({facts['weight_gb']} GB, copy {facts['copy_gb_s']} GB/s): tokens/s")
        _print(speed)
    print(json.dumps({"bench": "graphs_gpu_check", "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                      "transformers": transformers.__version__, "layers": args.layers, **facts,
                      "exact": exact, "speed": speed}))
    ok = all(r["same_as_eager"] and r["same_as_transformers"] in (None, True) for r in exact)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
