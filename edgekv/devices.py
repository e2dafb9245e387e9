"""Device profiles: one TOML per device in device_profiles/, every fact with its source or marked an estimate.

A fact is a table `{value = ..., source = "..."}` or `{value = ..., estimate = "how it was derived"}` (exactly one of
source/estimate). `load_device("pixel8")` reads device_profiles/pixel8.toml; `load_device("./my.toml")` reads a user's file.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgekvError

PROFILE_DIR = Path(__file__).resolve().parent.parent / "device_profiles"
CLASSES = ("phone", "datacenter", "host")
REQUIRED = ("ram_bytes", "app_budget_bytes", "mem_bandwidth_bytes_per_s", "compute_flops",
            "decode_efficiency", "prefill_efficiency")
REQUIRED_DATACENTER = ("usd_per_hour",)
POSITIVE = ("ram_bytes", "app_budget_bytes", "app_budget_entitled_bytes", "mem_bandwidth_bytes_per_s",
            "compute_flops")


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
            "runtime": self.runtime,
            "facts": {k: v.to_json() for k, v in self.facts.items()},
            "runtime_overhead_bytes": {k: v.to_json() for k, v in self.runtime_overhead.items()},
            "interconnect": {k: {"bytes_per_s": v.bytes_per_s.to_json(), "latency_s": v.latency_s.to_json()}
                             for k, v in self.interconnect.items()},
        }


def _fact(where: str, key: str, raw) -> Fact:
    if not isinstance(raw, dict) or "value" not in raw:
        raise EdgekvError(f"{where}: '{key}' must be a table with 'value' and 'source' or 'estimate'")
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise EdgekvError(f"{where}: '{key}.value' must be a finite non-negative number, got {value!r}")
    src, est = raw.get("source"), raw.get("estimate")
    if bool(src) == bool(est):
        raise EdgekvError(f"{where}: '{key}' needs exactly one of 'source' or 'estimate'")
    return Fact(value, src, est)


def parse_profile(data: dict, where: str) -> DeviceProfile:
    for k in ("id", "name", "class"):
        if k not in data:
            raise EdgekvError(f"{where}: missing field '{k}'")
    cls = data["class"]
    if cls not in CLASSES:
        raise EdgekvError(f"{where}: class must be one of {', '.join(CLASSES)}, got {cls!r}")
    required = REQUIRED + (REQUIRED_DATACENTER if cls == "datacenter" else ())
    facts = {}
    for k in required:
        if k not in data:
            raise EdgekvError(f"{where}: missing field '{k}'")
    skip = {"id", "name", "class", "os", "soc", "runtime", "runtime_overhead_bytes", "interconnect", "notes"}
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
    for k in ("app_budget_bytes", "app_budget_entitled_bytes"):
        if k in facts and facts[k].value > facts["ram_bytes"].value:
            raise EdgekvError(f"{where}: '{k}.value' {facts[k].value:.4g} is more than ram_bytes "
                              f"{facts['ram_bytes'].value:.4g}")
    return DeviceProfile(id=str(data["id"]), name=str(data["name"]), device_class=cls, os=str(data.get("os", "")),
                         soc=str(data.get("soc", "")), runtime=runtime, facts=facts, runtime_overhead=overhead,
                         interconnect=links, path=where)


def device_ids() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_device(name_or_path: str) -> DeviceProfile:
    """A built-in id ('pixel8') or the path of a user's TOML file."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise EdgekvError(f"device file {name_or_path} does not exist")
        path = p
    else:
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            from .names import suggestion
            hint = suggestion(name_or_path, device_ids())
            raise EdgekvError(f"unknown device {name_or_path!r}; " + (
                f"{hint} (`edgekv devices` lists every profile; or pass the path of a .toml profile)" if hint else
                f"known devices: {', '.join(device_ids())} (or pass the path of a .toml profile)"))
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EdgekvError(f"{path}: not valid TOML ({e})") from None
    return parse_profile(data, str(path))


def all_devices() -> list[DeviceProfile]:
    return [load_device(i) for i in device_ids()]
