import os, sys, time, statistics, torch, triton, triton.language as tl
from hf_specdec.kernels._dispatch import pdl_args, pdl_wait
import hf_specdec.kernels._dispatch as d
print("PDL", d.PDL, flush=True)

@triton.jit
def k1(x_ptr, PDL: tl.constexpr):
    pdl_wait(PDL)
    v = tl.load(x_ptr)
    tl.store(x_ptr, v + 1.0)

x = torch.zeros(1, device="cuda")
for n in (10, 100, 300):
    for pdl in (False, True):
        def body():
            for _ in range(n):
                k1[(1,)](x, PDL=pdl, launch_pdl=pdl)
        body(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        for _ in range(5): g.replay()
        torch.cuda.synchronize()
        cpu, wall = [], []
        for _ in range(50):
            t = time.perf_counter(); g.replay(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            cpu.append((t1 - t) * 1e6); wall.append((t2 - t) * 1e6)
        print(f"nodes {n} pdl {pdl}: replay() host {statistics.median(cpu):.1f} us, replay+sync {statistics.median(wall):.1f} us", flush=True)

# the tiny model's plain decode
import hf_specdec
from transformers import AutoModelForCausalLM
from hf_specdec.assets import asset_path
m = AutoModelForCausalLM.from_pretrained(asset_path("tiny-gemma4"), dtype=torch.float32).cuda().eval()
hf_specdec.enable(m)
ids = torch.randint(5, 4000, (1, 64), device="cuda")
times = {}
for n in (1, 65):
    for _ in range(3): m.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); m.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    times[n] = statistics.median(ts)
print(f"tiny-gemma4 plain: {(times[65]-times[1])/64*1e6:.1f} us a token", flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    m.generate(ids, max_new_tokens=65, do_sample=False, eos_token_id=None); torch.cuda.synchronize()
for e in prof.key_averages():
    if e.key in ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize"):
        print(e.key, e.count, f"{e.cpu_time_total/e.count:.1f} us avg")
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print("kernels in call", len(ev), "device time us", sum(e.time_range.elapsed_us() for e in ev))
