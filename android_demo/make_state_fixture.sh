#!/bin/sh
# Remakes core/src/test/resources/tiny-llama-kv-int4-state (StateFileTest's cross-check fixture): the tiny Llama
# fixture exported with a 4-bit cache (uint8 codes, float16 scales and zeros) at max_ctx 32, run by
# `edgekv run --save-state` (Python's writer, edgekv/export/statefile.py) over the prompt "The cat sat" for 4 greedy
# tokens; the folder keeps the export's manifest.json and the state file (the model files stay out: the state file
# names them by the manifest's sha256). Usage, from the repository root: android_demo/make_state_fixture.sh [PYTHON]
set -eu
PY=${1:-.venv/bin/python}
out=android_demo/core/src/test/resources/tiny-llama-kv-int4-state
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m edgekv.cli export --model fixtures/tiny/llama --strategy kv-int4:group=16 --max-ctx 32 --format onnx \
    --verify-steps 2 --threads 1 --out "$tmp/export" >/dev/null
"$PY" -m edgekv.cli run "$tmp/export" --prompt "The cat sat" -n 4 --threads 1 --save-state "$tmp/state.safetensors"
mkdir -p "$out"
cp "$tmp/export/manifest.json" "$tmp/state.safetensors" "$out/"
