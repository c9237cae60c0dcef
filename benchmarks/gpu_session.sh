#!/usr/bin/env bash
# One command for a GPU machine that only gets a copy of the working tree: the GPU tests, then the benches,
# with every result under one folder (few files: a machine that sends results back may cap their number).
#
#   bash benchmarks/gpu_session.sh OUT_DIR COMMIT \
#       [tests|quick|full-depth|moe-decode|moe-spec|fp8|tp|tp-tests|device-map|timeline|all]
#
#   tests       pytest of the Triton kernels, CUDA graphs and the Gemma 4 / DFlash / Step 3.5 models on the GPU
#   quick       python -m benchmarks.run_all --quick --skip soak (~7 min on an H100)
#   full-depth  e2e_synthetic on all 60 layers of the Gemma-4-31B shape at batch 1, median of 3 (~4 min, 61 GB)
#   moe-decode  the MoE GPU tests, then plain decode of the Gemma-4-26B-A4B shape (30 layers) and the Step 3.5
#               shape cut to 8 layers, batch 1 and 8, transformers' own MoE forward beside ours (~8 min)
#   moe-spec    verify_cost, draft_cost and e2e_synthetic (acceptance 0.8) on the same two shapes (~9 min)
#   fp8         the FP8 GPU tests (W8A8 and weight-only kernels, FP8 batch invariance), the W8A8 kernels beside the
#               weight-only and bf16 ones (dense and the 26B-A4B's experts), then the 31B at 60 layers in FP8 (plain,
#               MTP k=7 at 0.8), its verify cost (12 layers) and the 26B-A4B's FP8 decode (~8 min)
#   tp          (two GPUs or more) peer_sum between two ranks against NCCL's all-reduce, then the 31B shape at 12
#               layers under tp, batch 1 and 4, plain and MTP k=3 at 0.8 (96 new tokens, median of 3), then its
#               step's kernel timeline on rank 0 against one GPU (~6 min, each step under a timeout; NVLink
#               multicast off, as the device machines ask)
#   tp-tests    (two GPUs) the tensor-parallel tests: transformers' forwards, the fused ones, symmetric-memory and peer
#               sums, every case the one-GPU tokens (~5-6 min)
#   device-map  (two GPUs) the device_map tests (every mode, guards, the once-per-forward moves), then the 31B shape
#               at 12 layers split by a balanced device map against one GPU, batch 1 and 4, plain and MTP, and the
#               step's device time from the kernels' timeline (benchmarks/step_timeline.py) (~7 min)
#   timeline    one GPU: the step's kernel timeline of the E2B, E4B and 26B-A4B shapes at full depth, batch 1 (what
#               each kernel adds to the step, and layer 5's kernels one by one; benchmarks/step_timeline.py) (~5 min)
#   all         tests, then quick (default)
#
# COMMIT tags the records (a copied checkout may carry a stale git HEAD). Records go to OUT_DIR/results/*.jsonl
# (append them to benchmarks/results/ and run `python -m benchmarks.report`), logs to OUT_DIR/*.log.
set -uo pipefail
out="${1:?OUT_DIR}"
export BENCH_COMMIT="${2:?COMMIT}" PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(cd "$(dirname "$0")/.." && pwd)"
what="${3:-all}"
mkdir -p "$out/results"
status=0

run_tests() {
  python -m pytest -q tests/kernels tests/runtime \
    tests/models/gemma4 tests/models/dflash tests/models/step3p5 tests/cache/test_cache_sizing.py \
    -p no:cacheprovider >"$out/gpu_tests.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.log" | tail -12
  return $rc
}

two_gpu_pytest() {  # two_gpu_pytest LOG SECONDS PYTEST-ARGS...: NVLink multicast off, as the device machines ask
  local log="$1" seconds="$2"
  shift 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  timeout -k 10 "$seconds" python -m pytest -q "$@" -p no:cacheprovider >"$out/$log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/$log" | tail -12
  return $rc
}

run_quick() {
  python -m benchmarks.run_all --quick --skip soak --results-dir "$out/results" --no-report >"$out/run_all.log" 2>&1
  local rc=$?
  grep "\[run_all\]" "$out/run_all.log"
  return $rc
}

