#!/usr/bin/env bash
# d9d's first GPU run in one command: the headline figures first, every check inside BUDGET_S.
#
#   bash benchmarks/prepare_gpu_check.sh                       # here, once: the wheels the GPU machine lacks
#   bash benchmarks/gpu_check.sh                               # there, from the repo root (OUT: where to write)
#   DEVICE=cpu OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh # dry run without a GPU (tiny shapes)
#
# It needs no installed d9d: the machine's python3 and torch (2.11 or later) with the packages'
# source, examples/ and benchmarks/ on PYTHONPATH. What d9d needs besides torch and that Python lacks
# (msgspec, structlog; torchao for the float8 phase) is installed from the wheels in $WHEELS
# (benchmarks/.wheels, written by prepare_gpu_check.sh) into a temp folder, without a package index.
# benchmarks/gpu_check_run.py then runs the checks in order, each within its share of BUDGET_S, and
# writes $OUT/summary.txt (one `RESULT <check> PASS|FAIL|INFO|SKIP ...` line per check, whatever
# happens) and $OUT/logs.tgz; the exit status is 1 if a check failed, 2 if it could not start.
#
# Environment: PY (python3), WHEELS (benchmarks/.wheels), OUT (/tmp/d9d-gpu-check), BUDGET_S (540 on
# cuda, 1500 on cpu), SKIP ("name ..." checks to leave out), DEVICE (cuda | cpu).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PY=${PY:-python3} DEVICE=${DEVICE:-cuda}
WHEELS=${WHEELS:-$ROOT/benchmarks/.wheels}
case "$WHEELS" in /*) ;; *) WHEELS="$ROOT/$WHEELS" ;; esac
LIB=
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# what d9d imports besides torch; numpy, pyyaml and safetensors are on the GPU image, torchao is optional
NEEDED="msgspec structlog numpy yaml safetensors"
missing() {  # the modules of "$@" that $PY cannot find, each followed by a space
  $PY -c 'import importlib.util as u, sys; print("".join(m + " " for m in sys.argv[1:] if not u.find_spec(m)), end="")' "$@"
}
if [ -n "$(missing $NEEDED torchao)" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  LIB=$(mktemp -d /tmp/d9d-gpu-check-lib.XXXX)
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$LIB" "$WHEELS"/*.whl >"$LIB.log" 2>&1 ||
    echo "installing the wheels of $WHEELS failed: $(tail -c 300 "$LIB.log")" >&2
fi
LACKS=$(PYTHONPATH="${LIB:+$LIB:}${PYTHONPATH:-}" missing $NEEDED)
if [ -n "$LACKS" ]; then
  [ -n "$LIB" ] && rm -rf "$LIB" "$LIB.log"
  echo "error: $PY lacks $LACKS(import names): run bash benchmarks/prepare_gpu_check.sh where pip reaches" \
    "an index, and carry benchmarks/.wheels (or set WHEELS to a folder of their wheels)" >&2
  exit 2
fi
SOURCES=$(printf '%s:' "$ROOT"/packages/*/src)
export PYTHONPATH="${LIB:+$LIB:}$SOURCES$ROOT/examples:$ROOT/benchmarks:${PYTHONPATH:-}"
exec "$PY" benchmarks/gpu_check_run.py
