"""`edgekv ring`: run exact ring attention over local ranks, check it, and set the planner's prediction beside it.

    edgekv ring                                   # 4 ranks, 2k context, 32 x 128 heads (8 KV heads), 1 layer
    edgekv ring --world 4 --ctx 16k --check       # minutes on a 2-core host
    edgekv ring --world 2 --ctx 1001 --heads 8 --kv-heads 2 --head-dim 64 --check --json
    edgekv ring --device h100 --link infiniband --world 8 --ctx 128k --layers 80 --heads 64 --predict-only

No torch at import time (the main CLI imports this module for every command): launch is imported in the command.
"""
from __future__ import annotations

import sys

import click

from ..errors import EdgekvError
from . import model

DATACENTER = (("h100", "nvlink"), ("h100", "infiniband"))


@click.command("ring")
@click.option("--world", default=4, show_default=True, type=int, help="ranks (processes), one shard of the sequence each")
@click.option("-c", "--ctx", "ctx_text", default="2k", show_default=True, help="prompt length: 1001, 4k (=4096), 16k")
@click.option("--heads", default=32, show_default=True, type=int, help="query heads")
@click.option("--kv-heads", default=8, show_default=True, type=int, help="KV heads (GQA when fewer than --heads)")
@click.option("--head-dim", default=128, show_default=True, type=int, help="dimension of each attention head")
@click.option("--layers", default=1, show_default=True, type=int, help="attention layers run one after another")
@click.option("--decode-steps", default=8, show_default=True, type=int, help="tokens decoded after the prefill")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "bfloat16", "float16"]), help="q/K/V and messages (softmax is fp32)")
@click.option("--check", is_flag=True, help="compare with single-process attention (max abs difference)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--device", "device_name", default="host", show_default=True,
              help="device profile whose compute and interconnect the prediction uses")
@click.option("--link", default="loopback", show_default=True, help="interconnect of that profile (nvlink, "
              "pcie, infiniband, loopback)")
@click.option("--port", default=0, show_default=True, type=int, help="rendezvous port on 127.0.0.1 (0: a free one)")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True, type=float,
              help="seconds any rank may wait on another (init, barrier, each message)")
@click.option("--seed", default=0, show_default=True, type=int, help="seed of the random q, k, v every rank draws")
@click.option("--predict-only", is_flag=True, help="print the prediction without starting any rank")
@click.option("--explain", is_flag=True, help="print the assumptions behind the prediction and the datacenter "
              "decode comm/compute ratio (Llama-3-70B on H100)")
def ring(world, ctx_text, heads, kv_heads, head_dim, layers, decode_steps, dtype, check, as_json, device_name, link,
         port, timeout_s, seed, predict_only, explain):
    """Exact attention with the KV cache split by sequence over N local ranks (ring prefill, query-broadcast
    decode), measured against the planner's ring model."""
    from ..devices import load_device
    from ..units import parse_ctx

    ctx = parse_ctx(ctx_text)
    device = load_device(device_name)
    if link not in device.interconnect:
        have = ", ".join(sorted(device.interconnect)) or "none"
        raise EdgekvError(f"device {device.id!r} has no interconnect {link!r} (it has: {have})")
    from .config import RingConfig

    cfg = RingConfig(world=world, ctx=ctx, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, n_layers=layers,
                     decode_steps=decode_steps, dtype=dtype, seed=seed, port=port, timeout_s=timeout_s,
                     keep_outputs=check)
    cfg.validate()
    if not predict_only:  # before any rank starts: the world within the cores, the run's memory within what is free
        from .config import check_resources
        check_resources(cfg)
    predicted = {"prefill": model.predict_for_device("prefill", device, link, world, ctx, heads, kv_heads,
                                                     head_dim, layers, cfg.dtype_bytes)}
    if decode_steps:   # step s attends over ctx + s + 1 tokens: predict the middle one, as the median measured
        predicted["decode"] = model.predict_for_device("decode", device, link, world, ctx + decode_steps // 2,
                                                       heads, kv_heads, head_dim, layers, cfg.dtype_bytes)
    result = errors = None
    if not predict_only:
        from .launch import check_errors, run_ring   # torch from here on
        result = run_ring(cfg)
        if check:
            errors = check_errors(result)
    measured = result.measured() if result else None
    probe = result.link() if result else None
    from_link = {}
    if probe:     # the same model fed the transport this run measured: the prediction to set beside the measurement
        from_link = {phase: model.predict_for_device(phase, device, link, world, p.ctx, heads, kv_heads, head_dim,
                                                     layers, cfg.dtype_bytes, measured_link=probe)
                     for phase, p in predicted.items()}
    datacenter = _datacenter() if (explain or as_json) else []
    if as_json:
        _print_json(cfg, device.id, link, predicted, measured, errors, result, datacenter, probe, from_link)
    else:
        _print_tables(cfg, device, link, predicted, measured, errors, result, datacenter if explain else [], explain,
                      probe, from_link)


