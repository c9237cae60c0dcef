#!/usr/bin/env bash
export PYTHONPATH=$(pwd) PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(HF_SPECDEC_CUDA_GRAPHS=0 CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 scratch/diag.py tiny-gemma4 4 2>&1 | grep -v "^frame\|Loading weights" | head -40) > $OUT/diag.log
(HF_SPECDEC_CUDA_GRAPHS=0 timeout 90 python3 scratch/diag.py tiny-gemma4 4 2>&1 | grep -v "^frame\|Loading weights" | head -40) >> $OUT/diag.log
(timeout 90 python3 scratch/diag.py tiny-gemma4 4 2>&1 | grep -v "^frame\|Loading weights" | head -40) >> $OUT/diag.log
(timeout 90 python3 scratch/diag.py tiny-step3p5 3 2>&1 | grep -v "^frame\|Loading weights" | head -40) >> $OUT/diag.log
cat $OUT/diag.log | cut -c1-250
