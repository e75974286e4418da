#!/usr/bin/env bash
# The row-invariant kernels (issue 19) on the H200, each stage one device call of under ten
# minutes, from the repository root:
#   bash benchmarks/rowinv_h200.sh 1 "$OUT"   # the kernels' tests compiled for the GPU, the
#                                             # model's bitwise checks (1B and an odd shape),
#                                             # the 1B end-to-end and prefill speeds of the
#                                             # exact (rowinv) mode, its per-kernel profile
#   bash benchmarks/rowinv_h200.sh 2 "$OUT"   # the 1B speeds with XLA's kernels, the
#                                             # decode-size products' sweep, the 1B profiles
#   bash benchmarks/rowinv_h200.sh 6 "$OUT"   # 0.6B speeds and bitwise checks
#   bash benchmarks/rowinv_h200.sh 3 "$OUT"   # 8B speeds and bitwise checks
#   bash benchmarks/rowinv_h200.sh 4 "$OUT"   # transformers (sdpa) on the same machine
#   bash benchmarks/rowinv_h200.sh 7 "$OUT"   # when device time is short: after stage 1, the
#                                             # rest in one call (sdpa prefill, 0.6B and 8B
#                                             # end to end and prefill, 0.6B bitwise checks)
#   bash benchmarks/rowinv_h200.sh 8 "$OUT"   # what a call costs beyond its kernels: the 1B
#                                             # profile at the speed part's capacity, the
#                                             # 1B decode with the while loop in command
#                                             # buffers (the default) and without
#   bash benchmarks/rowinv_h200.sh 9 "$OUT"   # the exact prefill's attention alone under
#                                             # several row tiles / warps / stages (speed
#                                             # settings: each checked to keep the bits),
#                                             # and the exact prefill in 8,192-row blocks
#   bash benchmarks/rowinv_h200.sh 10 "$OUT"  # the attention settings the kernels choose
#                                             # (tiles_for): their GPU tests, the sweep
#                                             # (prefill blocks and decode steps), the exact
#                                             # prefill of the three shapes, and the 0.6B and
#                                             # 8B bitwise checks under them
#   bash benchmarks/rowinv_h200.sh 11 "$OUT"  # the decode step's attention under several
#                                             # warps / stages, timed in a loop (short)
#   bash benchmarks/rowinv_h200.sh 12 "$OUT"  # where an exact and a parallel prefill spend
#                                             # the device's time, traced (1B, 8B, 0.6B)
#   bash benchmarks/rowinv_h200.sh 13 "$OUT"  # the attention's key tile at 128 against 64:
#                                             # the bitwise checks under it (1B, 0.6B), then
#                                             # exact prefill and decode at both, one stretch;
#                                             # the exact prefill without loop graphs
#   bash benchmarks/rowinv_h200.sh 14 "$OUT"  # the exact prefill's figures against sdpa in
#                                             # one stretch: one block a call against four
#                                             # (speed and bits, 1B and 0.6B), the three
#                                             # shapes' prefill, transformers' sdpa, the 1B
#                                             # prefill profile
#   bash benchmarks/rowinv_h200.sh 15 "$OUT"  # which calls hold the host: a decode burst's
#                                             # call against its whole time, and each while
#                                             # loop in or out of a command buffer (XLA dump)
#   bash benchmarks/rowinv_h200.sh 16 "$OUT"  # a Mosaic GPU matrix kernel (JAX's Hopper
#                                             # example) against ours: bits at one segment,
#                                             # rates at the prefill shapes
#   bash benchmarks/rowinv_h200.sh 17 "$OUT"  # the Mosaic matrix kernel's GPU tests (bits
#                                             # against the Triton kernels) and the exact
#                                             # part at the 1B, 0.6B and 8B shapes
#   bash benchmarks/rowinv_h200.sh 18 "$OUT"  # prefill speed against sdpa, with the Mosaic
#                                             # products, and the prefill profile
#   bash benchmarks/rowinv_h200.sh 19 "$OUT"  # Triton against Mosaic: elementwise bits, and
#                                             # a first Mosaic attention against ours (bits,
#                                             # time; both value-product forms)
#   bash benchmarks/rowinv_h200.sh 20 "$OUT"  # the Mosaic kernel's GPU tests, and a decode
#                                             # step's 1B products on it (row padded to 64)
#                                             # against the Triton matvec kernel (traced)
#   bash benchmarks/rowinv_h200.sh 21 "$OUT"  # decode end to end (1B, 0.6B) with one decode
#                                             # program for every context, then with the
#                                             # short-context program (the default); the 1B
#                                             # exact part (its short burst runs that program)
#   bash benchmarks/rowinv_h200.sh 23 "$OUT"  # decode end to end (1B, 0.6B) with XLA's
#                                             # programmatic dependent launch off, then on
#                                             # (each kernel launched while the one before
#                                             # finishes); the exact part with it on
#   bash benchmarks/rowinv_h200.sh 22 "$OUT"  # a decode step's products alone (traced), every
#                                             # matvec column tile and segment count swept
#                                             # on the 0.6B shape, the defaults on the 1B
#   bash benchmarks/rowinv_h200.sh 24 "$OUT"  # the short-context kernels' GPU tests (attention
#                                             # bounded by max_keys, the fold's grouped loads,
#                                             # the Mosaic partials),
#                                             # then stage 21: one call for both
#   bash benchmarks/rowinv_h200.sh 25 "$OUT"  # the 8B's gated product alone under every
#                                             # column tile (its default gives 448 programs of
#                                             # 64 steps; the down product's 256 reach 2.96
#                                             # TB/s), and the 1B decode traced at 128 and 4k
#                                             # context (where the 4k's extra 140 us a token go)
#   bash benchmarks/rowinv_h200.sh 26 "$OUT"  # the RoPE-store inside the attention kernel
#                                             # (DenseModel.fuse_rope_store): its GPU tests (bits
#                                             # against the two launches; the norm kernel's),
#                                             # the 1B exact part under it, decode end to end
#                                             # without and with it (1B, 0.6B)
#   bash benchmarks/rowinv_h200.sh 28 "$OUT"  # the new defaults (RoPE-store in the attention,
#                                             # the 8B's wider gated tile): the gated kernel's
#                                             # GPU tests, 8B decode end to end and its exact
#                                             # part, the 1B profile at 128 and 4k context
#   bash benchmarks/rowinv_h200.sh 29 "$OUT"  # the attention kernels' and Mosaic kernel's GPU
#                                             # tests in full, and XLA mode's bitwise checks
#                                             # (benchmarks.run --part exact)
#   bash benchmarks/rowinv_h200.sh 30 "$OUT"  # the attention's keys per split (256, 128,
#                                             # 512): the 1B exact part, decode end to end
#                                             # (1B, 0.6B)
#   bash benchmarks/rowinv_h200.sh 31 "$OUT"  # the defaults' figures in one call: decode
#                                             # end to end (1B, 0.6B, 8B), their traced
#                                             # profiles, the 1B's and 0.6B's prefill
#                                             # against sdpa
#   bash benchmarks/rowinv_h200.sh 32 "$OUT"  # the probes of work moved into a kernel's
#                                             # last program (a norm after a product, the
#                                             # attention's fold): bits and time
#   bash benchmarks/rowinv_h200.sh 33 "$OUT"  # the model's fold in the last split program
#                                             # (fold_in_split): GPU tests, the 1B exact
#                                             # part, decode without and with it
#   bash benchmarks/rowinv_h200.sh 37 "$OUT"  # programmatic dependent launch inside the
#                                             # decode kernels (kernels/pdl.py): GPU
#                                             # tests, where the compiled kernels wait
#                                             # (PTX), decode under each mode
#   bash benchmarks/rowinv_h200.sh 38 "$OUT"  # the 1B exact part under PDL, the fold's
#                                             # loads at once (8, 16) at 4k, the gated
#                                             # kernel's old column tile
#   bash benchmarks/rowinv_h200.sh 40 "$OUT"  # a decode call's cost beyond its steps
#                                             # and its host phases (1B, 8B)
#   bash benchmarks/rowinv_h200.sh 41 "$OUT"  # chained decode bursts and PDL on: GPU
#                                             # tests, a call's cost chained and not,
#                                             # decode (1B, 0.6B, 8B)
#   bash benchmarks/rowinv_h200.sh 42 "$OUT"  # the defaults' decode end to end (1B, 0.6B,
#                                             # 8B), short
#   bash benchmarks/rowinv_h200.sh 43 "$OUT"  # chained speculative calls: GPU tests, the
#                                             # 1B oracle figures
#   bash benchmarks/rowinv_h200.sh 44 "$OUT"  # stage 43 under session 47's default (loop
#                                             # graphs in decode programs only), with time
#                                             # for the tests; test_rowinv_gpu_graph
#   bash benchmarks/rowinv_h200.sh 45 "$OUT"  # the 8B's decode under 128, 256 (default) and
#                                             # 512 keys a split: its 4k context sat 0.1-0.8
#                                             # points under 90% of its roofline (H100)
#   bash benchmarks/rowinv_h200.sh 46 "$OUT"  # the sampled draw's candidate search in
#                                             # blocks of 1,024 (default), 4,096 and 256 ids
#                                             # (three sort kernels, 22.6 us a 1B token)
#   bash benchmarks/rowinv_h200.sh 47 "$OUT"  # the embedded pair's speculative figures (draft
#                                             # model, n-gram) under the new default and with
#                                             # loop graphs in every program (speed only)
#   bash benchmarks/rowinv_h200.sh 48 "$OUT"  # the speculative figures under session 48's
#                                             # default (rounds calls of up to 256 tokens, no
#                                             # loop graphs outside decode programs): GPU
#                                             # tests, the 1B oracle, the embedded pair, a
#                                             # burst of rounds traced, the drafters table
#   bash benchmarks/rowinv_h200.sh 49 "$OUT"  # the Gemma 4 assistant's oracle figures with
#                                             # its greedy rounds as a loop of known trip
#                                             # count (the README's were taken with loop
#                                             # graphs in every program), and the drafters
#                                             # with rounds.BOUNDED_SAMPLING on
#   bash benchmarks/rowinv_h200.sh 50 "$OUT"  # session 48's CPU-only changes on the GPU:
#                                             # every drafter's greedy bursts in the fixed
#                                             # form, the MTP head and block drafter caught
#                                             # up first (their GPU tests, the drafters
#                                             # table, the probe without recorded rows)
#   bash benchmarks/rowinv_h200.sh 51 "$OUT"  # the fixed form's programs with while loops
#                                             # in command buffers
#                                             # (TURBOSPARK_FIXED_ROUNDS_GRAPHS=1): the
#                                             # drafters table, their GPU tests, the copies
#                                             # test's failure under the default
#   bash benchmarks/rowinv_h200.sh 52 "$OUT"  # session 49's default (greedy fixed rounds
#                                             # with while loops recorded): the drafters
#                                             # table and the embedded model's
#                                             # speculative.json, the speculative GPU tests
#   bash benchmarks/rowinv_h200.sh 53 "$OUT"  # the drafters table under session 49's last
#                                             # defaults (sampled n-gram rounds fixed, a
#                                             # drafter's loops bounded only in a fixed
#                                             # burst), and the model's speculative.json
#   bash benchmarks/rowinv_h200.sh 54 "$OUT"  # which construct recorded while loops get
#                                             # wrong (sorts, top-k, draws, the sampled
#                                             # rounds' shaping under conditionals)
#   bash benchmarks/rowinv_h200.sh 5 "$OUT"   # 1B decode with the while loop in XLA's command
#                                             # buffers (no host sync a step), and its profile
#                                             # with the command buffers kept while tracing
# Each writes its JSON and a log under $OUT; copy them into benchmarks/results.
set -uo pipefail
stage=${1:?stage 1 to 54}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2
# Compiled programs persist between stages (the machine keeps ignored folders from call to
# call while it stays warm): a later stage's program of an earlier stage's shape loads in
# seconds instead of compiling again.
export JAX_COMPILATION_CACHE_DIR="$PWD/.jax_cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
# Decode end to end through run_raw_completion (1B and 0.6B, row-invariant kernels): $1 the
# time limit, s; $2 the output's name; the rest, rowinv_model's extra options.
decode_speed() {
  local limit=$1 name=$2
  shift 2
  timeout "$limit" python -m benchmarks.rowinv_model --parts speed \
    --shapes llama-3.2-1b,qwen3-0.6b --modes rowinv --workloads completion "$@" \
    --out "$out/$name" --budget-s $((limit - 10)) 2>&1 | cut -c1-300 | grep speed | tail -8
}
# The short-context decode program (the default) against one program for every context,
# then the 1B exact part (its short burst runs that program); $1 and $2: the speed runs' and
# the exact part's time limits, s.
short_decode_against_one_program() {
  for keys in 0 512; do
    decode_speed "$1" "speed_short_$keys" --short-decode-keys $keys
  done
  timeout "$2" python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.2-1b \
    --out "$out/exact_short" --budget-s $(($2 - 10)) 2>&1 | tail -3
}
# The three shapes' prefill (exact and parallel) and transformers' sdpa in one stretch, then
# the 1B's traced prefill; $1 and $2: the speed part's and the profile's time limits, s.
prefill_against_sdpa() {
  timeout "$1" python -m benchmarks.rowinv_model --parts speed --modes rowinv \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --workloads prefill --out "$out/prefill" \
    --budget-s $(($1 - 10)) 2>&1 | cut -c1-260 | grep speed | tail -15
  timeout 110 python -m benchmarks.run --preset h200 --part hf --contexts "" --no-hf-compile \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/hf" 2>&1 | tail -6
  timeout "$2" python -m benchmarks.rowinv_model --parts prefill-profile --shapes llama-3.2-1b \
    --out "$out/prefill_profile" --budget-s $(($2 - 10)) 2>&1 | cut -c1-400 | tail -3
}
case "$stage" in
1)
  # -v: each test's name and outcome is on its line as it finishes, so a run the timeout cuts
  # short still says which failed (on a fresh machine compiling them takes about 150 s)
  timeout 200 env JAX_PLATFORMS=cuda python -m pytest -v -o addopts="" -p no:cacheprovider \
    tests/test_rowinv.py tests/test_pallas_row_norm.py tests/test_pallas_attention.py \
    tests/test_pallas_rope_store.py --tb=short -rf > "$out/gpu_tests.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests.txt" | tail -20
  timeout 150 python -m benchmarks.rowinv_model --parts exact \
    --exact-shapes llama-3.2-1b,odd-1.3b --out "$out/exact" --budget-s 135 2>&1 | tail -30
  timeout 170 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.2-1b \
    --modes rowinv --workloads completion,prefill --out "$out/speed" --budget-s 155 \
    2>&1 | tail -30
  timeout 110 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --shapes llama-3.2-1b --modes rowinv --out "$out/profile" --budget-s 95 2>&1 | tail -8
  ;;
