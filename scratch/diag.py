import os, sys, traceback, faulthandler
faulthandler.enable()
import torch
sys.path.insert(0, os.getcwd())
import hf_specdec
from hf_specdec.assets import asset_path
from tests.bundled import batch
from tests.generation.test_two_gpus import _split

asset, second = sys.argv[1], int(sys.argv[2])
graphs = os.environ.get("HF_SPECDEC_CUDA_GRAPHS") != "0"
print(f"== {asset} split {second} graphs={graphs} blocking={os.environ.get('CUDA_LAUNCH_BLOCKING')}", flush=True)
single = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(asset), dtype=torch.float32, device_map={"": "cuda:0"})
single.generation_config.eos_token_id = None
model = hf_specdec.AutoModelForCausalLM.from_pretrained(asset_path(asset), dtype=torch.float32, device_map=_split(asset, second))
model.generation_config.eos_token_id = None
ids, mask = (t.to("cuda:0") for t in batch(3))
exp = single.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
try:
    for i in range(3):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        print("call", i, "same:", torch.equal(got, exp), "graphs:", len(model._hf_specdec.graph_store.graphs),
              model._hf_specdec.graph_store.disabled_reason, flush=True)
except Exception:
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
