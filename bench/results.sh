#!/usr/bin/env bash
# bench/RESULTS.md from one run on one commit: the side-by-side comparison (compare.py writes the file), then
# one collection on the 50M-parameter MLP against its floors (and a fresh process's first collection against
# the version before the fused kernels), where one CNN collection's time goes, then the CNN collecting at every
# step in one process, alternating blocks with and without (ours, and wandb.watch), then a LoRA model of many
# adapters the same way and one collection on it against the version before its per-tensor costs were cut,
# then what the activation check costs, then the GPU figures that bench/gpu_cost.py measured on a lent GPU
# machine (bench/gpu/).
# Needs bench/setup.sh's venvs.
# Arguments go to compare.py (e.g. --repeats 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=bench/.venv/bin/python
FIRST_BASELINE=0d97e26  # telemetry.py before the fused kernels: the first collection must not be slower than it
MANY_BASELINE=d93d1cb  # telemetry.py before the per-tensor costs of a model of many small tensors were cut
export BENCH_COCKPIT_PYTHON=$PWD/bench/.venv-cockpit/bin/python BENCH_ANALYZER_PYTHON=$PWD/bench/.venv/bin/python
$PY bench/compare.py "$@"
{
    echo
    echo "## One collection on the 50M-parameter MLP, against its floors"
    echo
    echo "With \`--baseline $FIRST_BASELINE\` (the last commit before the fused kernels), a fresh process's first"
    echo "collection is timed against that version's, in alternating child processes."
    echo
    echo "\`$PY bench/collection_cost.py --repeats 15 --baseline $FIRST_BASELINE --first-rounds 15\`:"
    echo
    echo '```'
    $PY bench/collection_cost.py --repeats 15 --baseline "$FIRST_BASELINE" --first-rounds 15
    echo '```'
    echo
    echo "## Where one CNN collection's time goes, against the memory system's floor"
    echo
    echo "\`$PY bench/collection_parts.py --rounds 200\`:"
    echo
    echo '```'
    $PY bench/collection_parts.py --rounds 200
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
    echo "## A LoRA model of many adapters"
    echo
    echo "lora_deep: the LoRA workload's Llama at 32 layers of width 64 with rank-8 adapters on all seven"
    echo "projections: 448 trainable tensors in 2,665 modules, as many as a 7B Llama's LoRA on them, so a"
    echo "collection's per-tensor costs are a real model's. Collecting at every step, alternating blocks of 16"
    echo "steps with and without, 8 rounds:"
    echo
    echo "\`$PY bench/compare.py --blocks lora_deep ours 1 16 8\`:"
    echo
    echo '```'
    $PY bench/compare.py --blocks lora_deep ours 1 16 8
    echo '```'
    echo
    echo "One collection, this telemetry.py against $MANY_BASELINE's, in one process (alternating):"
    echo
    echo "\`$PY bench/ab_collection.py --baseline $MANY_BASELINE --workload lora_deep --pairs 100\`:"
    echo
    echo '```'
    $PY bench/ab_collection.py --baseline "$MANY_BASELINE" --workload lora_deep --pairs 100
    echo '```'
    echo
    echo "## The activation check (track_activations) on collecting and other steps"
    echo
    echo "\`$PY bench/activation_cost.py\`:"
    echo
    echo '```'
    $PY bench/activation_cost.py
    echo '```'
    echo
    echo "## On a GPU"
    echo
    echo "Measured on a lent machine with one H100 (Firecracker, 16 cores), not by this script (CI and this machine"
    echo "have no GPU), in one call, one command after the other: \`python3 -m pytest tests/test_gpu.py\` (5 passed);"
    echo "bench/gpu/h100_pass.json from \`python3 bench/gpu_pass.py --baseline OLD_TELEMETRY_PY --blocks 32 --json"
    echo "bench/gpu/h100_pass.json\`; bench/gpu/h100.json from \`python3 bench/gpu_cost.py --block 10 --rounds 3"
    echo "--collections 6 --json bench/gpu/h100.json\` on telemetry.py of 1c98077; then bench/gpu/h100_baseline.json from"
    echo "\`python3 bench/gpu_cost.py --telemetry OLD_TELEMETRY_PY --configs ours:1 --block 10 --rounds 3 --collections 4"
    echo "--json bench/gpu/h100_baseline.json\`, OLD_TELEMETRY_PY being telemetry.py of be9c43d, which took LoRA stable"
    echo "ranks from QRs and SVDs and wrote the adapters to the reference one by one. The two gpu_cost.py runs are two"
    echo "processes, whose hook times compare loosely (a later call measured be9c43d again, below); the parts of a"
    echo "collection, and gpu_pass.py, which holds both versions in one process, compare closely."
    echo "Printed by \`$PY bench/gpu_cost.py --from-json bench/gpu/h100.json --baseline-json bench/gpu/h100_baseline.json\`:"
    echo
    $PY bench/gpu_cost.py --from-json bench/gpu/h100.json --baseline-json bench/gpu/h100_baseline.json
    echo
    echo "The previous version's own figures in that call, with where its collections' time went. Printed by"
    echo "\`$PY bench/gpu_cost.py --from-json bench/gpu/h100_baseline.json\`:"
    echo
    $PY bench/gpu_cost.py --from-json bench/gpu/h100_baseline.json
    echo
    echo "A later call, on another instance of the machine, measured telemetry.py of be9c43d with the command of"
    echo "h100_baseline.json: bench/gpu/h100_be9c43d_second_call.json. Printed by"
    echo "\`$PY bench/gpu_cost.py --from-json bench/gpu/h100_be9c43d_second_call.json\`:"
    echo
    $PY bench/gpu_cost.py --from-json bench/gpu/h100_be9c43d_second_call.json
    echo
    echo "The weight pass and the reference's write on GPT-2's weights (ms, medians of 5), in the call of"
    echo "bench/gpu/h100.json, old being telemetry.py of be9c43d and new that of 1c98077; collection_X is the pass with"
    echo "the write beside it, as a collection runs them. Printed by"
    echo "\`$PY bench/gpu_pass.py --from-json bench/gpu/h100_pass.json\`:"
    echo
    $PY bench/gpu_pass.py --from-json bench/gpu/h100_pass.json
} >> bench/RESULTS.md
