#!/usr/bin/env bash
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 BENCH_COMMIT=${1:-unknown} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m 2>&1 | head -4
python3 -c "import torch;print(torch.__version__, torch.cuda.device_count())"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_cuda_graphs.py -k "spans" 2>&1 | tail -25 | tee $OUT/spanning_test.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/generation/test_two_gpus.py -x 2>&1 | tail -40 | tee $OUT/two_gpus_test.log
timeout 240 python3 -m benchmarks.multi_gpu --shape gemma4-31b --layers 12 --batch 1 --placements device_map --modes none mtp --results-dir $OUT/results 2>&1 | tail -30 | tee $OUT/multi_gpu_31b_device_map.log
