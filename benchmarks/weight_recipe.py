"""From fp16 weights, edgekv's int4 recipes against llama.cpp's Q4_K_M and Q4_0 of the same weights (issue 38).

    python benchmarks/weight_recipe.py                        # SmolLM2-135M and Gemma-3-270M
    python benchmarks/weight_recipe.py --model smollm2-135m --tokens 512

The fp source: the packaged GGUF's tensors dequantized (gguf's own quants.dequantize) and written as
  <work>/<model>-f16.gguf   matrices F16, vectors F32, every metadata key (tokenizer included) copied
  <work>/<model>-hf/        the same values as an HF folder (safetensors fp16, config, tokenizer), read back from
                            that f16 GGUF by transformers
llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize) makes Q4_K_M and Q4_0 from the f16 GGUF; edgekv
exports the HF folder with each --weights recipe. Every row is teacher-forced over the same tokens of verify-quant's
text (edgekv.export.quality.quality_text, the model's BOS first), one prefill call, and compared with the reference,
transformers fp32 on the HF folder's fp16 weights: KL(ref || row) in nats per position, mean, and top-1 agreement.
llama.cpp runs with an f16 cache and flash attention (its default CPU row); edgekv's artifacts with its fp32 cache.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from edgekv.children import child_setup  # a child dies with this process

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
MODELS = ("smollm2-135m", "gemma-3-270m")
# llama.h's LLAMA_FTYPE_MOSTLY_*: Q4_K_M the target; Q4_0 and Q4_1 its plain 4-bit blocks of 32 (Q4_1: a scale and a
# minimum per block, the nearest to MatMulNBits' asymmetric int4)
LLAMA_FTYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q4_1": 3}


def perturbation(name: str, a: np.ndarray, perturb: float) -> np.ndarray:
    """Gaussian noise for one dequantized 2-D tensor [rows, K]: per block of 32 along K, standard deviation perturb x
    (max - min) / 31 of the block (a Q5_0 step at perturb 1), seeded by the tensor's name. A dequantized GGUF's
    values sit on that GGUF's grids (every one of its blocks), and a quantizer whose type matches the file's finds
    them again (a round trip, not a quantization); the noise moves every value off every grid, so each quantizer
    rounds as it would from an original fp16 checkpoint. The reference is the perturbed model itself."""
    import zlib
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    b = a.reshape(a.shape[0], -1, 32)
    step = (b.max(-1, keepdims=True) - b.min(-1, keepdims=True)) / 31
    return (rng.standard_normal(b.shape).astype(np.float32) * (perturb * step)).reshape(a.shape)


def f16_gguf(src: Path, dst: Path, perturb: float = 0.0) -> None:
    """src's tensors dequantized into dst: 2-D as F16, the rest F32 (convert_hf_to_gguf.py's f16 layout), every
    key but the file type copied as it is; perturb > 0: the 2-D tensors moved off the file's grids (perturbation)."""
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type)
        shape = [int(x) for x in reversed(t.shape)]  # ne is innermost first
        a = np.asarray(a, dtype=np.float32).reshape(shape)
        if perturb and a.ndim == 2:
            a = a + perturbation(t.name, a, perturb)
        w.add_tensor(t.name, a.astype(np.float16) if a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(dst) + ".tmp", dst)


def hf_folder(gguf_path: Path, dst: Path) -> None:
    """The f16 GGUF as an HF folder: transformers dequantizes it into the family's class (the values are the f16
    ones), copied into a plain instance (a GGUF-loaded model cannot save_pretrained) and saved as fp16."""
    import torch
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain = type(loaded)(type(loaded.config).from_dict(config))
    plain.load_state_dict(loaded.state_dict())
    del loaded
    plain = plain.to(torch.float16)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, dst)


def tag(model: str, perturb: float) -> str:
    """The file-name stem of a model's fp source: <model>, or <model>-p<perturb> for a perturbed one."""
    return f"{model}-p{perturb:g}" if perturb else model


def sources(model: str, work: Path, perturb: float = 0.0) -> tuple[Path, Path]:
    from edgekv.models.weights import resolve_model

    work.mkdir(parents=True, exist_ok=True)
    f16, hf = work / f"{tag(model, perturb)}-f16.gguf", work / f"{tag(model, perturb)}-hf"
    if not f16.is_file():
        f16_gguf(resolve_model(model).resolve(), f16, perturb)
    if not (hf / "config.json").is_file():
        hf_folder(f16, hf)
    return f16, hf


def llama_quant(f16: Path, kind: str) -> Path:
    """llama.cpp's quantizer on the f16 GGUF (no importance matrix): <model>-<kind>.gguf beside it."""
    import llama_cpp

    out = f16.with_name(f16.name.replace("-f16.gguf", f"-{kind}.gguf"))
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[kind]
        params.nthread = 1
        tmp = out.with_name(out.name + ".tmp")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {kind} returned {rc}")
        os.replace(tmp, out)
    return out