2)
  timeout 200 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.2-1b \
    --modes xla --out "$out/speed_xla" --budget-s 180 2>&1 | tail -20
  timeout 180 python -m benchmarks.rowinv_model --parts products --shapes llama-3.2-1b \
    --out "$out/products" --budget-s 160 2>&1 | tail -5
  timeout 200 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --shapes llama-3.2-1b --out "$out/profile" --budget-s 180 2>&1 | tail -10
  ;;
6)
  timeout 290 python -m benchmarks.rowinv_model --parts speed,exact --shapes qwen3-0.6b \
    --exact-shapes qwen3-0.6b --out "$out/speed06" --budget-s 270 2>&1 | tail -30
  ;;
3)
  timeout 300 python -m benchmarks.rowinv_model --parts speed \
    --shapes llama-3.1-8b --out "$out/speed8b" --budget-s 280 2>&1 | tail -20
  timeout 250 python -m benchmarks.rowinv_model --parts exact \
    --exact-shapes llama-3.1-8b --out "$out/exact8b" --budget-s 230 2>&1 | tail -10
  ;;
4)
  timeout 560 python -m benchmarks.run --preset h200 --part hf --out "$out" 2>&1 | tail -20
  ;;
5)
  # The loop's condition is the one host sync a decode step has left (a row-invariant decode
  # program has no lax.cond): recorded as a CUDA graph conditional node instead.
  timeout 280 env XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    python -m benchmarks.rowinv_model --parts speed --shapes llama-3.2-1b --modes rowinv \
    --workloads decode,completion --out "$out/speed_graphs" --budget-s 260 2>&1 | tail -12
  # (on JAX 0.11.2 such a trace holds one step's kernels for a burst: the part refuses it)
  timeout 250 env XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true" \
    python -m benchmarks.rowinv_model --parts profile --shapes llama-3.2-1b --modes rowinv \
    --out "$out/profile_graphs" --budget-s 230 2>&1 | tail -8
  ;;
