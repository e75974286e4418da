#!/usr/bin/env bash
# The embedded models' second generation on one H200 (issue 18): one background job that
# outlives the device calls (a call runs at most 10 minutes; the job about 23), so the target
# trains for most of a session without a restart between calls:
#   bash benchmarks/recipe_h200.sh start OUT [SECONDS]  # start the job, follow it SECONDS (240)
#   bash benchmarks/recipe_h200.sh wait OUT [SECONDS]   # follow it up to SECONDS more (560),
#                                                       # then copy what is ready into OUT
# Each call must come within the machine's 30 s of idle time, or the job is lost with it. The
# job runs from a copy of this script (a later call's working tree replaces this file, and bash
# reads a script as it goes).
# The job, in order (budgets in seconds, from the environment):
#   1. with PROBE=1, the train step of the target35 preset at 64 x 1024 tokens on rows skewed
#      like code, timed and traced (benchmarks.profile_train);
#   2. the recipe: corpus (standard library + permissive packages), the embedded tokenizer,
#      the draft model (DRAFT_STEPS; or, with DRAFT_FROM, that folder as it is), the target with
#      its MTP head for TARGET_S seconds (its schedule's length set from its own step time;
#      with TARGET_INIT, continued from that folder's weights at peak TARGET_LR, cosine to
#      MIN_LR_RATIO of it), the block drafter (BLOCK_STEPS);
#   3. the quality bar on the held-out functions (recipe evaluate), and whether tapping the
#      new target changes its plain greedy decoding here (benchmarks.tap_check);
#   4. every drafter's figures on this GPU, greedy and sampled, and speculative.json
#      (benchmarks.drafters --preset h200-short);
#   5. the three folders packed as tsj-pycoder, tsj-pycoder-draft, tsj-pycoder-block.
# The defaults continue the embedded target and keep the embedded draft (this session's run);
# TARGET_INIT= DRAFT_FROM= PROBE=1 train everything from scratch as the first run did.
# Then, here: python -m turbospark_recipe unpack OUT --to models/ (after moving the old
# folders away), and the JSON files from OUT/results.tar.gz into benchmarks/results.
# A CPU rehearsal of the whole job, on tiny shapes and a few files (a few minutes):
#   RUN=/tmp/rehearsal SMOKE=1 bash benchmarks/recipe_h200.sh job
set -uo pipefail
cmd=${1:?start, wait or job}
run=${RUN:-/root/recipe_run}
log=$run/log.txt
follow() {  # follow the log until the job is done or $1 seconds have passed
  local t0=$SECONDS
  while [ ! -f "$run/done" ] && [ $((SECONDS - t0)) -lt "$1" ]; do sleep 5; done
  echo "--- after $((SECONDS - t0)) s; done: $([ -f "$run/done" ] && echo yes || echo no)"
  grep -v -i -E "warn|^\s*$|it/s\]|step/s\]" "$log" | cut -c1-400 | tail -60
}
collect() {  # what is ready, within a call's 8 files
  local out=$1
  cp "$log" "$out/log.txt" 2>/dev/null
  local parts=$run/parts
  [ -f "$run/done" ] || parts=$run/parts_early
  cp "$parts"/models.* "$out/" 2>/dev/null
  tar czf "$out/results.tar.gz" -C "$run" --ignore-failed-read probe summary.json \
    code_eval_h200.json tap_check.txt drafters 2>/dev/null
  ls -la "$out"
}
case "$cmd" in
start)
  out=${2:?output folder}
  rm -rf "$run" && mkdir -p "$run"
  cp "$0" "$run/job.sh"
  RUN=$run setsid nohup bash "$run/job.sh" job > "$log" 2>&1 < /dev/null &
  follow "${3:-240}"
  collect "$out"
  ;;
wait)
  out=${2:?output folder}
  follow "${3:-560}"
  collect "$out"
  ;;