def _sharing(world: int) -> dict:
    from .config import usable_cores
    cores = usable_cores()
    return {"usable_cores": cores, "oversubscribed": world > cores}


def _comm_ratio(measured: dict | None, from_link: dict) -> dict:
    """measured comm / comm predicted from the measured link, per phase."""
    if not measured:
        return {}
    return {phase: measured[phase]["comm_s"] / p.comm_s for phase, p in from_link.items() if p.comm_s > 0}


def _datacenter() -> list:
    from ..devices import load_device
    out = []
    for dev, link in DATACENTER:
        try:
            out.append(model.datacenter_decode_ratio(load_device(dev), link))
        except (EdgekvError, KeyError):
            continue
    return out


def _top(phases: dict) -> dict:
    """The issue's flat {compute_s, comm_s, bytes_per_rank}: one decode step (one token, all layers), or the prefill
    when there is no decode; every phase in full beside it."""
    step = "decode" if "decode" in phases else "prefill"
    return {"compute_s": phases[step]["compute_s"], "comm_s": phases[step]["comm_s"],
            "bytes_per_rank": int(phases[step]["bytes_per_rank"]), **phases}


def _print_json(cfg, device_id, link, predicted, measured, errors, result, datacenter, probe, from_link) -> None:
    pred = {k: v.to_json() for k, v in predicted.items()}
    pred_link = {k: v.to_json() for k, v in from_link.items()}
    obj = {
        "world": cfg.world, "ctx": cfg.ctx,
        "prefill_max_abs_err": errors["prefill_max_abs_err"] if errors else None,
        "decode_max_abs_err": errors["decode_max_abs_err"] if errors else None,
        "measured": _top(measured) if measured else None,
        "predicted": _top(pred),
        "predicted_from_measured_link": _top(pred_link) if pred_link else None,
        "comm_measured_over_predicted": _comm_ratio(measured, from_link) or None,
        "link_measured": {**probe, **_sharing(cfg.world)} if probe else None,
        "step": "decode (one token, all layers)" if cfg.decode_steps else "prefill (all layers)",
        "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "layers": cfg.n_layers,
        "decode_steps": cfg.decode_steps, "dtype": cfg.dtype, "backend": result.backend if result else None,
        "device": device_id, "link": link, "elapsed_s": result.elapsed_s if result else None,
        "datacenter_decode": [d.to_json() for d in datacenter],
    }
    from ..jsonfile import output_json
    sys.stdout.write(output_json(obj) + "\n")


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def _print_tables(cfg, device, link, predicted, measured, errors, result, datacenter, explain, probe,
                  from_link) -> None:
    from ..termtext import Col, console, print_table, time_column
    from ..render import GB_NOTE
    from ..units import fmt_gb

    con = console()
    title = (f"ring attention: {cfg.world} ranks, ctx {cfg.ctx:,}, {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads "
             f"x {cfg.head_dim}, {cfg.n_layers} layer(s), {cfg.dtype}; predicted for {device.id} over {link}")
    names = {"prefill": "prefill", "decode": "decode, 1 token"}
    rows = []  # (phase, what, compute s, comm s, bytes per rank, wall s)
    for phase, p in predicted.items():
        rows.append((names[phase], f"predicted ({device.id} profile)" if from_link else "predicted", p.compute_s,
                     p.comm_s, p.bytes_per_rank, p.wall_s))
        if phase in from_link:
            q = from_link[phase]
            rows.append(("", "predicted (link measured)", q.compute_s, q.comm_s, q.bytes_per_rank, q.wall_s))
        if measured:
            m = measured[phase]
            rows.append(("", f"measured ({result.backend})", m["compute_s"], m["comm_s"], m["bytes_per_rank"],
                         m["wall_s"]))
        if phase == "decode":
            rows.append(("", "predicted, moving KV", None, p.naive_comm_s, p.naive_bytes_per_rank,
                         p.compute_s + p.naive_comm_s))
    heads, cols_s = zip(*(time_column(n, [r[i] for r in rows]) for n, i in (("compute", 2), ("comm", 3),
                                                                              ("wall", 5))))
    cols = [Col("phase", keep=True), Col("", keep=True), Col(heads[0], "right"), Col(heads[1], "right"),
            Col("bytes per\nrank, GB", "right", give=1), Col(heads[2], "right")]
    cells = [[r[0], r[1], cols_s[0][k], cols_s[1][k], fmt_gb(r[4]), cols_s[2][k]] for k, r in enumerate(rows)]
    print_table(con, title, cols, cells, f"{GB_NOTE}.")
    notes = ["compute: the busiest rank (causal prefill: the last); comm: the same messages sent without compute; "
             "bytes: sent + received by the busiest rank (exact in --json); decode: median over steps"]
    if measured:
        notes.append(f"prefill comm hidden behind compute: the busiest rank waited {_secs(measured['prefill']['exposed_comm_s'])} "
                     f"of {_secs(measured['prefill']['wall_s'])}; {result.elapsed_s:.1f} s in all (incl. start-up)")
    if probe:
        share = _sharing(cfg.world)
        notes.append(f"link measured in this run over {result.backend}: {_secs(probe['latency_s'])} per message "
                     f"(median of {probe['pings']} pings from one rank to all {cfg.world - 1} others at once, "
                     "beside every decode step; "
                     f"{_secs(probe['pair_latency_s'])} between two ranks alone), "
                     f"{probe['bytes_per_s'] / 1e9:.2f} GB/s per rank while every rank sends "
                     f"({probe['large_bytes'] / 2**20:.0f} MiB ring steps); {probe['messages']:,} messages")
        if share["oversubscribed"]:
            notes.append(f"{cfg.world} ranks on {share['usable_cores']} usable cores: oversubscribed; a rank woken "
                         "by a message may wait for a core (milliseconds when the cores are busy); the probe runs "
                         "all ranks at once, so its latency holds that wait and so does the prediction from it")
        ratios = _comm_ratio(measured, from_link)
        if ratios:
            notes.append("comm measured / predicted from the measured link: "
                         + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if errors:
        dec = errors["decode_max_abs_err"]
        notes.append(f"max |ring - single-process attention|: prefill {errors['prefill_max_abs_err']:.3g}"
                     + (f", decode {dec:.3g}" if dec is not None else "") + f" ({cfg.dtype} inputs and outputs, fp32 softmax)")
    if device.device_class != "host" and measured:
        notes.append(f"predictions are for {device.id} over {link}, one device per rank; measurements are this machine")
    for n in notes:
        con.print(f"  {n}")
    if explain:
        for phase, p in predicted.items():
            con.print(f"\n[bold]{phase} prediction assumes[/bold]")
            for a in p.assumptions:
                con.print(f"  - {a}")
        for d in datacenter:
            con.print(f"\n[bold]datacenter decode, {d.model} on {d.world} x {d.device} over {d.link}, "
                      f"ctx {d.ctx:,}[/bold]: comm / compute = {d.ratio:.2f} "
                      f"(comm {_secs(d.cost.comm_s)}, compute {_secs(d.cost.compute_s)} per token); "
                      f"moving KV blocks instead: {d.naive_ratio:.1f}")
            for a in d.assumptions:
                con.print(f"  - {a}")