run_full_depth() {
  python -m benchmarks.e2e_synthetic --layers 60 --batch 1 --skip-hf --alpha 0.8 --k 3 7 --drafter mtp dflash \
    --prompt 256 --new-tokens 128 --repeats 3 --results-dir "$out/results" >"$out/full_depth.log" 2>&1
  local rc=$?
  grep -E "^ *(model_shape|gemma4)" "$out/full_depth.log"
  return $rc
}

run_moe_decode() {
  local rc=0
  timeout 200 python -m pytest -q tests/kernels/test_fused_moe.py tests/generation/test_experts.py \
    tests/models/gemma4/test_mtp_speculative.py tests/models/dflash/test_spec_decode.py tests/models/step3p5 \
    -k "moe or experts or step3p5" -p no:cacheprovider >"$out/gpu_moe_tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_moe_tests.log" | tail -12
  python -m benchmarks.decode --shapes gemma4-26b-a4b --batch 1 8 --backends hf_dynamic hf_specdec \
    --results-dir "$out/results" >"$out/moe_decode_26b.log" 2>&1 || rc=1
  python -m benchmarks.decode --shapes step3p5 --layers 8 --batch 1 8 --backends hf_specdec \
    --results-dir "$out/results" >"$out/moe_decode_step.log" 2>&1 || rc=1
  grep -hE "^ *(model_shape|gemma4|step3p5)|Error" "$out/moe_decode_26b.log" "$out/moe_decode_step.log"
  return $rc
}

run_moe_spec() {
  local rc=0
  python -m benchmarks.verify_cost --shape gemma4-26b-a4b --k 3 7 --batch 1 8 \
    --results-dir "$out/results" >"$out/moe_verify.log" 2>&1 || rc=1
  python -m benchmarks.verify_cost --shape step3p5 --layers 8 --k 3 --batch 1 8 \
    --results-dir "$out/results" >>"$out/moe_verify.log" 2>&1 || rc=1
  python -m benchmarks.e2e_synthetic --shape gemma4-26b-a4b --skip-hf --alpha 0.8 --k 3 7 --batch 1 8 \
    --drafter mtp dflash --prompt 256 --new-tokens 128 --repeats 3 --results-dir "$out/results" >"$out/moe_e2e_26b.log" 2>&1 || rc=1
  python -m benchmarks.e2e_synthetic --shape step3p5 --layers 8 --skip-hf --alpha 0.8 --k 3 --batch 1 8 \
    --drafter mtp --prompt 256 --new-tokens 128 --repeats 3 --results-dir "$out/results" >"$out/moe_e2e_step.log" 2>&1 || rc=1
  python -m benchmarks.draft_cost --shapes gemma4-26b-a4b step3p5 --step-layers 8 --batch 1 8 \
    --results-dir "$out/results" >"$out/moe_draft_cost.log" 2>&1 || rc=1
  grep -hE "^ *(model_shape|gemma4|step3p5|shape)|Error" "$out"/moe_verify.log "$out"/moe_e2e_*.log "$out/moe_draft_cost.log"
  return $rc
}

run_fp8() {
  local rc=0
  timeout 240 python -m pytest -q tests/kernels/test_fp8_w8a8.py tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_fp8_moe.py tests/kernels/test_stacked_linear.py tests/runtime/test_batch_invariance.py \
    tests/quantized -k "fp8 or w8a8 or stacked" -p no:cacheprovider >"$out/gpu_fp8_tests.log" 2>&1 || rc=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_fp8_tests.log" | tail -12
  python -m benchmarks.fp8_gpu_check --w8a8 --shapes 31b 26b --rows 1 4 16 >"$out/w8a8_check.log" 2>&1 || rc=1
  timeout 150 python -m benchmarks.moe_gpu_check --shapes gemma4-26b-a4b --weights all --tokens 1 4 8 \
    >"$out/moe_w8a8_check.log" 2>&1 || rc=1
  python -m benchmarks.e2e_synthetic --layers 60 --weights fp8 --alpha 0.8 --k 7 --batch 1 --drafter mtp \
    --prompt 256 --new-tokens 128 --repeats 3 --skip-hf --results-dir "$out/results" >"$out/fp8_e2e_31b.log" 2>&1 || rc=1
  python -m benchmarks.verify_cost --shape gemma4-31b --layers 12 --weights fp8 --k 3 7 --batch 1 \
    --results-dir "$out/results" >"$out/fp8_verify.log" 2>&1 || rc=1
  python -m benchmarks.decode --shapes gemma4-26b-a4b --weights fp8 --batch 1 8 --backends hf_specdec \
    --results-dir "$out/results" >"$out/fp8_decode_26b.log" 2>&1 || rc=1
  grep -hE "^ *(N|[0-9]+ )|^ *(model_shape|gemma4|shape)|Error" "$out/w8a8_check.log" "$out/moe_w8a8_check.log" \
    "$out"/fp8_*.log
  return $rc
}

