#!/usr/bin/env bash
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 BENCH_COMMIT=${1:-unknown} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/generation/test_two_gpus.py tests/runtime/test_cuda_graphs.py -k "two_gpus or spans or offloaded or main_device" > $OUT/two_gpus_test.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/two_gpus_test.log | tail -8
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py -k "prompt_launch or prompt_tiles" > $OUT/prompt_launch_gpu_test.log 2>&1; tail -1 $OUT/prompt_launch_gpu_test.log
timeout 200 python3 -m benchmarks.multi_gpu --shape gemma4-31b --layers 12 --batch 1 4 --placements device_map --modes none mtp --results-dir $OUT/results > $OUT/multi_gpu_31b_device_map.log 2>&1; grep -E "gemma4-31b|Error" $OUT/multi_gpu_31b_device_map.log | head -12
timeout 150 python3 -m benchmarks.multi_gpu --quick --gpus 2 --placements device_map offload --results-dir $OUT/results > $OUT/multi_gpu_tiny.log 2>&1; grep -E "tiny|Error" $OUT/multi_gpu_tiny.log | head -30
