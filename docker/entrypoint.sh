#!/usr/bin/env bash
# The containers' entrypoint: `cpullm serve` on 0.0.0.0:8000 with the container's
# arguments (the same as cpullm serve's: --model, --dtype, ...), or a recipe's with
# `recipe --model M --hardware H [serve flags]`. HOST and PORT move it; CPULLM names the
# cpullm command (default: the one on PATH).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = "recipe" ]; then
  shift
  exec "$here/serve_with_recipe.sh" "$@"
fi
exec "${CPULLM:-cpullm}" serve --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}" "$@"
