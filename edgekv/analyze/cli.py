"""`edgekv analyze`: how quantization error in a KV cache or a recurrent state grows with position (--probe error),
and whether the model can still recall a value it read d tokens ago (--probe recall).

The recall probe is an option of analyze, not a command of its own: it asks the same question of the same variants
(the export module with the state at each precision, built by make_variants, stepped in the same calls) and shares
--model, --strategy, --bits, --rounding, --ctx, --chunk, --text, --json, --plot and --threads; only what is scored
differs. Options that only mean something for the error curves (--save, --rank, --window, ...) are refused with it.

Imports torch lazily, inside the command: `edgekv plan` must stay torch-free.
"""
from __future__ import annotations

import sys
import time

import click

from ..clibase import threads_option
from ..errors import EdgekvError
from . import WEIGHT_BITS


def _strategy_help() -> str:
    """The strategies analyze measures: every registered class with an fp32 reference to compare against
    (Strategy.reference; edgekv.strategies.REGISTRY, torch-free)."""
    from ..strategies import REGISTRY, Strategy
    return " | ".join(n for n, c in REGISTRY.items() if c.reference is not Strategy.reference)


def _ints(text: str | None, what: str) -> list[int] | None:
    if not text:
        return None
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or not all(x.isascii() and x.isdigit() for x in parts):  # not '٣' nor '-1'
        raise EdgekvError(f"{what} {text!r}: use comma-separated integers, e.g. 8,4,2")
    return [int(x) for x in parts]


@click.command("analyze")
@click.option("-m", "--model", required=True, help="smollm2-135m, a .gguf, or an HF folder (e.g. fixtures/tiny/mamba)")
@click.option("--strategy", "strategy_spec", required=True,
              help=_strategy_help())
@click.option("--probe", type=click.Choice(["error", "recall"]), default="error", show_default=True,
              help="error: error vs position against fp32; recall: needle retrieval accuracy vs distance")
@click.option("--bits", default=None, help="state bits to compare, comma-separated (kv: 16,8,4,2; ssm: 16,8; "
              "recall: 32 is the fp32 reference, always included; default: the strategy's own bits, 8 for a "
              "recurrent state)")
@click.option("--rounding", default="nearest", show_default=True, help="nearest, stochastic, or both: nearest,stochastic")
@click.option("--weight-bits", default="4", show_default=True, type=click.Choice(["0", *map(str, WEIGHT_BITS)]),
              help="also measure weights-only and weights+state error with the weights quantized as `edgekv export "
              "--weights int4/int8` quantizes them for the .pte (0: skip; recall: only when given)")
@click.option("--rank", "ranks", default=None, help="mla: converted ranks to compare, a comma-separated list, e.g. "
              "64,128,192 (export --rank takes one; default: the strategy's rank)")
@click.option("--window", "windows", default=None,
              help="window: sizes to compare, e.g. 256,512 (default: the strategy's w)")
@click.option("-c", "--ctx", "ctx_text", default="2k", show_default=True,
              help="tokens of text to measure over (recall: the longest needle distance)")
@click.option("--target-ctx", "target_text", default="32k", show_default=True, help="context to extrapolate to")
@click.option("--chunk", "--prefill-chunk", "chunk", default=None, type=click.IntRange(1, 4096),
              help="tokens per call (default: 64 for caches, as chunked prefill; 1 for recurrent states, as decode)")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False),
              help="text file (default: the Python docs' topic pages and stdlib source on this machine)")
@click.option("--analytic/--no-analytic", default=True, help="recurrent layers: the analytic error prediction")
@click.option("--save", is_flag=True, help="store the fitted laws where `edgekv plan` reads them (edgekv/measurements)")
@click.option("--name", default=None, help="model name to store the measurement under (default: from --model)")
@click.option("--applies-to", default=None,
              help="store as evidence for a whole family, e.g. family:ssm (default: this model only)")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON (no progress bar)")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="write error vs position (PNG), fitted laws dashed; recall: accuracy vs distance "
              "(default: no plot)")
@click.option("--trials", default=8, show_default=True, type=click.IntRange(1, 10000),
              help="recall: needles per distance (the same needles at every distance and precision)")
