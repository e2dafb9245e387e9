#!/bin/sh
# benchmarks/results/arm64_vs_x86.json: `edgekv profile EXPORT --arch arm64` (arm64 under qemu against this host)
# for every export scripts/arm64_exports.sh made, one report each, gathered into one file. As root, after
# `make arm64-env`. Usage: [RUNTIMES="ort executorch"] scripts/arm64_bench.sh [PYTHON] [EXPORT_NAME...]
# (default: every export/arm64-*); reports kept per export and runtime under .arm64/reports/, gathered at the end.
set -u
PY=${1:-.venv/bin/python}
[ $# -gt 0 ] && shift
OUT=benchmarks/results/arm64_vs_x86.json
PARTS=.arm64/reports
mkdir -p "$PARTS"
names=${*:-$(cd export && ls -d arm64-* 2>/dev/null)}
for n in $names; do
    [ -f "export/$n/manifest.json" ] || { echo "skip $n: no export/$n/manifest.json" >&2; continue; }
    echo "== $n" >&2
    for rt in ${RUNTIMES:-ort executorch}; do
        part=$PARTS/$n.$rt.json
        [ -f "$part" ] && ! grep -q '"not run' "$part" && continue  # done before
        nice -n 10 "$PY" -m edgekv.cli profile "export/$n" --arch arm64 --runtime "$rt" --threads 1 \
            --out "$part" >/dev/null || echo "FAILED: $n $rt" >&2
    done
done
"$PY" - "$PARTS" "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
parts, out = Path(sys.argv[1]), Path(sys.argv[2])
reports = {}
for p in sorted(parts.glob("arm64-*.json")):  # NAME.RUNTIME.json: one report per export, its runs gathered
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
