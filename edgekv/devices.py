"""Device profiles: one TOML per device in device_profiles/, every fact with its source or marked an estimate.

A fact is a table `{value = ..., source = "..."}` or `{value = ..., estimate = "how it was derived"}` (exactly one of
source/estimate). `load_device("pixel8")` reads device_profiles/pixel8.toml; `load_device("./my.toml")` reads a user's file.
"""
from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgekvError
from .safetext import has_control, printable

PROFILE_DIR = Path(__file__).resolve().parent.parent / "device_profiles"
CLASSES = ("phone", "datacenter", "host")
REQUIRED = ("ram_bytes", "app_budget_bytes", "mem_bandwidth_bytes_per_s", "compute_flops",
            "decode_efficiency", "prefill_efficiency")
REQUIRED_DATACENTER = ("usd_per_hour",)
POSITIVE = ("ram_bytes", "app_budget_bytes", "app_budget_entitled_bytes", "mem_bandwidth_bytes_per_s",
            "compute_flops")
# optional: how far the real budget may be below app_budget_bytes (the budget is a rule of thumb or one measurement,
# not a limit the OS states); a plan fits "yes" only with more headroom than this, "tight" within it. Absent = 0.
UNCERTAINTY = "app_budget_uncertainty_bytes"


@dataclass(frozen=True)
class Fact:
    value: float
    source: str | None = None
    estimate: str | None = None

    @property
    def cite(self) -> str:
        return self.source if self.source else f"estimate: {self.estimate}"

    def to_json(self) -> dict:
        d = {"value": self.value}
        d["source" if self.source else "estimate"] = self.source or self.estimate
        return d


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_s: Fact
    latency_s: Fact


@dataclass(frozen=True)
class DeviceProfile:
    id: str
    name: str
    device_class: str
    os: str
    soc: str
    runtime: str
    facts: dict[str, Fact]
    runtime_overhead: dict[str, Fact]
    interconnect: dict[str, Interconnect] = field(default_factory=dict)
    path: str = ""
    # the CPU whose rates the profile holds, as /proc/cpuinfo's "model name" gives it (a host profile's speeds were
    # measured on that CPU; plan notes when it runs on another: cpu_note); "" = not stated (phones, GPUs)
    cpu: str = ""

    # the numbers the planner reads, by name
    @property
    def ram_bytes(self) -> int:
        return int(self.facts["ram_bytes"].value)

    @property
    def budget_bytes(self) -> int:
        return int(self.facts["app_budget_bytes"].value)

    @property
    def entitled_budget_bytes(self) -> int | None:
        f = self.facts.get("app_budget_entitled_bytes")
        return int(f.value) if f else None

    @property
    def budget_uncertainty_bytes(self) -> int:
        f = self.facts.get(UNCERTAINTY)
        return int(f.value) if f else 0

    @property
    def bandwidth(self) -> float:
        return float(self.facts["mem_bandwidth_bytes_per_s"].value)

    @property
    def flops(self) -> float:
        return float(self.facts["compute_flops"].value)

    @property
    def decode_efficiency(self) -> float:
        return float(self.facts["decode_efficiency"].value)

    @property
    def prefill_efficiency(self) -> float:
        return float(self.facts["prefill_efficiency"].value)

    @property
    def usd_per_hour(self) -> float | None:
        f = self.facts.get("usd_per_hour")
        return float(f.value) if f else None

    @property
    def is_datacenter(self) -> bool:
        return self.device_class == "datacenter"

    def overhead(self, runtime: str | None = None) -> Fact:
        rt = runtime or self.runtime
        if rt not in self.runtime_overhead:
            raise EdgekvError(f"device {self.id!r} has no runtime overhead for runtime {rt!r} "
                              f"(it has: {', '.join(sorted(self.runtime_overhead))})")
        return self.runtime_overhead[rt]

    def to_json(self) -> dict:
        return {
            "id": self.id, "name": self.name, "class": self.device_class, "os": self.os, "soc": self.soc,
            "runtime": self.runtime, **({"cpu": self.cpu} if self.cpu else {}),
            "facts": {k: v.to_json() for k, v in self.facts.items()},
            "runtime_overhead_bytes": {k: v.to_json() for k, v in self.runtime_overhead.items()},
            "interconnect": {k: {"bytes_per_s": v.bytes_per_s.to_json(), "latency_s": v.latency_s.to_json()}
                             for k, v in self.interconnect.items()},
        }


