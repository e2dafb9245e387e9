"""`edgekv export`: the stages in order, each a small function returning a value you can inspect.

    load -> tokenizer -> trace -> lower-onnx -> serialize-onnx -> lower-pte -> serialize-pte
         -> verify-onnx -> verify-pte -> manifest -> publish

Everything is written into a temporary sibling folder and renamed into place at the end (publish), so a failure at
any stage leaves nothing half-written at --out. Each failure is one EdgekvError naming its stage.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import EdgekvError

FORMATS = ("onnx", "pte")
ONNX_SINGLE_FILE = 2**31 - 2**26  # protobuf's 2 GiB limit, less room for the graph itself
VERIFY_TEXT = ("The Python standard library is very extensive, offering a wide range of facilities. It contains "
               "built-in modules that provide access to system functionality such as file I/O.")


@dataclass
class ExportOptions:
    model: str
    strategy: str = "kv"
    formats: tuple[str, ...] = ("onnx",)
    max_ctx: int = 512
    out: Path = Path("export/model")
    prefill_chunk: int = 32  # tokens per call of the .pte `prefill` method
    verify_steps: int = 16
    force: bool = False
    threads: int | None = None  # torch / ONNX Runtime / XNNPACK threads while exporting and verifying


@dataclass
class Stages:
    """Names each stage as it runs (echo: one line per stage; status: a spinner while it runs, e.g. rich's
    Console.status), times it, and turns any failure into one line naming the stage."""
    names: list[str]
    echo: object = print
    status: object = None
    timings: dict = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str, detail: str = ""):
        i = self.names.index(name) + 1
        line = f"[{i}/{len(self.names)}] {name}{': ' + detail if detail else ''}"
        self.echo(line + " ...")
        t0 = time.perf_counter()
        try:
            with (self.status(line) if self.status else nullcontext()):
                yield
        except EdgekvError as e:
            raise EdgekvError(f"export failed at stage {name}: {e}") from e
        except Exception as e:  # a toolchain error: keep its type and first line, never a traceback
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise EdgekvError(f"export failed at stage {name}: {type(e).__name__}: {first}") from e
        self.timings[name] = round(time.perf_counter() - t0, 2)
        self.echo(f"      {name} done in {self.timings[name]:.1f} s")


def args_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def parse_formats(text: str) -> tuple[str, ...]:
    fs = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    bad = [f for f in fs if f not in FORMATS]
    if bad or not fs:
        raise EdgekvError(f"--format {text!r}: choose from {', '.join(FORMATS)} (comma-separated)")
    return fs


def verify_prompt(tokenizer, vocab: int, n_max: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer.encode(VERIFY_TEXT).ids
    else:  # a model without a tokenizer (tests' random models): fixed pseudo-random ids
        import numpy as np
        ids = np.random.default_rng(0).integers(0, vocab, 40).tolist()
    return ids[:max(1, n_max)]


def planned(arch, strategy, max_ctx: int, chunk: int) -> dict:
    """The planner's Deployment for this artifact (fp32 weights as exported, state at max_ctx, workspace at the
    prefill chunk): what `edgekv profile` compares its measurement with. Runtime overhead is the device's, not the
    artifact's, so it is left out (0) here."""
    from ..plan import deployment
    d = deployment(arch, strategy, max_ctx, "fp32", "onnxruntime", 0, chunk).to_json()
    return {"weights": d["weights"], "runtime": d["runtime"], "bytes": d["bytes"],
            "note": "edgekv plan's arithmetic for this artifact; runtime overhead is per device (device profiles)"}


