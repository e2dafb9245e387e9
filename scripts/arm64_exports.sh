#!/bin/sh
# The exports benchmarks/results/arm64_vs_x86.json compares on arm64 (under qemu) and x86: SmolLM2-135M in every
# cache strategy that exports, with fp32 and int4 weights, and the tiny recurrent/attention fixtures, both formats,
# at a small max_ctx (emulation is 10-50x slower; 256 for quantized weights, which export checks over 256 tokens).
# Skips a folder that already holds a manifest.json.
# Usage: scripts/arm64_exports.sh [PYTHON]   (from the repository root; PYTHON defaults to .venv/bin/python)
set -u
PY=${1:-.venv/bin/python}
ex() {  # OUT FORMATS ARGS...
    out=export/$1; fmt=$2; shift 2
    case "$*" in *"--weights int"*) ctx=256 ;; *) ctx=128 ;; esac  # quantized weights are checked over 256 tokens
    [ -f "$out/manifest.json" ] && return 0
    echo "== $out" >&2
    nice -n 5 "$PY" -m edgekv.cli export --format "$fmt" --max-ctx $ctx --verify-steps 4 --threads 1 --out "$out" "$@" \
        >/dev/null || echo "FAILED: $out" >&2
}
ex arm64-tiny-llama onnx,pte --model fixtures/tiny/llama --strategy kv
ex arm64-tiny-llama-fp32 onnx --model fixtures/tiny/llama --strategy kv:dtype=fp32
ex arm64-tiny-llama-w4 onnx --model fixtures/tiny/llama --strategy kv:dtype=fp32 --weights int4
ex arm64-tiny-mamba onnx,pte --model fixtures/tiny/mamba --strategy ssm
ex arm64-tiny-mamba2 onnx,pte --model fixtures/tiny/mamba2 --strategy ssm
ex arm64-tiny-rwkv onnx,pte --model fixtures/tiny/rwkv --strategy linear
# SmolLM2: the plain fp32 cache in both formats; the rest in ONNX only (lowering a .pte of SmolLM2 took ~10
# min each on the shared 2-core host)
ex arm64-smollm2-kv-fp32 onnx,pte --model smollm2-135m --strategy kv --weights fp32
ex arm64-smollm2-kv-int4 onnx --model smollm2-135m --strategy kv --weights int4
for w in fp32 int4; do
    ex arm64-smollm2-kv-int4-$w onnx --model smollm2-135m --strategy kv-int4 --weights $w
    ex arm64-smollm2-kv-int8-$w onnx --model smollm2-135m --strategy kv-int8 --weights $w
    ex arm64-smollm2-window-$w onnx --model smollm2-135m --strategy window:w=64,sinks=4 --weights $w
    ex arm64-smollm2-mla-$w onnx --model smollm2-135m --rank 256 --weights $w
done
