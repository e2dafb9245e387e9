#!/bin/sh
# The exports benchmarks/results/arm64_vs_x86.json compares on arm64 (under qemu) and x86: SmolLM2-135M in every
# cache strategy that exports, with fp32 and int4 weights, and the tiny recurrent/attention fixtures, both formats,
# at a small max_ctx (emulation is 10-50x slower). Skips a folder that already holds a manifest.json.
# Usage: scripts/arm64_exports.sh [PYTHON]   (from the repository root; PYTHON defaults to .venv/bin/python)
set -u
PY=${1:-.venv/bin/python}
ex() {  # OUT ARGS...
    out=export/$1; shift
    [ -f "$out/manifest.json" ] && return 0
    echo "== $out" >&2
    nice -n 10 "$PY" -m edgekv.cli export --format onnx,pte --max-ctx 128 --verify-steps 4 --threads 1 --out "$out" "$@" \
        >/dev/null || echo "FAILED: $out" >&2
}
ex arm64-tiny-llama --model fixtures/tiny/llama --strategy kv
ex arm64-tiny-mamba --model fixtures/tiny/mamba --strategy ssm
ex arm64-tiny-mamba2 --model fixtures/tiny/mamba2 --strategy ssm
ex arm64-tiny-rwkv --model fixtures/tiny/rwkv --strategy linear
for s in kv kv-int4 kv-int8 window mla; do
    for w in fp32 int4; do
        case $s in
            window) ex arm64-smollm2-$s-$w --model smollm2-135m --strategy window:w=64,sinks=4 --weights $w ;;
            mla) ex arm64-smollm2-$s-$w --model smollm2-135m --rank 256 --weights $w ;;
            *) ex arm64-smollm2-$s-$w --model smollm2-135m --strategy $s --weights $w ;;
        esac
    done
done
