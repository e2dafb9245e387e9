"""The `edgekv` command: parse, call, render. No arithmetic here."""
from __future__ import annotations

import click

from . import __version__
from .clibase import PLAN_SPELLINGS, Group, PlanRuntimeChoice, plan_runtime


EXIT_NO_FIT = 3  # ran, but what was asked for does not fit its budget (plan, profile --limit / --device)


def _ctx(value: str) -> int:
    from .units import parse_ctx
    return parse_ctx(value)


def _plan_arch(spec: str, weights: str | None):
    """--model for a plan: with --weights gguf, a model with known weights (smollm2-135m, gemma-3-270m) is read from
    its GGUF (the tensors' own types), where a catalog name alone carries shapes only."""
    from .arch import load_arch
    if weights == "gguf":
        from .models.weights import known_gguf
        found = known_gguf(spec)
        if found is not None:
            return load_arch(str(found))
    return load_arch(spec)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgekv")
def main():
    """Put a long-context language model on a phone, and know before you ship whether it fits, how fast it runs
    and how much quality it loses.

    Start with:  edgekv plan --device pixel8 --ctx 32k
    """


def _strategy_help() -> str:
    """The strategies `--strategy` takes, as each registered class shows its spec (edgekv.strategies.REGISTRY)."""
    from .strategies import REGISTRY
    return "strategy spec, repeatable: " + ", ".join(c.help for c in REGISTRY.values())


STRATEGY_HELP = _strategy_help()


def _plan_runtimes() -> list[str]:
    """The runtimes `plan --runtime` takes, read from the data file the planner reads (no planner import at startup)."""
    import json
    from pathlib import Path
    data = json.loads((Path(__file__).resolve().parent / "costs" / "runtimes.json").read_text())
    keys = [k for k in data if not k.startswith("_") and k != "executorch"]
    return keys + [k for k in PLAN_SPELLINGS if k not in keys]


@main.command()
@click.option("-d", "--device", "device_name", required=True, help="device id (see `edgekv devices`) or a .toml profile")
@click.option("-c", "--ctx", "--max-ctx", "ctx_text", required=True,
              help="context length: 4000, 4k (=4096), 32K, 128k, 1m; or max: the longest context each option fits "
                   "(bounded by the budget or the model's trained context)")
@click.option("-m", "--model", "models", multiple=True, help="catalog name, HF folder, config.json or .gguf (repeatable); "
              "default: every catalog model that could plausibly run on the device")
@click.option("--strategy", "strategies", multiple=True, help=STRATEGY_HELP + " [default: every strategy that applies]")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "int8", "int4", "int4-mix", "gguf"]), default=None,
              help="weight precision (default: int4 on phones, fp16 on GPUs, as stored for a GGUF)")
@click.option("--runtime", default=None, type=PlanRuntimeChoice(_plan_runtimes()), callback=plan_runtime,
              help="runtime whose costs to plan with: executorch (= edgekv-pte) and ort (= onnxruntime) are the .pte "
                   "and ONNX edgekv export builds; executorch-llama = ExecuTorch's own Llama export, llama.cpp, vllm: "
                   "formats edgekv does not build (edgekv/costs/runtimes.json; default: what export --from-plan "
                   "builds for the device)")
@click.option("--chunk", "--prefill-chunk", "chunk", default=128, show_default=True, type=click.IntRange(1, 65536),
              help="prefill chunk (tokens per call)")
@click.option("--entitled", is_flag=True, help="iOS: use the increased-memory-limit entitlement's budget")
@click.option("--pte-kernel", "--pte-int8-kernel", "pte_int8_kernel", type=click.Choice(["executorch", "edgekv"]),
              default="executorch", show_default=True, help="the .pte's int8, fp16 and int4 caches (kv-int8, kv-int8c, kv, kv-int4): "
              "price the kernel export --pte-kernel builds, ExecuTorch's (custom_quantized_sdpa; an fp16 cache cast "
              "to fp32 for custom_sdpa) or edgekv's own (edgekv::int8_sdpa, edgekv::fp16_sdpa, edgekv::packed_sdpa for "
              "kv-int4), each at its rate "
              "measured on the host (edgekv/costs/attention_rates.json)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (bytes as integers) instead of the table")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="write memory vs context (PNG) with the budget line and the requested context (default: no plot)")
