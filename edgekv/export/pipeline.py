"""`edgekv export`: the stages in order, each a small function returning a value you can inspect.

    load -> tokenizer [-> quantize] -> trace -> lower-onnx -> serialize-onnx [-> quantize-onnx] -> lower-pte
         -> serialize-pte -> verify-onnx -> verify-pte [-> verify-quant-onnx -> verify-quant-pte] -> manifest -> publish

--weights int8|int4|fp16 (edgekv.export.wquant) adds the bracketed stages: the .pte path quantizes a copy of the eager
module with torchao before tracing (a .pte-only export of a bf16 / fp16 checkpoint: one linear at a time from the
narrow weights, _quantize_narrow), the ONNX path post-processes model.onnx with ONNX Runtime's quantizer. verify-pte
then compares the .pte with that quantized eager module (catches lowering bugs); an ONNX graph quantized after export
has no eager twin, so verify-onnx is replaced by verify-quant-onnx; verify-quant-* compares each quantized artifact with
the fp32 eager model over real text (top-1, KL) and refuses it beyond quality.THRESHOLDS.

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import EdgekvError
from .manifest import PARTIAL  # inside a `.NAME.tmp-PID` folder while it is being written
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
    narrow_pte: bool = False  # the .pte's module was quantized from narrow weights (_quantize); x.module is placeholders
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


def pte_narrow(x: Export) -> bool:
    """A .pte-only int8 / int4 export: its module is quantized one linear at a time from the narrow weights
    (_quantize), so the fp32 module is never built (budget.narrow_export says the same before the export starts)."""
    return tuple(x.opts.formats) == ("pte",) and x.opts.weights in ("int8", "int4")


def narrow_load(spec: str, strategy, max_ctx: int):
    """load_any with a bf16 / fp16 checkpoint's large weights kept as stored and the module over placeholders for
    them (lazy_weights.narrow_loading) -> (Loaded, the Stash, or None where nothing was kept narrow). Where a loader
    made new tensors of the kept ones (a checkpoint rewritten into another layout) and so left a placeholder out of
    the module, it is loaded again the fp32 way: a module must never compute over a placeholder's zeros."""
    from ..models import load_any
    from .lazy_weights import narrow_loading
    with narrow_loading() as stash:
        loaded = load_any(spec, strategy, max_ctx)
    if not stash.by_ptr:  # nothing kept narrow (an fp32 checkpoint, a GGUF): the module is the fp32 one
        stash.release()
        return loaded, None
    owned = {p.untyped_storage().data_ptr() for p in loaded.module.parameters()}
    if set(stash.by_ptr) <= owned:
        return loaded, stash
    stash.release()
    del loaded
    return load_any(spec, strategy, max_ctx), None


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
        return _quantize_narrow(x)
    with x.st.stage("quantize", f"{x.opts.weights} weights for the .pte (torchao, on a copy of the eager module)"):
        import copy
        x.qmodule = copy.deepcopy(x.module)
        x.quantization["pte"] = quantize_module(x.qmodule, x.opts.weights, x.loaded.source_format)


