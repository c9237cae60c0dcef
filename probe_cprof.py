"""cProfile of tiny-model speculative calls on the GPU: where the host's time per round goes."""
import cProfile
import io
import pstats

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.assets import asset_path, held_out_snippets

dev = "cuda"
tok = AutoTokenizer.from_pretrained(asset_path("tiny-gemma4"))
tok.padding_side = "left"
x = tok([s["text"][:200] for s in held_out_snippets()][:1], return_tensors="pt", padding=True).to(dev)
assistant = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-assistant"),
                                                            dtype=torch.float32).to(dev)
dflash = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4-dflash"), dtype=torch.float32).to(dev)
model = AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32).to(dev).eval()
model.generation_config.eos_token_id = None
hf_specdec.enable(model)
for label, kw in [("plain", {}), ("mtp k7", dict(assistant_model=assistant, num_speculative_tokens=7)),
                  ("dflash k7", dict(assistant_model=dflash, num_speculative_tokens=7))]:
    kw = dict(kw, max_new_tokens=128, do_sample=False)
    for _ in range(3):
        model.generate(**x, **kw)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        model.generate(**x, **kw)
    torch.cuda.synchronize()
    prof.disable()
    st = hf_specdec.last_generation_stats(model)
    s = io.StringIO()
    ps = pstats.Stats(prof, stream=s).sort_stats("tottime")
    ps.print_stats(30)
    print(f"==== {label}: rounds a call {st.num_target_forwards}")
    print("\n".join(line[:170] for line in s.getvalue().splitlines()[:45]))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(45)
    print("\n".join(line[:170] for line in s.getvalue().splitlines()[:60]))