@click.option("--explain", is_flag=True, help="a short derivation per row (memory sum vs budget, decode, prefill, "
              "risk), the shared device facts once; with --json every formula and input")
@click.option("--all", "show_all", is_flag=True, help="show every option in the table, not the top 30")
@click.option("--force", is_flag=True, help="replace an existing --plot, only if edgekv wrote it (default: refuse)")
def plan(device_name, ctx_text, models, strategies, weights, runtime, chunk, entitled, pte_int8_kernel, as_json, plot,
         explain, show_all, force):
    """Which model and long-context strategy fits a device at a context, how fast, at what quality risk.

    A catalog model is a shape (its published config.json): enough to plan; `edgekv export` needs its weights (an
    HF folder or a .gguf). Exit codes: 0 done; 2 bad input; 3 --model and --strategy were both given and no option
    fits the budget (so a script can gate on it)."""
    from . import render, termtext
    from .devices import load_device
    from .plan import default_models, make_plan
    from .strategies import parse_strategy

    longest = ctx_text.strip().lower() == "max"
    if longest and plot:
        from .errors import EdgekvError
        raise EdgekvError("--plot draws memory against the context: give --ctx a length, not max")
    ctx = None if longest else _ctx(ctx_text)
    if plot:
        from .outputs import PLOT_FORMATS, check_writable
        check_writable(plot, "--plot", PLOT_FORMATS, force=force)
    device = load_device(device_name)
    archs = [_plan_arch(m, weights) for m in models] if models else default_models(device)
    strats = [parse_strategy(s) for s in strategies] or None
    if longest:
        from .plan_search import make_max_plan
        mp = make_max_plan(device, archs, strats, weights, runtime, entitled, chunk, pte_int8_kernel)
        if as_json:
            termtext.print_json(mp.to_json(explain))
        else:
            render.max_ctx_table(mp, None if show_all else 30, explain)
        if models and strategies and mp.options and not any(o.ctx for o in mp.options):
            raise SystemExit(EXIT_NO_FIT)
        return
    p = make_plan(device, ctx, archs, strats, weights, runtime, entitled, chunk, pte_int8_kernel)
    from .plan_search import what_would_fit
    p.suggestions = what_would_fit(p, archs, strats, weights, entitled, chunk, bool(models))
    if plot:
        _plot(device, archs, strats, weights, runtime, entitled, chunk, p, plot, ctx, force)
    if as_json:
        termtext.print_json(p.to_json(explain))
    else:
        render.plan_screen(p, None if show_all else 30, explain)
        if plot:
            click.echo(f"plot written to {plot}")
    if models and strategies and p.rows and not any(r.fits for r in p.rows):
        raise SystemExit(EXIT_NO_FIT)


def _plot(device, archs, strats, weights, runtime, entitled, chunk, p, out, ctx, force=False):
    from . import render
    from .plan import make_plan
    from .units import fmt_ctx

    ctxs = sorted({2**k for k in range(10, 21)} | {ctx})
    # one curve for the best option of each strategy, then the next best overall, 10 at most
    ranked = p.ranked()
    picked = {}
    for r in ranked:
        picked.setdefault(r.strategy.name, r)
    extra = [r for r in ranked if r not in picked.values()]
    keep = {(r.model, r.strategy.label) for r in (list(picked.values()) + extra)[:10]}
    curves: dict = {}
    by_name = {a.name: a for a in archs}
    for c in ctxs:
        pc = make_plan(device, c, [by_name[m] for m, _ in keep if m in by_name], strats, weights, runtime, entitled,
                       chunk)
        for r in pc.rows:
            if (r.model, r.strategy.label) in keep:
                xs, ys = curves.setdefault(f"{r.model} {r.strategy.short}", ([], []))
                xs.append(c)
                ys.append(r.deployment.bytes["total"])
    fits = {f"{r.model} {r.strategy.short}": r.fits for r in ranked}
    from .outputs import write_atomic
    write_atomic(out, b"", writer=lambda tmp: render.plot_plan(  # the format follows the name's suffix
        curves, p.budget, f"{device.name}: total memory vs context (requested {fmt_ctx(ctx)})", tmp, ctx=ctx, fits=fits),
        option="--plot", force=force)