@click.option("--seed", default=0, show_default=True, help="recall: seed of the needles and filler offsets")
@click.option("--distances", "distance_text", default=None,
              help="recall: the needle distances to score, e.g. 8064,12k, instead of the ladder up to --ctx (far "
              "points alone, where each costs minutes; default: the ladder)")
@click.option("--compare", "compare", multiple=True,
              help="recall: another strategy to probe over the same trials, e.g. --compare kv-int8 --compare "
              "window:w=512,sinks=4 --compare mla (repeatable; default: --strategy alone)")
@threads_option(help="torch threads (default: torch's)")
@click.option("--force", is_flag=True, help="replace an existing --plot, only if edgekv wrote it (default: refuse)")
@click.pass_context
def analyze(cctx, model, strategy_spec, probe, bits, rounding, weight_bits, ranks, windows, ctx_text, target_text,
            chunk, text_file, analytic, save, name, applies_to, as_json, plot, trials, seed, distance_text, compare,
            threads, force):
    """Measure error vs position for quantized/compressed state on real weights, fit a growth law, extrapolate;
    or (--probe recall) needle-retrieval accuracy vs distance at each state precision."""
    from ..strategies import parse_strategy
    from ..units import parse_ctx

    base = parse_strategy(strategy_spec)
    weight_bits = int(weight_bits)
    ctx, target = parse_ctx(ctx_text), parse_ctx(target_text)
    roundings = [r.strip() for r in rounding.split(",") if r.strip()]
    if not roundings:
        raise EdgekvError(f"--rounding {rounding!r}: use nearest, stochastic or nearest,stochastic")
    for r in roundings:
        if r not in ("nearest", "stochastic"):
            raise EdgekvError(f"--rounding {r!r}: use nearest, stochastic or nearest,stochastic")
    # where the results go, checked before the measurement starts (minutes of work are not lost to a bad path)
    if plot:
        from ..outputs import PLOT_FORMATS, check_writable
        check_writable(plot, "--plot", PLOT_FORMATS, force=force)
    if save and probe == "error":
        save_target(_model_name(model) if name is None else name, "--model" if name is None else "--name")

    import torch

    from . import report
    from .run import Runner, default_text, make_variants, tokenize

    if threads:
        torch.set_num_threads(threads)
    if probe == "recall":
        from click.core import ParameterSource
        explicit = {p for p in cctx.params if cctx.get_parameter_source(p) != ParameterSource.DEFAULT}
        for opt in ("applies_to", "ranks", "windows", "target_text", "analytic"):
            if opt in explicit:
                flag = {"ranks": "rank", "windows": "window", "target_text": "target-ctx"}.get(opt, opt)
                raise EdgekvError(f"--{flag.replace('_', '-')} belongs to the error probe (--probe error), not to "
                                  "--probe recall")
        store_as = None
        if save:
            from pathlib import Path

            from ..measured import folder_key
            store_as = name if name is not None else (folder_key(Path(model)) if Path(model).is_dir()
                                                      else _model_name(model))
            save_target(store_as, "--model" if name is None else "--name", "recall")
        return _recall(model, base, _ints(bits, "--bits"), roundings,
                       weight_bits if "weight_bits" in explicit else None, ctx, chunk, text_file, trials, seed,
                       as_json, plot, list(compare), store_as, distance_text, force)
    if compare or distance_text:
        raise EdgekvError(f"--{'compare' if compare else 'distances'} belongs to the recall probe (--probe recall)")
    variants = make_variants(base, _ints(bits, "--bits"), roundings, weight_bits or None, _ints(ranks, "--rank"),
                             _ints(windows, "--window"))
    recurrent = base.recurrent
    chunk = chunk or (1 if recurrent else 64)
    from ..progress import Bar
    with Bar(f"analyze: loading {model} and its variants", None, not as_json):
        runner = Runner(model, base, variants, ctx, chunk)
    text = open(text_file, errors="replace").read() if text_file else default_text()
    tokens = tokenize(runner.ref, text, ctx)
    label = text_file or "Python docs topics + stdlib source"

    t0 = time.perf_counter()
    with Bar(f"analyze {len(variants)} variants", ctx, not as_json, "tokens") as bar:
        def step(done):
            bar.update(completed=done)
            bar.work(done, ctx)
        runner.run(tokens, on_step=step)
    seconds = time.perf_counter() - t0
    an = None
    from ..strategies import Ssm
    if analytic and isinstance(base, Ssm):
        from .analytic import ssm_prediction
        an = ssm_prediction(runner, tokens, target)
    result = report.summarise(runner, label, target, analytic=an)
    result["seconds"] = round(seconds, 2)
    if save:
        written = report.store(result, _model_name(model) if name is None else name, applies_to=applies_to)
        result["stored"] = [str(p) for p in written]
    _emit(result, as_json, plot, lambda r, p: report.plot(r, p, force), _table,
          "the curves above cover what was measured")


