#!/usr/bin/env bash
# The speculative modes as the command line runs them, each command a fresh process:
# plain, --speculative and --ngram 3 (draft length 4, the default, and 2), 96 new tokens after
# each of benchmarks/speculative.py's four prompts, with --stats and the wall time of the whole
# command. Modes are interleaved prompt by prompt, so a change in the machine's load spreads
# over all of them.
#
#     bash benchmarks/cli_speculative.sh > benchmarks/results/cli_speculative_cpu.txt
set -uo pipefail
prompts=("def fibonacci(n):" $'class Stack:\n    def __init__(self):'
         $'import os\nimport sys\n\n\ndef main(argv):' $'    def __repr__(self):\n        return')
modes=("" "--speculative" "--ngram 3" "--speculative --draft-len 2" "--ngram 3 --draft-len 2")
for p in "${prompts[@]}"; do
  for mode in "${modes[@]}"; do
    echo "== mode=[$mode] prompt=$(printf %q "$p") loadavg=$(cut -d' ' -f1 /proc/loadavg)"
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086  # $mode is several words on purpose
    python -m turbospark_jax.cli generate --max-tokens 96 --stats $mode "$p" 2>&1 >/dev/null \
      | grep -v '^\[turbospark-jax\]\|acceptance by\|  time:'
    t1=$(date +%s.%N)
    echo "wall $(python3 -c "print(f'{$t1 - $t0:.2f}')")s"
  done
done
