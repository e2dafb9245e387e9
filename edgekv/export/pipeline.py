"""`edgekv export`: the stages in order, each a small function returning a value you can inspect.

    load -> tokenizer [-> quantize] -> trace -> lower-onnx -> serialize-onnx [-> quantize-onnx] -> lower-pte
         -> serialize-pte -> verify-onnx -> verify-pte [-> verify-quant-onnx -> verify-quant-pte] -> manifest -> publish

--weights int8|int4|fp16 (edgekv.export.wquant) adds the bracketed stages: the .pte path quantizes a copy of the eager
module with torchao before tracing (a .pte-only export of a bf16 / fp16 checkpoint: one linear at a time from the
narrow weights, edgekv.export.narrow_route), the ONNX path post-processes model.onnx with ONNX Runtime's quantizer.
verify-pte then compares the .pte with that quantized eager module (catches lowering bugs); an ONNX graph quantized
after export has no eager twin, so verify-onnx is replaced by verify-quant-onnx; verify-quant-* compares each quantized
artifact with the fp32 eager model over real text (top-1, KL) and refuses it beyond quality.THRESHOLDS.

lower-pte and serialize-pte are skipped when the same traced program (weights, lowering code and toolchain
versions included) was lowered before: model.pte comes from edgekv.export.pte_cache (EDGEKV_PTE_CACHE=off turns it
off), checked by its sha256 and then verified like a new one.

Everything is written into a temporary sibling folder (`.NAME.tmp-PID`) and renamed into place at the end (publish),
so a failure at any stage leaves nothing half-written at --out; what a killed run left is removed by the next export
to the same --out. --force replaces only an earlier edgekv export (check_out), checked again right before the
rename. Each failure is one EdgekvError naming its stage.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import EdgekvError
from .manifest import PARTIAL  # inside a `.NAME.tmp-PID` folder while it is being written
from .narrow_route import fp32_reference, narrow_load, pte_narrow, quantize_narrow, release_quantized
from .options import (EXPORTABLE, QUALITY_TOKENS, WEIGHT_DTYPES, ExportOptions, Stages, attends_only, check_applies,
                      family_form, planned, strategy_entry, verify_prompt)
from .publish import _make_parents, _remove_partial, check_out, clean_leftovers, publish


def export_model(opts: ExportOptions, echo=print, status=None) -> dict:
    from ..arch.gguf import kept_readers
    with kept_readers():  # a GGUF's header parsed once for the checks and the load (released after load)
        return _export_model(opts, echo, status)


def _export_model(opts: ExportOptions, echo=print, status=None) -> dict:
    from .. import __version__
    from ..strategies import parse_strategy
    from . import manifest as mf

    out = Path(opts.out)
    check_out(out, opts.model, opts.force)
    mf.utf8_path(out, "--out")
    if Path(opts.model).exists():  # a path, not a packaged name
        mf.utf8_path(Path(opts.model), "--model")
    strategy = parse_strategy(opts.strategy)
    if not strategy.exportable:
        raise EdgekvError(f"strategy {strategy.name} is planned but not exported (exportable: {', '.join(EXPORTABLE)})")
    aliased = family_form(opts.model, strategy)
    if aliased is not strategy:
        echo(f"{strategy.label} on this model is its hybrid state with that attention cache: {aliased.label}")
        strategy = aliased
    from .runners import check_runners
    check_runners(opts.runners, check_applies(opts.model, strategy, opts.max_ctx))
    from .wquant import PTE_FP16, parse_weights
    opts.weights = parse_weights(opts.weights)
    quantized = opts.weights != "fp32"
    if quantized and "pte" in opts.formats and opts.weights == "fp16":
        raise EdgekvError(PTE_FP16)
    if "pte" in opts.formats and opts.weights == "int4-mix":
        from .wquant import MIX_ONNX
        raise EdgekvError(MIX_ONNX)
    if opts.weights == "gguf":
        from ..models.weights import resolve_model
        from .wquant import GGUF_ONLY, GGUF_PTE
        if resolve_model(opts.model).suffix.lower() != ".gguf":
            raise EdgekvError(GGUF_ONLY)
        if "pte" in opts.formats:
            raise EdgekvError(GGUF_PTE)
    if quantized and opts.max_ctx < QUALITY_TOKENS:
        raise EdgekvError(f"--weights {opts.weights} is checked against fp32 over {QUALITY_TOKENS} tokens of real "
                          f"text: use --max-ctx {QUALITY_TOKENS} or more")
    from .budget import check_export
    # the memory and time it will need: refused here, before anything is written or read; said where the output starts
    budget = check_export(opts, strategy)
    names = ["load", "tokenizer"] + (["calibrate"] if strategy.static_scales else []) \
        + (["quantize"] if quantized and "pte" in opts.formats else []) + ["trace"]
    for f in opts.formats:
        names += [f"lower-{f}", f"serialize-{f}"] + (["quantize-onnx"] if quantized and f == "onnx" else [])
    names += [f"verify-{f}" for f in opts.formats if not (quantized and f == "onnx")]
    names += ["verify-genai"] if "genai" in opts.runners else []
    names += [f"verify-quant-{f}" for f in opts.formats if quantized] + ["manifest", "publish"]
    st = Stages(names, echo, status)
    made = _make_parents(out)  # --out export/NAME from any folder, as other exporters do; removed again on failure
    cleaned = clean_leftovers(out)
    if cleaned:
        echo(f"removed {len(cleaned)} leftover(s) of earlier exports to {out} that did not finish: "
             + ", ".join(p.name for p in cleaned))
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        (tmp / PARTIAL).touch()  # marks the folder as this export's own work until publish
    except OSError as e:
        raise EdgekvError(f"cannot write beside {out}: {e.strerror or e}") from None
    published = False
    try:
        echo(budget["line"])
        manifest = _run(opts, strategy, st, tmp, mf, __version__)
        with st.stage("publish", str(out)):
            publish(tmp, out, opts.model, opts.force, echo)
        published = True
        return manifest
    finally:
        if not published:
            _remove_partial(tmp)
            for d in made:  # innermost first; only folders this call made, and only while empty
                try:
                    d.rmdir()
                except OSError:
                    break


@dataclass
class Export:
    """An export in progress: the options, and what each stage made for the ones after it."""
    opts: ExportOptions
    strategy: object
    st: Stages
    tmp: Path
    mf: object
    loaded: object = None
    tok_entry: dict | None = None
    tokenizer: object = None
    qmodule: object = None  # the module the .pte is traced from: the eager one, or its weight-quantized copy
    quantization: dict = field(default_factory=dict)
    chunk: int = 1
    pte_module: object = None
    pte_swapped: list = field(default_factory=list)
    in_place: bool = False  # the .pte writes its state in place (every attention layer is ExecuTorch's LLM kernel)
    dynamic: bool = False  # the .pte is one method with a dynamic token axis
    entries: dict = field(default_factory=dict)
    eps: dict = field(default_factory=dict)
    fused: bool = False  # the ONNX graph writes its state in place (every layer is GroupQueryAttention)
    any_fused: bool = False
    window_cache: bool = False
    artifacts: list = field(default_factory=list)
    partial: dict = field(default_factory=dict)  # the manifest so far: what the steppers read
    prompt: list = field(default_factory=list)
    steps: int = 0
    verification: dict = field(default_factory=dict)
    weight_quality: dict = field(default_factory=dict)
    fp32_rows: object = None  # verify-quant's fp32 logits (quality.teacher_forced), computed once
    n_params: int = 0  # counted before verify-quant frees the eager module's weights
    importance: object = None  # int4-mix: the importance matrix from calibration text (edgekv.export.wrecipe)
    stash: object = None  # the streamed ONNX export's narrow weights while it lowers (edgekv.export.lazy_weights)
    narrow_pte: bool = False  # the .pte's module was quantized from narrow weights (narrow_route): x.module holds
    # placeholders only
    tok_child: object = None  # the tokenizer stage running on the second core since the start (edgekv.export.tok_child)

    module = property(lambda self: self.loaded.module)
    layout = property(lambda self: self.loaded.layout)
    args = property(lambda self: self.loaded.args)
    et_run = property(lambda self: "executorch" in self.opts.runners)


def _run(opts: ExportOptions, strategy, st: Stages, tmp: Path, mf, version: str) -> dict:
    """The stages in order (the module docstring), each a function of the export in progress."""
    x = Export(opts, strategy, st, tmp, mf)
    try:
        _start_tokenizer(x)
        return _stages(x, opts, st, version)
    finally:
        if x.tok_child is not None:  # an export stopped before its tokenizer stage: the child goes before tmp does
            x.tok_child.stop()
        if x.stash is not None:  # a failed export's narrow weights: not left CURRENT for the next one in this process
            x.stash.release()
            x.stash = None


def _stages(x: Export, opts: ExportOptions, st: Stages, version: str) -> dict:
    from .targets import TARGETS
    _load(x)
    _tokenizer(x)
    _licenses(x)
    if "calibrate" in st.names:
        _calibrate(x)
    x.qmodule = x.module
    if "quantize" in st.names:
        _quantize(x)
    _entry_points(x)
    _trace(x)
    for fmt in ("onnx", "pte"):  # ONNX first whatever --format's order: the artifacts' order in the manifest
        if fmt in opts.formats:
            TARGETS[fmt].write(x)
    x.eps.clear()
    _prompt(x)
    for fmt in opts.formats:
        if f"verify-{fmt}" in st.names:
            _verify(x, TARGETS[fmt])
    if "verify-genai" in st.names:
        _verify_genai(x)
    for fmt in opts.formats:
        if f"verify-quant-{fmt}" in st.names:
            _verify_quant(x, TARGETS[fmt])
    return _manifest(x, version)


def _load(x: Export) -> None:
    from ..models import load_any
    from .targets import OnnxTarget
    with x.st.stage("load", f"{x.opts.model} ({x.strategy.label}, max_ctx {x.opts.max_ctx})"):
        if x.opts.threads:
            import torch
            torch.set_num_threads(x.opts.threads)
        if OnnxTarget.alone(x) or pte_narrow(x):  # the weights stay as stored (lazy_weights)
            x.loaded, x.stash = narrow_load(x.opts.model, x.strategy, x.opts.max_ctx)
        else:
            x.loaded = load_any(x.opts.model, x.strategy, x.opts.max_ctx)
        from ..arch.gguf import release_readers
        release_readers()


def _start_tokenizer(x: Export) -> None:
    """A large GGUF's tokenizer.json is built in a child while load and the rest run (edgekv.export.tok_child)."""
    from .tok_child import TokenizerChild, worth_it
    source = worth_it(x.opts.model)
    if source is not None:
        x.tok_child = TokenizerChild(source, x.tmp)