def _recall(model, base, bits, roundings, weight_bits, max_distance, chunk, text_file, trials, seed, as_json, plot,
            compare=(), store_as=None, distance_text=None, force=False):
    from .recall import FIRST_DISTANCE, RecallProbe, compare_variants, distances, make_trials
    from .recall import plot as recall_plot
    from .recall import store as recall_store
    from .run import Encoder, default_text, make_variants

    state_bits = [b for b in bits or [] if b != 32]
    variants = [] if bits and not state_bits else make_variants(base, state_bits or None, roundings, weight_bits)
    variants += compare_variants(compare)
    recurrent = base.recurrent
    chunk = chunk or (1 if recurrent else 64)
    given = None
    if distance_text:
        from ..units import parse_ctx
        given = sorted({parse_ctx(x.strip()) for x in distance_text.split(",") if x.strip()})
        if not given:
            raise EdgekvError(f"--distances {distance_text!r}: use comma-separated token counts, e.g. 8064,12k")
        if given[0] < FIRST_DISTANCE:
            raise EdgekvError(f"--distances {distance_text}: the recall probe needs at least {FIRST_DISTANCE} tokens "
                              "of distance")
        max_distance = given[-1]
    distances(max_distance)  # a too-short --ctx is one line before any weight is read
    if plot:
        from ..outputs import PLOT_FORMATS, check_writable
        check_writable(plot, "--plot", PLOT_FORMATS, force=force)
    probe = RecallProbe(model, base, variants, max_distance, chunk, seed)
    dists = given or distances(max_distance, probe.trained[0] if probe.trained else None)
    text = open(text_file, errors="replace").read() if text_file else default_text()
    enc = Encoder.for_model(probe.loaded)
    rows = make_trials(enc, text, dists, trials, seed)
    total = sum(t.value_at + len(t.value) - 1 for row in rows for t in row) * len(probe.modules)

    from ..progress import Bar
    t0 = time.perf_counter()
    with Bar(f"recall {len(probe.modules)} variants x {len(dists)} distances x {trials} trials", total,
             not as_json, "tok") as bar:
        def step(n):
            bar.advance(n)
            bar.work(bar.completed, total)
        tallies = probe.run(rows, on_step=step)
    result = probe.summarise(rows, tallies, text_file or "Python docs topics + stdlib source")
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["bos"] = enc.bos
    if store_as and not result["interrupted"]:
        result["stored"] = str(recall_store(result, store_as, "edgekv " + " ".join(sys.argv[1:])))
    _emit(result, as_json, plot, lambda r, p: recall_plot(r, p, force), _recall_table,
          "the table above covers the trials scored")


def _emit(result: dict, as_json: bool, plot: str | None, plotter, table, covered: str) -> None:
    """The plot if asked, then JSON on stdout or the table, then a note on stderr if the run was interrupted."""
    if plot:
        plotter(result, plot)
    if as_json:
        from ..jsonfile import output_json
        sys.stdout.write(output_json(result) + "\n")
    else:
        table(result, plot)
    if result["interrupted"]:
        click.echo(f"stopped early: {covered}", err=True)


