"""`edgekv export`'s options and its small pure steps: the formats and weight dtypes it writes, ExportOptions, the
Stages timer/progress that names each stage in errors, the strategy spec from --strategy/--rank/--window, the verify
prompt, the plan an export is checked against (planned) and the strategies a model's export module applies."""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EdgekvError
from ..strategies import REGISTRY

FORMATS = ("onnx", "pte")
WEIGHT_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8", "int4": "int4", "int4-mix": "int4-mix",
                 "gguf": "gguf blocks"}  # gguf: the file's own blocks (edgekv.export.gguf_blocks)
# what `edgekv export --strategy` takes: the registered strategies whose class says it is exported (ring splits a
# datacenter KV over GPUs: planned, never exported)
EXPORTABLE = tuple(n for n, c in REGISTRY.items() if c.exportable)
QUALITY_TOKENS = 256  # tokens of real text a quantized artifact is compared with fp32 over (verify-quant)
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
    weights: str = "fp32"  # fp32 | fp16 | int8 | int4 | int4-mix | gguf (edgekv.export.wquant)
    runners: tuple[str, ...] = ()  # --runner: genai (the ONNX graph GenAI loads), executorch (the runner .pte)
    max_memory: str | None = None  # --max-memory: the memory to plan for (edgekv.export.budget), e.g. "8GB"
    planned_for: str | None = None  # --from-plan DEVICE: the device profile the export was planned for
    pte_int8_kernel: str = "executorch"  # --pte-kernel: what reads an int8 cache's codes in the .pte


def _wrapped_exit(e: BaseException) -> SystemExit | None:
    """The SystemExit in an exception's chain (its __cause__ / __context__), if any: a toolchain that catches
    BaseException around user code (a tracer, a worker pool) can turn `sys.exit` from export's SIGTERM handler into
    an error of its own, which would otherwise become exit 2 instead of the stop's 143."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, SystemExit):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


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
            stop = _wrapped_exit(e)
            if stop is not None:  # SIGTERM's handler exited inside a toolchain that wrapped it in its own error
                raise stop from None
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise EdgekvError(f"export failed at stage {name}: {type(e).__name__}: {first}") from e
        self.timings[name] = round(time.perf_counter() - t0, 2)
        self.echo(f"      {name} done in {self.timings[name]:.1f} s")


def parse_formats(text: str) -> tuple[str, ...]:
    fs = tuple(dict.fromkeys(f.strip().lower() for f in text.split(",") if f.strip()))
    bad = [f for f in fs if f not in FORMATS]
    if bad or not fs:
        raise EdgekvError(f"--format {text!r}: choose from {', '.join(FORMATS)} (comma-separated)")
    return fs


def strategy_spec(strategy: str | None, rank: int | None = None, window: int | None = None) -> str:
    """--strategy with the --rank / --window shortcuts folded in: --rank r is mla:rank=r, --window W is window:w=W
    (added to an mla / window --strategy, or standing in for the default kv). Which strategy and parameter an option
    sets is the strategy class's `shortcut` (edgekv.strategies.REGISTRY)."""
    owner = {c.shortcut[0]: (n, c.shortcut[1]) for n, c in REGISTRY.items() if c.shortcut}
    given = [(flag, value, *owner[flag]) for flag, value in (("--rank", rank), ("--window", window))]
    spec = strategy or next((wants for _, value, wants, _ in given if value), "kv")
    name, _, params = spec.partition(":")
    for flag, value, wants, key in given:
        if value is None:
            continue
        if name.strip().lower() != wants:
            raise EdgekvError(f"{flag} applies to the {wants} strategy, not {spec!r}")
        if any(p.strip().startswith(key + "=") for p in params.split(",")):
            raise EdgekvError(f"{flag} and {spec!r} both set {key}: give it once")
        params = ",".join(filter(None, (params, f"{key}={value}")))
    return f"{name}:{params}" if params else name


def attends_only(layout) -> bool:
    """Is every state tensor a cache read by attention (key / value / latent and their quantization parameters)?
    Such a state's step traces with a dynamic token axis; a recurrent state's (ssm, conv, recurrent) unrolls its scan
    over a fixed number of tokens, and a short last prefill chunk cannot be padded (the state would absorb the junk
    tokens): its `prefill` method's tail runs through `decode`."""
    return all(t.role.split(".")[0] in ("key", "value", "latent") for t in layout.tensors)


