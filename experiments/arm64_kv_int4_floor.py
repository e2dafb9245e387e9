"""benchmarks/results/arm64_vs_x86_smollm2_kv_int4_floor.json: SmolLM2-135M kv-int4 (fp32 weights), eager torch
against itself one ulp away (edgekv.export.verify.nudge_one_ulp on every float parameter), over the prompt and
decode steps the ONNX export's verification compares (export.pipeline.verify_prompt, --verify-steps 4), at each
max_ctx given; and the fraction of the int4 code bytes the nudge changes. This is the noise floor the export's
verification now measures for a quantized cache (export.pipeline `nudged`); the ONNX artifacts' own verification
against eager (export/arm64-smollm2-kv-int4-*/manifest.json) is added beside it when the export folder exists.
Usage: python experiments/arm64_kv_int4_floor.py [MAX_CTX,...] (default 128,512); --exports: only refresh the exports'
verification records in the existing JSON (no eager runs)."""
from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgekv.export.options import verify_prompt
from edgekv.export.runtime import EagerStepper, state_as_numpy
from edgekv.export.tokenizer import write_tokenizer
from edgekv.export.verify import nudge_one_ulp, verify
from edgekv.models import load_any
from edgekv.strategies import parse_strategy

OUT = Path(__file__).resolve().parents[1] / "benchmarks/results/arm64_vs_x86_smollm2_kv_int4_floor.json"
STEPS = 4


def floor(ctx: int) -> dict:
    from tokenizers import Tokenizer
    loaded = load_any("smollm2-135m", parse_strategy("kv-int4"), ctx)
    module, layout, args = loaded.module, loaded.layout, loaded.args
    with tempfile.TemporaryDirectory() as d:
        te = write_tokenizer(loaded.source, Path(d), args.vocab)
        tok = Tokenizer.from_file(str(Path(d) / te["file"]))
    prompt = verify_prompt(tok, args.vocab, ctx - STEPS)
    partial = {"max_ctx": ctx, "state": layout.to_json(), "artifacts": []}
    nudged = copy.deepcopy(module)
    nudge_one_ulp(nudged)
    noise, ref = EagerStepper(partial, nudged), EagerStepper(partial, module)
    v = verify(noise, ref, prompt, STEPS, "uint8", "eager one ulp away")
    used = len(prompt) + STEPS  # code bytes in the slots the run wrote
    codes = [(a[..., :used, :] != b[..., :used, :]).mean()
             for a, b, t in zip(state_as_numpy(noise), state_as_numpy(ref), layout.to_json()["tensors"])
             if t["dtype"] == "uint8"]
    return {"max_ctx": ctx, "prompt_tokens": len(prompt), "decode_steps": STEPS,
            "positions": v["positions_compared"], "max_abs_diff": v["max_abs_diff"], "logit_scale": v["logit_scale"],
            "max_abs_diff_over_logit_scale": v["max_abs_diff"] / v["logit_scale"],
            "top1_agreement": v["top1_agreement"], "written_code_bytes_differ_fraction": float(np.mean(codes))}


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--exports"]:
        rows = json.loads(OUT.read_text())["floor"]
    else:
        rows = [floor(int(c)) for c in (sys.argv[1] if len(sys.argv) > 1 else "128,512").split(",")]
    exports = {}
    for p in sorted(Path("export").glob("arm64-smollm2-kv-int4-*/manifest.json")):
        m = json.loads(p.read_text())
        exports[p.parent.name] = {"weights": m["weights"]["dtype"], "max_ctx": m["max_ctx"],
                                  "verification": m.get("verification")}
    doc = {"what": "SmolLM2-135M kv-int4 (group 32), fp32 weights: eager torch against a copy of itself with every "
                   "float parameter one ulp away (the noise a different kernel's last bit makes), over the ONNX "
                   "export's verification prompt and steps; the fixed limit for a packed int4 cache is 1e-1 of the "
                   "logit scale (edgekv/export/verify.py REL_TOL uint8). exports: the arm64 exports' own "
                   "verification records (ONNX Runtime on x86 against eager), where made.",
           "made_by": "experiments/arm64_kv_int4_floor.py", "torch_threads": 1, "floor": rows, "exports": exports}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
