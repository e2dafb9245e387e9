"""One object per artifact format, with the same face: trace its entry points, lower and serialize them into the
export folder (its manifest entry), and the steppers its verification runs (the artifact and its eager reference).
ExecuTorch's source_transformation/ in spirit: what differs between ONNX Runtime and ExecuTorch lives in its target,
and pipeline._run only walks the formats in order. `x` is the export in progress (pipeline.Export)."""
from __future__ import annotations

from ..errors import EdgekvError


class OnnxTarget:
    fmt = "onnx"

    @staticmethod
    def trace(x, trace) -> None:
        """The layers ONNX Runtime's GroupQueryAttention serves, swapped (edgekv.models.swaps), traced; the state is
        written in place (fused) when every layer is."""
        from ..models.swaps import GQAAttention, for_runtime
        from . import genai
        alone = OnnxTarget.alone(x)
        if alone:  # the eager module is needed for nothing but this graph: verify-quant's fp32 side first
            from .narrow_route import fp32_reference
            fp32_reference(x, release=False)
        onnx_module, swapped = for_runtime(x.module, "onnxruntime")
        if alone:  # then what the swapped copy does not share (the separate q/k/v of its fused ones) freed, and the
            from .lazy_weights import stash_weights  # weights traced kept as their exact bf16 / fp16 (lazy_weights:
            from .narrow_route import release_weights  # the module traces over placeholders)
            for m in onnx_module.modules():  # a fused layer's separate q/k/v: the graph reads its qkv_proj only
                if isinstance(m, GQAAttention) and "qkv_proj" in m._modules:
                    for name in ("q_proj", "k_proj", "v_proj"):
                        m._modules.pop(name, None)  # its own dict (swaps._share): the eager layer keeps them
            release_weights(x.module, keep=onnx_module)
            x.stash = stash_weights(onnx_module, x.module)
        x.fused, x.any_fused = bool(swapped) and all(swapped), any(swapped)
        x.window_cache = any(isinstance(m, GQAAttention) and m.window is not None for m in onnx_module.modules())
        if "genai" in x.opts.runners:
            x.eps["onnx:forward"] = genai.trace(onnx_module, x.opts.max_ctx)
        else:
            x.eps.update(trace(onnx_module, {"onnx:forward": None}, lazy_state=True))

    @staticmethod
    def alone(x) -> bool:
        """The streamed ONNX graph is the only thing traced from the eager module (no .pte, no GenAI runner): its
        weights may stay narrow from the load on (lazy_weights), as only verify-quant's fp32 reference (and
        kv-int8c's calibration) run it eagerly."""
        return OnnxTarget.streamed(x) and "pte" not in x.opts.formats and "genai" not in x.opts.runners

    @staticmethod
    def streamed(x) -> bool:
        """int8 / int4 weights are quantized, and a GGUF's blocks carried (gguf_blocks.carry), one at a time from the
        graph's own W (onnx_quant.quantize_onnx): lowering leaves their transposes unfolded, so no fp32 copy of the
        weights is made beside the module's, and the module's weights are freed before quantize-onnx."""
        return x.opts.weights in ("int8", "int4", "int4-mix", "gguf")

    @staticmethod
    def write(x) -> None:
        """lower-onnx, serialize-onnx and (quantized weights) quantize-onnx."""
        from . import to_onnx
        opts, st, tmp = x.opts, x.st, x.tmp
        streamed = OnnxTarget.streamed(x)
        with st.stage("lower-onnx", "torch.onnx.export(dynamo=True)"):
            model = to_onnx.lower_onnx(x.eps.pop("onnx:forward"), x.entries["onnx"][0], fold_weights=not streamed,
                                       stash=x.stash)
        with st.stage("serialize-onnx", f"model.onnx + {to_onnx.EXTERNAL_DATA}"):
            to_onnx.save_onnx(model, tmp / "model.onnx")  # one tensor at a time
            del model
            if x.stash is not None:  # the narrow copies: written, read back from the file by quantize-onnx
                x.stash.release()
                x.stash = None
            if opts.weights == "fp32":  # the quantized recipes untie the head instead (onnx_quant.quantize_onnx)
                from .onnx_stream import fuse_tied_head_file
                fuse_tied_head_file(tmp / "model.onnx")
            x.artifacts.append(OnnxTarget._artifact(x, to_onnx.opset_of(tmp / "model.onnx")))
        if "quantize-onnx" in st.names:
            from .onnx_quant import quantize_onnx
            how = "the GGUF's own blocks, carried" if opts.weights == "gguf" else \
                f"{opts.weights} weights (" + ("edgekv.export.wrecipe's bits and blocks, as MatMulNBits"
                                               if opts.weights == "int4-mix" else "ONNX Runtime quantization tools") + ")"
            with st.stage("quantize-onnx", how):
                if streamed and "pte" not in opts.formats:  # the eager module is not traced again: verify-quant's
                    from .narrow_route import fp32_reference  # fp32 side (if not yet), its weights freed before
                    fp32_reference(x)                         # quantizing
                x.quantization["onnx"] = quantize_onnx(tmp / "model.onnx", tmp / "model.onnx", opts.weights,
                                                       x.entries["onnx"][0], x.loaded.source, x.importance)

    @staticmethod
    def _artifact(x, opset: int) -> dict:
        """model.onnx's manifest entry (and, for GenAI, its config files written beside the graph)."""
        import onnxruntime

        from . import genai, to_onnx
        from .runners import EDGEKV, GENAI
        art = {"format": "onnx", "file": "model.onnx", "runtime": f"onnxruntime {onnxruntime.__version__}",
               "opset": opset, "entry_points": x.entries["onnx"]}
        if x.any_fused:
            art["attention"] = "com.microsoft.GroupQueryAttention"
        if x.window_cache:  # the sliding layers' rows in GroupQueryAttention's own order (the schema says which)
            art["sliding_window_cache"] = True
        if x.fused:  # present.* may be bound to past.*'s buffers: the nodes write the new rows in place
            art["state_in_place"] = True
        art["external_data"] = to_onnx.EXTERNAL_DATA
        art["runners"] = [EDGEKV]
        if "genai" in x.opts.runners:  # genai_config.json + tokenizer_config.json beside the graph
            written = genai.write_config(x.tmp, x.args, x.layout, x.tok_entry, x.opts.max_ctx, x.fused,
                                         x.window_cache)
            art["runners"].append(GENAI)
            art["runner_files"] = [to_onnx.EXTERNAL_DATA, *written, x.tok_entry["file"]]
        return art

    @staticmethod
    def stepper(x):
        from .runtime import OrtStepper
        return OrtStepper(x.partial, x.tmp, x.opts.threads, spin=False)

    @staticmethod
    def references(x):
        """The eager module the graph is held to, and (fp32 weights, a quantized cache) the same module with codes a
        last bit flips (verify.limits)."""
        from .runtime import EagerStepper
        from .verify import nudged
        noise = EagerStepper(x.partial, nudged(x.module)) if x.opts.weights == "fp32" and x.strategy.kv_bits else None
        return EagerStepper(x.partial, x.module), noise

    @staticmethod
    def tolerance(x) -> str:
        from .verify import tolerance_dtype
        return "quantized-weights" if x.opts.weights != "fp32" else tolerance_dtype(x.layout, x.any_fused)