7)
  timeout 100 python -m benchmarks.run --preset h200 --part hf --contexts "" --no-hf-compile \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/hf" 2>&1 | tail -8
  timeout 220 python -m benchmarks.rowinv_model --parts speed,exact --shapes qwen3-0.6b \
    --exact-shapes qwen3-0.6b --modes rowinv --workloads completion,prefill \
    --out "$out/speed06" --budget-s 205 2>&1 | tail -12
  timeout 190 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
    --modes rowinv --workloads completion,prefill --out "$out/speed8b" --budget-s 175 \
    2>&1 | tail -12
  ;;
8)
  timeout 100 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --shapes llama-3.2-1b --modes rowinv --profile-capacity 8256 --out "$out/profile_8k" --budget-s 85 2>&1 | tail -4
  timeout 120 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts speed \
    --shapes llama-3.2-1b --modes rowinv --workloads decode,completion \
    --out "$out/speed_no_graphs" --budget-s 105 2>&1 | tail -10
  # the default: a row-invariant decode program compiles its loops as graphs (device_flags)
  timeout 120 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.2-1b \
    --modes rowinv --workloads decode,completion --out "$out/speed" --budget-s 105 \
    2>&1 | tail -10
  ;;
9)
  timeout 290 python -m benchmarks.rowinv_model --parts attention \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/attention" --budget-s 270 \
    2>&1 | tail -40
  # the exact prefill in blocks of 8,192 rows (its products on all of an 8k prompt at once)
  timeout 250 python -m benchmarks.rowinv_model --parts speed --modes rowinv \
    --workloads prefill --prefill-width 8192 --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b \
    --out "$out/prefill_8192" --budget-s 230 2>&1 | tail -16
  ;;
