#!/usr/bin/env bash
# Train recall-capable tiny byte-level fixtures on one GPU, in one short run:
#
#     bash scripts/gpu_recall.sh            # in the repository root; $OUT must name an empty, writable folder
#
# llama, mamba2 and mamba (Mamba-1) are trained by scripts/train_tiny.py with --recall-mix / --copy-weight at 512-byte
# windows, each under its own --time-budget and a hard `timeout` around it, by default all three at once on the one
# GPU (these 1.8M-parameter models are bound by kernel launches, not by the GPU, so sharing it costs each little;
# SERIAL=1 runs them one after another with shorter budgets). Each model is independent: one failing does not stop
# the others. Whatever each left (a finished model, or the checkpoint of its last evaluation, marked "partial" in its
# train_log.json) is written to $OUT as ONE tar of its folder, <model>.tar, with its console output <model>.log,
# plus gpu_recall.log (environment, exit codes, final lines). rwkv is not trained here (its CUDA kernel compiles at
# load time).
#
# Knobs (environment): PYTHON (default python3), DEVICE (default cuda; cpu for a dry run), BUDGET_SCALE (multiplies
# every training budget, e.g. 0.05 for a dry run), OVERHEAD (seconds the hard timeout allows beyond a budget for
# start-up, final evaluation and saving; default 75), BATCH_SCALE (divides the batch sizes, e.g. 16 for a CPU dry
# run), MODELS (default "llama mamba2 mamba"), SERIAL (1: one model at a time).
# Wall time with the defaults: at most max(budget) + OVERHEAD + a few seconds = 285 s (serial: 300 s of budgets +
# per-model start-up, about 320 s).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=NO TOKENIZERS_PARALLELISM=false

PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
BUDGET_SCALE=${BUDGET_SCALE:-1}
OVERHEAD=${OVERHEAD:-75}
BATCH_SCALE=${BATCH_SCALE:-1}
MODELS=${MODELS:-"llama mamba2 mamba"}
SERIAL=${SERIAL:-0}
if [ -z "${OUT:-}" ]; then
    echo "gpu_recall.sh: OUT is not set (the folder that receives the tars and logs)" >&2
    exit 2
fi
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_recall.XXXXXX") || exit 2
LOG="$OUT/gpu_recall.log"
T0=$(date +%s)

say() { echo "[gpu_recall +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

# per model: training budget in seconds (parallel / serial), batch, lr, warmup steps, eval every, batch workers
budget() {
    case "$1:$SERIAL" in
        llama:1) echo 110 ;; mamba2:1) echo 130 ;; mamba:1) echo 60 ;;
        llama:*) echo 210 ;; mamba2:*) echo 210 ;; mamba:*) echo 150 ;;
    esac
}
args() {
    case "$1" in
        llama) echo "--batch $(( 64 / BATCH_SCALE > 0 ? 64 / BATCH_SCALE : 1 )) --lr 1.5e-3 --warmup 200 --eval-every 250 --workers 4" ;;
        mamba2) echo "--batch $(( 64 / BATCH_SCALE > 0 ? 64 / BATCH_SCALE : 1 )) --lr 2e-3 --warmup 200 --eval-every 250 --workers 4" ;;
        mamba) echo "--batch $(( 32 / BATCH_SCALE > 0 ? 32 / BATCH_SCALE : 1 )) --lr 2e-3 --warmup 100 --eval-every 100 --workers 2" ;;
    esac
}

train() {  # train one model into $WORK/<model>; its console output goes to $OUT/<model>.log
    local m=$1 b t
    b=$("$PYTHON" -c "print(max(1, round($(budget "$m") * $BUDGET_SCALE)))")
    t=$(( b + OVERHEAD ))
    say "$m: start, training budget ${b}s, hard timeout ${t}s"
    # shellcheck disable=SC2046
    timeout --signal=TERM --kill-after=10 "$t" "$PYTHON" scripts/train_tiny.py --model "$m" --out "$WORK" \
        --device "$DEVICE" --seq 512 --recall-mix 0.75 --copy-weight 1.0 --steps 1000000 --time-budget "$b" \
        --log-every 50 $(args "$m") > "$OUT/$m.log" 2>&1
    local rc=$?
    say "$m: exit $rc$( [ $rc -eq 124 ] && echo ' (hard timeout)')"
    echo "$rc" > "$WORK/$m.rc"
}

{
    echo "gpu_recall.sh: $(date -u +%FT%TZ) on $(hostname), DEVICE=$DEVICE BUDGET_SCALE=$BUDGET_SCALE SERIAL=$SERIAL"
    echo "OVERHEAD=$OVERHEAD BATCH_SCALE=$BATCH_SCALE MODELS=$MODELS PYTHON=$PYTHON work=$WORK"
    nvidia-smi -L 2>&1 | head -4
    "$PYTHON" -c "import sys, torch, transformers, numpy; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__, \
'numpy', numpy.__version__)" 2>&1 | tail -2
    echo "cpus $(nproc)"
} >> "$LOG"

pids=""
for m in $MODELS; do
    if [ "$SERIAL" = 1 ]; then
        train "$m"
    else
        train "$m" &
        pids="$pids $!"
    fi
done
for p in $pids; do wait "$p"; done

for m in $MODELS; do
    if [ -f "$WORK/$m/train_log.json" ] && [ -f "$WORK/$m/model.safetensors" ]; then
        if tar -C "$WORK" -cf "$OUT/$m.tar" "$m"; then
            say "$m: $OUT/$m.tar $(du -k "$OUT/$m.tar" | cut -f1) KiB ($(ls "$WORK/$m" | tr '\n' ' '))"
        else
            say "$m: tar failed"
        fi
    else
        say "$m: no model folder to send"
    fi
    echo "--- $m: last lines of $m.log" >> "$LOG"
    grep -E "recall|done|Error|error|Traceback" "$OUT/$m.log" 2>/dev/null | tail -8 >> "$LOG"
    tail -3 "$OUT/$m.log" >> "$LOG" 2>/dev/null
done
say "finished"
rm -rf "$WORK"
exit 0