def _tokenizer(x: Export) -> None:
    with x.st.stage("tokenizer"):
        from .tokenizer import write_tokenizer
        child, x.tok_child = x.tok_child, None
        if child is not None and child.source.resolve() == Path(x.loaded.source).resolve():
            try:
                x.tok_entry = child.result()
            finally:
                child.stop()
        else:
            if child is not None:  # the model loaded from another file than the one guessed: the stage as ever
                child.stop()
            x.tok_entry = write_tokenizer(x.loaded.source, x.tmp, x.args.vocab)
        if x.tok_entry:  # the model folder's tokenizer.json: its panics and errors one line, its ids inside the vocab
            from .generate import load_tokenizer
            x.tokenizer = load_tokenizer(x.tmp / x.tok_entry["file"], x.args.vocab)


def _licenses(x: Export) -> None:
    """A Gemma export's NOTICE (and the terms): what its distributor must ship."""
    from .licenses import license_files
    arch = x.loaded.arch
    for name, data in license_files(arch.model_type, arch.name, f"{', '.join(x.opts.formats)} artifact(s), "
                                    f"{x.opts.weights} weights, state {x.strategy.label}").items():
        (x.tmp / name).write_bytes(data)


def _calibrate(x: Export) -> None:
    """kv-int8c: the static per-channel scales, before any copy of the module is made."""
    from .calibrate import CALIB_TOKENS, calibrate, calibration_ids
    from .tokenizer import bos_prefix
    n = min(CALIB_TOKENS, x.opts.max_ctx)
    with x.st.stage("calibrate", f"static K/V scales per channel from {n} tokens of real text (eager fp32)"):
        from .lazy_weights import materialized
        with materialized(x.module, x.stash):
            x.module.calibration = calibrate(x.module, calibration_ids(x.tokenizer, x.args.vocab, n,
                                                                       bos_prefix(x.tok_entry)))


