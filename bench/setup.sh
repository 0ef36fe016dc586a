#!/usr/bin/env bash
# The benchmark's virtual environments, inside bench/ and ignored by git:
#   bench/.venv          torch 2.13.0 (CPU), the peers (wandb, TensorBoard, Lightning), the LoRA workload's
#                        packages (transformers, peft) and the analyzer's (numpy, matplotlib)
#   bench/.venv-cockpit  Cockpit with its own pins, apart from the peers
# torch==2.13.0 goes in first and is named in every later install: an unpinned torch, or a package that wants
# a newer torch or torchvision, fetches a multi-GB CUDA build. A venv that finished installing is kept; run
# this again after a failed install to finish it. PYTHON picks the interpreter (python3 by default).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"

venv() {   # DIR PACKAGE...: a venv at DIR with torch and the packages, unless DIR/.installed says it is done
    local dir=$1
    shift
    if [ -f "$dir/.installed" ]; then
        echo "bench/$dir is ready"
        return 0
    fi
    echo "bench/$dir: installing $TORCH $*"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q "$TORCH"
    "$dir/bin/python" -m pip install -q "$TORCH" "$@"
    # The pin must have held: a second torch would make every ratio a comparison of two builds.
    "$dir/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.13.0'))" \
        || { echo "bench/$dir: torch is not 2.13.0" >&2; exit 1; }
    touch "$dir/.installed"
}

venv .venv numpy matplotlib wandb tensorboard lightning psutil py-spy pyinstrument transformers peft
# setuptools<81 still has the pkg_resources Cockpit imports. backpack-for-pytorch requires torchvision, whose
# newest release wants the next torch; 0.28.0 is the release for torch 2.13. Cockpit never imports it.
venv .venv-cockpit "setuptools<81" numpy torchvision==0.28.0 cockpit-for-pytorch psutil
