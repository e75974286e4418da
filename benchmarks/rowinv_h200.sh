#!/usr/bin/env bash
# The row-invariant kernels (issue 19) on the H200, each stage one device call of under ten
# minutes, from the repository root:
#   bash benchmarks/rowinv_h200.sh 1 "$OUT"   # the kernels' tests compiled for the GPU, the
#                                             # model's bitwise checks (1B and an odd shape),
#                                             # the decode-size products' sweep, the 1B speeds
#   bash benchmarks/rowinv_h200.sh 2 "$OUT"   # speeds and profiles: 1B, 0.6B (and 8B with
#                                             # BIG=1), the bitwise checks on 0.6B
#   bash benchmarks/rowinv_h200.sh 3 "$OUT"   # transformers (sdpa) on the same machine
# Each writes its JSON and a log under $OUT; copy them into benchmarks/results.
set -uo pipefail
stage=${1:?stage 1 to 3}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2
case "$stage" in
1)
  timeout 150 env JAX_PLATFORMS=cuda python -m pytest -q -x -o addopts="" -p no:cacheprovider \
    tests/test_rowinv.py tests/test_pallas_row_norm.py tests/test_pallas_attention.py \
    2>&1 | tail -15 | tee "$out/gpu_tests.txt"
  timeout 200 python -m benchmarks.rowinv_model --parts exact \
    --exact-shapes llama-3.2-1b,odd-1.3b --out "$out/exact" --budget-s 180 2>&1 | tail -30
  timeout 130 python -m benchmarks.rowinv_model --parts products --shapes llama-3.2-1b \
    --out "$out/products" --budget-s 110 2>&1 | tail -5
  timeout 100 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.2-1b \
    --out "$out/speed" --budget-s 85 2>&1 | tail -20
  ;;
2)
  shapes=llama-3.2-1b,qwen3-0.6b
  [ "${BIG:-0}" = 1 ] && shapes=$shapes,llama-3.1-8b
  timeout 330 python -m benchmarks.rowinv_model --parts speed --shapes $shapes \
    --out "$out/speed" --budget-s 300 2>&1 | tail -30
  timeout 150 python -m benchmarks.rowinv_model --parts exact,profile --shapes llama-3.2-1b \
    --exact-shapes qwen3-0.6b --out "$out/profile" --budget-s 130 2>&1 | tail -20
  ;;
3)
  timeout 560 python -m benchmarks.run --preset h200 --part hf --out "$out" 2>&1 | tail -20
  ;;
esac
ls -R "$out" | head -30