class PteTarget:
    fmt = "pte"

    @staticmethod
    def trace(x, trace) -> None:
        """ExecuTorch's LLM runner's forward, one method with a dynamic token axis, or prefill + decode."""
        from . import et_runner
        if x.et_run:
            x.eps["pte:forward"] = et_runner.trace(x.pte_module, x.chunk)
        elif x.dynamic:
            x.eps.update(trace(x.pte_module, {"pte:forward": None}, max_tokens=x.chunk, one_row=True))
        else:
            x.eps.update(trace(x.qmodule, {"pte:prefill": x.chunk, "pte:decode": 1}))

    @staticmethod
    def write(x) -> None:
        """lower-pte and serialize-pte."""
        from . import et_runner, pte_cache, to_pte
        st, tmp = x.st, x.tmp
        eps = {e["name"]: x.eps[f"pte:{e['name']}"] for e in x.entries["pte"]}
        meta = None
        if x.et_run:
            if x.tok_entry is None:
                raise EdgekvError("ExecuTorch's LLM runner needs a tokenizer: this model folder has none")
            meta = et_runner.metadata(x.args, x.tok_entry, x.opts.max_ctx, x.chunk)
        key = pte_cache.program_key(eps, in_place=x.in_place, runner_metadata=meta) \
            if pte_cache.limit() is not None else None
        hit = key and pte_cache.fetch(key, tmp / "model.pte")
        if hit:  # the same traced program, weights and lowering code as an earlier export's (edgekv.export.pte_cache)
            with st.stage("lower-pte", f"the same program was lowered before: {pte_cache.folder() / key}.pte"):
                pass
            with st.stage("serialize-pte", "model.pte (from the cache, its sha256 checked)"):
                x.artifacts.append(PteTarget._artifact(x, hit["delegation"]))
            return
        with st.stage("lower-pte", "to_edge_transform_and_lower + XnnpackPartitioner"):
            if x.et_run:
                edge = et_runner.lower(x.eps["pte:forward"], meta)
            else:
                edge = to_pte.lower_pte(eps, x.in_place)
        with st.stage("serialize-pte", "model.pte"):
            delegation = to_pte.delegation_summary(edge)  # before to_executorch, which rewrites the graphs
            (tmp / "model.pte").write_bytes(et_runner.to_buffer(edge) if x.et_run else to_pte.to_buffer(edge, x.in_place))
            x.artifacts.append(PteTarget._artifact(x, delegation))
            del edge
            if key:
                pte_cache.store(key, tmp / "model.pte", {"delegation": delegation})

    @staticmethod
    def _artifact(x, delegation: dict) -> dict:
        from importlib.metadata import version as pkg_version

        from ..models.swaps import custom_ops

        from . import to_pte
        from .runners import EDGEKV, ET_RUNNER
        art = {"format": "pte", "file": "model.pte", "runtime": f"executorch {pkg_version('executorch')}",
               "backend": "xnnpack", "entry_points": x.entries["pte"], "delegation": delegation}
        if any(x.pte_swapped):  # the runtime must register ExecuTorch's LLM kernels
            art["attention"] = to_pte.LLM_KERNELS
        if x.in_place:  # `forward` writes its rows into the past.* inputs and returns them as present.*
            art["state_in_place"] = True
        ops = custom_ops(x.pte_module)
        if ops:  # edgekv's own kernels (--pte-kernel edgekv): an app compiles their sources with its runtime;
            # edgekv run loads its own build of them (nothing from an export folder is executed: SECURITY.md)
            from .. import native
            art["custom_ops"] = {"ops": ops,
                                 "sources": [f"edgekv/native/{n}" for n in native.SOURCES + native.HEADERS],
                                 "sources_sha256": native.source_digest()}
        art["runners"] = [ET_RUNNER] if x.et_run else [EDGEKV]
        if x.et_run:  # the cache lives in the program's mutable buffers; the runner loads tokenizer.json
            art["state_location"] = "mutable_buffers"
            art["runner_files"] = [x.tok_entry["file"]]
        return art

    @staticmethod
    def stepper(x):
        from . import et_runner
        from .pte_stepper import PteStepper
        return et_runner.RunnerPteStepper(x.partial, x.tmp, x.opts.threads) if x.et_run else \
            PteStepper(x.partial, x.tmp, x.opts.threads)

    @staticmethod
    def references(x, art=None):
        """The eager module the .pte was traced from (its query rounded to int8 where the .pte's attention rounds it:
        edgekv.models.swaps.kernel_reference), called in the .pte's own chunks (art's, else those its manifest entry
        lists: pte_stepper.pte_calls, without loading it), and its own rounding noise (verify.limits): quantized
        weights, or (fp32 weights, a quantized cache, as OnnxTarget.references) the module one ulp away, whose K/V
        codes flip where a value sits on a rounding boundary (SmolLM2-135M kv-int4 at 8k: the .pte 4.85 over a logit
        scale of 42.3, past the fixed 1e-1, top-1 96 %; benchmarks/results/pte_export_fp32w_smollm2_8k.json)."""
        from .pte_stepper import pte_calls
        from .runtime import EagerStepper
        from .verify import nudged, nudged_quantized

        from ..models.swaps import kernel_reference
        if art is not None:
            chunk, tail, most = art.chunk, art.tail, art.max_chunk
        else:
            _, chunk, tail, most = pte_calls(x.partial)

        def eager(m):  # where custom_quantized_sdpa rounds the query to int8, the reference rounds it the same way
            # (edgekv's own int8 kernel rounds nothing: the module itself)
            return EagerStepper(x.partial, kernel_reference(m, "executorch", x.opts.pte_int8_kernel), chunk=chunk,
                                tail=tail, max_chunk=most)
        ref = eager(x.qmodule)
        if not x.quantization.get("pte"):
            return ref, eager(nudged(x.qmodule)) if x.opts.weights == "fp32" and x.strategy.kv_bits else None
        if x.narrow_pte:  # x.module is placeholders: the same codes, from the quantized module (verify.nudged_copy)
            from .verify import nudged_copy
            return ref, eager(nudged_copy(x.qmodule))
        return ref, eager(nudged_quantized(x.module, x.opts.weights))

    @staticmethod
    def tolerance(x) -> str:
        from .verify import tolerance_dtype
        return "quantized-weights" if x.opts.weights != "fp32" else tolerance_dtype(x.layout, False)


TARGETS = {"onnx": OnnxTarget, "pte": PteTarget}
