#!/usr/bin/env bash
# Everything the H200 benchmark needs, in three device calls of under ten minutes each:
#   bash benchmarks/h200_session.sh 1 "$OUT"   # GPU tests, exactness, decode profiles and HLO
#   bash benchmarks/h200_session.sh 2 "$OUT"   # our decode/prefill table and the W sweep
#                                              # (the sweep only with SWEEP=1)
#   bash benchmarks/h200_session.sh 3 "$OUT"   # transformers for all three shapes
#   bash benchmarks/h200_session.sh 4 "$OUT"   # exactness after a change: the dense checks,
#                                              # speculative rounds, Qwen3.5 and Gemma 4 tests
#   bash benchmarks/h200_session.sh 5 "$OUT"   # Qwen3.5 / Gemma 4 figures (benchmarks.families)
#   bash benchmarks/h200_session.sh 6 "$OUT"   # the recipe's train step traced (issue 18) and the
#                                              # row-invariant kernels again (issue 19)
#   bash benchmarks/h200_session.sh 7 "$OUT"   # the delta-rule row kernel (the GPU's walk):
#                                              # its tests, the layer against the XLA loop, the
#                                              # Qwen3.5 bitwise checks and figures on it
#   bash benchmarks/h200_session.sh 8 "$OUT"   # the embedded pair at draft lengths 4 / 6 / 8,
#                                              # n-gram lookup up to 3- and 4-grams (issue 14)
#   bash benchmarks/h200_session.sh 9 "$OUT"   # stage 7 in one call with a decode profile of
#                                              # the kernel and Gemma 4's figures (no hf)
#   bash benchmarks/h200_session.sh 10 "$OUT"  # stage 8, then the drafters' figures and the
#                                              # embedded model's speculative.json
#   bash benchmarks/h200_session.sh 11 "$OUT"  # the serving benchmark (issue 20; carry the
#                                              # server's packages as wheels, see README)
#   bash benchmarks/h200_session.sh 12 "$OUT"  # the delta-rule kernel's tests and checks as the
#                                              # GPU default, a decode profile with its HLO, and
#                                              # decode with and without command buffers
#   bash benchmarks/h200_session.sh 13 "$OUT"  # the Qwen3.5 figures
#   bash benchmarks/h200_session.sh 14 "$OUT"  # the oracle benchmark on the 1B shape (issue 14),
#                                              # then the Qwen3.5 test files on the GPU
#   bash benchmarks/h200_session.sh 15 "$OUT"  # after a change to the delta-rule kernel: its
#                                              # tests, the bitwise checks, a decode profile,
#                                              # the Qwen3.5 figures and test files
# Then, here: copy the JSON files into benchmarks/results, each under its own name (the report
# reads every *.json there; for a (shape, context) the first file in name order gives our row,
# the last one transformers'), and run
#   python -m benchmarks.run --report benchmarks/results
# A device call returns at most 8 files, so stage 1's and stage 2's logs hold every record too.
# Timings seen on one H200 (2026-12-02): stage 1 about 170 s; stage 2 about 190 s, 400 s with
# the sweep; stage 3 about 100 s for the 1B shape, 100 s for 0.6B, 160 s for 8B.
set -uo pipefail
stage=${1:?stage 1 to 15}
out=${2:?output folder}
export JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
quiet() { grep -v -i -E "warn|^\s*$" | cut -c1-300; }
# The delta-rule kernel's tests on the GPU, then the Qwen3.5 bitwise checks (arguments go to
# benchmarks.qwen35_exactness).
delta_rule_checks() {
  HYPOTHESIS_PROFILE=quick timeout 100 python3 -m pytest -n 0 -q -p no:cacheprovider \
    -p no:warnings tests/test_pallas_delta_rule.py 2>&1 | tail -3
  echo "delta-rule kernel tests: exit ${PIPESTATUS[0]}"
  timeout 100 python3 -m benchmarks.qwen35_exactness "$@" 2>&1 | quiet | tail -20
}
# A traced decode burst of the Qwen3.5-0.8B shape (arguments go to benchmarks.profile_decode).
qwen_profile() {
  timeout 80 python3 -m benchmarks.profile_decode --shape qwen3.5-0.8b --widths 16 \
    --tokens 128 --out "$out/profile" "$@" 2>&1 | quiet | tail -16
}
case "$stage" in
1)
  export HYPOTHESIS_PROFILE=quick
  timeout 120 python3 -m pytest -n 0 -q -p no:cacheprovider -p no:warnings \
    tests/test_pallas_attention.py tests/test_pallas_rope_store.py 2>&1 | tail -2
  echo "kernel tests: exit ${PIPESTATUS[0]}"
  timeout 150 python3 -m pytest -n 0 -q -p no:cacheprovider -p no:warnings -k llama_bf16_listed \
    tests/test_conformance_dense.py 2>&1 | tail -2
  echo "conformance on the GPU: exit ${PIPESTATUS[0]}"
  timeout 90 python3 -m benchmarks.run --preset h200 --part exact --out "$out" 2>&1 | quiet
  # The traced profile also dumps the optimised HLO of the decode program.
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run_blocks.*" \
    timeout 60 python3 -m benchmarks.profile_decode --widths 16 --out "$out" 2>&1 | quiet | tail -12
  cp "$(ls /tmp/hlo/*run_blocks*after_optimizations.txt | head -1)" "$out/decode_hlo.txt"
  timeout 45 python3 -m benchmarks.profile_decode --widths 16 --rope-store xla --no-trace \
    --out "$out" 2>&1 | quiet | tail -1
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
    timeout 45 python3 -m benchmarks.profile_decode --widths 16 --label graphs+while \
    --no-trace --out "$out" 2>&1 | quiet | tail -1
  ;;
