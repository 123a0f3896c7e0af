#!/usr/bin/env bash
# Serve a model with the recipe for a hardware class:
#   serve_with_recipe.sh --model M --hardware H [--variant V] [more cpullm serve flags]
# writes the recipe's config.yml and env.sh (cpullm recipe), takes its environment, and
# starts `cpullm serve --config config.yml` on HOST:PORT (0.0.0.0:8000). The flags after
# the recipe's own win over its config.
set -euo pipefail
model="" hardware="auto" variant=""
serve_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --model=*) model="${1#--model=}"; shift ;;
    --hardware) hardware="$2"; shift 2 ;;
    --hardware=*) hardware="${1#--hardware=}"; shift ;;
    --variant) variant="$2"; shift 2 ;;
    --variant=*) variant="${1#--variant=}"; shift ;;
    *) serve_args+=("$1"); shift ;;
  esac
done
cpullm="${CPULLM:-cpullm}"
recipe_dir="$(mktemp -d)"
recipe_args=(--hardware "$hardware" --output-dir "$recipe_dir")
[ -n "$model" ] && recipe_args+=(--model "$model")
[ -n "$variant" ] && recipe_args+=(--variant "$variant")
"$cpullm" recipe "${recipe_args[@]}"
# shellcheck disable=SC1091
source "$recipe_dir/env.sh"
exec "$cpullm" serve --config "$recipe_dir/config.yml" --host "${HOST:-0.0.0.0}" \
  --port "${PORT:-8000}" "${serve_args[@]}"