def gguf_types(path: Path) -> dict:
    """{tensor type name: count} of a GGUF's 2-D tensors (what llama.cpp's mix chose)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    return dict(sorted(Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2).items()))


def tokenize(model: str, text: str) -> list[int]:
    """text in the packaged model's GGUF tokenizer (no BOS)."""
    import tempfile

    from tokenizers import Tokenizer

    from edgekv.export.tokenizer import write_tokenizer
    from edgekv.models.weights import resolve_model

    with tempfile.TemporaryDirectory() as d:
        entry = write_tokenizer(resolve_model(model).resolve(), Path(d))
        tok = Tokenizer.from_file(str(Path(d) / entry["file"]))
    return tok.encode(text).ids


def token_ids(model: str, n: int) -> list[int]:
    """verify-quant's text as edgekv runs the packaged model: its GGUF's tokenizer, its BOS first where it adds one."""
    import tempfile

    from tokenizers import Tokenizer

    from edgekv.export.quality import quality_tokens
    from edgekv.export.tokenizer import bos_prefix, write_tokenizer
    from edgekv.models.weights import resolve_model

    with tempfile.TemporaryDirectory() as d:
        entry = write_tokenizer(resolve_model(model).resolve(), Path(d))
        tok = Tokenizer.from_file(str(Path(d) / entry["file"]))
    return quality_tokens(tok, tok.get_vocab_size(), n, bos_prefix(entry))


def log_probs(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(-1, keepdims=True))).astype(np.float32)


def compare(ref: np.ndarray, logits: np.ndarray) -> dict:
    """ref: the reference's log-probabilities [n, V]; logits: a row's [n, V]. KL(ref || row) per position."""
    kl, top = [], []
    for a in range(0, len(ref), 64):  # Gemma's 262k vocabulary: a few positions at a time in float64
        lp, lq = ref[a:a + 64].astype(np.float64), log_probs(logits[a:a + 64]).astype(np.float64)
        kl.append((np.exp(lp) * (lp - lq)).sum(-1))
        top.append(lp.argmax(-1) == lq.argmax(-1))
    kl, top = np.concatenate(kl), np.concatenate(top)
    return {"kl_mean": round(float(kl.mean()), 5), "kl_max": round(float(kl.max()), 3),
            "top1": round(float(top.mean()), 4), "positions": int(len(kl))}


def reference(hf: Path, ids: list[int]) -> np.ndarray:
    """transformers fp32 on the HF folder's fp16 weights: log-probabilities [n, V], one forward."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0]
        out = []
        for a in range(0, len(ids), 64):
            out.append(log_probs(model.lm_head(h[a:a + 64]).numpy()))
    return np.concatenate(out)


def llamacpp_logits(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp on a GGUF as it is: f16 K and V, flash attention, every position's logits from one prompt call."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids), n_batch=len(ids), n_ubatch=len(ids),
                          n_threads=threads, n_threads_batch=threads, flash_attn=True, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F16, type_v=llama_cpp.GGML_TYPE_F16, verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close()
    return out


def edgekv_export(hf: Path, weights: str, out: Path, ctx: int) -> dict:
    """`edgekv export -m <hf folder> --weights <weights>` (a child process): the manifest's weight record and its
    verify-quant."""
    if not (out / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "edgekv.cli", "export", "-m", str(hf), "--weights", weights, "-c", str(ctx),
               "-o", str(out), "--force", "--verify-steps", "4"]
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=child_setup())
    return json.loads((out / "manifest.json").read_text())


def edgekv_logits(folder: Path, ids: list[int], threads: int) -> np.ndarray:
    from edgekv.export.runtime import open_stepper
    manifest = json.loads((folder / "manifest.json").read_text())
    st = open_stepper(folder, manifest, "ort", threads)
    return st.prefill(ids)


def decode_cpu(folders: dict, ids: list[int], threads: int, at: int = 256, steps: int = 32) -> dict:
    """{row: CPU milliseconds per decode step} for each export folder ({row: folder}), after a prefill of `at` tokens,
    the next `steps` tokens teacher-forced one at a time, the folders' steps interleaved (each step of each in turn,
    so load changes reach all alike); this process's CPU time (ONNX Runtime runs in it), the median of the steps."""
    from edgekv.export.runtime import open_stepper
    st = {r: open_stepper(f, json.loads((f / "manifest.json").read_text()), "ort", threads) for r, f in folders.items()}
    for s in st.values():
        s.prefill(ids[:at])
    ms = {r: [] for r in st}
    for p in range(at, at + steps):
        for r, s in st.items():
            t0 = time.process_time()
            s.step([ids[p]], p)
            ms[r].append(1000 * (time.process_time() - t0))
    return {r: round(float(np.median(v)), 2) for r, v in ms.items()}


