#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most 8 minutes, for the day one is at hand:
# every test file that touches CUDA (found by grep, so a new one is included), then
# bench/scale.py on CUDA (the GPT-2-small shape, and the vmap/ghost crossover). Without a
# CUDA device it says so and exits 0: everything else runs in the CPU suite.
#
#   bash bench/gpu_check.sh            # from the repository root or anywhere
#
# Budget: tests 300 s, benchmark 170 s (each stopped by `timeout`); exit status 1 when a
# test failed or a step timed out, else 0.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to run;" \
         "the CPU suite covers everything else"
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

status=0
mapfile -t files < <(grep -rlI -i --include='test_*.py' 'cuda' tests/ | sort)
echo "gpu_check: ${#files[@]} test files mention CUDA: ${files[*]}"
timeout 300 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider "${files[@]}" || status=1

echo "gpu_check: bench/scale.py on CUDA (12 blocks, d 768; crossover at depth 2)"
timeout 170 "$PY" bench/scale.py --device cuda --85m --steps 5 --sweep 256 768 1024 || status=1
echo "gpu_check: done, status $status"
exit $status
