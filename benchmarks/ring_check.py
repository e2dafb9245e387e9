"""Ring attention on this host: predicted vs measured for a few configs, exactness, and a loopback link fit.

    .venv/bin/python benchmarks/ring_check.py                  # JSON on stdout (~1 min on 2 cores)
    .venv/bin/python benchmarks/ring_check.py --out out/ring.json --quick

Each config runs edgekv.ring over local gloo ranks with --check semantics; the prediction uses the device profile's
interconnect (host/loopback by default), as `edgekv ring` does. `loopback_fit` re-derives the link's latency and
bandwidth from the world-2 runs' comm probes (the messages without compute), to compare with what the profile says:
  latency   = decode probe time / 2            (one tiny message each way, 2 latencies)
  bandwidth = K/V block bytes / (prefill probe time - latency), per rank; x world for the whole machine
The Llama-3-70B datacenter decode ratios (H100 over NVLink and InfiniBand) are printed with their assumptions.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgekv.devices import load_device  # noqa: E402
from edgekv.ring import model  # noqa: E402

CONFIGS = [
    dict(world=2, ctx=1024, n_heads=8, n_kv_heads=2, head_dim=64),
    dict(world=2, ctx=4096, n_heads=32, n_kv_heads=8, head_dim=128),
    dict(world=4, ctx=1001, n_heads=8, n_kv_heads=2, head_dim=64),
    dict(world=4, ctx=2048, n_heads=32, n_kv_heads=8, head_dim=128),
]
QUICK = CONFIGS[:1] + CONFIGS[2:3]


def run_one(cfg_kw: dict, device, link: str, decode_steps: int) -> dict:
    from edgekv.ring.launch import RingConfig, check_errors, run_ring
    cfg = RingConfig(**cfg_kw, decode_steps=decode_steps, keep_outputs=True, timeout_s=300)
    t0 = time.perf_counter()
    res = run_ring(cfg)
    errors = check_errors(res)
    meas = res.measured()
    args = (device, link, cfg.world, cfg.ctx, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers,
            cfg.dtype_bytes)
    pred = {"prefill": model.predict_for_device("prefill", *args).to_json(),
            "decode": model.predict_for_device("decode", device, link, cfg.world, cfg.ctx + decode_steps // 2,
                                               *args[4:]).to_json()}
    for p in pred.values():
        p.pop("assumptions")
    return {"world": cfg.world, "ctx": cfg.ctx, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "dtype": cfg.dtype, "decode_steps": decode_steps, **errors,
            "measured": meas, "predicted": pred,
            "ratio_measured_over_predicted": {
                ph: {k: (meas[ph][k] / pred[ph][k] if pred[ph][k] else None)
                     for k in ("compute_s", "comm_s", "bytes_per_rank")} for ph in meas},
            "elapsed_s": time.perf_counter() - t0}


def loopback_fit(rows: list[dict]) -> dict | None:
    pts = [r for r in rows if r["world"] == 2]
    if not pts:
        return None
    big = max(pts, key=lambda r: r["measured"]["prefill"]["bytes_per_rank"])
    latency = min(r["measured"]["decode"]["comm_s"] for r in pts) / 2
    block = big["measured"]["prefill"]["bytes_per_rank"] / 2          # world 2: one block out, one in
    per_rank = block / max(big["measured"]["prefill"]["comm_s"] - latency, 1e-9)
    return {"latency_s": latency, "bytes_per_s_per_rank": per_rank, "bytes_per_s_machine": 2 * per_rank,
            "from": f"world 2, ctx {big['ctx']} (K/V block {int(block):,} B) and the decode probes"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="host")
    ap.add_argument("--link", default="loopback")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="two small configs only")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    a = ap.parse_args(argv)
    device = load_device(a.device)
    rows = []
    for kw in (QUICK if a.quick else CONFIGS):
        rows.append(run_one(kw, device, a.link, a.decode_steps))
        print(f"world {kw['world']} ctx {kw['ctx']}: done in {rows[-1]['elapsed_s']:.1f} s", file=sys.stderr)
    dc = []
    for dev, link in (("h100", "nvlink"), ("h100", "infiniband")):
        try:
            dc.append(model.datacenter_decode_ratio(load_device(dev), link).to_json())
        except Exception as e:  # noqa: BLE001 - a missing profile or link only drops that line
            print(f"skipping {dev}/{link}: {e}", file=sys.stderr)
    ic = device.interconnect[a.link]
    out = {"device": device.id, "link": a.link,
           "profile_link": {"bytes_per_s": ic.bytes_per_s.value, "latency_s": ic.latency_s.value},
           "runs": rows, "loopback_fit": loopback_fit(rows), "datacenter_decode": dc}
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