MAX_PROFILE_BYTES = 1 << 20  # the built-in profiles are a few KB
MAX_VALUE = 1e30  # larger than any device fact (bytes, bytes/s, FLOP/s, $/h) by orders of magnitude
MAX_TEXT = 4096   # characters in one string field


def _shown(value, limit: int = 60) -> str:
    """A value quoted in a one-line error: cut short (a 401-digit integer) and with control characters escaped."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {value.bit_length():,} bits"
    r = printable(repr(value))
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _text(where: str, key: str, value, default: str | None = None) -> str:
    """A string field: a string of printable characters, not another type."""
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise EdgekvError(f"{where}: '{key}' must be a string, got {type(value).__name__} {_shown(value)}")
    if len(value) > MAX_TEXT:
        raise EdgekvError(f"{where}: '{key}' is {len(value):,} characters long (at most {MAX_TEXT:,})")
    if has_control(value):
        raise EdgekvError(f"{where}: '{key}' holds terminal control characters ({_shown(value)})")
    return value


def _fact(where: str, key: str, raw) -> Fact:
    if not isinstance(raw, dict) or "value" not in raw:
        raise EdgekvError(f"{where}: '{printable(key)}' must be a table with 'value' and 'source' or 'estimate'")
    if has_control(key):
        raise EdgekvError(f"{where}: a key holds terminal control characters ({_shown(key)})")
    value = raw["value"]
    try:  # an integer of hundreds of digits has no float (OverflowError)
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= float(value) <= MAX_VALUE
    except OverflowError:
        ok = False
    if not ok:
        raise EdgekvError(f"{where}: '{key}.value' must be a finite non-negative number up to {MAX_VALUE:g}, "
                          f"got {_shown(value)}")
    src, est = raw.get("source"), raw.get("estimate")
    if bool(src) == bool(est):
        raise EdgekvError(f"{where}: '{key}' needs exactly one of 'source' or 'estimate'")
    src = _text(where, f"{key}.source", src) if src else None
    est = _text(where, f"{key}.estimate", est) if est else None
    return Fact(value, src, est)


def parse_profile(data: dict, where: str) -> DeviceProfile:
    for k in ("id", "name", "class"):
        if k not in data:
            raise EdgekvError(f"{where}: missing field '{k}'")
    for k in ("id", "name", "class", "os", "soc", "runtime", "notes", "cpu"):
        if k in data:
            _text(where, k, data[k])
    for k in ("runtime_overhead_bytes", "interconnect"):
        if k in data and not isinstance(data[k], dict):
            raise EdgekvError(f"{where}: '{k}' must be a table, got {type(data[k]).__name__}")
    cls = data["class"]
    if cls not in CLASSES:
        raise EdgekvError(f"{where}: class must be one of {', '.join(CLASSES)}, got {cls!r}")
    required = REQUIRED + (REQUIRED_DATACENTER if cls == "datacenter" else ())
    facts = {}
    for k in required:
        if k not in data:
            raise EdgekvError(f"{where}: missing field '{k}'")
    skip = {"id", "name", "class", "os", "soc", "runtime", "runtime_overhead_bytes", "interconnect", "notes", "cpu"}
    for k, raw in data.items():
        if k not in skip:
            facts[k] = _fact(where, k, raw)
    overhead_raw = data.get("runtime_overhead_bytes")
    if not isinstance(overhead_raw, dict) or not overhead_raw:
        raise EdgekvError(f"{where}: missing field 'runtime_overhead_bytes' (a table of runtime -> fact)")
    overhead = {rt: _fact(where, f"runtime_overhead_bytes.{rt}", raw) for rt, raw in overhead_raw.items()}
    runtime = data.get("runtime", next(iter(overhead)))
    if runtime not in overhead:
        raise EdgekvError(f"{where}: default runtime {runtime!r} has no entry in runtime_overhead_bytes")
    links = {}
    for name, raw in (data.get("interconnect") or {}).items():
        if not isinstance(raw, dict) or "bytes_per_s" not in raw or "latency_s" not in raw:
            raise EdgekvError(f"{where}: interconnect.{name} needs 'bytes_per_s' and 'latency_s' facts")
        links[name] = Interconnect(name, _fact(where, f"interconnect.{name}.bytes_per_s", raw["bytes_per_s"]),
                                   _fact(where, f"interconnect.{name}.latency_s", raw["latency_s"]))
    for k in ("decode_efficiency", "prefill_efficiency"):
        if not 0 < facts[k].value <= 1:
            raise EdgekvError(f"{where}: '{k}.value' must be in (0, 1]")
    # what the planner divides by, or what cannot be nothing: a device with 0 of it cannot run a model
    for k in POSITIVE + ((REQUIRED_DATACENTER if cls == "datacenter" else ())):
        if k in facts and not facts[k].value > 0:
            raise EdgekvError(f"{where}: '{k}.value' must be larger than 0")
    for name, link in links.items():
        if not link.bytes_per_s.value > 0:
            raise EdgekvError(f"{where}: 'interconnect.{name}.bytes_per_s.value' must be larger than 0")
    if UNCERTAINTY in facts and facts[UNCERTAINTY].value >= facts["app_budget_bytes"].value:
        raise EdgekvError(f"{where}: '{UNCERTAINTY}.value' {facts[UNCERTAINTY].value:.4g} is not less than "
                          f"app_budget_bytes {facts['app_budget_bytes'].value:.4g}")
    for k in ("app_budget_bytes", "app_budget_entitled_bytes"):
        if k in facts and facts[k].value > facts["ram_bytes"].value:
            raise EdgekvError(f"{where}: '{k}.value' {facts[k].value:.4g} is more than ram_bytes "
                              f"{facts['ram_bytes'].value:.4g}")
    return DeviceProfile(id=str(data["id"]), name=str(data["name"]), device_class=cls, os=str(data.get("os", "")),
                         soc=str(data.get("soc", "")), runtime=runtime, facts=facts, runtime_overhead=overhead,
                         interconnect=links, path=where, cpu=" ".join(str(data.get("cpu", "")).split()))


@dataclass(frozen=True)
class Budget:
    """What an artifact may hold on a device, on the one basis `plan`, `profile --device` and `report` share: the app
    budget less the runtime's own overhead = the bytes allowed above the runtime's baseline (what `profile` measures;
    the plan's total is those bytes plus the overhead, so total <= app budget is the same test). uncertainty: how far
    the app budget itself may be off (app_budget_uncertainty_bytes)."""
    device: str
    app: int
    runtime: str
    overhead: int
    uncertainty: int
    entitled: bool = False

    @property
    def above_baseline(self) -> int:
        return self.app - self.overhead

    def describe(self) -> str:
        from .units import fmt_mem
        return (f"{self.device} {'entitled ' if self.entitled else ''}app budget {fmt_mem(self.app)} - {self.runtime} "
                f"overhead {fmt_mem(self.overhead)} = {fmt_mem(self.above_baseline)} above the runtime's baseline")


def artifact_budget(device: DeviceProfile, runtime: str, entitled: bool = False) -> Budget:
    """The Budget of one runtime on one device; runtime: a key of the profile's runtime_overhead_bytes (a plan
    runtime's "overhead", edgekv/costs/runtimes.json)."""
    app = device.budget_bytes
    if entitled:
        if device.entitled_budget_bytes is None:
            raise EdgekvError(f"device {device.id} has no increased-memory-limit budget (iOS only)")
        app = device.entitled_budget_bytes
    return Budget(device.id, app, runtime, int(device.overhead(runtime).value), device.budget_uncertainty_bytes,
                  entitled)


def device_ids() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _looks_like_path(name: str) -> bool:
    return name.endswith(".toml") or "/" in name or os.sep in name or name.startswith(("~", "."))


def load_device(name_or_path: str) -> DeviceProfile:
    """A built-in id ('pixel8') or the path of a user's TOML file. A name is a path when it looks like one (a .toml
    suffix, a folder separator, a leading '.' or '~') or, failing a built-in id, names an existing file: a folder
    ./pixel8/ in the working directory does not hide the built-in pixel8."""
    shown = printable(name_or_path)
    builtin = PROFILE_DIR / f"{name_or_path}.toml"
    if not _looks_like_path(name_or_path) and name_or_path in device_ids():
        path = builtin
    elif _looks_like_path(name_or_path) or os.path.isfile(name_or_path):
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            raise EdgekvError(f"device file {shown} is a folder, not a .toml profile")
        if not path.is_file():
            raise EdgekvError(f"device file {shown} does not exist" + ("" if path.exists() else
                              f" (built-in devices: {', '.join(device_ids())})"))
    else:
        from .names import suggestion
        hint = suggestion(name_or_path, device_ids())
        raise EdgekvError(f"unknown device {shown!r}; " + (
            f"{hint} (`edgekv devices` lists every profile; or pass the path of a .toml profile)" if hint else
            f"known devices: {', '.join(device_ids())} (or pass the path of a .toml profile)"))
    where = printable(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise EdgekvError(f"{where}: cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise EdgekvError(f"{where}: larger than {MAX_PROFILE_BYTES >> 20} MiB; not a device profile")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EdgekvError(f"{where}: not valid TOML ({printable(e)})") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise EdgekvError(f"{where}: not valid TOML (nested too deep)") from None
    except (ValueError, MemoryError) as e:  # an integer past Python's 4300-digit limit for int(str)
        raise EdgekvError(f"{where}: not valid TOML ({type(e).__name__}: {printable(e)[:200]})") from None
    return parse_profile(data, where)


def all_devices() -> list[DeviceProfile]:
    return [load_device(i) for i in device_ids()]


CPUINFO = "/proc/cpuinfo"


@functools.lru_cache(maxsize=1)
def this_cpu() -> str | None:
    """This machine's CPU as /proc/cpuinfo's first "model name" line gives it (spaces collapsed), read once without
    torch; None where the file or the line is absent (not Linux, some ARM kernels)."""
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split()) or None
    except OSError:
        pass
    return None


def cpu_note(device: DeviceProfile) -> str | None:
    """One line where the profile's speeds are another CPU's than this machine's (its `cpu` is not /proc/cpuinfo's
    model name): the built-in profile whose `cpu` is this machine's (`--device ID`), or, if none, that the speeds
    are another CPU's and how to measure this one. None where they match, the profile names no cpu, or this
    machine's CPU is unknown."""
    if not device.cpu:  # a phone or GPU profile: no CPU of this machine's to compare (nothing read)
        return None
    here = this_cpu()
    if not here or here == device.cpu:
        return None
    match = [i for i in device_ids() if i != device.id and profile_cpu(i) == here]
    if match:
        return (f"note: {device.id}'s speeds were measured on {device.cpu}; this machine is {here}: "
                f"--device {match[0]} holds its rates")
    return (f"note: {device.id}'s speeds were measured on {device.cpu}, not on this machine's {here}, which no "
            "profile holds rates for: the speed column is that CPU's. To measure this one: benchmarks/"
            "attention_rates.py (kernel rates) and benchmarks/plan_vs_filled.py on filled_context runs, into a "
            "profile with cpu = this model name")


def profile_cpu(device_id: str) -> str:
    """A built-in profile's `cpu`, from its TOML without building (and checking) the whole profile: cpu_note scans
    every profile, and one that does not load is no match ('', as for a profile that names none)."""
    try:
        data = tomllib.loads((PROFILE_DIR / f"{device_id}.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return ""
    cpu = data.get("cpu")
    return " ".join(cpu.split()) if isinstance(cpu, str) else ""
