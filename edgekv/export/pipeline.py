"""`edgekv export`: the stages in order, each a small function returning a value you can inspect.

    load -> tokenizer [-> quantize] -> trace -> lower-onnx -> serialize-onnx [-> quantize-onnx] -> lower-pte
         -> serialize-pte -> verify-onnx -> verify-pte [-> verify-quant-onnx -> verify-quant-pte] -> manifest -> publish

--weights int8|int4|fp16 (edgekv.export.wquant) adds the bracketed stages: the .pte path quantizes a copy of the eager
module with torchao before tracing, the ONNX path post-processes model.onnx with ONNX Runtime's quantizer. verify-pte
then compares the .pte with that quantized eager module (catches lowering bugs); an ONNX graph quantized after export
has no eager twin, so verify-onnx is replaced by verify-quant-onnx; verify-quant-* compares each quantized artifact with
the fp32 eager model over real text (top-1, KL) and refuses it beyond wquant.THRESHOLDS.

Everything is written into a temporary sibling folder (`.NAME.tmp-PID`) and renamed into place at the end (publish),
so a failure at any stage leaves nothing half-written at --out; what a killed run left is removed by the next export
to the same --out. --force replaces only an earlier edgekv export (check_out), checked again right before the
rename. Each failure is one EdgekvError naming its stage.
"""
from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

from ..errors import EdgekvError
from .manifest import PARTIAL  # inside a `.NAME.tmp-PID` folder while it is being written
from .options import (  # noqa: F401 (re-exported: the export API)
    EXPORTABLE, FORMATS, QUALITY_TOKENS, VERIFY_TEXT, WEIGHT_DTYPES, ExportOptions, Stages, attends_only, check_applies,
    family_form, parse_formats, planned, strategy_entry, strategy_spec, verify_prompt)
from .publish import _make_parents, _remove_partial, check_out, clean_leftovers, publish  # noqa: F401 (re-exported)
from .verify import nudged, nudged_quantized  # noqa: F401 (re-exported)


def export_model(opts: ExportOptions, echo=print, status=None) -> dict:
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


