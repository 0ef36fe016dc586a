#!/usr/bin/env bash
# bench/RESULTS.md from one run on one commit: the side-by-side comparison (compare.py writes the file), then
# one collection on the 50M-parameter MLP against its floors, then the CNN collecting at every step in one
# process, alternating blocks with and without (ours, and wandb.watch), then what the activation check costs.
# Needs bench/setup.sh's venvs.
# Arguments go to compare.py (e.g. --repeats 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=bench/.venv/bin/python
export BENCH_COCKPIT_PYTHON=$PWD/bench/.venv-cockpit/bin/python BENCH_ANALYZER_PYTHON=$PWD/bench/.venv/bin/python
$PY bench/compare.py "$@"
{
    echo
    echo "## One collection on the 50M-parameter MLP, against its floors"
    echo
    echo "\`$PY bench/collection_cost.py --repeats 15\`:"
    echo
    echo '```'
    $PY bench/collection_cost.py --repeats 15
    echo '```'
    echo
    echo "## CNN collecting at every step, in one process"
    echo
    echo "Alternating blocks of 32 steps with and without, 16 rounds; ratio_median is the median per-round ratio"
    echo "of step times, extra_ms_median what a step with the configuration adds."
    for config in ours wandb_all; do
        echo
        echo "\`$PY bench/compare.py --blocks cnn $config 1 32 16\`:"
        echo
        echo '```'
        $PY bench/compare.py --blocks cnn "$config" 1 32 16
        echo '```'
    done
    echo
    echo "## The activation check (track_activations) on collecting and other steps"
    echo
    echo "\`$PY bench/activation_cost.py\`:"
    echo
    echo '```'
    $PY bench/activation_cost.py
    echo '```'
} >> bench/RESULTS.md
