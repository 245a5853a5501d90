#!/usr/bin/env bash
# Before/after on one machine: `bench/compare_peers --no-peer` against two fdx
# checkouts, alternating (round 1: before, after, after-without-C++-ops;
# round 2 the reverse), so drift shows up as disagreement between rounds.
#
#   bench/compare_commits.sh BEFORE_PYTHON BEFORE_REPO [OUT_DIR]
#
# BEFORE_PYTHON is a Python with the "before" checkout installed editable
# (e.g. a copy of .venv after `pip install -e BEFORE_REPO --no-deps`).  Each
# variant runs from its own repo directory, because `python -m` puts the
# working directory first on sys.path.  Read the tables' ratios only.
set -u
before_py=$1 before_repo=$2 out=${3:-/tmp/fdx-compare-commits}
after_repo=$(cd "$(dirname "$0")/.." && pwd)
after_py=$after_repo/.venv/bin/python
WORKLOADS=${WORKLOADS:-single,c32}
mkdir -p "$out"
run() { # name python repo [env...]
  local name=$1 py=$2 repo=$3; shift 3
  echo "=== $name round $R $(date +%T)"
  (cd "$repo" && env FDX_COMPARE_NO_REEXEC=1 "$@" "$py" "$repo/bench/compare_peers" --no-peer \
     --workloads "$WORKLOADS" --num-prompts 32 --wait-idle 5 --no-progress --out-dir "$out/$name-$R" 2>&1 | tail -12)
}
for R in 1 2; do
  if [ "$R" = 1 ]; then order="before after after-no-native"; else order="after-no-native after before"; fi
  for v in $order; do
    case $v in
      before) run before "$before_py" "$before_repo" ;;
      after) run after "$after_py" "$after_repo" ;;
      after-no-native) run after-no-native "$after_py" "$after_repo" FDX_NATIVE_OPS=0 ;;
    esac
  done
done