@main.command()
@click.option("-d", "--device", "device_name", default="h100", show_default=True, help="datacenter GPU profile")
@click.option("-m", "--model", "model", default="llama-3-70b", show_default=True, help="catalog name or path")
@click.option("-c", "--ctx", "ctx_text", default="4000,32k,128000", show_default=True, help="context(s), comma-separated")
@click.option("--strategy", "strategies", multiple=True, help=STRATEGY_HELP + " [default: every strategy that applies]")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default="int4", show_default=True,
              help="weight precision")
@click.option("--preset", type=click.Choice(["quadratic-tax"]), default=None,
              help="reproduce a published analysis from its stated assumptions (default: none; --device, --model, "
              "--ctx, --strategy, --weights are then ignored)")
@click.option("--json", "as_json", is_flag=True, help="print JSON rows instead of the table")
@click.option("--explain", is_flag=True, help="print the formula and assumptions behind every number")
def baseline(device_name, model, ctx_text, strategies, weights, preset, as_json, explain):
    """The same model on a datacenter GPU: per-user state, users per GPU, $ per million tokens."""
    from . import render, termtext
    from .plan import baseline as run_baseline
    from .serving import QUADRATIC_TAX, quadratic_tax

    if preset == "quadratic-tax":
        rows = quadratic_tax()
        title = ("quadratic tax (AI Made Simple): Llama-3-70B shape on one H100, 39 GB KV pool, "
                 f"${QUADRATIC_TAX['usd_per_hour']:.2f}/GPU-h, {QUADRATIC_TAX['tok_s_per_user']:.0f} tok/s per user")
        if as_json:
            termtext.print_json({"preset": preset, "assumptions": QUADRATIC_TAX,
                               "rows": [r.to_json(explain) for r in rows]})
        else:
            render.baseline_table(rows, title, explain)
        return
    from .arch import load_arch
    from .devices import load_device
    from .strategies import parse_strategy
    from .units import parse_ctx_list

    ctxs = parse_ctx_list(ctx_text)
    device = load_device(device_name)
    arch = load_arch(model)
    strats = [parse_strategy(s) for s in strategies] or None
    rows = run_baseline(device, arch, ctxs, strats, weights)
    if as_json:
        termtext.print_json({"device": device.to_json(), "model": arch.name, "weights": weights,
                           "rows": [r.to_json(explain) for r in rows]})
    else:
        render.baseline_table(rows, f"{arch.name} on {device.name}, {weights} weights", explain)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print the profiles as JSON (every fact with its source)")
def devices(as_json):
    """List the built-in device profiles."""
    from . import render, termtext
    from .devices import all_devices

    ds = all_devices()
    if as_json:
        termtext.print_json([d.to_json() for d in ds])
        return
    render.devices_table(ds)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print the catalog as JSON")
def models(as_json):
    """List the built-in model catalog."""
    from . import render, termtext
    from .arch import catalog_arch, catalog_entry, catalog_names

    out = []
    for n in catalog_names():
        a, e = catalog_arch(n), catalog_entry(n)
        out.append({"name": n, "display_name": e.get("display_name"), "model_type": a.model_type, "family": a.family,
                    "params": a.n_params, "layers": a.n_layers, "hf_repo": e.get("hf_repo"),
                    "config_source": e.get("config_source")})
    if as_json:
        termtext.print_json(out)
        return
    render.models_table(out)