2)
  timeout 300 python3 -m benchmarks.run --preset h200 --part ours --widths "" --out "$out" 2>&1 | quiet
  [ -n "${SWEEP:-}" ] && timeout 200 python3 -m benchmarks.run --preset h200 --part ours \
    --shapes llama-3.2-1b --contexts 128 --sweep-contexts 128,16384 --out "$out/sweep" 2>&1 | quiet
  ;;
3)
  for s in ${SHAPES:-llama-3.2-1b qwen3-0.6b llama-3.1-8b}; do
    timeout 400 python3 -m benchmarks.run --preset h200 --part hf --shapes $s \
      --out "$out/hf_$s" 2>&1 | quiet
  done
  ;;
4)
  export HYPOTHESIS_PROFILE=quick
  timeout 90 python3 -m benchmarks.run --preset h200 --part exact --out "$out" 2>&1 | quiet
  timeout 120 python3 -m benchmarks.spec_gpu_check 2>&1 | quiet | tail -20
  timeout 120 python3 -m benchmarks.qwen35_exactness 2>&1 | quiet | tail -20
  timeout 240 python3 -m pytest -n 0 -q -p no:cacheprovider -p no:warnings -x \
    tests/test_gemma4.py tests/test_qwen3_5.py tests/test_speculative_families.py \
    tests/test_mtp_drafter.py tests/test_gemma4_assistant.py 2>&1 | tail -3
  echo "family tests on the GPU: exit ${PIPESTATUS[0]}"
  ;;
5)
  timeout 560 python3 -m benchmarks.families --out "$out" 2>&1 | quiet
  ;;
6)
  timeout 300 python3 -m benchmarks.profile_train --out "$out" 2>&1 | quiet
  timeout 200 python3 -m benchmarks.rowinv --out "$out/rowinv" --budget-s 170 2>&1 | quiet | tail -5
  ;;
7)
  delta_rule_checks
  timeout 120 python3 -m benchmarks.delta_rule_kernel --out "$out/delta_rule_kernel.json" 2>&1 |
    quiet
  timeout 300 python3 -m benchmarks.families --shapes qwen3.5-0.8b,qwen3.5-4b --no-hf \
    --out "$out/families_pallas" 2>&1 | quiet
  ;;
8)
  timeout 400 python3 -m benchmarks.speculative --part embedded --tokens 128 \
    --draft-lens 4,6,8 --ngram 3,4 --out "$out" 2>&1 | quiet
  ;;
9)
  delta_rule_checks
  timeout 80 python3 -m benchmarks.delta_rule_kernel --out "$out/delta_rule_kernel.json" 2>&1 |
    quiet
  qwen_profile
  timeout 170 python3 -m benchmarks.families --shapes gemma4-e2b --no-hf \
    --out "$out/families_gemma4" 2>&1 | quiet
  ;;
10)
  timeout 200 python3 -m benchmarks.speculative --part embedded --tokens 128 \
    --draft-lens 4,6,8 --ngram 3,4 --out "$out" 2>&1 | quiet
  timeout 200 python3 -m benchmarks.drafters --preset h200 --drafters ngram,draft-model \
    --max-seconds 140 --write-speculative-json --out "$out/drafters" 2>&1 | quiet | tail -30
  cp models/tsj-pycoder/speculative.json "$out/" 2>/dev/null
  ;;
11)
  timeout 300 python3 -m benchmarks.serve --preset h200 --budget-s 200 --out "$out/serve" 2>&1 |
    quiet | tail -30
  ;;
12)
  delta_rule_checks
  timeout 80 python3 -m benchmarks.delta_rule_kernel --out "$out/delta_rule_kernel.json" 2>&1 |
    quiet
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run_blocks.*" \
    qwen_profile
  hlo=$(ls -S /tmp/hlo/*run_blocks*after_optimizations.txt | head -1)
  echo "command buffers in $hlo: $(grep -c 'command_buffer' "$hlo")"
  cp "$hlo" "$out/qwen_decode_hlo.txt"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
    qwen_profile --label graphs+while --no-trace
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" qwen_profile --label no-graphs --no-trace
  ;;
13)
  timeout 500 python3 -m benchmarks.families --shapes qwen3.5-0.8b,qwen3.5-4b --no-hf \
    --out "$out/families_qwen35" 2>&1 | quiet
  ;;
14)
  timeout 290 python3 -m benchmarks.speculative --part oracle --shapes llama-3.2-1b \
    --tokens 256 --out "$out/oracle_1b" 2>&1 | quiet | tail -25
  export HYPOTHESIS_PROFILE=quick
  timeout 260 python3 -m pytest -n 0 -q -p no:cacheprovider -p no:warnings -x \
    tests/test_qwen3_5.py tests/test_qwen3_5_mtp.py tests/test_mtp_drafter.py \
    tests/test_speculative_families.py tests/test_block_drafter_qwen35.py 2>&1 | tail -4
  echo "Qwen3.5 test files on the GPU: exit ${PIPESTATUS[0]}"
  ;;
15)
  delta_rule_checks
  qwen_profile
  timeout 200 python3 -m benchmarks.families --shapes qwen3.5-0.8b,qwen3.5-4b --no-hf \
    --out "$out/families_qwen35" 2>&1 | quiet
  timeout 150 python3 -m pytest -n 0 -q -p no:cacheprovider -p no:warnings \
    tests/test_qwen3_5_mtp.py tests/test_qwen3_5.py 2>&1 | tail -4
  echo "Qwen3.5 test files on the GPU: exit ${PIPESTATUS[0]}"
  ;;
esac
