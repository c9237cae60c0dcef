#!/usr/bin/env bash
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 BENCH_COMMIT=${1:-unknown} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/generation/test_two_gpus.py > $OUT/two_gpus_test.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/two_gpus_test.log | tail -8
timeout 150 python3 -m benchmarks.multi_gpu --shape gemma4-31b --layers 12 --batch 1 --placements device_map --modes none mtp --results-dir $OUT/results > $OUT/multi_gpu_31b_device_map.log 2>&1; grep -E "gemma4-31b|Error" $OUT/multi_gpu_31b_device_map.log | grep -v '^{' | head -12
