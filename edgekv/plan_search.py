"""What the plan searches for beyond one table: what would fit well when nothing does (another strategy, runtime,
weights or a larger device of the class, from the planner's own rows), and `plan --ctx max`, the longest context per
option (bisection over the same memory model, capped at the trained context)."""
from __future__ import annotations

from dataclasses import dataclass

from . import memory as M
from .arch import Arch
from .clibase import plan_flag
from .devices import DeviceProfile, artifact_budget, cpu_note
from .errors import EdgekvError
from .plan import (DEFAULT_CHUNK, Plan, PlanRow, default_models, default_runtime, device_deployment, make_plan,
                   plan_one, strategies_for)
from .quality import RISK_ORDER
from .strategies import NotApplicable, ParamsDoNotFit, Strategy
from .units import fmt_mem
def fits_well(r: PlanRow) -> bool:
    """Fits with headroom beyond the budget's uncertainty, at quality risk none or low."""
    return r.fit == "yes" and RISK_ORDER[r.quality["risk"]] <= RISK_ORDER["low"]


def _suggestion(kind: str, what: str, r: PlanRow, args: list[str]) -> dict:
    return {"kind": kind, "what": what, "model": r.model, "strategy": r.strategy.label, "short": r.strategy.short,
            "weights": r.deployment.weight_precision, "runtime": r.runtime, "fit": r.fit,
            "headroom_bytes": r.headroom, "risk": r.quality["risk"], "decode_tokens_per_s": round(r.decode.value, 3),
            "command": "edgekv plan " + " ".join(plan_flag(a) if i and args[i - 1] == "--runtime" else a
                                                 for i, a in enumerate(args))}


def what_would_fit(plan: Plan, archs: list[Arch], strategies: list[Strategy] | None, weights: str | None,
                   entitled: bool, chunk: int, models_given: bool) -> list[dict] | None:
    """None when some row of the plan fits well (fits_well); else the planner's own best row that does under each
    change one flag makes: every strategy (where --strategy narrowed the plan), each other runtime the device
    profile has, and the smallest device of the same class with a larger budget (its plausible models unless
    --model named some). An empty list: nothing the planner knows fits well."""
    if any(fits_well(r) for r in plan.rows):
        return None
    d, ctx, rt = plan.device, plan.ctx, plan.runtime
    from .units import fmt_ctx
    k8 = plan.int8_kernel  # the .pte's int8 kernel the plan priced (plan --pte-kernel), kept in each suggestion
    plain = ["-d", d.id, "-c", fmt_ctx(ctx)] + [a for m in archs for a in ("-m", m.name)] * models_given \
        + (["--entitled"] if entitled else []) + (["--pte-kernel", k8] if k8 != "executorch" else [])
    base = plain + (["--weights", weights] if weights else [])
    strat = [a for s in strategies or [] for a in ("--strategy", s.label)]
    out = []

    def best(p: Plan) -> PlanRow | None:
        return next((r for r in p.ranked() if fits_well(r)), None)

    if strategies:
        r = best(make_plan(d, ctx, archs, None, weights, rt, entitled, chunk, k8))
        if r:
            out.append(_suggestion("strategy", r.strategy.short, r, base + ["--runtime", rt]))
    w_now = {r.deployment.weight_precision for r in plan.rows}
    # wider weights, where quantized ones are what the plan used: their measured cost can be what sets the risk
    wider = [w for w in ("int8", "fp16") if w not in w_now] if w_now and w_now <= {"int4", "int8"} else []
    for other in [rt] + [k for k, v in M.PLAN_RUNTIMES.items() if k != rt and v["overhead"] in d.runtime_overhead]:
        r = None if other == rt else best(make_plan(d, ctx, archs, strategies, weights, other, entitled, chunk, k8))
        if r:
            out.append(_suggestion("runtime", plan_flag(other), r, base + strat + ["--runtime", other]))
            continue
        for w in wider:  # the runtime alone does not: with wider weights
            r = best(make_plan(d, ctx, archs, strategies, w, other, entitled, chunk, k8))
            if r:
                out.append(_suggestion("weights" if other == rt else "runtime and weights", f"{plan_flag(other)}, {w}", r,
                                       plain + strat + ["--runtime", other, "--weights", w]))
                break
    from .devices import all_devices
    budget = plan.budget
    bigger = sorted((x for x in all_devices() if x.device_class == d.device_class and x.budget_bytes > budget
                     and M.PLAN_RUNTIMES[rt]["overhead"] in x.runtime_overhead), key=lambda x: x.budget_bytes)
    for x in bigger:
        r = best(make_plan(x, ctx, archs if models_given else default_models(x), strategies, weights, rt, False,
                           chunk, k8))
        if r:
            args = ["-d", x.id] + base[2:] + strat + ["--runtime", rt]
            out.append(_suggestion("device", f"{x.id} ({x.name}, budget {fmt_mem(x.budget_bytes)})", r, args))
            break
    return out


CTX_SEARCH_MAX = 1 << 20  # 1m tokens: the search's ceiling where the model names no trained length


@dataclass
class Longest:
    """One option's longest context on a device: ctx (the total stays within the budget), ctx_yes (headroom stays
    beyond the budget's uncertainty), what bounds ctx ("memory", "trained" or "search") and why in words; row: the
    option planned at ctx (None when it fits at no context)."""
    model: str
    strategy: Strategy
    ctx: int
    ctx_yes: int
    bound: str
    why: str
    row: PlanRow | None = None

    def to_json(self, explain: bool = False) -> dict:
        d = self.row.to_json(explain) if self.row else {"model": self.model, "strategy": self.strategy.name,
                                                          "params": self.strategy.params}
        d["max_ctx"] = {"value": self.ctx, "with_headroom": self.ctx_yes, "bound": self.bound, "why": self.why}
        return d


