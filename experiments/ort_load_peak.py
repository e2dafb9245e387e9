"""Where an ONNX export's peak memory above the baseline comes from: ONNX Runtime's session load maps
model.onnx.data and packs every MatMulNBits weight from the mapped pages, so at the end of the load the process holds
the file's pages it read and the packed copies together; OrtStepper (lean) then gives the file's pages back
(edgekv.export.pte_stepper.release_file_pages). With --paged each export also loads inside
edgekv.export.pte_stepper.paging_out (as OrtStepper now does), which gives the pages back while the packing reads
them. This prints and stores, per export (and per mode): the RSS above the baseline (after importing onnxruntime) at
the end of the load, the peak (VmHWM), the file pages released and the RSS after.

    python experiments/ort_load_peak.py EXPORT [EXPORT ...] [--paged] [--repeats N] --out benchmarks/results/X.json

Each load runs in its own process (python -c), one thread, the session options OrtStepper sets."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from edgekv.children import child_setup  # a child dies with this process

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
def st(k):
    for line in open('/proc/self/status'):
        if line.startswith(k):
            return int(line.split()[1]) * 1024
import onnxruntime as ort
from contextlib import nullcontext
from edgekv.export.pte_stepper import paging_out, release_file_pages
f, paged = Path(sys.argv[1]), sys.argv[3] == '1'
base = st('VmRSS')
o = ort.SessionOptions(); o.enable_cpu_mem_arena = False; o.enable_mem_pattern = False; o.intra_op_num_threads = 1
t = time.process_time()
with paging_out(f / 'model.onnx.data') if paged else nullcontext():
    s = ort.InferenceSession(str(f / 'model.onnx'), o, providers=['CPUExecutionProvider'])
cpu = time.process_time() - t
after, hwm = st('VmRSS'), st('VmHWM')
rel = release_file_pages(f / 'model.onnx.data', sparse=True)
mib = 2.0 ** 20
print(json.dumps({'data_file_mib': (f / 'model.onnx.data').stat().st_size / mib, 'baseline_mib': base / mib,
                  'after_load_mib': (after - base) / mib, 'peak_mib': (hwm - base) / mib,
                  'file_pages_released_mib': rel / mib, 'after_release_mib': (st('VmRSS') - base) / mib,
                  'load_cpu_s': cpu}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+")
    ap.add_argument("--paged", action="store_true", help="also load each export with paging_out around the load (as "
                    "OrtStepper does), in its own process: the rows alternate")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        for e in a.exports:
            for paged in ((False, True) if a.paged else (False,)):
                p = subprocess.run([sys.executable, "-c", CHILD, str(Path(e).resolve()), str(ROOT), str(int(paged))],
                                   capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                                   timeout=600, preexec_fn=child_setup())
                r = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-500:]}
                rows.append({"export": Path(e).name, "paging_out": paged, **r, "loadavg": list(os.getloadavg())})
                print(json.dumps(rows[-1]))
    if a.out:
        Path(a.out).write_text(json.dumps({"experiment": "ort_load_peak", "started_utc": datetime.now(UTC).isoformat(
            timespec="seconds"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
