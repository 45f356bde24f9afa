#!/usr/bin/env bash
# d9d on one GPU: the CUDA paths CPU tests cannot reach, in one run of a few minutes (BUDGET_S).
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh            # on the GPU machine, from the repo root
#   DEVICE=cpu OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh # dry run without a GPU (a test runs it)
#
# It needs no installed d9d: it uses the machine's python3 and torch (2.11 or later) with the
# packages' source, examples/ and benchmarks/ on PYTHONPATH. What d9d needs besides torch (msgspec,
# structlog, numpy, pyyaml, safetensors), where a bare GPU image lacks it, is installed from the
# wheels in $WHEELS (no package index needed) into a temp folder. Bash 4.4 or later. Writes $OUT/summary.txt (one `RESULT <check> PASS|FAIL|INFO|SKIP ...` line per check) and
# $OUT/logs.tgz (every check's log, the profiler trace and memory snapshot); exits 1 if a check failed.
#
# Environment: PY (python3), WHEELS (directory of .whl files), BUDGET_S (480: the whole run),
# SKIP ("name ..." checks to leave out), DEVICE (cuda | cpu: cpu shrinks every check).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
OUT=${OUT:-/tmp/d9d-gpu-check}
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac  # relative to the repository root (we cd there)
DEVICE=${DEVICE:-cuda}
export DEVICE
BUDGET_S=${BUDGET_S:-480}
DEADLINE=$(($(date +%s) + BUDGET_S))
WORK=$(mktemp -d /tmp/d9d-gpu-check.XXXX)
LOGS=$WORK/logs
mkdir -p "$OUT" "$LOGS"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# what d9d imports besides torch (numpy usually comes with torch, pyyaml and safetensors may not)
NEEDED="msgspec structlog numpy yaml safetensors"
missing() { for m in $NEEDED; do $PY -c "import $m" 2>/dev/null || printf '%s ' "$m"; done; }
LACKS=$(missing)
if [ -n "$LACKS" ]; then
  if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target "$WORK/lib" "$WHEELS"/*.whl >"$LOGS/pip.log" 2>&1 ||
      echo "installing the wheels of $WHEELS failed: $(tail -c 300 "$LOGS/pip.log")"
  fi
  LACKS=$(PYTHONPATH="$WORK/lib:${PYTHONPATH:-}" missing)
  if [ -n "$LACKS" ]; then
    echo "error: $PY lacks $LACKS(import names); set WHEELS to a directory holding their wheels" >&2
    exit 2
  fi
fi
SOURCES=$(printf '%s:' "$ROOT"/packages/*/src)
export PYTHONPATH="$WORK/lib:$SOURCES$ROOT/examples:$ROOT/benchmarks:${PYTHONPATH:-}"

note() { echo "$*" | tee -a "$SUMMARY"; }
# check NAME SECONDS COMMAND...: runs under min(SECONDS, time left), logs to $LOGS/NAME.log and copies
# its RESULT lines (or one made from its exit status) into the summary.
check() {
  local name=$1 limit=$2 left
  shift 2
  if skipped "$name"; then note "RESULT $name SKIP (SKIP)"; return; fi
  left=$((DEADLINE - $(date +%s)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 15 ]; then note "RESULT $name SKIP (out of BUDGET_S)"; return; fi
  local start=$(date +%s) rc
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - start))
  if grep -q '^RESULT ' "$LOGS/$name.log"; then
    grep '^RESULT ' "$LOGS/$name.log" | sed "s/\$/  [${took}s]/" | tee -a "$SUMMARY"
    # a crash after its RESULT line (teardown, a second failure) is a failure too
    [ $rc -eq 0 ] || note "RESULT $name FAIL exit $rc after its result: $(tail -c 300 "$LOGS/$name.log" | tr '\n' ' ')"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    note "RESULT $name FAIL timed out after ${limit}s: $(tail -c 300 "$LOGS/$name.log" | tr '\n' ' ')"
  elif [ $rc -eq 0 ]; then
    note "RESULT $name PASS [${took}s]"
  else
    note "RESULT $name FAIL exit $rc [${took}s]: $(tail -c 400 "$LOGS/$name.log" | tr '\n' ' ')"
  fi
}
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
# metrics NAME RUN CHECK: a run's metrics as one RESULT line (loss falls and stays finite; throughput
# and memory), unless CHECK was skipped
metrics() {
  skipped "$3" && return
  $PY - "$WORK/runs/$2/metrics.jsonl" "$1" <<'EOF' | tee -a "$SUMMARY"
import json, math, sys
path, name = sys.argv[1], sys.argv[2]
try:
    steps = [r for r in map(json.loads, open(path)) if "loss" in r]
    first, last = steps[0], steps[-1]
    ok = last["loss"] < first["loss"] and all(math.isfinite(r["loss"]) for r in steps)
    keys = [k for k in ("tokens_per_s", "mfu", "peak_memory_gib", "peak_rss_gib") if k in last]
    print(f"RESULT {name} {'PASS' if ok else 'FAIL'} steps {first['step']}..{last['step']} loss "
          f"{first['loss']:.3f}->{last['loss']:.3f} " + " ".join(f"{k}={last[k]}" for k in keys))
except (OSError, ValueError, IndexError, KeyError) as error:
    print(f"RESULT {name} FAIL no metrics ({type(error).__name__}: {error})")
EOF
}

