"""The fresh-process side of benchmarks/decode_speed.py (and of filled_context.py and profile_ort.py, which import it
from there): one configuration per child process, so its peak RSS (VmHWM) is its own (child_* and CHILDREN,
run_child, child_main), and the work folder of exports, the HF folder and GenAI models the rows run (Work)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from edgekv.children import child_setup  # every child dies with the benchmark, SIGKILL included

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


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
        from edgekv.export.pte_stepper import PteStepper as Stepper
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


def llamacpp_session(spec: dict):
    """llama.cpp on the GGUF as it is (spec: model_path, ctx, threads, kv = f16 / q8_0 / q4_0): flash attention,
    K and V of that type, and on a model with sliding-window layers (Gemma 3) a window-sized cache on them (swa_full
    off; the C API's default sizes those layers' cache at n_ctx too; a model without sliding layers is unaffected).
    Returns (prefill(ids), step(token, pos)), each giving the last evaluated position's logits (a copy)."""
    import llama_cpp
    import numpy as np

    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
               "q4_0": llama_cpp.GGML_TYPE_Q4_0}[spec["kv"]]
    llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=spec["ctx"], n_batch=512, n_ubatch=512,
                          n_threads=spec["threads"], n_threads_batch=spec.get("prefill_threads") or spec["threads"],
                          flash_attn=True,
                          type_k=kv_type, type_v=kv_type, swa_full=False, verbose=False)

    def logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()

    def prefill(ids):
        llm.eval(ids)
        return logits()

    def step(t, pos):
        llm.eval([t])
        return logits()

    return prefill, step


def child_llamacpp(spec: dict) -> dict:
    baseline = _status_bytes("VmRSS")
    prefill, step = llamacpp_session(spec)
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
    """An HF safetensors folder of the GGUF's weights, for GenAI's builder: transformers dequantizes the GGUF into the
    family's own class (LlamaForCausalLM for SmolLM2, Gemma3ForCausalLM for Gemma 3: the class the reference logits
    come from) but cannot save_pretrained that model, so its weights are copied into a plain one of that class first."""
    import torch
    import transformers

    torch.set_num_threads(1)
    p, out = Path(spec["model_path"]), Path(spec["out"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # else the builder refuses it as "a gguf quantized model"
    plain = type(loaded)(type(loaded.config).from_dict(config)).to(torch.float32)
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


def run_child(spec: dict, timeout: int, script: str = str(Path(__file__).with_name("decode_speed.py"))) -> dict:
    """Run one spec in a fresh process (`script --child -`, the spec's JSON on stdin; it prints `RESULT {json}`; by default
    benchmarks/decode_speed.py, whose child_main is this module's); returns its result (here plus peak RSS), or
    {"error": one line}. benchmarks/profile_ort.py and filled_context.py run their children through it too."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(spec.get("threads", 1)), PYTHONPATH=str(ROOT))
    try:
        # the spec on stdin: a filled 32k context's ids are more than one argument may hold (MAX_ARG_STRLEN, 128 KiB)
        p = subprocess.run([sys.executable, script, "--child", "-"], input=json.dumps(spec), capture_output=True,
                           preexec_fn=child_setup(),
                           text=True, timeout=timeout, env=env, cwd=ROOT)
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
                               text=True, cwd=ROOT, preexec_fn=child_setup())
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
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, preexec_fn=child_setup())
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
            cmd = [sys.executable, "-c", GENAI_BUILDER, "-i", str(hf), "-o", str(tmp),
                   "-p", precision, "-e", "cpu", "-c", str(self.root / "genai" / "cache"),
                   "--extra_options", "hf_token=false"]
            env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800, preexec_fn=child_setup())
            if p.returncode != 0 or not (tmp / "genai_config.json").is_file():
                raise RuntimeError(f"GenAI builder failed: {_last_line(p.stderr) or p.returncode}")
            tmp.rename(folder)
        return self._once(f"genai-{precision}", folder, build)


def builder_config(c):
    """A transformers config as ONNX Runtime GenAI's builder (0.18) reads it: transformers 5 nests Gemma 3's RoPE per
    layer type (rope_parameters {"full_attention": {...}, "sliding_attention": {...}}), where the builder's Gemma 3
    path wants rope_parameters["rope_type"] / ["rope_theta"] and config.rope_local_base_freq. The global layers' entry
    is lifted to the top and the sliding layers' theta set as rope_local_base_freq; a config without that nesting is
    returned as it is."""
    rp = getattr(c, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_type" not in rp and "full_attention" in rp and "sliding_attention" in rp:
        c.rope_parameters = {**rp, **rp["full_attention"]}
        c.rope_local_base_freq = rp["sliding_attention"]["rope_theta"]
    return c


def genai_builder_main(argv: list[str]) -> None:
    """`python -m onnxruntime_genai.models.builder ARGV`, each config it loads passed through builder_config."""
    import runpy

    import transformers

    load = transformers.AutoConfig.from_pretrained
    transformers.AutoConfig.from_pretrained = lambda *a, **k: builder_config(load(*a, **k))
    sys.argv = ["builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


GENAI_BUILDER = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import speed_child; "
                 "speed_child.genai_builder_main(sys.argv[1:])")


def child_spec(arg: str) -> str:
    """A child's spec: `-` reads it from stdin (what run_child sends), anything else is the JSON itself."""
    return sys.stdin.read() if arg == "-" else arg


def entry(main, child_main) -> None:
    """A benchmark script's `__main__`: `SCRIPT --child JSON` runs one row in this process (the parent's fresh child),
    anything else runs `main()`; edgekv's own errors (a bad --model ...) are one line and exit 2."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(child_spec(sys.argv[2]))
        return
    try:
        main()
    except Exception as e:
        from edgekv.errors import EdgekvError
        if not isinstance(e, EdgekvError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
