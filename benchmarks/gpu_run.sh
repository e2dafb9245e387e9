#!/usr/bin/env bash
# The GPU baseline check as one device run, for a session lent a GPU (an H100/H200: about 2 minutes of its 15):
#   run(command="bash benchmarks/gpu_run.sh", timeout_s=540)   ->  $OUT/gpu_baseline_*.json, $OUT/gpu_info.txt
# Copy the JSON into benchmarks/results/ and the table into benchmarks/README.md (GPU baseline).
# The device machine's python3 holds a CUDA torch; everything else gpu_baseline.py imports is edgekv itself, numpy and
# sympy (checked with sys.modules), which that image has. Dry run on this machine's CPU (slow, same code path but
# the allocator statistics): DEVICE=cpu PY=.venv/bin/python OUT=/tmp/gpu bash benchmarks/gpu_run.sh
set -uo pipefail
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} | tee "$OUT/gpu_info.txt"
rc=0
run() {  # name, then gpu_baseline.py's arguments; a failed run is recorded and the next one still runs
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  timeout 200 $PY benchmarks/gpu_baseline.py --device "$DEVICE" --out "$OUT/gpu_baseline_$name.json" "$@" \
    > "$OUT/gpu_baseline_$name.log" 2>&1 || { rc=1; echo "   FAILED (log: $OUT/gpu_baseline_$name.log)"; tail -5 "$OUT/gpu_baseline_$name.log"; }
  $PY - "$OUT/gpu_baseline_$name.json" <<'PYEOF' 2>/dev/null || true
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"   {r['model']:<14} {r['strategy']:<18} {r['ctx']:>6}  measured {r['measured_bytes'] / 2**20:9.1f} MiB"
          f"  planned {r['predicted']['compared'] / 2**20:9.1f} MiB  {r['error_pct']:+6.2f} %  {r['step']}")
PYEOF
  echo "   ($((SECONDS - t0)) s)"
}
# native strategies: a plain fp16 cache (in place, serving_step) and SSM states (module forward)
run native --models llama-3.2-1b,qwen2.5-0.5b,mamba2-1.3b,mamba-130m --ctx 1k,8k,32k
# a quantized cache and a rolling window, through the module's forward (a second state per step)
run kv-int8 --models llama-3.2-1b --strategy kv-int8 --ctx 1k,32k
run window --models llama-3.2-1b --strategy window:w=4096 --ctx 8k,32k
exit $rc