10)
  timeout 100 env JAX_PLATFORMS=cuda python -m pytest -v -o addopts="" -p no:cacheprovider \
    tests/test_pallas_attention.py -k "tiles" --tb=short -rf > "$out/gpu_tests_tiles.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_tiles.txt" | tail -5
  timeout 110 python -m benchmarks.rowinv_model --parts attention \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/attention" --budget-s 100 \
    2>&1 | tail -3
  timeout 150 python -m benchmarks.rowinv_model --parts speed --modes rowinv \
    --workloads prefill --shapes qwen3-0.6b,llama-3.1-8b,llama-3.2-1b \
    --out "$out/prefill" --budget-s 140 2>&1 | tail -16
  timeout 170 python -m benchmarks.rowinv_model --parts exact \
    --exact-shapes qwen3-0.6b,llama-3.1-8b --out "$out/exact" --budget-s 160 2>&1 | tail -5
  ;;
11)
  timeout 140 python -m benchmarks.rowinv_model --parts attention --attention-cases decode \
    --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/attention_decode" \
    --budget-s 130 2>&1 | tail -45
  ;;
12)
  timeout 290 python -m benchmarks.rowinv_model --parts prefill-profile \
    --shapes ${SHAPES:-llama-3.2-1b,llama-3.1-8b,qwen3-0.6b} --out "$out/prefill_profile" \
    --budget-s 270 2>&1 | cut -c1-900 | tail -14
  ;;
13)
  timeout 150 python -m benchmarks.rowinv_model --parts exact --key-tile 128 \
    --exact-shapes llama-3.2-1b,qwen3-0.6b --out "$out/exact_kt128" --budget-s 140 \
    2>&1 | cut -c1-400 | tail -4
  for kt in 64 128; do
    timeout 130 python -m benchmarks.rowinv_model --parts speed --key-tile $kt \
      --shapes llama-3.2-1b,qwen3-0.6b --modes rowinv --workloads completion,prefill \
      --out "$out/speed_kt$kt" --budget-s 120 2>&1 | cut -c1-260 | grep speed | tail -16
  done
  timeout 90 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts speed \
    --shapes llama-3.2-1b --modes rowinv --workloads prefill --out "$out/prefill_no_graphs" \
    --budget-s 80 2>&1 | cut -c1-260 | grep speed | tail -5
  ;;
14)
  for s in llama-3.2-1b qwen3-0.6b; do
    timeout 80 python -m benchmarks.probe_prefill_calls --shape $s \
      --out "$out/prefill_calls_$s.json" 2>&1 | tail -3
  done
  prefill_against_sdpa 150 60
  ;;
15)
  timeout 60 python -m benchmarks.probe_call_sync --shape tiny --steps 64 --dump /tmp/dump_tiny \
    --out "$out/call_sync_tiny.json" 2>&1 | tail -8
  timeout 150 python -m benchmarks.probe_call_sync --shape llama-3.2-1b --steps 128 \
    --dump /tmp/dump_1b --out "$out/call_sync_1b.json" 2>&1 | tail -8
  timeout 120 python -m benchmarks.probe_prefill_calls --shape llama-3.2-1b \
    --out "$out/prefill_calls_1b.json" 2>&1 | tail -3
  ;;
16)
  timeout 300 python -m benchmarks.probe_mosaic_matmul --out "$out/mosaic_matmul.json" \
    2>&1 | cut -c1-700 | tail -6
  ;;
17)
  timeout 230 env JAX_PLATFORMS=cuda python -m pytest -v -o addopts="" -p no:cacheprovider \
    tests/test_mosaic_matmul.py tests/test_rowinv.py --tb=short -rf > "$out/gpu_tests_mosaic.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_mosaic.txt" | tail -12
  timeout 300 python -m benchmarks.rowinv_model --parts exact \
    --exact-shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --out "$out/exact" --budget-s 290 \
    2>&1 | tail -12
  ;;
18)
  prefill_against_sdpa 200 70
  ;;