def _run(opts: ExportOptions, strategy, st: Stages, tmp: Path, mf, version: str) -> dict:
    from ..models import load_any
    from .runtime import EagerStepper, OrtStepper, PteStepper
    from .trace import trace
    from .runners import unsupported as runners_unsupported
    from .verify import describe, verify

    with st.stage("load", f"{opts.model} ({strategy.label}, max_ctx {opts.max_ctx})"):
        if opts.threads:
            import torch
            torch.set_num_threads(opts.threads)
        loaded = load_any(opts.model, strategy, opts.max_ctx)
        module, layout, args = loaded.module, loaded.layout, loaded.args
    with st.stage("tokenizer"):
        from .tokenizer import bos_prefix, write_tokenizer
        tok_entry = write_tokenizer(loaded.source, tmp, args.vocab)
        tokenizer = None
        if tok_entry:  # the model folder's tokenizer.json: its panics and errors one line, its ids inside the vocab
            from .generate import load_tokenizer
            tokenizer = load_tokenizer(tmp / tok_entry["file"], args.vocab)

    from .licenses import license_files  # a Gemma export's NOTICE (and the terms): what its distributor must ship
    for name, data in license_files(loaded.arch.model_type, loaded.arch.name, f"{', '.join(opts.formats)} artifact(s), "
                                    f"{opts.weights} weights, state {strategy.label}").items():
        (tmp / name).write_bytes(data)

    if "calibrate" in st.names:  # kv-int8c: the static per-channel scales, before any copy of the module is made
        from .calibrate import CALIB_TOKENS, calibrate, calibration_ids
        n = min(CALIB_TOKENS, opts.max_ctx)
        with st.stage("calibrate", f"static K/V scales per channel from {n} tokens of real text (eager fp32)"):
            module.calibration = calibrate(module, calibration_ids(tokenizer, args.vocab, n, bos_prefix(tok_entry)))

    qmodule, quantization = module, {}
    if "quantize" in st.names:
        from .wquant import quantize_module
        with st.stage("quantize", f"{opts.weights} weights for the .pte (torchao, on a copy of the eager module)"):
            import copy
            qmodule = copy.deepcopy(module)
            quantization["pte"] = quantize_module(qmodule, opts.weights)

    chunk = max(1, min(opts.prefill_chunk, opts.max_ctx))
    # a .pte whose state is written in place (plain and quantized caches: ExecuTorch's LLM kernels) is one method
    # with a dynamic token axis: XNNPACK packs the weights once per method, and no call is padded. A recurrent state
    # keeps a fixed-size `prefill` and a one-token `decode`: its scan traces as an unrolled loop, which needs a fixed
    # length.
    # each attention layer ExecuTorch's custom_sdpa serves is swapped for one that calls it (edgekv.models.swaps);
    # when every layer is, the state is written in place
    from ..models.swaps import GQAAttention, for_runtime
    pte_module, pte_swapped = for_runtime(qmodule, "executorch") if "pte" in opts.formats else (qmodule, [])
    in_place = bool(pte_swapped) and all(pte_swapped)
    # any other state made of caches only (rolling window, MLA latent) traces with a dynamic token axis
    # too, as its ONNX graph does: one method, its state copied in and out of the method's planned buffers
    dynamic = in_place or ("pte" in opts.formats and attends_only(layout))
    if dynamic and chunk < 2:
        raise EdgekvError(f"a .pte of this strategy takes 2 or more tokens per call: use --prefill-chunk 2 or more "
                          f"(and --max-ctx 2 or more), not {chunk}")
    entries = {"onnx": [mf.entry_point("forward", "seq", layout, args.vocab)],
               "pte": [mf.entry_point("forward", "seq", layout, args.vocab, max_tokens=chunk)] if dynamic else
               [mf.entry_point("prefill", chunk, layout, args.vocab, tail="decode"),
                mf.entry_point("decode", 1, layout, args.vocab)]}
    from . import et_runner, genai
    if "genai" in opts.runners:  # GenAI's input names (input_ids, attention_mask), every row's logits
        entries["onnx"] = [genai.entry_point(layout, args.vocab)]
    et_run = "executorch" in opts.runners
    if et_run:  # forward(tokens, input_pos), the cache in the program's buffers (edgekv.export.et_runner)
        if not in_place:
            raise EdgekvError(f"--runner executorch: {strategy.label} is not written in place by this model's .pte")
        entries["pte"] = [et_runner.entry_point(args.vocab, chunk)]
    with st.stage("trace", ", ".join(f"{f}:{e['name']}" for f in opts.formats for e in entries[f])):
        eps = {}
        fused = any_fused = window_cache = False
        if "onnx" in opts.formats:
            # the layers ONNX Runtime's GroupQueryAttention serves, swapped (edgekv.models.swaps); the state is
            # written in place (fused) when every layer is
            onnx_module, swapped = for_runtime(module, "onnxruntime")
            fused, any_fused = bool(swapped) and all(swapped), any(swapped)
            window_cache = any(isinstance(m, GQAAttention) and m.window is not None for m in onnx_module.modules())
            if "genai" in opts.runners:
                eps["onnx:forward"] = genai.trace(onnx_module, opts.max_ctx)
            else:
                eps.update(trace(onnx_module, {"onnx:forward": None}))
            del onnx_module
        if et_run:
            eps["pte:forward"] = et_runner.trace(pte_module, chunk)
        elif dynamic:
            eps.update(trace(pte_module, {"pte:forward": None}, max_tokens=chunk))
        elif "pte" in opts.formats:
            eps.update(trace(qmodule, {"pte:prefill": chunk, "pte:decode": 1}))

    artifacts = []
    if "onnx" in opts.formats:
        from . import to_onnx
        with st.stage("lower-onnx", "torch.onnx.export(dynamo=True)"):
            model = to_onnx.lower_onnx(eps["onnx:forward"], entries["onnx"][0])
            if opts.weights == "fp32":  # the quantized recipes untie the head instead (wquant.quantize_onnx)
                from .wquant import fuse_tied_head
                fuse_tied_head(model)
        with st.stage("serialize-onnx", f"model.onnx + {to_onnx.EXTERNAL_DATA}"):
            to_onnx.save_onnx(model, tmp / "model.onnx")
            import onnxruntime
            art = {"format": "onnx", "file": "model.onnx", "runtime": f"onnxruntime {onnxruntime.__version__}",
                   "opset": to_onnx.opset(model), "entry_points": entries["onnx"]}
            if any_fused:
                art["attention"] = "com.microsoft.GroupQueryAttention"
            if window_cache:  # the sliding layers' rows in GroupQueryAttention's own order (the schema says which)
                art["sliding_window_cache"] = True
            if fused:  # present.* may be bound to past.*'s buffers: the nodes write the new rows in place
                art["state_in_place"] = True
            art["external_data"] = to_onnx.EXTERNAL_DATA
            from .runners import EDGEKV, GENAI
            art["runners"] = [EDGEKV]
            if "genai" in opts.runners:  # genai_config.json + tokenizer_config.json beside the graph
                written = genai.write_config(tmp, args, layout, tok_entry, opts.max_ctx, fused and not window_cache)
                art["runners"].append(GENAI)
                art["runner_files"] = [to_onnx.EXTERNAL_DATA, *written, tok_entry["file"]]
            artifacts.append(art)
            del model
        if "quantize-onnx" in st.names:
            from .wquant import quantize_onnx
            how = "the GGUF's own blocks, carried" if opts.weights == "gguf" else \
                f"{opts.weights} weights (ONNX Runtime quantization tools)"
            with st.stage("quantize-onnx", how):
                quantization["onnx"] = quantize_onnx(tmp / "model.onnx", tmp / "model.onnx", opts.weights,
                                                     entries["onnx"][0], loaded.source)
    if "pte" in opts.formats:
        from . import to_pte
        with st.stage("lower-pte", "to_edge_transform_and_lower + XnnpackPartitioner"):
            if et_run:
                if tok_entry is None:
                    raise EdgekvError("ExecuTorch's LLM runner needs a tokenizer: this model folder has none")
                edge = et_runner.lower(eps["pte:forward"],
                                       et_runner.metadata(args, tok_entry, opts.max_ctx, chunk))
            else:
                edge = to_pte.lower_pte({e["name"]: eps[f"pte:{e['name']}"] for e in entries["pte"]}, in_place)
        with st.stage("serialize-pte", "model.pte"):
            delegation = to_pte.delegation_summary(edge)  # before to_executorch, which rewrites the graphs
            (tmp / "model.pte").write_bytes(et_runner.to_buffer(edge) if et_run else to_pte.to_buffer(edge, in_place))
            from importlib.metadata import version as pkg_version
            art = {"format": "pte", "file": "model.pte", "runtime": f"executorch {pkg_version('executorch')}",
                   "backend": "xnnpack", "entry_points": entries["pte"], "delegation": delegation}
            if any(pte_swapped):  # the runtime must register ExecuTorch's LLM kernels
                art["attention"] = to_pte.LLM_KERNELS
            if in_place:  # `forward` writes its rows into the past.* inputs and returns them as present.*
                art["state_in_place"] = True
            from .runners import EDGEKV, ET_RUNNER
            art["runners"] = [ET_RUNNER] if et_run else [EDGEKV]
            if et_run:  # the cache lives in the program's mutable buffers; the runner loads tokenizer.json
                art["state_location"] = "mutable_buffers"
                art["runner_files"] = [tok_entry["file"]]
            artifacts.append(art)
            del edge
    del eps

    partial = {"max_ctx": opts.max_ctx, "state": layout.to_json(), "artifacts": artifacts}
    n_max = opts.max_ctx - opts.verify_steps
    prompt = verify_prompt(tokenizer, args.vocab, n_max if n_max > 0 else opts.max_ctx - 1)
    steps = max(0, min(opts.verify_steps, opts.max_ctx - len(prompt)))
    verification = {}
    from .verify import tolerance_dtype
    for fmt in opts.formats:
        if f"verify-{fmt}" not in st.names:
            continue
        with st.stage(f"verify-{fmt}", f"{len(prompt)} prompt tokens + {steps} decode steps vs eager torch"):
            noise = None
            if fmt == "onnx":
                art, ref = OrtStepper(partial, tmp, opts.threads, spin=False), EagerStepper(partial, module)
                if opts.weights == "fp32" and strategy.kv_bits:  # codes that a last bit flips (verify.limits)
                    noise = EagerStepper(partial, nudged(module))
            else:
                art = et_runner.RunnerPteStepper(partial, tmp, opts.threads) if et_run else \
                    PteStepper(partial, tmp, opts.threads)

                def eager(m):
                    return EagerStepper(partial, m, chunk=art.chunk, tail=art.tail, max_chunk=art.max_chunk)
                ref = eager(qmodule)
                if quantization.get("pte"):  # the quantized module's own rounding noise (verify.limits)
                    noise = eager(nudged_quantized(module, opts.weights))
            tol = "quantized-weights" if opts.weights != "fp32" else tolerance_dtype(layout, fmt == "onnx" and any_fused)
            v = verify(art, ref, prompt, steps, tol,
                       artifacts[[a["format"] for a in artifacts].index(fmt)]["runtime"], noise,
                       last_rows=et_run and fmt == "pte")
            verification[fmt] = v
            st.echo(f"      {describe(v)}")
            if not v["passed"]:
                raise EdgekvError(f"{fmt} artifact disagrees with eager torch beyond tolerance ({describe(v)})")
    if "verify-genai" in st.names:
        # GenAI runs the very model.onnx edgekv's own session runs. With fp32 weights both are held to eager torch;
        # with quantized weights there is no quantized torch module (ONNX Runtime's tools quantized the graph), so
        # GenAI is held to edgekv's ONNX Runtime session of the same graph, and that graph to the fp32 model by
        # verify-quant-onnx (top-1, KL): an int4 graph held to fp32 logits fails on rounding alone. The tolerance is
        # the quantized-weights one: MatMulNBits quantizes activations per block at run time, and GenAI's calls
        # (one token, then the prompt in its own chunks) round them at other points than edgekv's session does
        quantized = opts.weights != "fp32"
        with st.stage("verify-genai", f"ONNX Runtime GenAI's Generator, {len(prompt)} prompt tokens + {steps} decode "
                      "steps vs " + ("edgekv's ONNX Runtime session of the same graph" if quantized else
                                     "eager torch")):
            import onnxruntime_genai
            art = genai.GenaiStepper(partial, tmp, opts.threads)
            ref = OrtStepper(partial, tmp, opts.threads, spin=False) if quantized else EagerStepper(partial, module)
            v = verify(art, ref, prompt, steps, "quantized-weights" if quantized else tolerance_dtype(layout, any_fused),
                       f"onnxruntime-genai {onnxruntime_genai.__version__}", last_rows=True)
            if quantized:
                v["against"] = "edgekv's ONNX Runtime session of the same model.onnx"
            del art, ref
            verification["genai"] = v
            st.echo(f"      {describe(v)}")
            if not v["passed"]:
                raise EdgekvError(f"GenAI disagrees with {'the same graph in ONNX Runtime' if quantized else 'eager torch'}"
                                  f" beyond tolerance ({describe(v)})")

    weight_quality = {}
    for fmt in opts.formats:
        if f"verify-quant-{fmt}" not in st.names:
            continue
        from .wquant import describe_quality, quality_tokens, verify_quant
        with st.stage(f"verify-quant-{fmt}", f"{opts.weights} artifact vs fp32 eager, {QUALITY_TOKENS} tokens of "
                      "real text (top-1, KL)"):
            tokens = quality_tokens(tokenizer, args.vocab, QUALITY_TOKENS, bos_prefix(tok_entry))
            art = OrtStepper(partial, tmp, opts.threads, spin=False) if fmt == "onnx" else \
                et_runner.RunnerPteStepper(partial, tmp, opts.threads) if et_run else PteStepper(partial, tmp, opts.threads)
            weight_quality[fmt] = verify_quant(EagerStepper(partial, module), art, tokens, opts.weights, fmt)
            st.echo(f"      {describe_quality(weight_quality[fmt])}")
            if fmt not in verification:  # ONNX Runtime's tools quantized it: no quantized torch module to hold it to
                verification[f"{fmt}-quant"] = {  # so verify-quant is its verification, thresholds and all
                    "runtime": artifacts[[a["format"] for a in artifacts].index(fmt)]["runtime"],
                    "against": "the fp32 eager torch module, teacher-forced over real text", **weight_quality[fmt]}

    with st.stage("manifest", "manifest.json (sha256 of every file)"):
        plan_arch = loaded.arch
        if opts.weights == "gguf":  # the plan's gguf weights are the file's tensors as stored (its header)
            from ..arch import read_gguf
            plan_arch = read_gguf(loaded.source)
        n_params = sum(p.numel() for p in module.parameters())
        from .wquant import BITS
        manifest = {
            "schema_version": 1, "edgekv_version": version,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": {"name": loaded.arch.name, "source": str(loaded.source), "source_format": loaded.source_format,
                      "model_type": args.model_type, "n_params": int(n_params), "vocab": args.vocab,
                      "n_layers": args.n_layers, "config": args.to_json()},
            "strategy": strategy_entry(strategy, module),
            "max_ctx": opts.max_ctx,
            **({"planned_for": opts.planned_for} if opts.planned_for else {}),
            "weights": {"dtype": WEIGHT_DTYPES[opts.weights],
                        "bytes": int(quantization["onnx"]["bytes"]) if opts.weights == "gguf" else
                        int(n_params * BITS[opts.weights] // 8),
                        **({"quantization": quantization} if quantization else {})},
            "state": layout.to_json(), "artifacts": artifacts, "tokenizer": tok_entry,
            "runners_unsupported": runners_unsupported(layout, artifacts),
            "verification": verification, **({"weight_quality": weight_quality} if weight_quality else {}),
            "timings_s": dict(st.timings),
            "deployment": planned(plan_arch, strategy, opts.max_ctx, opts.formats, chunk, opts.weights,
                                  pte_methods=len(entries["pte"])),
            "files": mf.file_table(tmp)}
        mf.write_manifest(tmp, manifest)
    return manifest