def verify_prompt(tokenizer, vocab: int, n_max: int, bos=()) -> list[int]:
    """VERIFY_TEXT's ids after `bos` (tokenizer.bos_prefix: the BOS the model is run with). Without it Gemma 3 reads
    its first text token as it never does in use, and its weight-quantized module's own rounding noise (verify's
    floor) grows about threefold: the comparison then measures that noise (docs/export.md#verification-limits)."""
    ids = tokenizer.encode(VERIFY_TEXT).ids if tokenizer is not None else []
    if len(set(ids)) < 4:
        # no tokenizer (tests' random models), or one that maps the text to a few ids (a word-level test vocabulary
        # reads it as unknown words: one id, whose embedding row may be zero, and the comparison would check
        # nothing): fixed pseudo-random ids
        import numpy as np
        ids = np.random.default_rng(0).integers(0, vocab, 40).tolist()
    else:
        ids = list(bos) + ids
    return ids[:max(1, n_max)]


def planned(arch, strategy, max_ctx: int, formats, pte_chunk: int, weights: str = "fp32", pte_methods: int = 2,
            int8_kernel: str = "executorch") -> dict:
    """The planner's Deployment for each artifact, at the prefill call size and on the runtime it is planned for
    (weights at the export's precision, state at max_ctx): what `edgekv profile` compares its measurement with. onnx: ONNX
    Runtime, calls of OrtStepper's size (OrtStepper reads it back from here); pte: ExecuTorch, calls of at most
    pte_chunk tokens, pte_methods methods (1: `forward`; 2: `prefill` + `decode`, XNNPACK packs the weights twice).
    The top-level bytes are the first format's. Runtime overhead is the device's, not the artifact's, so it is left
    out (0) here. int8_kernel: --pte-kernel (edgekv's own kernels read the int8 or fp16 cache in place)."""
    from ..plan import deployment
    from .stepper import Stepper
    plans = {"onnx": ("onnxruntime", min(Stepper.max_chunk, max_ctx), 1), "pte": ("executorch", pte_chunk, pte_methods)}
    out = {}
    for fmt in formats:
        runtime, chunk, methods = plans[fmt]
        d = deployment(arch, strategy, max_ctx, weights, runtime, 0, chunk, methods=methods,
                       int8_kernel=int8_kernel).to_json()
        out[fmt] = {"runtime": runtime, "prefill_chunk": chunk, "methods": methods, "bytes": d["bytes"]}
        if fmt == "onnx":  # what OrtStepper sets (lean=True): without it ORT keeps earlier calls' blocks
            out[fmt]["session_options"] = {"enable_cpu_mem_arena": False, "enable_mem_pattern": False}
    first = out[formats[0]]
    return {"weights": weights, "runtime": first["runtime"], "bytes": first["bytes"], "formats": out,
            "note": "edgekv plan's arithmetic for this artifact; runtime overhead is per device (device profiles)"}


def strategy_entry(strategy, module) -> dict:
    """The manifest's strategy: name, params, label; a converted MLA adds its rank and per-layer relative
    factorisation error ||W - W_up W_down||_F / ||W||_F of W = [W_k; W_v] (edgekv.models.converted_mla.factorise_kv)."""
    out = {"name": strategy.name, "params": strategy.params, "label": strategy.label}
    calibration = getattr(module, "calibration", None)
    if calibration:  # kv-int8c: how its static scales were set (edgekv.export.calibrate)
        out["calibration"] = calibration
    errors = getattr(module, "errors", None)
    if errors:
        out["rank"] = int(module.rank)
        out["factorisation_error"] = [float(e) for e in errors]
    return out


def family_form(spec: str, strategy):
    """The strategy as spec's family keeps it: on a hybrid that keeps only the hybrid form (LFM2, Granite-4.0-H,
    Falcon-H1, Zamba2, Qwen3.5), kv / kv-int8 / kv-int4 are its native state with that attention cache
    (edgekv.models.hybrid_alias, as analyze does); anything else as given."""
    from ..models import family_of, hybrid_alias
    from ..models.weights import resolve_model

    return hybrid_alias(family_of(resolve_model(spec)), strategy)


def check_applies(spec: str, strategy, max_ctx: int):
    """One clear line before any stage runs when the strategy does not fit the model (ssm on a transformer, kv on
    Mamba): the model's Arch from its config.json or GGUF header, no weights read."""
    from ..arch import read_config_json, read_gguf
    from ..models import check_strategy, family_of, layout_for
    from ..models.weights import resolve_model

    path = resolve_model(spec)
    family = family_of(path)  # a model type with an export module (edgekv.models.FAMILIES)
    arch = read_gguf(path) if path.suffix.lower() == ".gguf" else read_config_json(path)
    if arch.max_position and max_ctx > arch.max_position:  # as the load stage checks it, before the weights are read
        raise EdgekvError(f"max_ctx {max_ctx} exceeds the model's trained context {arch.max_position}")
    layout = layout_for(arch, strategy, max_ctx)
    check_strategy(family, strategy)  # whose module keeps this state
    return layout