19)
  timeout 100 python -m benchmarks.probe_mosaic_elementwise --out "$out/mosaic_elementwise.json" \
    2>&1 | cut -c1-300 | grep op
  timeout 200 python -m benchmarks.probe_mosaic_attention --out "$out/mosaic_attention.json" \
    2>&1 | cut -c1-600 | tail -4
  timeout 200 python -m benchmarks.probe_mosaic_attention --pv-after \
    --out "$out/mosaic_attention_pv_after.json" 2>&1 | cut -c1-600 | tail -4
  ;;
20)
  timeout 200 env JAX_PLATFORMS=cuda python -m pytest -v -o addopts="" -p no:cacheprovider \
    tests/test_mosaic_matmul.py tests/test_rowinv.py --tb=short -rf > "$out/gpu_tests_mosaic.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_mosaic.txt" | tail -12
  timeout 330 python -m benchmarks.probe_mosaic_decode --shapes 1B --out "$out/mosaic_decode.json" \
    2>&1 | cut -c1-900 | grep -v "^1B" | tail -12
  ;;
21)
  short_decode_against_one_program 180 150
  ;;
22)
  timeout 400 python -m benchmarks.rowinv_model --parts products \
    --shapes qwen3-0.6b,llama-3.2-1b --out "$out/products" --budget-s 380 2>&1 | tail -5
  ;;
23)
  for pdl in false true; do
    XLA_FLAGS="--xla_gpu_enable_pdl=$pdl" decode_speed 170 "speed_pdl_$pdl"
  done
  timeout 120 env XLA_FLAGS="--xla_gpu_enable_pdl=true" python -m benchmarks.rowinv_model \
    --parts exact --exact-shapes llama-3.2-1b --out "$out/exact_pdl" --budget-s 110 2>&1 | tail -3
  ;;
24)
  # under the ten minutes of one call: the tests, then stage 21's runs with shorter limits
  timeout 160 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_attention.py tests/test_mosaic_matmul.py --tb=short -rf \
    > "$out/gpu_tests_short.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_short.txt" | tail -12
  short_decode_against_one_program 160 130
  ;;
25)
  timeout 300 python -m benchmarks.rowinv_model --parts products --shapes llama-3.1-8b \
    --products gate_up --out "$out/products_8b_gated" --budget-s 290 2>&1 | tail -3
  timeout 240 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --modes rowinv --shapes llama-3.2-1b --profile-contexts 128,4096 --out "$out/profile_1b_4k" \
    --budget-s 230 2>&1 | cut -c1-400 | tail -3
  ;;
26)
  timeout 100 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_rope_store.py tests/test_pallas_row_norm.py \
    --tb=short -rf > "$out/gpu_tests_rope_attention.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_rope_attention.txt" | tail -12
  timeout 120 python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.2-1b \
    --fuse-rope --out "$out/exact_fused_rope" \
    --budget-s 110 2>&1 | tail -3
  decode_speed 160 speed_rope
  decode_speed 160 speed_rope_fused --fuse-rope
  ;;
28)
  # the defaults of session 41: the RoPE-store inside the attention, the 8B's gated product
  # at 64 columns a program; a traced profile records each step's kernels only without the
  # loop graphs (with them, JAX 0.11.2's trace holds one step's kernels for a whole burst)
  timeout 100 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_rowinv.py -k gated --tb=short -rf > "$out/gpu_tests_gated.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_gated.txt" | tail -6
  timeout 140 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
    --modes rowinv --workloads completion --out "$out/speed8b" --budget-s 130 2>&1 \
    | cut -c1-300 | grep speed | tail -4
  timeout 150 python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.1-8b \
    --out "$out/exact8b" --budget-s 140 2>&1 | cut -c1-400 | tail -3
  timeout 150 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --modes rowinv --shapes llama-3.2-1b --profile-contexts 128,4096 \
    --out "$out/profile_1b_4k" --budget-s 140 2>&1 | cut -c1-300 | tail -3
  ;;
29)
  # the attention without the unmasked loop outside the row-invariant form (session 41's
  # stage 24 ran out of its 100 s with that case failed and the Mosaic tests unfinished),
  # then XLA mode's own guarantees on the GPU (chunked == token by token, speculative ==
  # plain, at its one width)
  timeout 200 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_attention.py tests/test_mosaic_matmul.py --tb=short -rf \
    > "$out/gpu_tests_attention.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_attention.txt" | tail -12
  timeout 300 python -m benchmarks.run --preset h200 --part exact --out "$out/exact_xla" 2>&1 \
    | tail -8
  ;;
30)
  # the keys per split at a long context: the split kernel's programs (8 KV heads times the
  # splits) against the fold's walk; each setting's 1B exact part first (it moves the
  # partials' fold order on every path at once), then decode (1B, 0.6B) against the default
  # in the same call (at 128 keys a split the short program's 512 keys are four splits, past
  # ON_CHIP_SPLITS: it runs the split and fold kernels too)
  for keys in 256 128 512; do
    timeout 60 python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.2-1b \
      --keys-per-split $keys --out "$out/exact_kps_$keys" --budget-s 50 2>&1 \
      | grep -o '"all_equal": [a-z]*' | head -2
    decode_speed 110 "speed_kps_$keys" --keys-per-split $keys
  done
  ;;
31)
  # the defaults' figures against the issue's bars (session 43 on an H200): decode end to
  # end, each shape traced at 128 and 4k (loop graphs off, as every profile; read them with
  # python -m benchmarks.decode_bound), the exact and parallel prefill against sdpa
  decode_speed 120 speed
  timeout 170 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
    --modes rowinv --workloads completion --out "$out/speed8b" --budget-s 160 2>&1 \
    | cut -c1-300 | grep speed | tail -4
  timeout 230 env TURBOSPARK_LOOP_GRAPHS=0 python -m benchmarks.rowinv_model --parts profile \
    --modes rowinv --shapes llama-3.2-1b,qwen3-0.6b,llama-3.1-8b --profile-contexts 128,4096 \
    --out "$out/profile" --budget-s 215 2>&1 | cut -c1-300 | tail -3
  for shape in llama-3.2-1b qwen3-0.6b; do
    timeout 95 python -m benchmarks.rowinv_model --parts speed --modes rowinv --shapes $shape \
      --workloads prefill --out "$out/prefill_$shape" --budget-s 85 2>&1 | cut -c1-260 \
      | grep speed | tail -5
    timeout 95 python -m benchmarks.run --preset h200 --part hf --contexts "" --no-hf-compile \
      --shapes $shape --out "$out/hf_$shape" 2>&1 | tail -2
  done
  ;;
