#!/usr/bin/env bash
# tests/unsloth_check.py on a lent GPU machine, which has torch, transformers, peft and accelerate but no network.
#   bash bench/gpu/unsloth_device.sh pack   # here: what that machine lacks, for its Python 3.12, into .whl/site.tar.xz
#   bash bench/gpu/unsloth_device.sh run    # there, with .whl carried: the check, then tests/test_gpu.py; logs in $OUT
# The versions are the ones checked together on the CPU (unsloth's CPU fallback); transformers and peft travel too,
# since unsloth pins the transformers it patches. The site is trimmed: unsloth's web studio and bitsandbytes'
# libraries for other CUDA versions than the machine's torch (cu130) would not fit what a call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
PACKAGES="unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 peft==0.21.2 transformers==5.17.0
  dill==0.4.1 multiprocess==0.70.19 fsspec==2026.2.0 tyro docstring_parser typeguard shtab hf_transfer msgspec json5
  nest_asyncio structlog pydantic==2.14.4 pydantic_core==2.50.5 annotated_types typing_inspection typing_extensions
  cut_cross_entropy torchao==0.18.0 bitsandbytes==0.50.2 certifi"
case "${1:-}" in
pack)
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$work/dl" $PACKAGES
  python3 -m pip install -q --no-deps --no-compile --target "$work/site" --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any --only-binary=:all: "$work"/dl/*.whl
  rm -rf "$work/site/studio" "$work/site/unsloth_cli" "$work/site/test" "$work/site/bin"
  find "$work/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*cuda130*' -delete
  mkdir -p .whl && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  tar -cJf .whl/site.tar.xz -C "$work/site" . && rm -rf "$work" && ls -l .whl/site.tar.xz ;;
run)
  mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  status=0
  timeout 270 python3 tests/unsloth_check.py /tmp/unsloth-check --steps 60 > "$OUT/unsloth.log" 2>&1 || status=$?
  echo "unsloth_check exit $status"
  cp /tmp/unsloth-check/results.json "$OUT/unsloth_results.json" || true
  cp /tmp/unsloth-check/healthy/telemetry.jsonl "$OUT/healthy.jsonl" || true
  python3 -c "import json, sys; [print(k, v) for k, v in json.load(open(sys.argv[1])).items()]" \
    "$OUT/unsloth_results.json" || tail -40 "$OUT/unsloth.log"
  timeout 150 python3 -m pytest -q tests/test_gpu.py tests/test_lora.py -k "gpu or unsloth" > "$OUT/pytest.log" 2>&1 \
    || status=$?
  tail -15 "$OUT/pytest.log"
  exit $status ;;
*) echo "usage: $0 pack|run" >&2; exit 2 ;;
esac