def _recall_table(result: dict, plot: str | None) -> None:
    from ..termtext import Col, console, print_table
    title = (f"edgekv analyze --probe recall — {result['model']}, chunk {result['chunk']}: top-1 accuracy of the "
             f"{result['value_len']} value tokens (mean log-prob) by needle distance d")
    beyond = result.get("beyond_trained") or [False] * len(result["distances"])
    cols = [Col("variant", keep=True)] + [Col(f"d={d}" + ("*" if b else ""), "right", give=i)
                                          for i, (d, b) in enumerate(zip(result["distances"], beyond))]
    cells = [[v["label"], *[("-" if a is None else f"{a:.2f} ({lp:.2f})") for a, lp in zip(v["accuracy"], v["logprob"])]]
             for v in result["variants"]]
    c = console()
    print_table(c, title, cols, cells, "")
    n = max((max(v["trials"]) for v in result["variants"]), default=0)
    c.print(f"{n} trials per distance; chance {result['chance']:.3f} (log-prob {result['chance_logprob']:.2f}). "
            f"{result['seconds']} s on this machine.")
    if any(beyond):
        c.print(f"* past the {result['trained_ctx']:,} tokens the model was trained at ({result['trained_from']})")
    if result.get("stored"):
        c.print(f"stored in {result['stored']} (edgekv plan cites it)")
    if plot:
        c.print(f"plot written to {plot}")


NAME_RE = r"[A-Za-z0-9][A-Za-z0-9._-]*"  # a stored measurement's model name: one plain file name part


def save_target(name: str, option: str, probe: str = "probe"):
    """Check, before any work, that --save can store under `name`: a plain name ([A-Za-z0-9._-], not starting with
    a dot) whose files stay in edgekv/measurements/, a folder that can be written."""
    import re

    from ..outputs import check_writable
    from ..quality import MEASURED_DIR
    if not re.fullmatch(NAME_RE, name) or len(name) > 128:
        raise EdgekvError(f"{option}: {name!r} cannot name a stored measurement: use letters, digits, '.', '_' and "
                          "'-' (e.g. --name my-model)")
    check_writable(MEASURED_DIR / f"{name}__{probe}.json", "--save", force=True)  # the store updates its own files


def _model_name(spec: str) -> str:
    from pathlib import Path
    p = Path(spec)
    return p.stem if p.suffix else (p.name if p.exists() else spec)


def _table(result: dict, plot: str | None) -> None:
    from ..termtext import Col, console, print_table
    title = (f"edgekv analyze — {result['model']}, {result['ctx']} tokens measured, chunk {result['chunk']}, "
             f"extrapolated to {result['target_ctx']}")
    cols = [Col("variant", keep=True), Col("source", give=3), Col("mean\nKL", "right", give=1),
            Col("KL (last\nwindow)", "right", give=4), Col("top-1", "right", give=2), Col("growth", give=2),
            Col("law", give=5), Col(f"KL @ {result['target_ctx']}\n[95%]", "right")]
    cells = []
    for v in result["variants"]:
        f, e = v["fit"], v["extrapolated"]
        law = "-" if not f else (f"{f['params']['a']:.2g} t^{f['params']['b']:.2f}" if f["law"] == "power"
                                 else f"{f['params']['a']:.2g} e^({f['params']['k']:.2g} t)")
        cells.append([v["label"], v["source"], f"{v['mean_kl']:.3g}", f"{v['kl'][-1]:.3g}" if v["kl"] else "-",
                      f"{v['mean_top1']:.3f}", f["class"] if f else "-", law,
                      (f"{e['kl']:.3g} [{e['low']:.2g}, {e['high']:.2g}]" + (" far" if e["far_beyond_measured"] else ""))
                      if e else "-"])
    c = console()
    print_table(c, title, cols, cells, f"{result['seconds']} s on this machine. KL in nats/token against the fp32 "
                f"reference; 'far' = more than 4x beyond the measured range.")
    an = result.get("analytic")
    if an:
        c.print(f"analytic ({an['model']}): predicted vs measured state error at {an['compare_at']} tokens: "
                f"{an['predicted_at']:.3g} vs {an['measured_at']:.3g} ({an['error_pct']:+.0f}%); dominant channels: "
                f"{an['dominant']}")
        for layer in an["layers"]:
            c.print(f"  layer {layer['layer']}: decay median {layer['decay_median']:.4f} max {layer['decay_max']:.5f}, "
                    f"error gain 1/(1-a) up to {layer['gain_max']:.3g}, saturates after ~{layer['saturation_tokens']:.0f} "
                    f"tokens; needs {layer['bits_needed']} bits at {result['target_ctx']} tokens")
    for p in result.get("stored", []):
        c.print(f"stored {p}")
    if plot:
        c.print(f"plot written to {plot}")
