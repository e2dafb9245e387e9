"""`edgekv export --runner genai`: an ONNX folder that ONNX Runtime GenAI loads and generates from with its own loop.

What GenAI reads (the shape of what its own builder writes, onnxruntime_genai/models/builders/base.py
make_genai_config, pinned onnxruntime-genai 0.18.0):
  genai_config.json   model.type, context_length, bos/eos/pad ids, vocab_size; decoder: filename, head_size,
                      hidden_size, heads, layers, KV heads, the input and output names (past_key_values.%d.key ->
                      present.%d.key), session options; search: greedy defaults, max_length = context_length,
                      past_present_share_buffer
  tokenizer.json + tokenizer_config.json   (ONNX Runtime Extensions' tokenizer, as og.Tokenizer loads it)
  model.onnx (+ model.onnx.data)           inputs input_ids [1, seq] int64, attention_mask [1, total] int64,
                      past_key_values.{i}.key / .value [1, Hkv, max_ctx, D]; outputs logits [1, seq, V] fp32,
                      present.{i}.key / .value of the same shape.

The graph is edgekv's own fused float-cache graph (edgekv.models.swaps: ORT's GroupQueryAttention, as GenAI's builder
emits it) with GenAI's input names: the position of the first token is attention_mask's sum minus the call's tokens
(batch 1, no padding), from which the graph derives GroupQueryAttention's seqlens_k and total_sequence_length as
before. The cache has max_ctx slots, and GroupQueryAttention writes each call's rows into the present buffer that
GenAI binds to the past buffer (past_present_share_buffer: true), so the state exists once, as in edgekv's stepper.
Logits come back for every token of the call, as GenAI's builder makes them (edgekv's own graph takes `rows` and
computes the last row only; GenAI feeds no such input). OrtStepper drives the same graph (verify, profile,
`edgekv run --runtime ort`), so one artifact serves both.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..arch.variants import variant
from ..errors import EdgekvError
from . import manifest as mf
from .stepper import Stepper

CONFIG = "genai_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
FILES = (CONFIG, "tokenizer.json", TOKENIZER_CONFIG)  # what GenAI opens beside the graph
IDS, MASK = "input_ids", "attention_mask"


def entry_point(layout, vocab: int) -> dict:
    """The graph's inputs and outputs as the manifest lists them (GenAI's names)."""
    state = layout.tensors
    return {"name": "forward", "tokens": "seq",
            "inputs": [mf.tensor_spec(IDS, "int64", [1, "seq"]), mf.tensor_spec(MASK, "int64", [1, "total"])]
            + [mf.tensor_spec(t.name, t.dtype, t.shape) for t in state],
            "outputs": [mf.tensor_spec("logits", "float32", [1, "seq", vocab])]
            + [mf.tensor_spec(t.output, t.dtype, t.shape) for t in state]}


def trace(module, max_ctx: int):
    """torch.export of the module behind GenAI's inputs; pass the module for_runtime(module, "onnxruntime") returns."""
    import torch
    from torch import nn

    class GenaiInputs(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, *past):
            pos = attention_mask.sum(1) - input_ids.shape[1]  # [1]: the first new token's position
            return self.m(input_ids, pos, *past)

    ex = (torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 3, dtype=torch.int64), *module.empty_state())
    dyn = torch.export.Dim.DYNAMIC
    shapes = ({1: dyn(min=1, max=max_ctx)}, {1: dyn(min=1, max=max_ctx)}, tuple(None for _ in ex[2:]))
    return torch.export.export(GenaiInputs(module).eval(), ex, dynamic_shapes=shapes, strict=False)


def sliding_window(layout) -> dict | None:
    """genai_config.json's model.decoder.sliding_window for a graph whose native sliding layers keep
    GroupQueryAttention's window-sized cache (Gemma 3's local layers: W rows), or None when every layer keeps one slot
    per position.

    GenAI sizes such a layer's cache itself: C = window_size + slack rows, the slack being cache_slack, or its CPU
    default of 16 when cache_slack is 0 (onnxruntime-genai src/models/windowed_kv_cache.cpp,
    ComputeWindowedKvCacheSize; the pinned 0.18.0 checked by tests/test_genai_gemma.py), and binds that buffer to the
    graph's past input, which is W rows here. So the config
    says window_size W - 1 and cache_slack 1: C = W. With slide_inputs and slide_key_value_cache false GenAI reads
    window_size for that size only; the attention window itself is the graph's (local_window_size W on each node),
    and `layers` names the sliding layers (their past_key_values.%d index)."""
    slots = {t.layer: t.shape[2] for t in layout.tensors if t.role == "key" and t.shape[2] != layout.ctx}
    if not slots:
        return None
    widths = set(slots.values())
    if len(widths) != 1 or min(widths) < 2:
        raise EdgekvError(f"GenAI sizes every sliding layer's cache from one window; this graph's sliding layers keep "
                          f"{sorted(widths)} rows")
    w = widths.pop()
    return {"window_size": w - 1, "cache_slack": 1, "slide_key_value_cache": False, "slide_inputs": False,
            "layers": sorted(slots)}