def _largest(ok, lo: int, hi: int) -> int:
    """The largest c in [lo, hi] with ok(c), given ok(lo) and not ok(hi + 1) or hi the ceiling; ok must hold below
    any context where it holds (memory grows with the context)."""
    if ok(hi):
        return hi
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def longest_ctx(arch: Arch, strategy: Strategy, device: DeviceProfile, weights: str, runtime: str | None = None,
                chunk: int = DEFAULT_CHUNK, entitled: bool = False, int8_kernel: str = "executorch") -> Longest:
    """Bisection over the memory model (device_deployment: the bytes plan_one counts) for the longest context
    within the budget, capped at the model's trained context (past it the plan's risk is high whatever the memory);
    the option is then planned at that context."""
    name = runtime or default_runtime(device)
    basis = artifact_budget(device, M.PLAN_RUNTIMES[name]["overhead"], entitled)
    strategy.check_device(device.is_datacenter)
    memo: dict[int, int] = {}

    def above(c: int) -> int:  # bytes above the runtime's baseline at c tokens
        if c not in memo:
            b = device_deployment(arch, strategy, device, c, weights, name, chunk, int8_kernel).bytes
            memo[c] = b["total"] - b["runtime"]
        return memo[c]

    cap = arch.trained_ctx[0] if arch.trained_ctx else CTX_SEARCH_MAX
    fits = lambda c: above(c) <= basis.above_baseline  # noqa: E731
    roomy = lambda c: above(c) + basis.overhead < basis.app - basis.uncertainty  # noqa: E731  (fit "yes")
    if not fits(1):
        return Longest(arch.name, strategy, 0, 0, "memory",
                       f"does not fit at any context: {fmt_mem(above(1))} above the runtime's baseline at 1 token, "
                       f"{basis.describe()}")
    ctx = _largest(fits, 1, cap)
    yes = _largest(roomy, 1, ctx) if roomy(1) else 0
    if ctx == cap:
        bound, why = (("trained", f"the model was trained at {cap:,} tokens ({arch.trained_ctx[1]}); it fits "
                                  "there, and past it the risk is high") if arch.trained_ctx else
                      ("search", f"no trained length known; fits at {cap:,} tokens, the longest searched"))
    else:
        over = above(ctx + 1) - basis.above_baseline
        bound, why = "memory", (f"at {ctx + 1:,} tokens it would hold {above(ctx + 1):,} B above the runtime's "
                                f"baseline, {over:,} B more than {basis.describe()}")
    row = plan_one(arch, strategy, device, ctx, weights, runtime, None, chunk, entitled, int8_kernel)
    return Longest(arch.name, strategy, ctx, yes, bound, why, row)


@dataclass
class MaxPlan:
    device: DeviceProfile
    options: list[Longest]
    not_applicable: list[dict]
    budget: int
    runtime: str

    def ranked(self) -> list[Longest]:
        return sorted(self.options, key=lambda o: (-o.ctx, RISK_ORDER[o.row.quality["risk"]] if o.row else 9,
                                                   -(o.row.decode.value if o.row else 0)))

    def to_json(self, explain: bool = False) -> dict:
        return {"device": self.device.to_json(), "ctx": "max", "budget_bytes": self.budget,
                "budget_uncertainty_bytes": self.device.budget_uncertainty_bytes,
                "cpu_note": cpu_note(self.device),
                "runtime": {"name": self.runtime, "flag": plan_flag(self.runtime),
                         "label": M.PLAN_RUNTIMES[self.runtime]["label"]},
                "options": [o.to_json(explain) for o in self.ranked()], "not_applicable": self.not_applicable}


def make_max_plan(device: DeviceProfile, archs: list[Arch], strategies: list[Strategy] | None = None,
                  weights: str | None = None, runtime: str | None = None, entitled: bool = False,
                  chunk: int = DEFAULT_CHUNK, int8_kernel: str = "executorch") -> MaxPlan:
    """`plan --ctx max`: every option's longest context on the device (longest_ctx)."""
    if entitled and device.entitled_budget_bytes is None:
        raise EdgekvError(f"device {device.id} has no increased-memory-limit budget (iOS only)")
    name = runtime or default_runtime(device)
    if name not in M.PLAN_RUNTIMES:
        raise EdgekvError(f"unknown runtime {name!r}; runtimes: {', '.join(M.PLAN_RUNTIMES)}")
    device.overhead(M.PLAN_RUNTIMES[name]["overhead"])  # one line naming the runtimes the profile has
    out, na = [], []
    for arch in archs:
        w = weights or ("gguf" if arch.gguf_path else ("fp16" if device.is_datacenter else "int4"))
        for s in strategies_for(arch, device, strategies):
            try:
                out.append(longest_ctx(arch, s, device, w, runtime, chunk, entitled, int8_kernel))
            except NotApplicable as e:
                na.append({"model": arch.name, "strategy": s.name, "reason": str(e)})
            except ParamsDoNotFit as e:
                if strategies:
                    raise
                na.append({"model": arch.name, "strategy": s.label, "reason": str(e)})
    budget = device.entitled_budget_bytes if entitled else device.budget_bytes
    return MaxPlan(device, out, na, budget, name)