32)
  # a decode step's norm in the last program of the product before it (a counter bumped
  # atomically as each program ends): its bits against the two launches over dependent
  # steps, and each form's time a step, for the products before the 1B's, 0.6B's and 8B's
  # norms (benchmarks/probe_last_program.py)
  timeout 300 python -m benchmarks.probe_last_program --out "$out/probe_last_program.json" \
    2>&1 | cut -c1-400 | tail -8
  # and a long context's attention folding its key splits in each tile's last split program
  # instead of the fold kernel (benchmarks/probe_last_split.py), against the two launches
  timeout 250 python -m benchmarks.probe_last_split --out "$out/probe_last_split.json" \
    2>&1 | cut -c1-400 | tail -8
  ;;
33)
  # the fold in the last split program (DenseModel.fold_in_split, the default since
  # session 45) compiled (the RoPE-store kernels' tests), the 1B exact part under it, then
  # decode (1B, 0.6B) with the fold kernel and with it
  timeout 220 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_rope_store.py tests/test_probe_last_split.py --tb=short -rf \
    > "$out/gpu_tests_fold_in_split.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_fold_in_split.txt" | tail -8
  timeout 130 python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.2-1b \
    --fold-in-split --out "$out/exact_fold_in_split" --budget-s 120 2>&1 | cut -c1-400 \
    | tail -2
  decode_speed 110 speed_fold_kernel --no-fold-in-split
  decode_speed 110 speed_fold_in_split --fold-in-split
  ;;
37)
  # programmatic dependent launch from inside the decode kernels (kernels/pdl.py):
  # their GPU tests (each mode bitwise the kernels without it), where XLA and we put
  # griddepcontrol in the compiled kernels (benchmarks/probe_pdl_ptx.py reads their PTX),
  # decode (1B, 0.6B) under each mode back to back (the exact part under PDL: stage 38)
  timeout 150 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_pdl.py --tb=short -rf > "$out/gpu_tests_pdl.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_pdl.txt" | tail -6
  timeout 100 python -m benchmarks.probe_pdl_ptx --out "$out/probe_pdl_ptx.json" 2>&1 \
    | cut -c1-700 | tail -3
  for mode in off trigger; do
    decode_speed 100 "speed_pdl_$mode" --pdl $mode
  done
  ;;
38)
  # after stage 37: the 1B exact part under PDL's trigger mode (or the mode in PDL), then
  # the fold's loads at once (the last split program's fold at 4k walks 16 splits' partials
  # four at a time) at 8 and 16
  timeout 130 python -m benchmarks.rowinv_model --parts exact --exact-shapes llama-3.2-1b \
    --pdl "${PDL:-trigger}" --out "$out/exact_pdl" --budget-s 120 2>&1 | cut -c1-400 \
    | tail -2
  for loads in 8 16; do
    decode_speed 100 "speed_fold_loads_$loads" --fold-loads $loads
  done
  # the gated kernel's column tile as it was until session 45 (192 programs: 16 columns on
  # the 0.6B, 32 on the 1B) against the default (96: 32 and 64), decode end to end
  decode_speed 100 speed_gated_programs_192 --gated-programs 192
  ;;
40)
  # what a decode call costs beyond its steps, and where its host time goes (the state's
  # checks, the program's dispatch, the wait for the burst), 1B and 8B row-invariant:
  # the end-to-end figures pay it once a call (benchmarks/call_overhead.py)
  for shape in llama-3.2-1b llama-3.1-8b; do
    timeout 140 python -m benchmarks.call_overhead --shape $shape \
      --out "$out/call_overhead_$shape.json" 2>&1 | cut -c1-600 | tail -1
  done
  ;;
41)
  # chained decode bursts (the generation loop queues each burst on the device before it
  # reads the one before) with PDL's trigger mode (the default since session 46): the
  # chain's tests on the GPU, a call's cost chained against one by one (1B, 8B), decode end
  # to end (1B, 0.6B), the 8B's
  timeout 60 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_chained_bursts.py tests/test_chained_rounds.py --tb=short -rf \
    > "$out/gpu_tests_chained.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_chained.txt" | tail -6
  timeout 100 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_pallas_pdl.py --tb=short -rf > "$out/gpu_tests_pdl_default.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_pdl_default.txt" | tail -6
  timeout 60 python -m benchmarks.call_overhead --shape llama-3.2-1b \
    --out "$out/call_overhead_chained_llama-3.2-1b.json" 2>&1 | cut -c1-400 | tail -1
  timeout 90 python -m benchmarks.call_overhead --shape llama-3.1-8b \
    --out "$out/call_overhead_chained_llama-3.1-8b.json" 2>&1 | cut -c1-400 | tail -1
  decode_speed 110 speed_chained
  timeout 150 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
    --modes rowinv --workloads completion --out "$out/speed8b_chained" --budget-s 140 2>&1 \
    | cut -c1-300 | grep speed | tail -4
  ;;
42)
  # the defaults' decode figures end to end in one stretch (1B, 0.6B, then 8B): the short
  # form of stage 31's speed part, for a call with little device time left
  decode_speed 100 speed
  timeout 150 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
    --modes rowinv --workloads completion --out "$out/speed8b" --budget-s 140 2>&1 \
    | cut -c1-300 | grep speed | tail -4
  ;;
