"""`edgekv export --runner executorch`: a .pte that ExecuTorch's LLM runner (TextLLMRunner in C++ and in the pinned
executorch's Python package, executorch.extension.llm.runner; LlmModule on Android; the iOS runner) loads and
generates from with its own loop.

What the runner reads (as ExecuTorch's own Llama export writes it: examples/models/llama/export_llama_lib.py
_load_llama_model_metadata, extension/llm/export/builder.py, executorch 1.5.1):
  forward(tokens [1, seq] int64, input_pos [1] int64) -> logits [1, vocab] fp32 of the call's last token, with a
  dynamic token axis of 1..get_max_seq_len tokens (enable_dynamic_shape: the runner prefills the prompt in calls of
  at most that many tokens, then decodes one token per call). The cache is the program's mutable buffers: the runner
  keeps no state of its own.
  constant methods get_max_seq_len (tokens per call), get_max_context_len (cache slots), get_vocab_size,
  get_n_layers, use_kv_cache, use_sdpa_with_kv_cache, enable_dynamic_shape, get_bos_id, get_eos_ids.
  tokenizer.json: pytorch_tokenizers' HF tokenizer, which the runner picks for a .json path.

The model is edgekv's own module traced as the explicit-state .pte is (edgekv.models.swaps.SdpaAttention: each
call's rows written with index_put into the cache, attended by ExecuTorch's llama::custom_sdpa over the written slots
only, or int8 codes in place by llama::custom_quantized_sdpa; a packed cache read back by edgekv.quant's unpacking),
with its cache tensors moved into buffers of a wrapper module. ExecuTorch's reinplace pass (ExecutorchBackendConfig.run_reinplace_pass)
turns each index_put on a buffer into index_put_, so the cache is written where it lies, and the memory plan of the
in-place .pte (edgekv.export.to_pte._in_place_planning) makes custom_sdpa's view of a cache read that buffer. The
strategy is the
one edgekv planned: kv fp32/fp16 and kv-int8/int4/int2 in edgekv.quant's layout (int8 codes with fp16 scales per
token and group), not ExecuTorch's QuantizedKVCache (fp32 scales and zero points, and custom_quantized_sdpa, which
also quantizes the query: see edgekv.models.swaps.SdpaAttention for what that costs).
Buffers the runner never wrote are not read: custom_sdpa attends over slots 0..input_pos+seq-1 only, each written by
an earlier or the same call.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from . import manifest as mf

TOKENS, INPUT_POS = "tokens", "input_pos"


def metadata(args, tok: dict | None, max_ctx: int, chunk: int) -> dict:
    """The constant methods the runner reads (ExecuTorch's names)."""
    eos = list(tok["eos_token_ids"]) if tok else []
    out = {"get_max_seq_len": chunk, "get_max_context_len": max_ctx, "get_vocab_size": args.vocab,
           "get_n_layers": args.n_layers, "use_kv_cache": True, "use_sdpa_with_kv_cache": True,
           "enable_dynamic_shape": True}
    if tok and tok["bos_token_id"] is not None:
        out["get_bos_id"] = tok["bos_token_id"]
    if eos:
        out["get_eos_ids"] = eos
    return out


def entry_point(vocab: int, chunk: int) -> dict:
    return {"name": "forward", "tokens": "seq", "max_tokens": chunk,
            "inputs": [mf.tensor_spec(TOKENS, "int64", [1, "seq"]), mf.tensor_spec(INPUT_POS, "int64", [1])],
            "outputs": [mf.tensor_spec("logits", "float32", [1, vocab])]}


def trace(module, chunk: int):
    """torch.export of the module with its state in buffers; module: what for_runtime(model, "executorch") returns."""
    import torch
    from torch import nn

    class CacheInBuffers(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m
            self.names = []
            for i, s in enumerate(m.empty_state()):
                self.register_buffer(f"state_{i}", s, persistent=False)
                self.names.append(f"state_{i}")

        def forward(self, tokens, input_pos):
            state = [getattr(self, n) for n in self.names]
            last = torch.arange(tokens.shape[1], dtype=torch.int64)[-1:]  # the last token's logits only
            out = self.m(tokens, input_pos, *state, rows=last)
            for buf, new in zip(state, out[1:]):
                buf.copy_(new)
            return out[0][:, 0, :]

    ex = (torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    shapes = ({1: torch.export.Dim("token_dim", max=chunk)}, {0: 1})
    return torch.export.export(CacheInBuffers(module).eval(), ex, dynamic_shapes=shapes, strict=False)


def lower(ep, meta: dict):
    from executorch.exir import to_edge_transform_and_lower

    from .to_pte import _only_needed_xnnpack_passes, _partitioner
    with _only_needed_xnnpack_passes():
        return to_edge_transform_and_lower({"forward": ep}, partitioner=[_partitioner(True)], constant_methods=meta)


def to_buffer(edge) -> bytes:
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    from .to_pte import _in_place_planning
    prog = edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True,
                                                      memory_planning_pass=_in_place_planning(),
                                                      sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass()))
    ops = [str(n.target) for n in prog.exported_program("forward").graph_module.graph.nodes
           if n.op == "call_function"]
    # the cache must be written where it lies: a copy_ back into a buffer would be a whole-cache copy per call
    if any("copy_" in o and "dim_order" not in o for o in ops) or not any("index_put_" in o for o in ops):
        raise EdgekvError("the runner .pte does not write its cache in place (reinplace pass did not apply)")
    return prog.buffer


def _kernels():
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (llama::custom_sdpa)
    import executorch.kernels.quantized  # noqa: F401 (quantize_per_token, an int8 cache's query)


class RunnerPteStepper:
    """The runner .pte through ExecuTorch's Method API, making the runner's calls (forward(tokens, input_pos), at most
    get_max_seq_len tokens per call, the last token's logits back): the export's verification and `edgekv profile`
    (TextLLMRunner returns text, not logits). The state is the program's; reset() reloads the method."""

    runtime = "executorch-runner"
    chunk = None
    tail = "pad"
    in_place = True

    def __init__(self, manifest: dict, folder: Path, threads: int | None = None):
        import torch
        from executorch.extension.pybindings import portable_lib

        from .runners import ET_RUNNER, require
        from .runtime import quiet_native_stderr, release_file_pages
        a = require(manifest, folder, ET_RUNNER)
        _kernels()
        with quiet_native_stderr():
            if threads:
                portable_lib._unsafe_reset_threadpool(threads)
            torch.set_num_threads(threads or portable_lib._threadpool_get_thread_count())
        self.torch, self.where = torch, Path(folder) / a["file"]
        self.max_ctx = int(manifest["max_ctx"])
        self.max_chunk = int(a["entry_points"][0]["max_tokens"])
        self.manifest, self.state = manifest, None
        try:
            self.program = portable_lib._load_program(str(self.where))
        except Exception as e:
            raise EdgekvError(f"{self.where}: ExecuTorch cannot load it ({type(e).__name__}: {e})") from None
        release_file_pages(self.where)
        self.reset()

    def reset(self):
        self.method = None  # free the old method's buffers first
        try:
            self.method = self.program.load_method("forward")
        except Exception as e:
            raise EdgekvError(f"{self.where}: ExecuTorch cannot load forward ({type(e).__name__}: {e})") from None

    def prefill(self, tokens: list[int], pos: int = 0, last: bool = False, after_call=None) -> np.ndarray:
        """last=True: calls of up to get_max_seq_len tokens, as the runner prefills, and the last row. Every row
        (verify, the quality check): one token per call, the .pte returning the last token's logits only."""
        n = self.max_chunk if last else 1
        rows = []
        for s in range(0, len(tokens), n):
            rows.append(self.step(tokens[s:s + n], pos + s))
            if after_call:
                after_call()
        return rows[-1] if last else np.concatenate(rows)

    def step(self, tokens: list[int], pos: int, last: bool = True) -> np.ndarray:
        if not tokens or len(tokens) > self.max_chunk:
            raise EdgekvError(f"the runner .pte takes 1..{self.max_chunk} tokens per call, got {len(tokens)}")
        if pos < 0 or pos + len(tokens) > self.max_ctx:
            raise EdgekvError(f"positions {pos}..{pos + len(tokens) - 1} are outside max_ctx {self.max_ctx}")
        t = self.torch
        inputs = [t.tensor([tokens], dtype=t.int64), t.tensor([pos], dtype=t.int64)]  # alive until execute ends
        self.method.set_inputs(inputs)
        self.method.execute()
        return self.method.get_outputs(clone_outputs=False)[0].float().numpy().copy()


# TextLLMRunner's bare "Generation failed" on a --runner executorch .pte: its attention is llama::custom_sdpa, whose
# kernels are registered only once executorch.extension.llm.custom_ops is imported (Python) or linked (C++)
CUSTOM_OPS_HINT = ("this .pte's attention is ExecuTorch's llama::custom_sdpa: in Python `import "
                   "executorch.extension.llm.custom_ops` before TextLLMRunner; in C++ link extension/llm/custom_ops")


def generate(folder: Path, manifest: dict, prompt: str, max_new_tokens: int, emit=None, after_prefill=None,
             threads: int | None = None) -> dict:
    """Greedy generation with ExecuTorch's TextLLMRunner (its tokenizer, its prefill and decode loop, its stop on the
    .pte's eos ids); the same dict as edgekv.export.generate.generate, with the runner's text pieces (one per new
    token) where that has token ids: the Python runner hands back text only."""
    from .runners import ET_RUNNER, require
    from .runtime import quiet_native_stderr
    a = require(manifest, folder, ET_RUNNER)
    tok = manifest["tokenizer"]
    if tok is None:
        raise EdgekvError(f"{folder}: ExecuTorch's runner needs a tokenizer file; this export carries none")
    import torch  # the runner's extension links libtorch
    _kernels()
    if threads:  # the llama:: kernels run on torch's pool, XNNPACK on ExecuTorch's (PteStepper says why both)
        from executorch.extension.pybindings import portable_lib
        with quiet_native_stderr():
            portable_lib._unsafe_reset_threadpool(threads)
        torch.set_num_threads(threads)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    with quiet_native_stdout(), quiet_native_stderr():  # its load logs the metadata it read, line by line
        try:
            runner = TextLLMRunner(str(Path(folder) / a["file"]), str(Path(folder) / tok["file"]))
        except Exception as e:
            raise EdgekvError(f"{folder}: ExecuTorch's LLM runner cannot load it ({type(e).__name__}: {e})") from None
    max_ctx = int(manifest["max_ctx"])
    pieces, stats = [], []
    first = [True]

    def on_token(piece: str):
        if first[0] and after_prefill:
            after_prefill()
        first[0] = False
        pieces.append(piece)
        if emit and piece:
            emit(piece)

    bos = 1 if tok["add_bos_token"] and tok["bos_token_id"] is not None else 0
    cfg = GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=0.0, num_bos=bos, num_eos=0,
                           seq_len=max_ctx)
    t0 = time.perf_counter()
    with quiet_native_stdout(), quiet_native_stderr():
        try:
            runner.generate(prompt, cfg, token_callback=on_token, stats_callback=stats.append)
        except Exception as e:
            raise EdgekvError(f"ExecuTorch's LLM runner failed: {type(e).__name__}: {e}" + (
                f" ({CUSTOM_OPS_HINT})" if "Generation failed" in str(e) else "")) from None
    wall = time.perf_counter() - t0
    s = stats[-1] if stats else None
    n_prompt = s.num_prompt_tokens if s else None
    prefill_s = (s.prompt_eval_end_ms - s.inference_start_ms) / 1e3 if s else None
    decode_s = (s.inference_end_ms - s.prompt_eval_end_ms) / 1e3 if s else None
    steps = len(pieces) - 1
    stopped = "max_new_tokens" if len(pieces) >= max_new_tokens else (
        "max_ctx" if n_prompt and n_prompt + len(pieces) >= max_ctx else "eos")
    return {"prompt_tokens": n_prompt, "new_tokens": len(pieces), "tokens": None, "pieces": pieces,
            "text": "".join(pieces), "prefill_s": prefill_s if prefill_s is not None else wall,
            "prefill_tok_s": n_prompt / prefill_s if prefill_s else None,
            "decode_tok_s": steps / decode_s if steps > 0 and decode_s else None, "stopped": stopped}


class quiet_native_stdout:
    """The runner prints what it generates and its stats to file descriptor 1 from C++; edgekv prints the text itself
    (and --json must stay one JSON object). Inside, fd 1 goes nowhere and sys.stdout writes to the real stdout."""

    def __enter__(self):
        import os
        import sys
        import tempfile
        sys.stdout.flush()
        self._saved = os.dup(1)
        self._sink = tempfile.TemporaryFile()
        os.dup2(self._sink.fileno(), 1)
        # Python's own prints (edgekv's streamed text) still reach the real stdout
        self._py, sys.stdout = sys.stdout, os.fdopen(os.dup(self._saved), "w", buffering=1)
        return self

    def __exit__(self, *exc):
        import os
        import sys
        sys.stdout.flush()
        sys.stdout.close()
        sys.stdout = self._py
        os.dup2(self._saved, 1)
        os.close(self._saved)
        self._sink.close()
        return False