C=benchmarks/gpu_check.py
Q=(examples/quickstart/config.yaml "trainer.device=$DEVICE" "trainer.checkpointing.save_dir=$WORK/runs" trainer.logging.period_steps=5)
if [ "$DEVICE" = cpu ]; then
  SMALL=(model.hidden_size=64 model.intermediate_size=128 model.num_layers=2 dataset.seq_len=64)
  THROUGHPUT=(--tiny)
else
  SMALL=()
  THROUGHPUT=(--layers 8 --seq 8192 --steps 8 --warmup 3 --phases bf16 plain-bf16 bf16+compile bf16+full-ac)
fi
check env 60 $PY $C env
if command -v nvidia-smi >/dev/null 2>&1; then  # the driver, which torch does not report
  note "INFO driver $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
fi
# the quickstart: 20 steps, checkpoints at 10 and 20, one profiled step with a memory snapshot, then
# a resume to 24 from the device's checkpoint (pinned staging, the device's RNG state)
check quickstart 120 bash -c "$PY examples/quickstart/train.py ${Q[*]} ${SMALL[*]} trainer.run.name=qs \
  trainer.schedule.total_steps=20 trainer.checkpointing.period_steps=10 trainer.profiling.start_step=6 \
  trainer.profiling.active_steps=1 trainer.profiling.memory_snapshot=true trainer.profiling.dir=$LOGS/profile \
  && $PY examples/quickstart/train.py ${Q[*]} ${SMALL[*]} trainer.run.name=qs trainer.schedule.total_steps=24"
metrics quickstart_loss qs quickstart
if skipped quickstart; then
  :
elif grep -q '"step": 24' "$WORK/runs/qs/metrics.jsonl" 2>/dev/null; then
  note "RESULT quickstart_resume PASS resumed 20 -> 24"
else
  note "RESULT quickstart_resume FAIL no step 24 in metrics.jsonl"
fi
check dtypes 60 $PY $C dtypes
check cp_attention 60 $PY $C cp
check flex_docmask 120 $PY $C flex
check fsdp 90 $PY $C fsdp
check fsdp_compiled 120 env TORCH_LOGS=graph_breaks,recompiles $PY $C fsdp_compiled
# CPU offload on one rank: parameters, grads and AdamW state in pinned host memory, device bytes between
# steps and step time against the same run without offload
check cpu_offload 120 $PY $C cpu_offload
# throughput at the shipped 8B shape (8 layers): d9d against the plain PyTorch loop, compile, full AC
check gpu_throughput 240 $PY benchmarks/gpu_throughput.py "${THROUGHPUT[@]}" --device "$DEVICE"
grep -E "tok/s|/ plain|MFU|Error" "$LOGS/gpu_throughput.log" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
# MoE with compile and full activation checkpointing: graphs and recompiles counted from the log
check moe_compile 150 env TORCH_LOGS=graph_breaks,recompiles $PY examples/quickstart/train.py "${Q[@]}" "${SMALL[@]}" \
  trainer.run.name=moe trainer.schedule.total_steps=6 trainer.checkpointing.period_steps=0 trainer.logging.period_steps=1 \
  "model.moe={num_experts: 8, top_k: 2, moe_intermediate_size: 128}" trainer.compile.enabled=true \
  trainer.activation_checkpointing.mode=full
metrics moe_loss moe moe_compile
skipped moe_compile || note "INFO moe_compile graph_breaks=$(grep -c 'Graph break' "$LOGS/moe_compile.log" 2>/dev/null) recompiles=$(grep -c 'Recompiling' "$LOGS/moe_compile.log" 2>/dev/null)"
# float8 linears (torchao, when this Python has it: put its wheel in WHEELS): loss, _scaled_mm calls
# and step time with float8 tensorwise and rowwise against bf16
if $PY -c "import torchao" >/dev/null 2>&1; then
  if [ "$DEVICE" = cpu ]; then F8=(--steps 4 --layers 1 --hidden 64); else F8=(--steps 30 --layers 4 --hidden 2048); fi
  check float8 180 $PY benchmarks/float8.py "${F8[@]}" --device "$DEVICE"
  grep -E "^(bf16|tensorwise|rowwise):" "$LOGS/float8.log" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
else
  note "RESULT float8 SKIP torchao is not installed (its wheel in WHEELS installs it)"
fi
tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
echo "==== summary ($((BUDGET_S - DEADLINE + $(date +%s)))s) ===="
cat "$SUMMARY"
! grep -q '^RESULT [a-z_0-9]* FAIL' "$SUMMARY"