43)
  # the speculative loop's chained device calls (session 46, untimed so far): their GPU
  # tests, then the 1B oracle figures against the README's (4.67x, 84% of ideal at alpha 0.9
  # and draft length 8 before the chain; the plain baseline there is chained now too)
  timeout 100 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    tests/test_chained_rounds.py tests/test_speculative.py --tb=short -rf \
    > "$out/gpu_tests_chained_rounds.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/gpu_tests_chained_rounds.txt" | tail -6
  timeout 400 python -m benchmarks.speculative --part oracle --shapes llama-3.2-1b \
    --out "$out/speculative" 2>&1 | tail -12
  ;;
44)
  # the speculative rounds without loop graphs (session 47: WHILE command buffers only in a
  # row-invariant model's decode programs): their GPU tests with room to compile (86 s on an
  # H100), a stuck test's stack printed after 60 s, the GPU-graph test at full float32
  # precision, then the 1B oracle figures against stage 43's (taken with the graphs
  # everywhere)
  timeout 200 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_chained_rounds.py tests/test_speculative.py \
    "tests/test_rowinv_gpu_graph.py::test_gpu_form_matches_xla_and_its_widths_agree" \
    --tb=short -rf > "$out/gpu_tests_speculative.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_speculative.txt" | tail -8
  timeout 200 python -m benchmarks.speculative --part oracle --shapes llama-3.2-1b \
    --out "$out/speculative" 2>&1 | tail -12
  # what the change costs the rounds: the same figures with the graphs in every program (the
  # old default; its own tests above showed it unsafe, so speed only)
  timeout 200 env TURBOSPARK_LOOP_GRAPHS=1 python -m benchmarks.speculative --part oracle \
    --shapes llama-3.2-1b --out "$out/speculative_graphs_everywhere" 2>&1 | tail -12
  ;;
45)
  # the 8B's attention at 4k: 16 splits of 256 keys a KV head (128 programs), each folded in
  # its tile's last split program; session 43 chose 256 on the 1B and 0.6B only. Decode end
  # to end at each setting, back to back (a setting other than 256 changes every path's
  # attention bits alike: its exact part before it could become the default)
  for keys in 256 128 512; do
    timeout 120 python -m benchmarks.rowinv_model --parts speed --shapes llama-3.1-8b \
      --modes rowinv --workloads completion --keys-per-split $keys \
      --out "$out/speed8b_kps_$keys" --budget-s 110 2>&1 | cut -c1-300 | grep speed | tail -4
  done
  ;;
46)
  # the sampled decode's extra 40 us a token on the 1B (H200, session 43's trace) is mostly
  # the blocked top-64's three sort kernels (rows of 1,024 ids: 126, then 8, then one row);
  # blocks of 4,096 take two levels of longer rows, blocks of 256 more levels of shorter
  # ones. Decode end to end at each (greedy is the control: it draws no candidates)
  for block in 1024 4096 256; do
    decode_speed 100 "speed_top_block_$block" --top-block $block
  done
  ;;
47)
  # what session 47's default (no loop graphs but in row-invariant decode programs) costs the
  # embedded model's drafters, whose rounds loop over draft steps inside the rounds' loop: the
  # README's figures (H200, 2026-12-03) were 0.89-0.90x without the graphs and 1.09-1.12x
  # with them for the first-generation pair's draft model
  # (an empty switch is the default)
  for graphs in "" 1; do
    timeout 280 env TURBOSPARK_LOOP_GRAPHS=$graphs python -m benchmarks.speculative \
      --part embedded --tokens 128 --draft-lens 4,8 --ngram 3 \
      --out "$out/embedded_graphs_${graphs:-default}" 2>&1 | tail -8
  done
  ;;
48)
  # session 48: with no loop graphs a call of rounds whose loop stops on data holds the host
  # until it ends, so each call's host work is paid in full: calls of up to 256 tokens
  # (rounds.MAX_BURST, 64 before), and greedy rounds of loop-free drafters as a loop of
  # known trip count (rounds.FIXED_ROUNDS), which returns at once
  timeout 170 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_fixed_rounds.py tests/test_chained_rounds.py \
    tests/test_speculative.py --tb=short -rf > "$out/gpu_tests_speculative.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_speculative.txt" | tail -8
  # the greedy oracle's rounds as a loop of known trip count against the while_loop: how
  # long a launch holds the host, with the target rows recorded and without
  timeout 170 python -m benchmarks.probe_fixed_rounds --record-logits 0,1 --out "$out" \
    2>&1 | grep shape | cut -c1-330
  timeout 200 python -m benchmarks.speculative --part oracle --shapes llama-3.2-1b \
    --out "$out/speculative" 2>&1 | grep '"alpha": 0.9' | cut -c1-300
  timeout 150 python -m benchmarks.speculative --part embedded --tokens 128 --draft-lens 4 \
    --ngram 3 --out "$out/embedded" 2>&1 | tail -3
  timeout 100 python -m benchmarks.profile_rounds --shape llama-3.2-1b --draft-len 8 \
    --out "$out/profile" 2>&1 | head -1 | cut -c1-400
  timeout 200 python -m benchmarks.drafters --preset h200-short --max-seconds 180 \
    --out "$out/drafters" 2>&1 | tail -24
  ;;
49)
  # the costed oracle over the assistant: its bursts are greedy and unrecorded, so since
  # session 48 they run as a loop of known trip count (the assistant's draft loop bounded)
  timeout 300 python -m benchmarks.assistant_oracle --out "$out/assistant" 2>&1 | tail -14
  # rounds.BOUNDED_SAMPLING: the sampled judge's and draft loops as loops of known trip
  # count, so sampled bursts run fixed; against stage 48's drafters table (sampled rows)
  timeout 200 python -m benchmarks.drafters --preset h200-short --max-seconds 150 \
    --drafters ngram,draft-model,mtp --bounded-sampling --out "$out/drafters_bounded" \
    2>&1 | tail -14
  ;;
