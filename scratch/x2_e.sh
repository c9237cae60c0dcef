#!/usr/bin/env bash
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 BENCH_COMMIT=${1:-unknown} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 150 python3 -m benchmarks.multi_gpu --gpus 2 --batch 1 --new-tokens 64 --placements device_map --results-dir $OUT/results > $OUT/multi_gpu_tiny.log 2>&1; grep -E "tiny|Error" $OUT/multi_gpu_tiny.log | head -16
timeout 330 python3 -m pytest -q -p no:cacheprovider -x tests/runtime tests/models/gemma4 tests/kernels/test_paged_attention.py -k "not e4b and not 31b and not full_depth" > $OUT/gpu_tests_single.log 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests_single.log | tail -8
