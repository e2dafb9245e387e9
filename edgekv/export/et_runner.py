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

from pathlib import Path


from ..errors import EdgekvError
from . import manifest as mf
from .stepper import Stepper

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


class RunnerPteStepper(Stepper):
    """The runner .pte through ExecuTorch's Method API, making the runner's calls (forward(tokens, input_pos), at most
    get_max_seq_len tokens per call, the last token's logits back: Stepper.last_row_only): `edgekv run` and `edgekv
    profile --runtime executorch-runner`, the export's verification. TextLLMRunner itself returns text, not logits
    (tests/test_runners.py holds its text to this stepper's). The state is the program's; reset() reloads the
    method."""

    runtime = "executorch-runner"
    last_row_only = True
    in_place = True

    def __init__(self, manifest: dict, folder: Path, threads: int | None = None):
        import torch
        from executorch.extension.pybindings import portable_lib

        from .pte_stepper import quiet_native_stderr, release_file_pages
        from .runners import ET_RUNNER, require
        a = require(manifest, folder, ET_RUNNER)
        _kernels()
        with quiet_native_stderr():
            if threads:
                portable_lib._unsafe_reset_threadpool(threads)
            torch.set_num_threads(threads or portable_lib._threadpool_get_thread_count())
        self.torch, self.where = torch, Path(folder) / a["file"]
        self.max_chunk = int(a["entry_points"][0]["max_tokens"])
        try:
            self.program = portable_lib._load_program(str(self.where))
        except Exception as e:
            raise EdgekvError(f"{self.where}: ExecuTorch cannot load it ({type(e).__name__}: {e})") from None
        release_file_pages(self.where)
        super().__init__(manifest)

    def reset(self):
        self.method, self.state = None, None  # free the old method's buffers first
        try:
            self.method = self.program.load_method("forward")
        except Exception as e:
            raise EdgekvError(f"{self.where}: ExecuTorch cannot load forward ({type(e).__name__}: {e})") from None

    def _call(self, tokens, pos, rows):
        if len(tokens) > self.max_chunk:
            raise EdgekvError(f"the runner .pte takes 1..{self.max_chunk} tokens per call, got {len(tokens)}")
        t = self.torch
        inputs = [t.tensor([tokens], dtype=t.int64), t.tensor([pos], dtype=t.int64)]  # alive until execute ends
        self.method.set_inputs(inputs)
        self.method.execute()
        return self.method.get_outputs(clone_outputs=False)[0].float().numpy().copy()