50)
  # session 48 built these on the CPU only: draft models', the assistant's and the MTP
  # head's greedy draft loops bounded (loops.bounded_while), the MTP head and the block
  # drafter caught up before a chain's first call (DeviceDrafter.catch_up), so every greedy
  # unrecorded burst runs as a loop of known trip count. Their GPU tests, then the drafters
  # table against drafters_h100_fixed_rounds_s48 (a model drafter slower than there goes
  # back to the while_loop), then the probe's recorded-rows question
  timeout 250 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    -o faulthandler_timeout=90 tests/test_loops.py tests/test_fixed_rounds.py \
    tests/test_mtp_drafter.py tests/test_block_drafter.py tests/test_gemma4_assistant.py \
    tests/test_chained_rounds.py tests/test_speculative.py --tb=short -rf \
    > "$out/gpu_tests_fixed_drafters.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_fixed_drafters.txt" | tail -8
  timeout 200 python -m benchmarks.drafters --preset h200-short --max-seconds 180 \
    --out "$out/drafters" 2>&1 | tail -24
  timeout 110 python -m benchmarks.probe_fixed_rounds --record-logits 0,1 --out "$out" \
    2>&1 | grep shape | cut -c1-330
  ;;
51)
  # stage 50: the MTP head's greedy rounds ran at 0.56-0.64x of plain in the fixed form
  # (1.00-1.13x in session 48's while_loop form), the draft model's at 0.88x at length 2.
  # Their rounds hold loops (the chain, the draft loop) inside each round's conditional,
  # which XLA's default command buffers cannot record, so each conditional reads its
  # predicate back to the host. With while loops recorded too (every loop of the fixed
  # form has a known trip count, the case the decode programs already run):
  timeout 200 env TURBOSPARK_FIXED_ROUNDS_GRAPHS=1 python -m benchmarks.drafters \
    --preset h200-short --max-seconds 160 --drafters mtp,draft-model,ngram,block \
    --out "$out/drafters_fixed_graphs" 2>&1 | tail -22
  timeout 220 env JAX_PLATFORMS=cuda TURBOSPARK_FIXED_ROUNDS_GRAPHS=1 python -m pytest -q \
    -o addopts="" -p no:cacheprovider -o faulthandler_timeout=60 tests/test_loops.py \
    tests/test_fixed_rounds.py tests/test_mtp_drafter.py tests/test_block_drafter.py \
    --tb=short -rf > "$out/gpu_tests_fixed_graphs.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_fixed_graphs.txt" | tail -8
  timeout 90 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    "tests/test_fixed_rounds.py::test_the_fixed_form_copies_no_cache_of_a_dense_model" \
    --tb=long > "$out/gpu_test_fixed_copies.txt" 2>&1
  grep -E "assert|Error|passed|failed" "$out/gpu_test_fixed_copies.txt" | tail -8
  ;;
52)
  # session 49's default: greedy bursts in the fixed form compile with while loops in
  # command buffers (device_flags.fixed_rounds_options). The table for the README and the
  # model's speculative.json, then the speculative GPU tests stage 50 ran out of time for
  timeout 220 python -m benchmarks.drafters --preset h200-short --max-seconds 190 \
    --write-speculative-json --out "$out/drafters" 2>&1 | tail -24
  cp models/tsj-pycoder/speculative.json "$out/drafters/speculative.json"
  timeout 260 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_chained_rounds.py tests/test_speculative.py \
    tests/test_gemma4_assistant.py tests/test_fixed_rounds.py --tb=short -rf \
    > "$out/gpu_tests_speculative.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_speculative.txt" | tail -8
  ;;
53)
  # session 49's last defaults: sampled n-gram rounds in the fixed form (the judge's rows
  # side by side), and a drafter's loops bounded only when its burst is (the MTP head's
  # sampled rows fell to 0.71-0.77x with its chain bounded inside while_loop bursts)
  timeout 300 python -m benchmarks.drafters --preset h200-short --max-seconds 250 \
    --write-speculative-json --out "$out/drafters" 2>&1 | tail -24
  cp models/tsj-pycoder/speculative.json models/tsj-pycoder/README.md "$out/drafters/"
  timeout 200 env JAX_PLATFORMS=cuda python -m pytest -q -o addopts="" -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_fixed_rounds.py tests/test_mtp_drafter.py \
    tests/test_loops.py --tb=short -rf > "$out/gpu_tests_fixed_rounds.txt" 2>&1
  grep -E "FAILED|ERROR|Timeout|passed|failed" "$out/gpu_tests_fixed_rounds.txt" | tail -8
  # BOUNDED_SAMPLING with the drafters' loops unrolled in sampled fixed bursts (session 49,
  # after its device time): against the table's sampled rows above
  timeout 150 python -m benchmarks.drafters --preset h200-short --max-seconds 120 \
    --drafters draft-model,mtp,block --bounded-sampling --out "$out/drafters_bounded" \
    2>&1 | grep sampled
  ;;
54)
  # the sampled fixed rounds gave wrong tokens with their while loops recorded (stage 51);
  # small programs of each construct they hold, with and without the recording
  timeout 200 python -m benchmarks.probe_loop_graphs --seeds 8 \
    --out "$out/probe_loop_graphs.json" 2>&1 | cut -c1-300
  ;;
*)
  echo "rowinv_h200.sh: no stage $stage (see the list at the top)" >&2
  exit 2
  ;;
esac
ls -R "$out" | head -30