def _quantize(x: Export) -> None:
    from .wquant import quantize_module
    if x.stash is not None:
        return quantize_narrow(x)
    with x.st.stage("quantize", f"{x.opts.weights} weights for the .pte (torchao, on a copy of the eager module)"):
        import copy
        x.qmodule = copy.deepcopy(x.module)
        x.quantization["pte"] = quantize_module(x.qmodule, x.opts.weights, x.loaded.source_format)


def _entry_points(x: Export) -> None:
    """Each artifact's methods (manifest entry points), and how the .pte is traced.

    A .pte whose state is written in place (plain and quantized caches: ExecuTorch's LLM kernels) is one method with a
    dynamic token axis: XNNPACK packs the weights once per method, and no call is padded. A recurrent state keeps a
    fixed-size `prefill` and a one-token `decode`: its scan traces as an unrolled loop, which needs a fixed length.
    Each attention layer ExecuTorch's custom_sdpa serves is swapped for one that calls it (edgekv.models.swaps); when
    every layer is, the state is written in place. Any other state made of caches only (rolling window, MLA latent)
    traces with a dynamic token axis too, as its ONNX graph does: one method, its state copied in and out of the
    method's planned buffers."""
    from ..models.swaps import for_runtime
    from . import et_runner, genai
    opts, layout, vocab, mf = x.opts, x.layout, x.args.vocab, x.mf
    x.chunk = chunk = max(1, min(opts.prefill_chunk, opts.max_ctx))
    x.pte_module, x.pte_swapped = for_runtime(x.qmodule, "executorch", int8_kernel=opts.pte_int8_kernel) \
        if "pte" in opts.formats else (x.qmodule, [])
    x.in_place = bool(x.pte_swapped) and all(x.pte_swapped)
    x.dynamic = x.in_place or ("pte" in opts.formats and attends_only(layout))
    if x.dynamic and chunk < 2:
        raise EdgekvError(f"a .pte of this strategy takes 2 or more tokens per call: use --prefill-chunk 2 or more "
                          f"(and --max-ctx 2 or more), not {chunk}")
    x.entries = {"onnx": [mf.entry_point("forward", "seq", layout, vocab)],
                 "pte": [mf.entry_point("forward", "seq", layout, vocab, max_tokens=chunk, one_row=True)] if x.dynamic else
                 [mf.entry_point("prefill", chunk, layout, vocab, tail="decode"),
                  mf.entry_point("decode", 1, layout, vocab)]}
    if "genai" in opts.runners:  # GenAI's input names (input_ids, attention_mask), every row's logits
        x.entries["onnx"] = [genai.entry_point(layout, vocab)]
    if x.et_run and opts.pte_int8_kernel == "edgekv":
        raise EdgekvError("--runner executorch takes ExecuTorch's own kernels: use --pte-kernel executorch")
    if x.et_run:  # forward(tokens, input_pos), the cache in the program's buffers (edgekv.export.et_runner)
        if not x.in_place:
            raise EdgekvError(f"--runner executorch: {x.strategy.label} is not written in place by this model's .pte")
        from ..models.swaps import RingSdpaAttention
        if any(isinstance(m, RingSdpaAttention) for m in x.pte_module.modules()):
            # the rings are written in place in edgekv's own .pte (pte_stepper); the runner's program keeps the
            # cache in mutable buffers, which no test has run a ring through yet
            raise EdgekvError("--runner executorch: this model's sliding-window layers are not carried into the "
                              "runner's program yet; export without --runner (edgekv run reads the .pte)")
        x.entries["pte"] = [et_runner.entry_point(vocab, chunk)]


