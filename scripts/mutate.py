"""Mutation testing of the modules whose numbers users act on: `make mutate` (cosmic-ray, pinned in
requirements-mutate.lock; not part of `make test`).

    .venv-mutate/bin/python scripts/mutate.py [--python .venv/bin/python] [--only fit,verify] [--max-per-module N]
                                              [--seed 0] [--json benchmarks/results/mutation.json]

For each module below: the functions listed (their line ranges, found with ast, so the list survives edits) are
mutated one change at a time by cosmic-ray, and only that module's fast tests run against each mutant. A mutant
is killed when those tests fail (or time out), survives when they pass. It all runs in a scratch copy of the work
tree (the tracked and untracked-not-ignored files), so the checkout is never left mutated.

Operators: cosmic-ray's, less those whose mutants say nothing about a number here (bit shifts and bitwise ops,
modulo, power, `is`, exception and decorator removal, variable insertion) and each binary operator's replacements
kept to its inverse (+ <-> -, * <-> /): the mutants that move a planned byte, a tolerance, a sign or an interval.
--max-per-module N samples N mutants per module (seeded) where the machine has no time for all of them; the JSON
says how many were generated, sampled and run.

The score and the surviving mutants go to --json; tests/README.md says which survivors are accepted and why.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by the mutation venv, which does not install edgekv: children.py is stdlib only
from edgekv.children import child_setup  # noqa: E402  (every child dies with this process)

# module: (functions to mutate (None: the whole file), the fast tests that guard them, timeout per run in s)
MODULES = {
    "strategies": ("edgekv/strategies/layout.py", ["_kv_pair", "_ssm_pair", "_linear_state"],
                   "tests/test_state_bytes.py tests/test_memory.py tests/test_verify.py", 120),
    "storage": ("edgekv/strategies/storage.py", None,
                "tests/test_strategies.py tests/test_state_bytes.py tests/test_memory.py tests/test_verify.py "
                "tests/test_kv_fp8.py", 180),
    "weights": ("edgekv/memory/weights.py", ["weight_bytes_one", "weight_bytes"],
                "tests/test_memory.py tests/test_state_bytes.py tests/test_arch.py -k 'memory or state or catalog_config'",
                180),
    "costs": ("edgekv/memory/workspace.py", ["workspace_bytes", "_layer_scratch", "runtime_load_bytes"],
              "tests/test_memory.py tests/test_state_bytes.py tests/test_arch.py -k 'memory or state or catalog_config'",
              180),
    "variants": ("edgekv/arch/variants.py", None, "tests/test_variants.py", 300),
    "quant": ("edgekv/quant.py", None, "tests/test_quant.py", 120),
    "verify": ("edgekv/export/verify.py", ["tolerance_dtype", "limits", "verify", "min_top1"],
               "tests/test_verify.py", 120),
    "manifest": ("edgekv/export/manifest.py", ["validate", "sha256_file", "load_export"],
                 "tests/test_verify.py -k 'manifest or folder or refused'", 120),
    "profile": ("edgekv/profile/run.py", ["profile", "median_run"],
                "tests/test_profile.py -k 'median_run or known_allocation or prediction_counts'", 300),
    "fit": ("edgekv/analyze/fit.py", ["Fit.predict", "Fit.interval", "_ols", "fit_growth", "extrapolate"],
            "tests/test_fit.py", 120),
    "recall": ("edgekv/analyze/recall.py", ["RecallProbe.summarise", "chance"],
               "tests/test_recall.py -k 'summary or chance'", 120),
    "prefill": ("edgekv/memory/prefill.py", ["eager_attention_flop", "eager_readback_values", "eager_prefill",
                                            "prefill_graph", "_at_head_dim", "head_dim_scale", "prefill_at_rates",
                                            "matmul_kernel_rate", "matmul_shape_scale", "prefill_keys_factor"],
                "tests/test_attention_rates.py -k 'prefill or prompt or head_size or shapes or keys or kv_head'", 120),
    # a cache with no stored kernel rate: its decode and prompt between the runtime's measured kinds
    "bracket": ("edgekv/memory/speed.py", ["attention_bracket", "eager_decode"],
                "tests/test_attention_rates.py -k 'bracket or no_measured_kernel'", 120),
    "prefill_bracket": ("edgekv/memory/prefill.py", ["prefill_bracket"],
                        "tests/test_attention_rates.py -k 'bracket or no_measured_kernel'", 120),
    "ring": ("edgekv/ring/launch.py", ["check_errors", "reference_attention"],
             "tests/test_ring.py -k 'wrong or prefill_matches or decode_steps_after'", 300),
}

# cosmic-ray operator names (regexes) left out; see the module docstring
EXCLUDE = [
    r"core/ReplaceBinaryOperator_\w+_(FloorDiv|Mod|Pow|RShift|LShift|BitOr|BitAnd|BitXor)$",
    r"core/ReplaceBinaryOperator_(FloorDiv|Mod|Pow|RShift|LShift|BitOr|BitAnd|BitXor)_\w+$",
    r"core/ReplaceBinaryOperator_(Add_Mul|Add_Div|Sub_Mul|Sub_Div|Mul_Add|Mul_Sub|Div_Add|Div_Sub)$",
    r"core/ReplaceComparisonOperator_\w+_(Is|IsNot)$",
    r"core/ReplaceComparisonOperator_(Is|IsNot)_\w+$",
    r"core/ReplaceUnaryOperator_\w+_(Invert|UAdd)$",
    r"core/ExceptionReplacer", r"core/RemoveDecorator", r"core/VariableInserter", r"core/VariableReplacer",
]


# survivors accepted after reading them (tests/README.md says the same): module -> [(a fragment of the mutated
# line, why the tests may let it through)]. A survivor matching none is a gap to close with a test.
ACCEPTED = {
    "fit": [("k != 0 and", "equivalent: k * span >= 1 with span > 0 already needs k > 0"),
            ("max(n - 2, 0)", "equivalent: a fit needs 4 points, so n - 2 >= 2"),
            ("aicp - 3", "threshold moved less than any measured curve sits from it"),
            ("b <= B_FLAT", "threshold moved less than any measured curve sits from it"),
            ("* sb) < 0", "threshold moved less than any measured curve sits from it"),
            ("t.max() + t.min()", "positions start at 1: the span moves by 2 in thousands")],
    "verify": [("argmax(1)", "equivalent: the logits are 2-D"),
               ("agree[ -1]", "equivalent: the noise side compares over as many positions")],
    "manifest": [("f.read(", "equivalent: the block size a file is hashed in")],
    "recall": [("all(1)", "equivalent: the stacked tallies are 2-D"),
               ("trials[ -1]", "equivalent: every row of trials has the same distances")],
    "strategies": [("m.version <= 1", "equivalent: Mamba versions are 1 and 2"),
                   ('s >= "window"', "equivalent over the strategy names that reach the line"),
                   ('s > "hybrid"', "equivalent over the strategy names that reach the line"),
                   ('dtype <= "int8"', "a head-shaped linear-attention state: no catalog model has one (gap)")],
    "quant": [("bits > 8", "equivalent: unpacking 8-bit codes is the identity")],
    "ring": [("= -1.0", "equivalent: a maximum of absolute differences is never below 0")],
    "profile": [('get("step", 1)', "the child always reports the step it reached")],
    "weights": [("read = 1.0", "one byte in hundreds of MB"),
                ('w.cls < "embedding"', "one embedding row in a tied model's read per token")],
    "costs": [("read = 1.0", "one byte in hundreds of MB"), ("else 1", "one byte in hundreds of MB"),
              ("else -1", "one byte in hundreds of MB"),
              ('w.cls < "embedding"', "one embedding row in a tied model's read per token"),
              ("methods > 0", "equivalent: (methods - 1) x ... is 0 at one method"),
              ("methods: int = 2", "every caller passes methods"), ("parts[not 1]", "explanation text only"),
              ("{methods - 2}", "explanation text only"),
              ("* 3)", "below the 10 % band of the measured peaks (test_memory)"),
              ("1 * m.d_inner", "below the 10 % band of the measured peaks (test_memory)"),
              ("- ssm_w)", "below the 10 % band of the measured peaks (test_memory)"),
              ("1 < t <", "below the 10 % band of the measured peaks (test_memory)"),
              ("kv_bits < 7", "equivalent: cache bits are 8, 4 or 2"),
              ("copies = 1 +", "below the 10 % band of the measured peaks (test_memory)"),
              ("if not rt.get(\"logits_planned\")", "below the 10 % band of the measured peaks (test_memory)"),
              ('if not rt["scores"]', "native MLA (DeepSeek) has no measured peak yet: a gap")],
    "variants": [("gguf_export = True", "Qwen3's GGUF export is not claimed though the loader reads its tensors "
                                        "(tests/test_variants.py GGUF_NOT_CLAIMED): untested end to end, not wrong")],
    "prefill": [('p["matmul"] - p["logits"]', "a gap: the logits are under 1 % of a prompt's matmuls on the models "
                                             "tested, inside the hand tests' 1 % band"),
              ('p["logits"] - p["scans"]', "equivalent on the models tested: no recurrent scans in a KV cache's prompt"),
              ('p["attention"] - p["reexpand"]', "equivalent on the models tested: no latent re-expanded (not mla)"),
              ('t.role != "key"', "equivalent: a layer's value tensors and scales have its keys' slots"),
              ('t.role <= "key"', "equivalent: no role sorts before \"key\" but \"key\" itself"),
              ('t.role > "key"', "equivalent: a layer's value tensors and scales have its keys' slots"),
              ("if lo >= hi:", "equivalent: lo is never above hi"),
              ("slots != layout.ctx", "equivalent: a layer never keeps more slots than the context"),
              ("layout.ctx else 1)", "one FLOP in ~1e12"), ("layout.ctx else -1)", "one FLOP in ~1e12"),
              ("p[0] <= d]", "equivalent: a measured head size returned before"),
              ("p[0] >= d]", "equivalent: a measured head size returned before"),
              ("/ 1000000001.0", "display: the same 3 digits"), ("/ 999999999.0", "display: the same 3 digits"),
              ("* 1000000001.0", "display: the same 3 digits"), ("* 999999999.0", "display: the same 3 digits"),
              ('parts["ring"] = 1.0', "one FLOP in ~1e12"), ('parts["ring"] = -1.0', "one FLOP in ~1e12"),
              ("isinstance(m, Attention)}) != 1:", "equivalent: a model with no attention layer has no head size, "
                                                  "so no curve, and returned before"),
              ("break", "equivalent: every model with a stored curve has one mixer a block (the hybrids' attention "
                        "sits beside a recurrence only where no kernel curve prices it)")],
    "bracket": [('int8_kernel > "edgekv"', "equivalent over the two kernels callers pass (executorch, edgekv)"),
                ("if s != 0:", "equivalent: attention seconds are never negative"),
                ("* 1001.0", "display: the same 3 digits"), ("* 999.0", "display: the same 3 digits")],
    "prefill_bracket": [('int8_kernel > "edgekv"', "equivalent over the two kernels callers pass (executorch, edgekv)"),
                        ("len(got) <= 1", "equivalent: an empty bracket returned before"),
                        ('t.role != "key"', "equivalent: an SSM's layout prices no kind without the guard either (no "
                                            "head size, so no kernel rate; the fused graph leaves the eager kinds out)"),
                        ('t.role <= "key"', "equivalent: as != (an SSM's layout prices no kind)"),
                        ('t.role > "key"', "equivalent: as != (an SSM's layout prices no kind)"),
                        ('t.role >= "key"', "equivalent: as != (an SSM's layout prices no kind)")],
    "storage": [('rounding <= "nearest"', "equivalent over the two roundings callers pass (nearest, stochastic)"),
                ("frozen=False", "equivalent: nothing assigns to a storage after it is made")],
}


def annotate(module: dict) -> dict:
    """Mark each survivor with the reason it is accepted (ACCEPTED), or None: a gap."""
    for s in module.get("survivors", []):
        s["accepted"] = next((why for frag, why in ACCEPTED.get(module["name"], []) if frag in s["mutant"]), None)
    module["accepted"] = sum(1 for s in module.get("survivors", []) if s["accepted"])
    return module


def function_lines(path: Path, names: list[str] | None) -> list[str]:
    """'start-end' line ranges of the named functions ('Class.method' for a method), or the whole file."""
    src = path.read_text()
    if names is None:
        return [f"1-{len(src.splitlines())}"]
    found = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{f.name}"] = (f.lineno, f.end_lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(node.name, (node.lineno, node.end_lineno))
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{path}: no function {', '.join(missing)} (update scripts/mutate.py MODULES)")
    return [f"{found[n][0]}-{found[n][1]}" for n in names]


def scratch_copy(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True, preexec_fn=child_setup()).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def toml_config(module_path: str, lines: list[str], command: str, timeout: float) -> str:
    q = json.dumps  # TOML basic strings take JSON's escapes
    return "\n".join([
        "[cosmic-ray]", f"module-path = {q(module_path)}", f"timeout = {timeout}", "excluded-modules = []",
        f"test-command = {q(command)}", "", "[cosmic-ray.distributor]", 'name = "local"', "",
        "[cosmic-ray.filters.operators-filter]", "exclude-operators = [" + ", ".join(q(e) for e in EXCLUDE) + "]",
        "", "[cosmic-ray.filters.line-filter]", f"lines = {{ {q(module_path)} = [{', '.join(q(x) for x in lines)}] }}",
        ""])


def run_module(name: str, work: Path, python: str, max_n: int | None, seed: int, log) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    module_path, funcs, tests, timeout = MODULES[name]
    command = f"{python} -m pytest -x -q -p no:cacheprovider -p no:warnings {tests}"
    cfg = work / f"mutate-{name}.toml"
    db = work / f"mutate-{name}.sqlite"
    cfg.write_text(toml_config(module_path, function_lines(work / module_path, funcs), command, timeout))
    bin_dir = Path(sys.executable).parent
    baseline = subprocess.run(shlex.split(command), cwd=work, capture_output=True, text=True, preexec_fn=child_setup())
    if baseline.returncode != 0:
        log(f"{name}: its tests fail unmutated, skipped:\n{baseline.stdout[-2000:]}")
        return {"module": module_path, "error": "tests fail on the unmutated code"}
    subprocess.run([bin_dir / "cosmic-ray", "init", cfg, db, "--force"], cwd=work, check=True, capture_output=True, preexec_fn=child_setup())
    for tool in ("cr-filter-operators", "cr-filter-lines"):
        args = [bin_dir / tool, db, cfg] if tool == "cr-filter-operators" else [bin_dir / tool, db, "--config", cfg]
        subprocess.run(args, cwd=work, check=True, capture_output=True, preexec_fn=child_setup())
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        # in source order, so that a seeded sample is the same sample on every run
        pending = [w.job_id for w in sorted(wdb.pending_work_items, key=lambda w: (
            tuple(w.mutations[0].start_pos), w.mutations[0].operator_name, w.mutations[0].occurrence))]
        generated = wdb.num_work_items
        sampled = len(pending)
        if max_n is not None and len(pending) > max_n:
            keep = set(random.Random(seed).sample(pending, max_n))
            drop = [j for j in pending if j not in keep]
            wdb.set_multiple_results(drop, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED))
            sampled = max_n
    log(f"{name}: {generated} mutants generated, {sampled} to run ({tests})")
    subprocess.run([bin_dir / "cosmic-ray", "exec", cfg, db], cwd=work, check=True, preexec_fn=child_setup())
    return summarize(name, work)


def summarize(name: str, work: Path) -> dict:
    """The module's result from its session database in the scratch copy: generated, run, killed, survivors."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    module_path, funcs, tests, _ = MODULES[name]
    killed, survivors, incompetent, pending, filtered = 0, [], 0, 0, 0
    with use_db(str(work / f"mutate-{name}.sqlite"), WorkDB.Mode.open) as wdb:
        generated = wdb.num_work_items
        pending = len(wdb.pending_work_items)
        for item, result in wdb.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                filtered += result.output != "not sampled"
                continue
            if result.worker_outcome != WorkerOutcome.NORMAL:
                incompetent += 1
            elif result.test_outcome.value == "killed":
                killed += 1
            elif result.test_outcome.value == "survived":
                m = item.mutations[0]
                line = (work / m.module_path).read_text().splitlines()[m.start_pos[0] - 1].strip()
                plus = [x[1:].strip() for x in (result.diff or "").splitlines()
                        if x.startswith("+") and not x.startswith("+++")]
                survivors.append({"line": m.start_pos[0], "operator": m.operator_name, "code": line,
                                  "mutant": plus[0] if plus else ""})
            else:
                incompetent += 1
    run = killed + len(survivors)
    return {"module": module_path, "functions": funcs or "all", "tests": tests, "generated": generated,
            "in_scope": generated - filtered, "run": run, "not_run": pending, "killed": killed,
            "survived": len(survivors), "incompetent": incompetent,
            "score": round(killed / run, 3) if run else None, "survivors": survivors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".venv/bin/python"), help="the project's python (runs the tests)")
    ap.add_argument("--only", default=None, help=f"comma-separated modules: {', '.join(MODULES)}")
    ap.add_argument("--max-per-module", type=int, default=None, help="run a seeded sample of N mutants per module")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write (merge by module) the results here")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--collect", default=None, help="summarize the session databases of a kept scratch copy")
    ap.add_argument("--annotate", action="store_true", help="only re-mark the --json file's survivors (ACCEPTED)")
    a = ap.parse_args(argv)
    if a.annotate:
        doc = json.loads(Path(a.json).read_text())
        doc["modules"] = [annotate(m) for m in doc["modules"]]
        doc["accepted_survivors"] = sum(m["accepted"] for m in doc["modules"])
        doc["survivors_not_accepted"] = [dict(s, module=m["module"]) for m in doc["modules"]
                                         for s in m["survivors"] if not s["accepted"]]
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    names = a.only.split(",") if a.only else list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        print(f"unknown module(s): {', '.join(unknown)} (have: {', '.join(MODULES)})", file=sys.stderr)
        return 2
    if a.collect:
        work = Path(a.collect)
        names = [n for n in names if (work / f"mutate-{n}.sqlite").is_file()]
    else:
        work = Path(tempfile.mkdtemp(prefix="edgekv-mutate-"))
        scratch_copy(work)
    os.environ["PYTHONPATH"] = str(work)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []

    def log(s):
        print(s, file=sys.stderr, flush=True)

    try:
        for n in names:
            r = summarize(n, work) if a.collect else run_module(n, work, a.python, a.max_per_module, a.seed, log)
            r["name"] = n
            if not a.collect:
                r["sample"], r["seed"] = a.max_per_module, a.seed
            results.append(r)
            if "score" in r:
                log(f"{n}: killed {r['killed']} of {r['run']} (score {r['score']}), {r['survived']} survived")
    finally:
        if a.keep or a.collect:
            log(f"scratch copy kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        out = Path(a.json)
        old = json.loads(out.read_text()) if out.is_file() else {}
        mods = {m["name"]: m for m in old.get("modules", [])}
        mods.update({r["name"]: r for r in results})
        mods = {k: v for k, v in mods.items() if k in MODULES}  # a module renamed or dropped leaves no stale rows
        for m in mods.values():
            annotate(m)
        tot_k = sum(m.get("killed", 0) for m in mods.values())
        tot_r = sum(m.get("run", 0) for m in mods.values())
        doc = {"benchmark": "mutation", "tool": "cosmic-ray 8.7.0 (requirements-mutate.lock)",
               "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "command": "scripts/mutate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "sampled_per_module": a.max_per_module, "seed": a.seed,
               "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],  # at the end of the run
               "operators_excluded": EXCLUDE, "killed": tot_k, "survived": tot_r - tot_k, "run": tot_r,
               "score": round(tot_k / tot_r, 3) if tot_r else None,
               "accepted_survivors": sum(m["accepted"] for m in mods.values()),
               "survivors_not_accepted": [dict(s, module=m["module"]) for m in mods.values()
                                          for s in m.get("survivors", []) if not s["accepted"]],
               "modules": [mods[k] for k in MODULES if k in mods]}
        out.write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {out}")
    for r in results:
        print(f"{r['name']:<10} {r.get('killed', '-')}/{r.get('run', '-')} killed, {r.get('survived', '-')} survived"
              + (f"  ({r['error']})" if "error" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