def _quantize_narrow(x: Export) -> None:
    """The .pte's module from a narrow load (pte_narrow): verify-quant's fp32 logits first (each layer widened only
    while it runs: fp32_reference), then a copy sharing the placeholders, each linear widened from its bf16 / fp16
    copy just before torchao quantizes it (quantize_module's value), what the quantizer left over a placeholder
    widened, and the narrow copies dropped. The fp32 module never exists whole; after this stage the .pte's module
    holds the quantized codes and nothing else of the weights (x.module is placeholders only)."""
    from .lazy_weights import fp32_value, over_placeholders, sharing_copy, widen_left
    from .wquant import quantize_module, trim
    with x.st.stage("quantize", f"{x.opts.weights} weights for the .pte (torchao, one linear at a time from the "
                    f"{x.stash.kept_bytes / 1e9:.2f} GB of narrow weights; the fp32 reference computed first)"):
        fp32_reference(x, release=False)
        q = sharing_copy(x.module, x.stash)
        x.quantization["pte"] = quantize_module(q, x.opts.weights, x.loaded.source_format, fp32_value(x.stash))
        widen_left(q, x.stash)
        left = over_placeholders(q, x.stash)
        assert not left, f"the .pte's module still reads placeholders: {left[:3]}"
        x.qmodule, x.narrow_pte = q, True
        x.stash.release()
        x.stash = None
        trim()


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
                 "pte": [mf.entry_point("forward", "seq", layout, vocab, max_tokens=chunk)] if x.dynamic else
                 [mf.entry_point("prefill", chunk, layout, vocab, tail="decode"),
                  mf.entry_point("decode", 1, layout, vocab)]}
    if "genai" in opts.runners:  # GenAI's input names (input_ids, attention_mask), every row's logits
        x.entries["onnx"] = [genai.entry_point(layout, vocab)]
    if x.et_run and opts.pte_int8_kernel == "edgekv":
        raise EdgekvError("--runner executorch takes ExecuTorch's own kernels: use --pte-int8-kernel executorch")
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
    with x.st.stage(f"verify-{fmt}", f"{len(x.prompt)} prompt tokens + {x.steps} decode steps vs eager torch"):
        if fmt == "pte" and x.narrow_pte and not x.et_run:
            # the quantized module's last use (verify-quant holds the .pte to the fp32 logits computed in quantize):
            # its calls run first and it is freed before the .pte loads, so the two never share the memory
            ref, noise = target.references(x)
            ref, noise = record(ref, x.prompt, x.steps, noise)
            release_quantized(x)
            art = target.stepper(x)
        else:
            art = target.stepper(x)
            ref, noise = target.references(x) if fmt == "onnx" else target.references(x, art)
        v = verify(art, ref, x.prompt, x.steps, target.tolerance(x), _runtime(x, fmt), noise,
                   last_rows=x.et_run and fmt == "pte")
        x.verification[fmt] = v
        x.st.echo(f"      {describe(v)}")
        if not v["passed"]:
            raise EdgekvError(f"{fmt} artifact disagrees with eager torch beyond tolerance ({describe(v)})")


def release_quantized(x: Export) -> None:
    """Drop the .pte's quantized eager module (x.qmodule and its swapped copy x.pte_module): nothing after verify-pte
    reads it on the narrow route (pte_narrow)."""
    import gc

    from .wquant import trim
    x.qmodule = x.pte_module = None
    gc.collect()
    trim()


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


def fp32_reference(x: Export, release: bool = True) -> list[int]:
    """verify-quant's fp32 side, once for every format: the eager module's logits over the quality text
    (quality.teacher_forced). That is the module's last use but for tracing: with release its weights are freed after
    it, before a quantized artifact's runtime loads (an ONNX-only int8 / int4 export computes it before tracing and
    frees them as the graph no longer needs them: OnnxTarget). Returns the tokens."""
    from .lazy_weights import materialized
    from .quality import quality_tokens, teacher_forced
    from .runtime import EagerStepper
    from .tokenizer import bos_prefix
    from .wquant import trim
    tokens = quality_tokens(x.tokenizer, x.args.vocab, QUALITY_TOKENS, bos_prefix(x.tok_entry))
    if x.fp32_rows is None:
        # over placeholders (narrow_load) each layer is widened to fp32 only while it runs, once per call: the text is
        # then read in prefill calls only (2 at 128 tokens a call, not 1 and 127 one-token steps), which gives the
        # same logits up to fp32 rounding (a causal model's row i depends on tokens[:i + 1] only)
        whole = len(tokens) - 1 if x.stash is not None else None
        with short_state(x.module, x.layout.to_json(), len(tokens)) as state, materialized(x.module, x.stash):
            x.fp32_rows = teacher_forced(EagerStepper({**state, "artifacts": x.artifacts}, x.module), tokens, whole)
        trim()
        x.n_params = sum(p.numel() for p in x.module.parameters())
    if x.opts.weights == "int4-mix" and x.importance is None and x.tokenizer is not None:
        from . import wrecipe
        # over placeholders (narrow_load) the calibration runs on the widened values too: without them the layers'
        # inputs are those of the placeholders, and every channel's importance the same
        with materialized(x.module, x.stash):
            x.importance = wrecipe.eager_importance(
                x.module, lambda n: short_state(x.module, x.layout.to_json(), n),
                lambda state: EagerStepper({**state, "artifacts": x.artifacts}, x.module),
                list(bos_prefix(x.tok_entry)) + wrecipe.calibration_ids(lambda t: x.tokenizer.encode(t).ids,
                                                                        wrecipe.CALIBRATION_TOKENS))
        trim()
    if release:
        release_weights(x.module)
    return tokens