def _trace(x: Export) -> None:
    from .targets import TARGETS
    from .trace import trace
    with x.st.stage("trace", ", ".join(f"{f}:{e['name']}" for f in x.opts.formats for e in x.entries[f])):
        for fmt in ("onnx", "pte"):
            if fmt in x.opts.formats:
                TARGETS[fmt].trace(x, trace)


def _prompt(x: Export) -> None:
    """The manifest so far (what the steppers read), and the prompt and decode steps every verification runs."""
    opts = x.opts
    x.partial = {"max_ctx": opts.max_ctx, "state": x.layout.to_json(), "artifacts": x.artifacts}
    n_max = opts.max_ctx - opts.verify_steps
    from .tokenizer import bos_prefix
    x.prompt = verify_prompt(x.tokenizer, x.args.vocab, n_max if n_max > 0 else opts.max_ctx - 1, bos_prefix(x.tok_entry))
    x.steps = max(0, min(opts.verify_steps, opts.max_ctx - len(x.prompt)))


def _runtime(x: Export, fmt: str) -> str:
    return x.artifacts[[a["format"] for a in x.artifacts].index(fmt)]["runtime"]


def _verify(x: Export, target) -> None:
    """verify-FMT: the artifact against its eager module, prompt and decode steps, within the format's tolerance."""
    from .verify import describe, record, verify
    fmt = target.fmt
    # a .pte call that gives the last row only (the runner's) or one row (forward: manifest one_row) gives every
    # row of the prompt one token per call: the prompt again in its chunks, last row compared (verify's last_rows)
    last_rows = fmt == "pte" and (x.et_run or x.dynamic)
    with x.st.stage(f"verify-{fmt}", f"{len(x.prompt)} prompt tokens + {x.steps} decode steps vs eager torch"):
        if fmt == "pte" and x.narrow_pte and not x.et_run:
            # the quantized module's last use (verify-quant holds the .pte to the fp32 logits computed in quantize):
            # its calls run first and it is freed before the .pte loads, so the two never share the memory
            ref, noise = target.references(x)
            ref, noise = record(ref, x.prompt, x.steps, noise, last_rows)
            release_quantized(x)
            art = target.stepper(x)
        else:
            art = target.stepper(x)
            ref, noise = target.references(x) if fmt == "onnx" else target.references(x, art)
        v = verify(art, ref, x.prompt, x.steps, target.tolerance(x), _runtime(x, fmt), noise,
                   last_rows=last_rows)
        x.verification[fmt] = v
        x.st.echo(f"      {describe(v)}")
        if not v["passed"]:
            raise EdgekvError(f"{fmt} artifact disagrees with eager torch beyond tolerance ({describe(v)})")


