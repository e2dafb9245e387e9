"""Click commands `export` and `run`; edgekv/cli.py registers them. Imported when `edgekv` starts, so nothing
heavy at module level: torch, ExecuTorch and ONNX Runtime are imported inside the commands.

Standalone (before the main CLI registers them): python -m edgekv.export.cli export|run ...
"""
from __future__ import annotations

import sys

import click

from ..clibase import Group, argv_text, artifact_runtime, artifact_runtime_choice, threads_option
from ..errors import EdgekvError


def _strategy_help() -> str:
    """--strategy's help, from the registries: the exportable strategies (edgekv.strategies.REGISTRY) and the ones each
    family's module keeps (edgekv.models.FAMILIES; both torch-free)."""
    from ..models import FAMILIES
    from ..strategies import REGISTRY
    specs = ", ".join(c.help for c in REGISTRY.values() if c.exportable)
    per_family = "; ".join(f"{f.name}: {', '.join(f.strategies)}" for f in FAMILIES if f.model_types)
    return f"state strategy [default: kv]: {specs} (by family: {per_family})"


def _quiet() -> None:
    """Keep the toolchain's import-time chatter (torchao's optional kernels, torch's pytree deprecations,
    FutureWarnings) out of the command's output; errors still surface as EdgekvError lines."""
    import logging
    import warnings

    for name in ("torchao", "torch.utils._pytree", "torch.onnx", "torch._export", "torch.export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for cat in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)
    warnings.filterwarnings("ignore", module=r"(torch|executorch|onnxscript|torchao)\.")


def _stop_on_sigterm() -> None:
    """SIGTERM (kill, a job scheduler) unwinds like Ctrl-C: the export's temporary folder is removed on the way out.
    (SIGKILL cannot be caught: the next export to the same --out removes what it left.) The line goes straight to
    file descriptor 2 (no stream between it and the caller, whatever a progress display holds); the signal is
    recorded (children.stopped), so an error the exit meets on its way out still exits 143 (edgekv.clibase)."""
    import os
    import signal

    from ..children import STOPPED_BY, stopped

    def stop(signum, frame):
        if not STOPPED_BY:
            os.write(2, b"edgekv: export stopped (SIGTERM); nothing was published\n")
        stopped(signum, said=True)
        sys.exit(143)
    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (an export called from a library's worker thread)
        pass


def _need(module: str) -> None:
    import importlib
    try:
        importlib.import_module(module)
    except ImportError:
        raise EdgekvError(f"this command needs {module}: pip install 'edgekv[runtime]'") from None


@click.command("export")
@click.option("-m", "--model", required=True, help="the weights: a .gguf file, an HF folder (config.json + "
              "*.safetensors), or the packaged smollm2-135m (a catalog name alone is a shape, not weights)")
@click.option("--strategy", default=None, help=_strategy_help())
@click.option("--rank", type=click.IntRange(1), default=None,
              help="MLA latent width r (one number; analyze --rank takes a list): shortcut for mla:rank=r "
              "(default: none)")
@click.option("--window", type=click.IntRange(1), default=None,
              help="window size W: shortcut for window:w=W (default: none)")
@click.option("-f", "--format", "formats", default="onnx", show_default=True,
              help="onnx, pte, or onnx,pte (with --from-plan: the device runtime's)")
@click.option("-c", "--max-ctx", "--ctx", "max_ctx", default="512", show_default=True,
              help="context the artifact holds (cache slots): 512, 2k, 8k ...")
@click.option("-o", "--out", required=True, help="export folder to create (e.g. export/smollm2-kv)")
@click.option("--prefill-chunk", "--chunk", "prefill_chunk", default=32, show_default=True, type=click.IntRange(1),
              help="tokens per call of the .pte prefill method (with --from-plan: the plan's 128)")
@click.option("--verify-steps", default=16, show_default=True, type=click.IntRange(0),
              help="decode steps compared against eager torch after the prompt")
@click.option("--force", is_flag=True, help="replace --out if it exists (default: refuse)")
@click.option("--weights", default="fp32", show_default=True,
              help="weight precision, through each runtime's own tooling: fp32, int8, int4 (torchao 8da4w for "
              ".pte, ONNX Runtime MatMulNBits for ONNX), int4-mix (ONNX only: edgekv's own recipe, llama.cpp "
              "Q4_K_M's per-tensor bits as 4 / 8-bit blocks, a searched float minimum per 4-bit block weighted "
              "by an importance matrix from calibration text), fp16 (ONNX only), gguf (ONNX "
              "from a .gguf only: the file's own blocks carried, no second quantization); a quantized artifact is checked "
              "against fp32 over real text (top-1, KL) and refused beyond edgekv.export.wquant's thresholds "
              "(with --from-plan: the plan's, int4 on phones)")
@click.option("--from-plan", "from_plan", default=None, metavar="DEVICE",
              help="export what `edgekv plan --device DEVICE` assumes for this model: its weight precision (int4 on "
              "phones), its runtime's format (pte for executorch, onnx for onnxruntime) and prefill chunk (128), "
              "wherever the option is not given; prints the plan command whose row the artifact is "
              "(default: none, the defaults shown here)")
@click.option("--runner", "runners", default=None,
              help="also make the artifact a runtime's own LLM API loads: genai (the ONNX folder for ONNX Runtime "
              "GenAI: genai_config.json, tokenizer_config.json, a graph fed input_ids / attention_mask; plain float "
              "kv, Gemma 3's sliding layers included), executorch (a .pte for ExecuTorch's LLM runner / LlmModule: "
              "the cache in the program's buffers, its metadata methods; kv and kv-int8/int4/int2, no sliding-window "
              "layers yet); comma-separated (default: none)")
@click.option("--pte-kernel", "--pte-int8-kernel", "pte_int8_kernel", type=click.Choice(["executorch", "edgekv"]),
              default="executorch", show_default=True,
              help="what reads a kv-int8 / kv-int8c cache's codes, a kv (fp16) cache or kv-int4 / kv-int2's packed "
              "codes in the .pte: executorch (llama::custom_quantized_sdpa on int8 codes, its query rounded to int8 "
              "and on x86 a scalar int8 GEMM; the other caches' rows read back into fp32 every call for "
              "llama::custom_sdpa; in ExecuTorch's LLM custom ops, so a stock app loads the .pte) or edgekv "
              "(edgekv's own edgekv::int8_sdpa, edgekv::fp16_sdpa and edgekv::packed_sdpa, "
              "edgekv/native, built here with g++: the cache read in place, fp32 query, AVX2; an app must compile "
              "edgekv/native's sources with its runtime, the manifest's custom_ops). --pte-int8-kernel is its "
              "earlier name")
@threads_option(help="compute threads for tracing and verification (torch, ONNX Runtime, XNNPACK); on a machine "
              "shared with other jobs, 1 avoids thread-barrier stalls (default: the libraries' own)")
@click.option("--max-memory", "max_memory", default=None, metavar="SIZE",
              help="memory the export may use, e.g. 8GB: it says its estimated peak before it starts and refuses, "
              "one line, when that is more (default: EDGEKV_MAX_MEMORY, else what the machine has available)")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object, {\"out\", \"manifest\"} (the manifest as written), instead of the summary; "
              "the stage lines stay on stderr, the progress bar is off")
@click.pass_context
def export_cmd(cctx, model, strategy, rank, window, formats, max_ctx, out, prefill_chunk, verify_steps, force, weights,
               from_plan, runners, pte_int8_kernel, threads, max_memory, as_json):
    """Export a model's decode step (state as explicit inputs/outputs) to ONNX and/or ExecuTorch, verify it
    against eager PyTorch, and write manifest.json + tokenizer.json beside it."""
    from pathlib import Path

    from ..units import fmt_mem, parse_ctx

    plan_cmd = None
    if from_plan:
        formats, weights, prefill_chunk, plan_cmd = _from_plan(cctx, from_plan, model, strategy_spec_text(
            strategy, rank, window), formats, weights, prefill_chunk, max_ctx)
    _need("torch")  # first: torch configures its loggers on import, _quiet then quiets them
    _quiet()
    from .pipeline import export_model
    from .options import ExportOptions, parse_formats, strategy_spec
    from .runners import parse_runners

    fmts = parse_formats(formats)
    opts = ExportOptions(model=model, strategy=strategy_spec(strategy, rank, window), formats=fmts,
                         max_ctx=parse_ctx(max_ctx),
                         out=Path(out), prefill_chunk=prefill_chunk, verify_steps=verify_steps, force=force,
                         threads=threads, weights=weights, runners=parse_runners(runners, fmts), max_memory=max_memory,
                         planned_for=_device_id(from_plan) if from_plan else None, pte_int8_kernel=pte_int8_kernel)
    if "genai" in opts.runners:
        _need("onnxruntime_genai")
    from ..progress import stage_status
    _stop_on_sigterm()
    bar, status = stage_status("export", enabled=not as_json)
    with bar:
        m = export_model(opts, echo=bar.message, status=status if bar.on else None)
    if as_json:
        from ..termtext import print_json
        print_json({"out": str(opts.out), "manifest": m})
        return
    click.echo(f"wrote {out}: " + ", ".join(f"{n} ({fmt_mem(f['bytes'])})" for n, f in m["files"].items())
               + " (GB = 1e9 bytes)")
    click.echo(f"state: {m['state']['strategy']} at max_ctx {m['max_ctx']}: {fmt_mem(m['state']['bytes'])}"
               f" ({len(m['state']['tensors'])} tensors)")
    errors = m["strategy"].get("factorisation_error")
    if errors:  # a GQA model converted to MLA: how much of each layer's [W_k; W_v] the rank keeps
        import statistics
        order = sorted(range(len(errors)), key=errors.__getitem__)
        lo, hi = order[0], order[-1]
        click.echo(f"factorisation error ||W - W_up W_down|| / ||W|| of [W_k; W_v] at rank {m['strategy']['rank']}: "
                   f"median {statistics.median(errors):.3f}, lowest {errors[lo]:.3f} (layer {lo}), highest "
                   f"{errors[hi]:.3f} (layer {hi}); every layer's in manifest.json strategy.factorisation_error")
    for fmt, v in m["verification"].items():
        if fmt.endswith("-quant"):  # the runtime's tools quantized it: held to verify-quant's thresholds vs fp32
            t = v["thresholds"]
            click.echo(f"verified {fmt[:-len('-quant')]}: {v['weights']} weights vs fp32 over {v['positions']} "
                       f"positions of real text: top-1 {v['top1_agreement']:.1%} "
                       + (f"(needs >= {t['min_top1']:.0%}), " if t["min_top1"] is not None else
                          "(not held: random weights, the fp32 model reads the text no better than chance), ")
                       + f"KL mean {v['kl_mean']:.3g} nats (needs <= {t['max_kl_mean']:.3g})")
            continue
        click.echo(f"verified {fmt}: max |logit diff| {v['max_abs_diff']:.2e} (scale {v['logit_scale']:.1f}), "
                   f"top-1 {v['top1_agreement']:.1%} over {v['positions_compared']} positions")
    for fmt, v in m.get("weight_quality", {}).items():
        carried = m["weights"].get("quantization", {}).get(fmt, {})
        if carried.get("source_format") == "gguf":  # where the weights came from, and how exactly
            types = ", ".join(f"{t} x {n}" for t, n in carried["source_types"].items())
            exact = sum(t["exact"] for t in carried["tensors"].values())
            click.echo(f"weights: the GGUF's own blocks ({carried['source']}: {types}), {exact} of "
                       f"{len(carried['tensors'])} tensors bit-exact; {carried['matmuls_left_float']} MatMuls left "
                       "float")
        if carried.get("requantized"):  # a GGUF's blocks quantized a second time: what that costs
            click.echo(f"weights ({fmt}): {carried['requantized']}: KL mean {v['kl_mean']:.3g} nats, top-1 "
                       f"{v['top1_agreement']:.1%} against the file's own weights")
        if f"{fmt}-quant" in m["verification"]:
            continue  # said on its verified line
        click.echo(f"{v['weights']} weights ({fmt}) vs fp32 over {v['positions']} positions of real text: top-1 "
                   f"{v['top1_agreement']:.1%}, KL mean {v['kl_mean']:.3g} nats")
    for a in m["artifacts"]:
        click.echo(f"{a['file']} runs in: " + "; ".join(RUNNER_WORDS.get(r, r) for r in a.get("runners", ["edgekv"])))
        if a.get("custom_ops"):  # edgekv's own kernels: an app's ExecuTorch build must have them
            c = a["custom_ops"]
            click.echo(f"{a['file']} calls {', '.join(c['ops'])}: an app compiles {', '.join(c.get('sources', []))} "
                       "with its ExecuTorch runtime (a stock ExecuTorch build cannot load it)")
    for runner, why in m.get("runners_unsupported", {}).items():
        click.echo(f"not for {runner}: {why}")
    if plan_cmd:
        click.echo(f"the plan row this artifact is: {plan_cmd}")


def strategy_spec_text(strategy, rank, window) -> str:
    from .options import strategy_spec
    return strategy_spec(strategy, rank, window)


# manifest artifacts[].runners (edgekv.export.runners) in words a newcomer reads: which app API loads the file, how
RUNNER_WORDS = {
    "edgekv": "edgekv run / edgekv profile, and an app through android_demo/ (edgekv's loop feeds the state back "
              "each call: android_demo/README.md)",
    "onnxruntime-genai": "ONNX Runtime GenAI's Generator (og.Model on this folder; Java, C#, Objective-C APIs)",
    "executorch-llm-runner": "ExecuTorch's TextLLMRunner / Android LlmModule (first `import "
                             "executorch.extension.llm.custom_ops` in Python, or link extension/llm/custom_ops)",
}
PLAN_FORMAT = {"executorch": "pte", "onnxruntime": "onnx"}


def _device_id(name: str) -> str:
    """The id of the device profile `name` loads (a built-in id, or a TOML file's own id), for the manifest."""
    from ..devices import load_device
    return load_device(name).id


def _from_plan(cctx, device_name, model, strategy, formats, weights, prefill_chunk, max_ctx):
    """--from-plan DEVICE: the options the plan assumes for that device, where the user gave none. -> (formats,
    weights, prefill_chunk, the `edgekv plan` command whose row the artifact is)."""
    from click.core import ParameterSource

    from ..devices import load_device
    from ..plan import DEFAULT_CHUNK

    device = load_device(device_name)
    given = lambda name: cctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    if device.runtime not in PLAN_FORMAT:
        raise EdgekvError(f"--from-plan {device_name}: its runtime {device.runtime!r} has no export format "
                          f"(exports: {', '.join(f'{k} -> {v}' for k, v in PLAN_FORMAT.items())})")
    if not given("formats"):
        formats = PLAN_FORMAT[device.runtime]
    if not given("weights"):
        weights = "fp16" if device.is_datacenter else "int4"
    if not given("prefill_chunk"):
        prefill_chunk = DEFAULT_CHUNK
    # edgekv's own .pte is the plan's edgekv-pte runtime (executorch there is ExecuTorch's own Llama export)
    runtime = "edgekv-pte" if "pte" in formats.split(",") else "onnxruntime"
    cmd = (f"edgekv plan --device {device.id} --ctx {max_ctx} --model {model} --strategy {strategy} "
           f"--weights {weights} --runtime {runtime} --chunk {prefill_chunk}")
    return formats, weights, prefill_chunk, cmd


@click.command("run")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("-p", "--prompt", required=True, help="text to continue (tokenized with the export's tokenizer.json)")
@click.option("-n", "--max-new-tokens", default=32, show_default=True, type=click.IntRange(0),
              help="new tokens to generate at most, the first from the prefill (greedy; stops early at the end-of-text "
                   "token; 0: prefill only); `profile --steps` counts decode calls instead")
@click.option("--runtime", type=artifact_runtime_choice(), default=None, callback=artifact_runtime,
              help="runtime to run in (default: ort when the export has an ONNX model, else executorch); edgekv's "
              "greedy loop drives each. ort / executorch: the explicit-state artifact; genai: ONNX Runtime GenAI's "
              "Generator and tokenizer (an export made with --runner genai); executorch-runner: the runner .pte "
              "called as ExecuTorch's LLM runner calls it (--runner executorch)")
@threads_option(help="compute threads (ONNX Runtime intra-op, ExecuTorch XNNPACK threadpool); default: the runtime's")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object when done (text, token ids, prefill / decode speed) instead of streaming")
@click.option("--save-state", "save_state", type=click.Path(dir_okay=False), default=None,
              help="after the run, write the state (tensors, position, token ids) to this safetensors file, checked "
              "before the run; an existing file is replaced only with --force and only if edgekv wrote it (default: "
              "none, the state is not kept)")
@click.option("--resume", type=click.Path(dir_okay=False), default=None,
              help="start from a state file written by --save-state for this export and runtime (checked first): "
              "the prompt continues it (default: none, start from an empty state)")
@click.option("--force", is_flag=True, help="replace an existing --save-state file, only if edgekv wrote it (e.g. "
              "--resume S --save-state S --force; default: refuse)")
def run_cmd(folder, prompt, max_new_tokens, runtime, threads, as_json, save_state, resume, force):
    """Greedy generation from an export folder: its runtime, manifest and tokenizer only (hashes checked)."""
    from .generate import generate, open_export

    prompt = argv_text(prompt, "--prompt")
    needs = {"executorch": ("torch", "executorch"), "executorch-runner": ("torch", "executorch"),
             "genai": ("onnxruntime_genai",)}
    for module in needs.get(runtime, ("onnxruntime",)):
        _need(module)  # torch first, as in export
    _quiet()
    if (save_state or resume) and runtime not in (None, "ort", "executorch"):
        raise EdgekvError(f"--save-state / --resume need a runtime whose state is explicit I/O (ort, executorch); "
                          f"{runtime} keeps its state inside")
    if save_state:  # before the run: its prefill is not lost to a path that cannot be written
        from ..outputs import check_writable
        check_writable(save_state, "--save-state", force=force)
    manifest, stepper, tok = open_export(folder, runtime, threads)
    start = None
    if resume:
        from . import statefile
        start = statefile.load(resume, manifest, stepper)
    stream = not as_json  # --json: one object when done, nothing streamed
    r = generate(manifest, stepper, tok, prompt, max_new_tokens,
                 emit=(lambda s: click.echo(s, nl=False)) if stream else None,
                 after_prefill=(lambda: click.echo(prompt, nl=False)) if stream else None, start=start)
    state_tokens, pending = r.pop("state_tokens"), r.pop("pending")
    if save_state:
        from . import statefile
        r["saved_state"] = {"file": str(save_state), "position": len(state_tokens),
                            "bytes": statefile.save(save_state, manifest, stepper, len(state_tokens), state_tokens,
                                                    pending, force)}
    if as_json:
        from ..termtext import print_json
        print_json({"folder": str(folder), "runtime": stepper.runtime, "threads": threads, "prompt": prompt, **r})
        return
    click.echo()
    rate = f", decode {r['decode_tok_s']:.1f} tok/s" if r["decode_tok_s"] else ""
    resumed = f" after {r['resumed_at']} resumed" if resume else ""
    saved = f"; state at position {len(state_tokens)} saved to {save_state}" if save_state else ""
    click.echo(f"[{r['prompt_tokens']} prompt tokens{resumed}, prefill {r['prefill_s'] * 1e3:.0f} ms; "
               f"{r['new_tokens']} new tokens{rate}; stopped at {r['stopped']}{saved}]", err=True)


@click.group(cls=Group)
def cli():
    """edgekv export / run, standalone."""


cli.add_command(export_cmd)
cli.add_command(run_cmd)

if __name__ == "__main__":
    cli()

# the names edgekv/cli.py may import
export = export_cmd
run = run_cmd
