#!/bin/sh
# The exports benchmarks/results/arm64_vs_x86*.json compare on arm64 (under qemu) and x86: the tiny recurrent and
# attention fixtures, and SmolLM2-135M in every cache strategy that exports with int4 weights (what a phone runs) and
# fp32 weights, each format in its own folder (NAME for ONNX, NAME-pte for the .pte), at a small max_ctx (emulation
# is 10-50x slower; 256 with quantized weights, which export checks over 256 tokens). Skips a folder that already
# holds a manifest.json; a failed export's log is kept as .arm64/logs/NAME.log.
# Usage (from the repository root): scripts/arm64_exports.sh [PYTHON] [NAME|tiny|smollm2-int4|smollm2-fp32 ...]
# PYTHON defaults to .venv/bin/python; the names default to the groups tiny, smollm2-int4, smollm2-fp32 in that order
# (NAME: one export of a group, e.g. arm64-smollm2-kv-int4-int4-pte).
set -u
PY=${1:-.venv/bin/python}
[ $# -gt 0 ] && shift
LOGS=.arm64/logs
args() {  # NAME -> "FORMATS ARGS..." (empty for an unknown name)
    n=${1%-pte}; fmt=onnx; [ "$n" != "$1" ] && fmt=pte
    case $n in
    arm64-tiny-llama) echo "onnx,pte --model fixtures/tiny/llama --strategy kv" ;;
    arm64-tiny-llama-fp32) echo "onnx --model fixtures/tiny/llama --strategy kv:dtype=fp32" ;;
    arm64-tiny-llama-w4) echo "onnx --model fixtures/tiny/llama --strategy kv:dtype=fp32 --weights int4" ;;
    arm64-tiny-mamba|arm64-tiny-mamba2) echo "onnx,pte --model fixtures/tiny/${n#arm64-tiny-} --strategy ssm" ;;
    arm64-tiny-rwkv) echo "onnx,pte --model fixtures/tiny/rwkv --strategy linear" ;;
    arm64-smollm2-*-int4|arm64-smollm2-*-fp32)
        w=${n##*-}; s=${n#arm64-smollm2-}; s=${s%-*}
        case $s in
        kv-fp16|kv-fp32) s="--strategy kv:dtype=${s#kv-}" ;;
        kv-int8|kv-int4) s="--strategy $s" ;;
        window) s="--strategy window:w=64,sinks=4" ;;
        mla) s="--rank 256" ;;
        *) return 0 ;;
        esac
        echo "$fmt --model smollm2-135m $s --weights $w" ;;
    esac
}
ex() {  # NAME
    a=$(args "$1")
    [ -n "$a" ] || { echo "arm64_exports: unknown export $1" >&2; return 1; }
    out=export/$1
    case "$a" in *"--weights int"*) ctx=256 ;; *) ctx=128 ;; esac  # quantized weights are checked over 256 tokens
    [ -f "$out/manifest.json" ] && return 0
    echo "== $out $(date -u +%H:%M:%S)" >&2
    mkdir -p export "$LOGS"
    # shellcheck disable=SC2086
    if nice -n 10 "$PY" -m edgekv.cli export --max-ctx $ctx --verify-steps 4 --threads 1 --out "$out" --format $a \
            >"$LOGS/$1.log" 2>&1; then
        echo "   done $(date -u +%H:%M:%S)" >&2
    else
        echo "FAILED: $out ($(tail -n 1 "$LOGS/$1.log"))" >&2
    fi
}
group() {
    case $1 in
    tiny) echo arm64-tiny-llama arm64-tiny-llama-fp32 arm64-tiny-llama-w4 arm64-tiny-mamba arm64-tiny-mamba2 arm64-tiny-rwkv ;;
    smollm2-int4|smollm2-fp32)
        for f in "" -pte; do
            for s in kv-fp16 kv-fp32 kv-int8 kv-int4 window mla; do printf '%s ' "arm64-smollm2-$s-${1#smollm2-}$f"; done
        done; echo ;;
    *) echo "$1" ;;
    esac
}
for g in ${*:-tiny smollm2-int4 smollm2-fp32}; do
    for n in $(group "$g"); do ex "$n"; done
done
