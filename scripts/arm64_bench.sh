#!/bin/sh
# benchmarks/results/arm64_vs_x86*.json: `edgekv profile EXPORT --arch arm64` (arm64 under qemu against this host)
# for the exports scripts/arm64_exports.sh made, one report each, gathered into one file. As root, after
# `make arm64-env`. Usage:
#   [RUNTIMES="ort executorch"] [CTX=40] [STEPS=8] [OUT=benchmarks/results/arm64_vs_x86.json] \
#       scripts/arm64_bench.sh [PYTHON] [EXPORT_NAME...]
# (default: every export/arm64-*); reports kept per export and runtime under .arm64/reports/ (a report already there
# is not run again), and the named exports' reports gathered into OUT at the end. CTX is the run's context (CTX -
# STEPS prompt tokens, then STEPS greedy steps).
set -u
PY=${1:-.venv/bin/python}
[ $# -gt 0 ] && shift
OUT=${OUT:-benchmarks/results/arm64_vs_x86.json}
PARTS=.arm64/reports
mkdir -p "$PARTS"
names=${*:-$(cd export && ls -d arm64-* 2>/dev/null)}
for n in $names; do
    [ -f "export/$n/manifest.json" ] || { echo "skip $n: no export/$n/manifest.json" >&2; continue; }
    for rt in ${RUNTIMES:-ort executorch}; do
        part=$PARTS/$n.$rt.json
        [ -f "$part" ] && ! grep -q '"not run' "$part" && continue  # done before
        grep -q "\"format\": \"$([ "$rt" = ort ] && echo onnx || echo pte)\"" "export/$n/manifest.json" || continue
        echo "== $n $rt $(date -u +%H:%M:%S)" >&2
        nice -n 10 "$PY" -m edgekv.cli profile "export/$n" --arch arm64 --runtime "$rt" --threads 1 \
            --ctx "${CTX:-40}" --steps "${STEPS:-8}" --out "$part" >"$PARTS/$n.$rt.log" 2>&1 \
            || echo "FAILED: $n $rt ($(tail -n 1 "$PARTS/$n.$rt.log"))" >&2
    done
done
"$PY" - "$PARTS" "$OUT" $names <<'PYEOF'
import json, sys
from pathlib import Path
parts, out, names = Path(sys.argv[1]), Path(sys.argv[2]), set(sys.argv[3:])
reports = {}
for p in sorted(parts.glob("arm64-*.json")):  # NAME.RUNTIME.json: one report per export, its runs gathered
    if p.name.rsplit(".", 2)[0] not in names:
        continue
    r = json.loads(p.read_text())
    r["artifact"] = Path(r["artifact"]).name
    have = reports.setdefault(r["artifact"], dict(r, runs=[]))
    have["runs"] += [x for x in r["runs"] if not x["status"].startswith("not run")]
reports = list(reports.values())
doc = {"what": "edgekv profile EXPORT --arch arm64 --threads 1: each export run in an arm64 Debian root under "
               "qemu-user (aarch64 wheels of the pinned runtimes) and on this x86-64 host, the arm64 run fed the "
               "host's greedy tokens; logits compared over the last prompt position and each decode step; the "
               "state after the run; memory above the runtime baseline (arm64: the guest's own pages, qemu's "
               "taken out). Bytes are integers; no speed (emulated).",
       "made_by": "scripts/arm64_exports.sh then scripts/arm64_bench.sh", "reports": reports}
out.write_text(json.dumps(doc, indent=1) + "\n")
print(f"wrote {out}: {len(reports)} exports")
PYEOF