def _verify_genai(x: Export) -> None:
    """GenAI runs the very model.onnx edgekv's own session runs. With fp32 weights both are held to eager torch;
    with quantized weights there is no quantized torch module (ONNX Runtime's tools quantized the graph), so GenAI is
    held to edgekv's ONNX Runtime session of the same graph, and that graph to the fp32 model by verify-quant-onnx
    (top-1, KL): an int4 graph held to fp32 logits fails on rounding alone. The tolerance is the quantized-weights one:
    MatMulNBits quantizes activations per block at run time, and GenAI's calls (one token, then the prompt in its own
    chunks) round them at other points than edgekv's session does."""
    from . import genai
    from .runtime import EagerStepper, OrtStepper
    from .verify import describe, tolerance_dtype, verify
    opts, quantized = x.opts, x.opts.weights != "fp32"
    with x.st.stage("verify-genai", f"ONNX Runtime GenAI's Generator, {len(x.prompt)} prompt tokens + {x.steps} decode "
                    "steps vs " + ("edgekv's ONNX Runtime session of the same graph" if quantized else "eager torch")):
        import onnxruntime_genai
        art = genai.GenaiStepper(x.partial, x.tmp, opts.threads)
        ref = OrtStepper(x.partial, x.tmp, opts.threads, spin=False) if quantized else EagerStepper(x.partial, x.module)
        v = verify(art, ref, x.prompt, x.steps,
                   "quantized-weights" if quantized else tolerance_dtype(x.layout, x.any_fused),
                   f"onnxruntime-genai {onnxruntime_genai.__version__}", last_rows=True)
        if quantized:
            v["against"] = "edgekv's ONNX Runtime session of the same model.onnx"
        del art, ref
        x.verification["genai"] = v
        x.st.echo(f"      {describe(v)}")
        if not v["passed"]:
            raise EdgekvError(f"GenAI disagrees with {'the same graph in ONNX Runtime' if quantized else 'eager torch'}"
                              f" beyond tolerance ({describe(v)})")