def write_config(folder: Path, args, layout, tok: dict, max_ctx: int, fused: bool, window_cache: bool = False
                 ) -> list[str]:
    """genai_config.json and tokenizer_config.json beside model.onnx and tokenizer.json; returns the files written.
    fused: every layer is GroupQueryAttention over the state in place; window_cache: the sliding layers keep the op's
    window-sized cache (the manifest's sliding_window_cache)."""
    if tok is None:
        raise EdgekvError("GenAI needs a tokenizer: this model folder has no tokenizer.json")
    window = sliding_window(layout)
    if not fused or (window is not None and not window_cache):
        raise EdgekvError("GenAI needs the fused GroupQueryAttention graph: a plain float cache with one slot per "
                          "position in every layer, or a model's own sliding-window layers in the op's window cache "
                          "(GenAI sizes every layer's cache itself)")
    eos = list(tok["eos_token_ids"])
    cfg = {
        "model": {
            # the model.type GenAI runs it as a plain decoder under (the variant's genai_type)
            "type": getattr(variant(args.model_type), "genai_type", "llama"),
            "context_length": max_ctx, "vocab_size": args.vocab,
            "bos_token_id": tok["bos_token_id"] if tok["bos_token_id"] is not None else (eos or [0])[0],
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": (eos or [0])[0],
            "decoder": {
                # the options edgekv's OrtStepper sets (lean): without them ORT keeps the blocks of earlier calls
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                    "enable_cpu_mem_arena": False, "enable_mem_pattern": False},
                "filename": "model.onnx", "head_size": args.head_dim, "hidden_size": args.hidden,
                "num_attention_heads": args.n_heads, "num_hidden_layers": args.n_layers,
                "num_key_value_heads": args.n_kv_heads,
                "inputs": {"input_ids": IDS, "attention_mask": MASK, "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                **({"sliding_window": window} if window else {})}},
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": max_ctx,
                   "min_length": 0, "past_present_share_buffer": True, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
                   "repetition_penalty": 1.0, "length_penalty": 1.0, "early_stopping": True,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}}
    (folder / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    tj = json.loads((folder / tok["file"]).read_text())
    names = {t["id"]: t["content"] for t in tj.get("added_tokens", [])}

    def token(i):
        if i is None:
            return None
        return names.get(i) or next((k for k, v in (tj.get("model", {}).get("vocab") or {}).items() if v == i), None)

    # GPT2Tokenizer: a byte-level BPE tokenizer.json (the GGUF conversions, SmolLM2, the byte fixtures); ONNX Runtime
    # Extensions reads the model, merges and pre-tokenizer from tokenizer.json itself
    tcfg = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": bool(tok["add_bos_token"]), "add_eos_token": False,
            "bos_token": token(tok["bos_token_id"]), "eos_token": token(eos[0]) if eos else None,
            "clean_up_tokenization_spaces": False, "model_max_length": max_ctx}
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(tcfg, indent=2) + "\n")
    return [CONFIG, TOKENIZER_CONFIG]


def _load(folder: Path, threads: int | None = None):
    """og.Model of the folder; threads: ORT's intra-op threads, overlaid on genai_config.json's session options."""
    import onnxruntime_genai as og
    try:
        cfg = og.Config(str(folder))
        if threads:
            cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        return og, og.Model(cfg)
    except Exception as e:  # GenAI raises RuntimeError with its own message
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise EdgekvError(f"{folder}: ONNX Runtime GenAI cannot load it ({first})") from None


class GenaiStepper(Stepper):
    """GenAI's Generator as a Stepper (`edgekv run` and `edgekv profile --runtime genai`, the export's verification):
    a call is append_tokens(tokens), its logits GenAI's get_logits() (the last token's), so the prompt goes in one
    call, as GenAI's own loop appends it; every row of a prompt takes one token per call (Stepper.last_row_only).
    The cache and its buffers are GenAI's own; the tokenizer is GenAI's (og.Tokenizer), as an app's."""

    runtime = "genai"
    last_row_only = True

    def __init__(self, manifest: dict, folder: Path, threads: int | None = None):
        from .runners import GENAI, require
        require(manifest, folder, GENAI)
        self.og, self.model = _load(folder, threads)
        self.threads = threads
        self.max_chunk = int(manifest["max_ctx"])
        super().__init__(manifest)

    def reset(self):
        p = self.og.GeneratorParams(self.model)
        # max_length is the export's max_ctx, whatever the run's length: with a sliding_window in its config GenAI
        # sizes every layer's cache from max_length (a shorter one no longer matches the graph's inputs)
        p.set_search_options(max_length=self.max_ctx, do_sample=False)
        self.gen = self.og.Generator(self.model, p)
        self.pos, self.state = 0, None

    def _call(self, tokens, pos, rows):
        if pos != self.pos:
            raise EdgekvError(f"GenAI continues its own sequence at position {self.pos}, not {pos}")
        self.gen.append_tokens(np.asarray(tokens, dtype=np.int32))
        self.pos += len(tokens)
        return self.gen.get_logits()[0, -1:].astype(np.float32)

    def own_tokenizer(self):
        return GenaiTokenizer(self.og.Tokenizer(self.model))


class GenaiTokenizer:
    """og.Tokenizer (ONNX Runtime Extensions over tokenizer.json and tokenizer_config.json) behind the calls edgekv's
    generation loop makes."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(ids=[int(i) for i in self.tok.encode(text)])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(np.asarray(ids, dtype=np.int32))