job)
  export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
  mkdir -p "$run"
  target_init=${TARGET_INIT-models/tsj-pycoder} draft_from=${DRAFT_FROM-models/tsj-pycoder-draft}
  if [ -n "${SMOKE:-}" ]; then
    export JAX_PLATFORMS=cpu
    TARGET_S=${TARGET_S:-40} DRAFT_STEPS=4 BLOCK_STEPS=4 target=tiny35 draft=tiny seq=64
    batch=4 corpus=(--max-files 150) preset=smoke
    functions=8 tap_tokens=8
    # the embedded folders are not tiny35: a rehearsal continues what it trains first
    if [ -n "$target_init" ] || [ -n "$draft_from" ]; then
      TARGET_INIT= DRAFT_FROM= SMOKE=1 RUN=$run/first bash "$0" job || exit 1
      target_init=${target_init:+$run/first/m/tsj-pycoder}
      draft_from=${draft_from:+$run/first/m/tsj-pycoder-draft}
    fi
  else
    export JAX_PLATFORMS=cuda
    TARGET_S=${TARGET_S:-700} DRAFT_STEPS=${DRAFT_STEPS:-640} BLOCK_STEPS=${BLOCK_STEPS:-2400}
    target=target35 draft=draft seq=1024 batch=64
    corpus=() preset=h200-short functions=200 tap_tokens=128
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  fi
  if [ -n "${PROBE:-}" ]; then
    timeout 240 python3 -m benchmarks.profile_train --presets "$target" --batch-sizes "$batch" \
      --seq-len "$seq" --steps 6 --tokens zipf --out "$run/probe"
  fi
  if [ -n "$target_init" ]; then
    start=(--target-init "$target_init" --target-lr "${TARGET_LR:-1e-3}" --target-warmup 100
           --target-min-lr-ratio "${MIN_LR_RATIO:-0.02}" --seed 1)
  else
    start=(--target-lr "${TARGET_LR:-2e-3}")
  fi
  draft_args=(--draft-preset "$draft" --draft-batch-size $((2 * batch)) --draft-steps
              "$DRAFT_STEPS" --draft-lr 3e-3)
  [ -n "$draft_from" ] && draft_args=(--draft-from "$draft_from")
  echo "[job] recipe, the target for $TARGET_S s:" \
    "${start[*]} ${draft_args[*]}"
  m=$run/m
  timeout $((TARGET_S + 900)) python3 -m turbospark_recipe recipe --out "$run/r" \
    --tokenizer models/tsj-pycoder --packages "${corpus[@]}" --target-preset "$target" \
    "${draft_args[@]}" --seq-len "$seq" \
    --target-batch-size "$batch" --target-seconds "$TARGET_S" \
    --target-steps 100000 "${start[@]}" --block-steps "$BLOCK_STEPS" \
    --block-batch-size "$batch" --block-lr 1e-3 --block-share 0.2 \
    --max-seconds $((TARGET_S + 600)) --no-progress --log-every 100 || exit 1
  cp "$run/r/summary.json" "$run/summary.json"
  mkdir -p "$m" "$run/probe"
  mv "$run/r/target" "$m/tsj-pycoder"; mv "$run/r/draft" "$m/tsj-pycoder-draft"
  mv "$run/r/block" "$m/tsj-pycoder-block"
  cp "$run"/r/*_history.jsonl "$run/probe/" 2>/dev/null
  python3 -m turbospark_recipe pack "$m/tsj-pycoder" "$m/tsj-pycoder-draft" \
    "$m/tsj-pycoder-block" --out "$run/parts_early"
  timeout 150 python3 -m turbospark_recipe evaluate --model "$m/tsj-pycoder" --packages \
    "${corpus[@]}" --functions "$functions" --out "$run/code_eval_h200.json" \
    --card "the training machine's held-out split (H200)"
  timeout 120 python3 -m benchmarks.tap_check "$m/tsj-pycoder" "$m/tsj-pycoder-block" \
    "$tap_tokens" > "$run/tap_check.txt" 2>&1
  timeout 240 python3 -m benchmarks.drafters --preset "$preset" --target "$m/tsj-pycoder" \
    --max-seconds 180 --write-speculative-json --out "$run/drafters"
  python3 -m turbospark_recipe pack "$m/tsj-pycoder" "$m/tsj-pycoder-draft" \
    "$m/tsj-pycoder-block" --out "$run/parts"
  touch "$run/done"
  ;;
esac