def _verify_quant(x: Export, target) -> None:
    """verify-quant-FMT: the weight-quantized artifact against the fp32 eager module over real text (top-1, KL)."""
    from .quality import check_quality, compare_rows, describe_quality
    fmt, opts = target.fmt, x.opts
    with x.st.stage(f"verify-quant-{fmt}", f"{opts.weights} artifact vs fp32 eager, {QUALITY_TOKENS} tokens of "
                    "real text (top-1, KL)"):
        tokens = fp32_reference(x)
        art = target.stepper(x)
        q = x.weight_quality[fmt] = check_quality(compare_rows(x.fp32_rows, art, tokens), opts.weights, fmt)
        x.st.echo(f"      {describe_quality(q)}")
        if fmt not in x.verification:  # ONNX Runtime's tools quantized it: no quantized torch module to hold it to
            x.verification[f"{fmt}-quant"] = {  # so verify-quant is its verification, thresholds and all
                "runtime": _runtime(x, fmt),
                "against": "the fp32 eager torch module, teacher-forced over real text", **q}


def _manifest(x: Export, version: str) -> dict:
    from .runners import unsupported as runners_unsupported
    from .wquant import BITS
    opts, loaded, args, module, quantization = x.opts, x.loaded, x.args, x.module, x.quantization
    with x.st.stage("manifest", "manifest.json (sha256 of every file)"):
        plan_arch = loaded.arch
        if opts.weights == "gguf":  # the plan's gguf weights are the file's tensors as stored (its header)
            from ..arch import read_gguf
            plan_arch = read_gguf(loaded.source)
        n_params = x.n_params or sum(p.numel() for p in module.parameters())
        manifest = {
            "schema_version": 1, "edgekv_version": version,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": loaded.arch.name, "source": str(loaded.source), "source_format": loaded.source_format,
                      "model_type": args.model_type, "n_params": int(n_params), "vocab": args.vocab,
                      "n_layers": args.n_layers, "config": args.to_json()},
            "strategy": strategy_entry(x.strategy, module),
            "max_ctx": opts.max_ctx,
            **({"planned_for": opts.planned_for} if opts.planned_for else {}),
            "weights": {"dtype": WEIGHT_DTYPES[opts.weights],
                        "bytes": int(quantization["onnx"]["bytes"]) if opts.weights == "gguf" else
                        int(n_params * BITS[opts.weights] // 8) + _wider_bytes(quantization.get("onnx") or {}),
                        **({"quantization": quantization} if quantization else {})},
            "state": x.layout.to_json(), "artifacts": x.artifacts, "tokenizer": x.tok_entry,
            "runners_unsupported": runners_unsupported(x.layout, x.artifacts),
            "verification": x.verification, **({"weight_quality": x.weight_quality} if x.weight_quality else {}),
            "timings_s": dict(x.st.timings),
            "deployment": planned(plan_arch, x.strategy, opts.max_ctx, opts.formats, x.chunk, opts.weights,
                                  pte_methods=len(x.entries["pte"]), int8_kernel=opts.pte_int8_kernel),
            "files": x.mf.file_table(x.tmp)}
        x.mf.write_manifest(x.tmp, manifest)
    return manifest


def _wider_bytes(record: dict) -> int:
    """int4-mix: the bytes its 8-bit tensors add over 4 bits and its 4-bit tensors' fp32 remainders, 4 B per block of 32
    (per_tensor's shapes), nominal like the rest."""
    import math
    return sum(math.prod(t["shape"]) * (t["bits"] - 4) // 8 + (math.prod(t["shape"]) // 8 if t["bits"] == 4 else 0)
               for t in record.get("per_tensor", {}).values() if "shape" in t)
