"""hf_specdec's benchmarks (a source checkout's folder, not part of the installed package).

``BENCHES`` is the registry: every bench module of this folder by name, in the order ``run_all`` runs them,
with the one line ``hf-specdec bench --help`` shows for it. A new bench is added here and nowhere else.
This file imports nothing, so the command line can list the benches without loading torch.
"""

BENCHES = {
    "decode": "plain decoding: transformers dynamic / static+compile vs hf_specdec, beside the bandwidth floor",
    "verify_cost": "one verify step (k+1 tokens per row) / one decode step",
    "draft_cost": "one draft step (Gemma 4 MTP, Step 3.5 MTP, DFlash) / one target step",
    "e2e_synthetic": "MTP and DFlash end to end at a fixed acceptance rate (not lossless) beside plain decoding",
    "hf_native_assisted": "transformers' assisted decoding vs hf_specdec MTP on identical weights",
    "hf_native_step_mtp": "transformers' Step 3.7 generate(use_mtp=True) vs hf_specdec Step 3.5 MTP on identical weights",
    "e2e_tiny": "the bundled tiny family: plain vs every speculative mode, real tau",
    "soak": "many generate calls on the bundled family: device memory, leaked blocks, repeat answers per call",
    "multi_gpu": "device_map over N GPUs, offload and tensor parallelism in every mode vs one device",
}

# ``all``: benchmarks/run_all.py
RUN_ALL = "every benchmark above at one size (run_all), then a README of its tables and the plot"