def decode_pass(a) -> dict:
    """--decode-only: decode_cpu on each model's edgekv exports of a previous run (--out), written back into it."""
    out = Path(a.out)
    d = json.loads(out.read_text())
    load0 = list(os.getloadavg())
    for m in a.model or list(d["models"]):
        ids = token_ids(m, a.tokens)
        folders = {f"edgekv {w}": Path(a.work) / f"{tag(m, a.perturb)}-{w}" for w in a.weights.split(",")}
        for r, ms in decode_cpu(folders, ids, a.threads, steps=a.decode_steps).items():
            d["models"][m]["rows"][r]["decode_cpu_ms_at_256"] = ms
    d["decode"] = {"what": f"CPU ms per decode step, median of {a.decode_steps} steps after a 256-token prefill, the "
                           "exports' steps interleaved in one process (decode_cpu)", "threads": a.threads,
                   "loadavg_start": load0, "loadavg_end": list(os.getloadavg())}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=1) + "\n")
    os.replace(tmp, out)
    return d


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=MODELS)
    ap.add_argument("--work", default="/tmp/edgekv_weight_recipe", help="where the fp sources and artifacts go")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="int4,int4-mix", help="edgekv recipes, comma-separated")
    ap.add_argument("--perturb", type=float, default=0.0,
                    help="move the fp source off the GGUF's grids first: Gaussian noise of this many Q5_0 steps per "
                         "block (perturbation)")
    ap.add_argument("--reuse", help="a previous JSON of this benchmark: its rows for the same model, source and tokens "
                                    "are kept, not measured again (llama.cpp's rows take most of the time)")
    ap.add_argument("--decode-only", action="store_true",
                    help="only time the decode steps of the exports a previous run made (--out: its JSON, updated)")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", default=str(BENCH / "results" / "weight_recipe.json"))
    a = ap.parse_args(argv)
    old = json.loads(Path(a.reuse).read_text()) if a.reuse else {}
    if a.decode_only:
        return decode_pass(a)
    work = Path(a.work)
    result = {"benchmark": "weight_recipe", "tokens": a.tokens, "threads": a.threads,
              "command": " ".join(["python benchmarks/weight_recipe.py", *(argv if argv is not None else sys.argv[1:])]),
              "what": "KL(ref || row) in nats per position (mean) and top-1 agreement over verify-quant's text, one "
                      "prefill; ref = transformers fp32 on the fp16 weights (the packaged GGUF dequantized); "
                      "llama.cpp rows: its quantizer's Q4_K_M / Q4_0 of the same f16 GGUF (no imatrix), f16 cache, "
                      "flash attention; edgekv rows: `edgekv export -m <fp16 HF folder> --weights W`, ONNX Runtime",
              "perturb": a.perturb, "loadavg_start": list(os.getloadavg()), "models": {}}
    for m in a.model or MODELS:
        f16, hf = sources(m, work, a.perturb)
        ids = token_ids(m, a.tokens)
        ref = reference(hf, ids)
        prev = (old.get("models") or {}).get(m) or {}
        same = prev.get("ids_first") == ids[:8] and old.get("tokens") == a.tokens and \
            old.get("perturb", 0.0) == a.perturb
        rows = {k: {**r, "reused_from": a.reuse} for k, r in (prev.get("rows") or {}).items()} if same else {}
        for kind in LLAMA_FTYPES:
            if f"llama.cpp {kind}" in rows:
                continue
            q = llama_quant(f16, kind)
            t0 = time.perf_counter()
            rows[f"llama.cpp {kind}"] = {**compare(ref, llamacpp_logits(q, ids, a.threads)),
                                         "file_bytes": q.stat().st_size, "tensor_types": gguf_types(q),
                                         "seconds": round(time.perf_counter() - t0, 1)}
            print(m, kind, json.dumps(rows[f"llama.cpp {kind}"]), flush=True)
        for w in a.weights.split(","):
            folder = work / f"{tag(m, a.perturb)}-{w}"
            manifest = edgekv_export(hf, w, folder, max(1024, a.tokens))
            t0 = time.perf_counter()
            rec = ((manifest.get("weights") or {}).get("quantization") or {}).get("onnx") or {}
            data = sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))
            rows[f"edgekv {w}"] = {**compare(ref, edgekv_logits(folder, ids, a.threads)), "file_bytes": data,
                                   "tool": rec.get("tool"), "weight_bytes": manifest["weights"]["bytes"],
                                   "bits": dict(sorted(Counter(t["bits"] for t in (rec.get("per_tensor") or {}).values()
                                                               ).items())),
                                   "seconds": round(time.perf_counter() - t0, 1)}
            print(m, w, json.dumps(rows[f"edgekv {w}"]), flush=True)
        folders = {f"edgekv {w}": work / f"{tag(m, a.perturb)}-{w}" for w in a.weights.split(",")}
        for r, ms in decode_cpu(folders, ids, a.threads, steps=a.decode_steps).items():
            rows[r]["decode_cpu_ms_at_256"] = ms  # median of 32 steps after a 256-token prefill, interleaved
        km = rows["llama.cpp Q4_K_M"]["kl_mean"]
        for r in rows.values():
            r["kl_vs_q4_k_m"] = round(r["kl_mean"] / km, 2) if km else None
        result["models"][m] = {"ids_first": ids[:8], "rows": rows}
    result["loadavg_end"] = list(os.getloadavg())
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