@contextmanager
def short_state(module, layout: dict, n: int):
    """The state verify-quant's fp32 side runs with (layout: StateLayout.to_json()): where every attention layer
    keeps one slot per position (edgekv.models.cache.FullCache) and every state tensor is [1, Hkv, ctx, D], the
    same layers with n slots for the n tokens of the quality text, and the state with n; else the export's own.
    The logits are the same: a slot past the text is masked out (an exact zero weight) at any ctx. What it saves
    is the ctx-sized state twice over (a step writes a new state beside the old) and attention over ctx slots,
    every step: at an 8k export of Llama-3.2-1B, 0.54 GB of the pass's peak and most of its time."""
    from ..models.cache import FullCache
    ctx = layout["ctx"]
    layers = [m for m in module.modules() if hasattr(m, "cache") and m.cache is not None]
    fits = (n < ctx and layers and all(type(m.cache) is FullCache and m.cache.slots == ctx for m in layers)
            and all(len(t["shape"]) == 4 and t["shape"][2] == ctx for t in layout["tensors"])
            and all(type(c) is FullCache for c in getattr(module, "caches", [None])))
    if not fits:
        yield {"max_ctx": ctx, "state": layout}
        return
    short = FullCache(n)
    tensors = [{**t, "shape": [*t["shape"][:2], n, t["shape"][3]], "bytes": t["bytes"] // ctx * n}
               for t in layout["tensors"]]
    saved = [m.cache for m in layers]
    try:
        for m in layers:
            m.cache = short
        yield {"max_ctx": n, "state": {**layout, "ctx": n, "tensors": tensors,
                                       "bytes": sum(t["bytes"] for t in tensors)}}
    finally:
        for m, c in zip(layers, saved):
            m.cache = c


def release_weights(module, keep=None) -> None:
    """Drop the eager module's weights (each parameter keeps its object and dtype, not its storage), but those whose
    storage `keep` (a module: the runtime's swapped copy being traced) shares; and collect."""
    import gc

    import torch
    kept = set() if keep is None else {t.untyped_storage().data_ptr()
                                       for t in (*keep.parameters(), *keep.buffers())}
    for p in module.parameters():
        if p.numel() and p.untyped_storage().data_ptr() not in kept:
            p.data = torch.empty(0, dtype=p.dtype)
    gc.collect()
    from .wquant import trim
    trim()


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
                                  pte_methods=len(x.entries["pte"])),
            "files": x.mf.file_table(x.tmp)}
        x.mf.write_manifest(x.tmp, manifest)
    return manifest


def _wider_bytes(record: dict) -> int:
    """int4-mix: the bytes its 8-bit tensors add over 4 bits and its 4-bit tensors' fp32 remainders, 4 B per block of 32
    (per_tensor's shapes), nominal like the rest."""
    import math
    return sum(math.prod(t["shape"]) * (t["bits"] - 4) // 8 + (math.prod(t["shape"]) // 8 if t["bits"] == 4 else 0)
               for t in record.get("per_tensor", {}).values() if "shape" in t)