def export_model(opts: ExportOptions, echo=print, status=None) -> dict:
    from .. import __version__
    from ..strategies import parse_strategy
    from . import manifest as mf

    out = Path(opts.out)
    if out.exists() and not opts.force:
        raise EdgekvError(f"{out} already exists (pass --force to replace it)")
    if not out.parent.exists():
        raise EdgekvError(f"cannot write {out}: folder {out.parent} does not exist")
    strategy = parse_strategy(opts.strategy)
    names = ["load", "tokenizer", "trace"] + [f"{s}-{f}" for f in opts.formats for s in ("lower", "serialize")] \
        + [f"verify-{f}" for f in opts.formats] + ["manifest", "publish"]
    st = Stages(names, echo, status)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        manifest = _run(opts, strategy, st, tmp, mf, __version__)
        with st.stage("publish", str(out)):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(opts: ExportOptions, strategy, st: Stages, tmp: Path, mf, version: str) -> dict:
    from ..models import load_model
    from .runtime import EagerStepper, OrtStepper, PteStepper
    from .trace import trace
    from .verify import describe, verify

    with st.stage("load", f"{opts.model} ({strategy.label}, max_ctx {opts.max_ctx})"):
        if opts.threads:
            import torch
            torch.set_num_threads(opts.threads)
        loaded = load_model(opts.model, strategy, opts.max_ctx)
        module, layout, args = loaded.module, loaded.layout, loaded.args
        cache_dtype = layout.tensors[0].dtype
    with st.stage("tokenizer"):
        from .tokenizer import write_tokenizer
        tok_entry = write_tokenizer(loaded.source, tmp)
        tokenizer = None
        if tok_entry:
            from tokenizers import Tokenizer
            tokenizer = Tokenizer.from_file(str(tmp / tok_entry["file"]))

    chunk = max(1, min(opts.prefill_chunk, opts.max_ctx))
    entries = {"onnx": [mf.entry_point("forward", "seq", layout, args.vocab)],
               "pte": [mf.entry_point("prefill", chunk, layout, args.vocab),
                       mf.entry_point("decode", 1, layout, args.vocab)]}
    with st.stage("trace", ", ".join(f"{f}:{e['name']}" for f in opts.formats for e in entries[f])):
        want = {}
        if "onnx" in opts.formats:
            want["onnx:forward"] = None
        if "pte" in opts.formats:
            want.update({"pte:prefill": chunk, "pte:decode": 1})
        eps = trace(module, want)

    artifacts = []
    if "onnx" in opts.formats:
        from . import to_onnx
        with st.stage("lower-onnx", "torch.onnx.export(dynamo=True)"):
            if args_bytes(module) > ONNX_SINGLE_FILE:
                raise EdgekvError(f"{args_bytes(module) / 1e9:.2f} GB of fp32 weights exceed ONNX's 2 GB single-file "
                                  "limit (external data is not implemented yet); use --format pte")
            model = to_onnx.lower_onnx(eps["onnx:forward"], entries["onnx"][0])
        with st.stage("serialize-onnx", "model.onnx"):
            to_onnx.save_onnx(model, tmp / "model.onnx")
            import onnxruntime
            artifacts.append({"format": "onnx", "file": "model.onnx",
                              "runtime": f"onnxruntime {onnxruntime.__version__}", "opset": to_onnx.opset(model),
                              "entry_points": entries["onnx"]})
            del model
    if "pte" in opts.formats:
        from . import to_pte
        with st.stage("lower-pte", "to_edge_transform_and_lower + XnnpackPartitioner"):
            edge = to_pte.lower_pte({"prefill": eps["pte:prefill"], "decode": eps["pte:decode"]})
        with st.stage("serialize-pte", "model.pte"):
            delegation = to_pte.delegation_summary(edge)  # before to_executorch, which rewrites the graphs
            (tmp / "model.pte").write_bytes(to_pte.to_buffer(edge))
            from importlib.metadata import version as pkg_version
            artifacts.append({"format": "pte", "file": "model.pte",
                              "runtime": f"executorch {pkg_version('executorch')}", "backend": "xnnpack",
                              "entry_points": entries["pte"], "delegation": delegation})
            del edge
    del eps

    partial = {"max_ctx": opts.max_ctx, "state": layout.to_json(), "artifacts": artifacts}
    n_max = opts.max_ctx - opts.verify_steps
    prompt = verify_prompt(tokenizer, args.vocab, n_max if n_max > 0 else opts.max_ctx - 1)
    steps = max(0, min(opts.verify_steps, opts.max_ctx - len(prompt)))
    verification = {}
    for fmt in opts.formats:
        with st.stage(f"verify-{fmt}", f"{len(prompt)} prompt tokens + {steps} decode steps vs eager torch"):
            if fmt == "onnx":
                art, ref = OrtStepper(partial, tmp, opts.threads, spin=False), EagerStepper(partial, module)
            else:
                art = PteStepper(partial, tmp, opts.threads)
                ref = EagerStepper(partial, module, chunk=art.chunk)
            v = verify(art, ref, prompt, steps, cache_dtype, artifacts[[a["format"] for a in artifacts].index(fmt)]
                       ["runtime"])
            verification[fmt] = v
            st.echo(f"      {describe(v)}")
            if not v["passed"]:
                raise EdgekvError(f"{fmt} artifact disagrees with eager torch beyond tolerance ({describe(v)})")

    with st.stage("manifest", "manifest.json (sha256 of every file)"):
        n_params = sum(p.numel() for p in module.parameters())
        manifest = {
            "schema_version": 1, "edgekv_version": version,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": loaded.arch.name, "source": str(loaded.source), "source_format": loaded.source_format,
                      "model_type": args.model_type, "n_params": int(n_params), "vocab": args.vocab,
                      "n_layers": args.n_layers, "config": args.to_json()},
            "strategy": {"name": strategy.name, "params": strategy.params, "label": strategy.label},
            "max_ctx": opts.max_ctx,
            "weights": {"dtype": "float32", "bytes": int(n_params * 4)},
            "state": layout.to_json(), "artifacts": artifacts, "tokenizer": tok_entry,
            "verification": verification, "timings_s": dict(st.timings),
            "deployment": planned(loaded.arch, strategy, opts.max_ctx, opts.prefill_chunk),
            "files": mf.file_table(tmp)}
        mf.write_manifest(tmp, manifest)
    return manifest