run_tp() {
  local rc=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # (a peer_sum that failed its test could spin: the runs after it then take NCCL's sums)
  two_gpu_pytest gpu_peer_sum_tests.log 100 tests/distributed/test_peer_sum_gpu.py \
    || { rc=1; export HF_SPECDEC_TP_PEER_SUM=0; }
  local shape=(--shape gemma4-31b --layers 12 --batch 1 4 --modes none mtp --placements tp --new-tokens 96
               --repeats 3 --results-dir "$out/results")
  timeout -k 10 200 python -m benchmarks.multi_gpu "${shape[@]}" >"$out/tp_31b.log" 2>&1 || rc=1
  grep -hE "^ *(model_shape|gemma4)|Error" "$out/tp_31b.log"
  timeout -k 10 150 python -m benchmarks.step_timeline --shape gemma4-31b --layers 12 --gpus 2 --placement tp \
    >"$out/step_timeline_tp.log" 2>&1 || rc=1
  grep -vE "Warning|warn|^ *$" "$out/step_timeline_tp.log" | tail -30
  return $rc
}

run_tp_tests() {
  two_gpu_pytest gpu_tp_tests.log 400 tests/distributed/test_tensor_parallel_gpu.py tests/distributed/test_peer_sum_gpu.py
}

run_device_map() {
  local rc=0
  two_gpu_pytest gpu_two_gpu_tests.log 240 tests/generation/test_two_gpus.py tests/runtime/test_placement.py || rc=1
  timeout 240 python -m benchmarks.multi_gpu --shape gemma4-31b --layers 12 --batch 1 4 --modes none mtp \
    --placements device_map --new-tokens 96 --repeats 3 --results-dir "$out/results" >"$out/device_map_31b.log" 2>&1 \
    || rc=1
  grep -hE "^ *(model_shape|gemma4)|Error" "$out/device_map_31b.log"
  timeout -k 10 120 python -m benchmarks.step_timeline --shape gemma4-31b --layers 12 --gpus 2 \
    >"$out/step_timeline_31b.log" 2>&1 || rc=1
  grep -E "^(one GPU|device_map)|Error" "$out/step_timeline_31b.log"
  return $rc
}

run_timeline() {
  local rc=0 shape
  for shape in gemma4-e2b gemma4-e4b gemma4-26b-a4b; do
    timeout -k 10 150 python -m benchmarks.step_timeline --shape "$shape" --layers 0 --gpus 0 --new-tokens 40 \
      --detail-layer 5 >"$out/step_timeline_$shape.log" 2>&1 || rc=1
    grep -A60 -E "^one GPU|Error" "$out/step_timeline_$shape.log"
  done
  return $rc
}

case "$what" in
  moe-decode) run_moe_decode || status=1 ;;
  moe-spec) run_moe_spec || status=1 ;;
  tests) run_tests || status=1 ;;
  quick) run_quick || status=1 ;;
  full-depth) run_full_depth || status=1 ;;
  fp8) run_fp8 || status=1 ;;
  tp) run_tp || status=1 ;;
  tp-tests) run_tp_tests || status=1 ;;
  device-map) run_device_map || status=1 ;;
  timeline) run_timeline || status=1 ;;
  all) run_tests || status=1; run_quick || status=1 ;;
  *) echo "unknown part '$what': tests, quick, full-depth, moe-decode, moe-spec, fp8, tp, tp-tests, device-map or all" >&2
     exit 2 ;;
esac
exit $status
