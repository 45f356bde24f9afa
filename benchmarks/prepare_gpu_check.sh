#!/usr/bin/env bash
# Prepare the GPU check here, where pip reaches an index: the wheels the GPU machine lacks, for its
# Python 3.12 on x86-64 Linux, into benchmarks/.wheels (ignored by git; the run carries it).
#
#   bash benchmarks/prepare_gpu_check.sh
#
# msgspec (cp312, manylinux), structlog and torchao 0.18.0 (pure Python; the torchao release built
# against torch 2.11, the machine's; its float8 training needs no compiled extension). Idempotent: a
# wheel already there is kept. Ends with the size (the tree that travels holds at most 64 MiB) and
# the one command to run there. Environment: PYTHON (python3: any Python with pip), WHEELS (the folder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-benchmarks/.wheels}
TORCHAO=torchao==0.18.0
if ! git check-ignore -q "$WHEELS/x.whl"; then
  echo "error: $WHEELS is not ignored by git, so its wheels would be committed; add it to .gitignore" >&2
  exit 2
fi
if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
  echo "error: $PYTHON has no pip; set PYTHON to a Python that has it (python3 -m ensurepip adds it)" >&2
  exit 2
fi
mkdir -p "$WHEELS"
target=(--python-version 3.12 --implementation cp --abi cp312)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() { "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WHEELS" "$@"; }
download "${target[@]}" "${platforms[@]}" msgspec
download "${target[@]}" "${platforms[@]}" structlog
# the pure-Python wheel (py3-none-any), not the cp310-abi3 one with extensions for one CUDA build
download --python-version 3.12 --implementation py --abi none --platform any "$TORCHAO"
for name in msgspec structlog torchao; do
  count=$(find "$WHEELS" -maxdepth 1 -name "$name-*.whl" | wc -l)
  if [ "$count" -ne 1 ]; then
    echo "error: $WHEELS holds $count $name wheels, and the machine's pip installs one of each: keep one" >&2
    exit 1
  fi
done
bytes=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
ls -1 "$WHEELS"
echo "$WHEELS: $((bytes / 1024)) KiB (the tree that travels holds at most 64 MiB)"
echo "run it with the device tool: command 'bash benchmarks/gpu_check.sh', carry [\"$WHEELS\"], timeout_s 600"
