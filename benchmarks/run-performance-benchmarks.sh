#!/usr/bin/env bash
# The serving benchmark suite, run as vLLM CPU's performance-benchmark script runs its own:
#   ON_CPU=1 SERVING_JSON=cpullm/benchmarks/suite/serving-tests-cpu.json \
#   MODEL_FILTER=HuggingFaceTB/SmolLM2-135M-Instruct DRY_RUN=1 \
#   benchmarks/run-performance-benchmarks.sh
# DRY_RUN=1 writes the commands only; results, the table and plots go to
# ./benchmark/results/. Any flag of `cpullm bench suite` may follow.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cpullm="${CPULLM:-cpullm}"
if ! command -v "$cpullm" > /dev/null && [ -x "$here/.venv/bin/cpullm" ]; then
  cpullm="$here/.venv/bin/cpullm"
fi
exec "$cpullm" bench suite "$@"
