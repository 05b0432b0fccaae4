#!/usr/bin/env bash
# The dependency rules of docs/style.md, checked on the include lines: server -> engine ->
# {graphs -> kernels, models}; kernels/ and graphs/ include nothing from models/; protobuf types
# never leave server/, bench/ (and the tests of those). Prints each offending line; exit 1 if any.
set -uo pipefail
cd "${1:-$(dirname "$0")/..}"
bad=0
rule() {  # folder, forbidden include prefixes (a regex), why
  local hits
  hits=$(grep -rnE "^#include \"($2)" "$1" --include='*.h' --include='*.cc' --include='*.cu' \
           --include='*.cuh' 2>/dev/null)
  if [ -n "$hits" ]; then
    echo "layering: $1/ must not include $2 ($3):"
    echo "$hits"
    bad=1
  fi
}
rule kernels 'models/|engine/|graphs/|server/|tailserve/' 'kernels are the bottom layer'
rule graphs 'models/|engine/|server/|tailserve/' 'graphs depend on kernels only'
rule models 'engine/|server/|graphs/|kernels/|tailserve/' 'models sit beside graphs, under engine'
rule common 'models/|engine/|server/|graphs/|kernels/|tailserve/' 'common is shared by all'
rule engine 'server/|tailserve/' 'the engine sees native types only'
# The serving core (the files directly in engine/) knows the Backend seam, not the CUDA backend.
core=$(grep -nE '^#include "engine/cuda/' engine/*.h engine/*.cc 2>/dev/null)
if [ -n "$core" ]; then
  echo "layering: engine/*.{h,cc} (the serving core) must not include engine/cuda/:"
  echo "$core"
  bad=1
fi
exit $bad
