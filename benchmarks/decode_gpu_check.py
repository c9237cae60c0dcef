"""Plain decoding of a Gemma-4-31B-shaped model (random bf16 weights): hf_specdec vs transformers generate.

    PYTHONPATH=. python benchmarks/decode_gpu_check.py [--layers 12] [--new-tokens 64]

Every layer has the real 31B shapes (hidden 5376, 32 q heads, sliding 16 kv x 256 with window 1024,
full 4 kv x 512 with attention_k_eq_v, intermediate 21504, vocab 262144); ``--layers`` keeps the
[5 sliding, 1 full] pattern at a smaller depth so the model fits beside HF's cache (the bandwidth floor is
computed for the depth that runs). Checks the greedy tokens agree (a mismatch is reported with the
top-2 logit gap at that step: bf16 near-ties are expected to flip, docs/architecture.md, "Exactness"), times tokens/s at
batch 1 and 8, and prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build_model(num_layers: int):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    types = [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(num_layers)]
    types[-1] = "full_attention"
    config = Gemma4TextConfig(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024, layer_types=types,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    # Built directly on the GPU in bf16: transformers' own random init (normal, std 0.02) runs there in seconds.
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def copy_bandwidth_gb_s() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start) / 1e9


def timed_generate(model, ids, new_tokens):
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, return_dict_in_generate=True, output_logits=True)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    return out, ids.shape[0] * new_tokens / (time.perf_counter() - start)


def first_mismatch(a, b, logits):
    """(step, top-2 gap of the reference logits there) of the first differing token, or None."""
    diff = (a != b).any(dim=0).nonzero()
    if len(diff) == 0:
        return None
    step = int(diff[0]) - (a.shape[1] - len(logits))
    top2 = logits[step].float().topk(2, dim=-1).values
    return step, float((top2[:, 0] - top2[:, 1]).min())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    import transformers

    import hf_specdec

    model = build_model(args.layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth_gb_s()
    rows = []
    for batch in (1, 8):
        ids = torch.randint(3, 262144, (batch, args.prompt), device="cuda")
        hf_out, hf_tps = timed_generate(model, ids, args.new_tokens)
        hf_specdec.enable(model)
        ours, ours_tps = timed_generate(model, ids, args.new_tokens)
        hf_specdec.disable(model)
        mismatch = first_mismatch(hf_out.sequences, ours.sequences, hf_out.logits)
        floor = bandwidth * 1e9 / weight_bytes * batch
        rows.append(dict(batch=batch, hf_dynamic_tokens_per_s=round(hf_tps, 1),
                         hf_specdec_tokens_per_s=round(ours_tps, 1), floor_tokens_per_s=round(floor, 1),
                         same_tokens=mismatch is None, first_mismatch=mismatch))
    print(f"gemma-4-31B shapes, {args.layers} layers, {weight_bytes / 1e9:.1f} GB bf16, copy {bandwidth:.0f} GB/s")
    print(f"{'batch':>5} {'HF tok/s':>10} {'ours tok/s':>11} {'floor tok/s':>12}  same tokens (first mismatch, top-2 gap)")
    for r in rows:
        print(f"{r['batch']:>5} {r['hf_dynamic_tokens_per_s']:>10} {r['hf_specdec_tokens_per_s']:>11} "
              f"{r['floor_tokens_per_s']:>12}  {r['same_tokens']} {r['first_mismatch'] or ''}")
    print(json.dumps({"bench": "decode_gpu_check", "gpu": torch.cuda.get_device_name(), "layers": args.layers,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "weight_gb": round(weight_bytes / 1e9, 2), "copy_gb_s": round(bandwidth, 1), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