# `edgekv --help`: each command's one-line summary, whole (click cuts a summary it derives at 45 characters with
# "..."), and one example each command's own --help ends with
HELP = {
    "plan": ("Which model and cache strategy fit a device at a context, how fast, at what risk.",
             "edgekv plan --device pixel8 --ctx 32k --model llama-3.2-1b"),
    "baseline": ("The same model on a datacenter GPU: users per GPU, $ per million tokens.",
                 "edgekv baseline --device h100 --model llama-3-70b --ctx 4000,32k,128000"),
    "devices": ("List the built-in device profiles.", "edgekv devices --json"),
    "models": ("List the built-in model catalog.", "edgekv models"),
    "export": ("Export a model's decode step to ONNX / ExecuTorch, verified.",
               "edgekv export -m smollm2-135m --from-plan pixel8 -c 2k -o export/smollm2"),
    "run": ("Generate text from an export folder with its runtime.",
            'edgekv run export/smollm2-pixel8 -p "The capital of France is" -n 16'),
    "analyze": ("Measure a cache's error or recall against distance on real weights.",
                "edgekv analyze --model smollm2-135m --strategy kv-int4 --ctx 2k --plot kv4.png"),
    "profile": ("Measure an export's peak memory and speed against its plan.",
                "edgekv profile export/smollm2-pixel8 -c 512,2k -d pixel8 -o prof.json"),
    "report": ("One page: plan, measured profile, quality curve and GPU baseline.",
               "edgekv report export/smollm2-pixel8 --profile prof.json"),
    "ring": ("Exact attention with the KV cache split over N ranks, vs the ring model.",
             "edgekv ring --world 4 --ctx 4k --check"),
}


def _with_help(name: str, cmd: click.Command) -> click.Command:
    """cmd with its whole summary and its example (HELP)."""
    import inspect
    if name in HELP:
        summary, example = HELP[name]
        cmd.short_help = summary
        cmd.help = inspect.cleandoc(cmd.help or summary) + f"\n\n\b\nExample:\n  {example}"
    return cmd


# Commands that live in their own packages (they import torch lazily, inside the command), by the module that
# defines them: imported when the command is looked up, so that `edgekv plan` does not import four command modules
# it does not run.
OPTIONAL = {"ring": ".ring.cli", "export": ".export.cli", "run": ".export.cli", "analyze": ".analyze.cli",
            "profile": ".profile.cli", "report": ".profile.cli"}


class _LazyCommands(dict):
    """main.commands: the optional commands are imported on first use (a lookup, or listing them all); a module that
    cannot be imported (a missing optional dependency) leaves its commands out, as before."""

    def __init__(self, commands: dict, lazy: dict[str, str]):
        super().__init__(commands)
        self._lazy = dict(lazy)

    def _load(self, name: str) -> None:
        import importlib
        module = self._lazy.get(name)
        if module is None:
            return
        names = [n for n, m in self._lazy.items() if m == module]
        for n in names:
            del self._lazy[n]
        try:
            mod = importlib.import_module(module, __package__)
        except ImportError:
            return
        for n in names:
            if hasattr(mod, n):
                super().__setitem__(n, _with_help(n, getattr(mod, n)))

    def _load_all(self) -> None:
        for n in list(self._lazy):
            self._load(n)

    def __getitem__(self, name):
        self._load(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self._load(name)
        return super().get(name, default)

    def __contains__(self, name) -> bool:
        self._load(name)
        return super().__contains__(name)

    def __iter__(self):
        self._load_all()
        return super().__iter__()

    def __len__(self) -> int:
        self._load_all()
        return super().__len__()

    def keys(self):
        self._load_all()
        return super().keys()

    def items(self):
        self._load_all()
        return super().items()

    def values(self):
        self._load_all()
        return super().values()


main.commands = _LazyCommands({n: _with_help(n, c) for n, c in main.commands.items()}, OPTIONAL)

if __name__ == "__main__":
    main()
