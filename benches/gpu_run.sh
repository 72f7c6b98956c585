#!/usr/bin/env bash
# One command for a lent GPU machine (no package registry there; torch, triton, numba, pytest,
# pytest-benchmark and hypothesis are preinstalled): install detsum in place, run the whole test
# suite (the `cuda`-marked tests included), then every benchmark, writing everything to $OUT.
#   bash benches/gpu_run.sh            # from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benches/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . || exit 1
python3 - <<'PY' | tee "$OUT/gpu_env.txt"
import datetime, torch, triton
print("date", datetime.date.today().isoformat())
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
PY
python3 -m pytest -q -x -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tail -n 40 | tee "$OUT/tests.txt"
python3 -m pytest benches --benchmark-only -q -p no:cacheprovider \
    --benchmark-json="$OUT/bench-gpu.json" 2>&1 | tail -n 20
python3 benches/summarize.py "$OUT/bench-gpu.json" | tee "$OUT/bench-gpu.txt"
