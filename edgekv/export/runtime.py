"""Run an exported artifact step by step, with the state fed back: what an app does, and what verify compares.

A Stepper holds the state tensors of one sequence and calls the artifact's entry points:
    step(tokens, pos) -> logits [C, V] (numpy fp32) for the C tokens at positions pos..pos+C-1
    prefill(tokens)   -> logits for every prompt token, in as many calls as the artifact needs
With last=True both ask the artifact for the last token's row only (its `rows` input, edgekv.models.head): the
output matrix then runs over one row per call, as generation needs.
Nothing here imports edgekv.models: an artifact runs from its manifest alone. (ExecuTorch's Python runtime imports
torch itself; ONNX Runtime does not.)

A dynamic token axis (the ONNX graph; the .pte `forward` method of a state written in place) takes any 1..max_chunk
tokens per call, unpadded. Fixed-size prefill (the .pte `prefill` method of the other states takes exactly `chunk`
tokens): a shorter last chunk runs as the entry point's `tail` says. "pad": padded with token 0; the padding writes junk K/V into slots past the prompt, masked
(slot > position) until the decode step at that position overwrites them, so the result is the same as an unpadded
call. "decode": token by token through `decode`, for states that padding would corrupt (a recurrent state absorbs
every token it sees; a rolling window would overwrite live slots).
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .manifest import ROWS
from .pte_stepper import PteStepper, paging_out, release_file_pages
from .stepper import NP_DTYPES, ORT_DTYPES, Stepper, check_graph_io, entry, recorded_chunk


class OrtStepper(Stepper):
    """spin=False stops ORT's worker threads from busy-waiting between calls: needed when another compute library
    (verify's eager torch) runs in the same process in between, or both slow down by an order of magnitude on a
    small machine.

    lean=True (the default) gives back the pages of model.onnx.data as loading reads them (paging_out) and once it is
    done (release_file_pages, sparse), and turns off ORT's CPU memory arena and memory-pattern planning: with them on, ORT keeps the blocks of earlier
    calls, so memory is what one call needs, which is what the planner predicts (benchmarks/plan_accuracy.py). An app should set the same two
    options (SessionOptions.enable_cpu_mem_arena / enable_mem_pattern = false); the manifest's deployment says so."""

    runtime = "ort"

    def __init__(self, manifest: dict, folder: Path, threads: int | None = None, spin: bool = True,
                 lean: bool = True):
        import onnxruntime as ort

        a = entry(manifest, "onnx")
        opts = ort.SessionOptions()
        if lean:
            opts.enable_cpu_mem_arena = False
            opts.enable_mem_pattern = False
        if threads:
            opts.intra_op_num_threads = threads
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # lean: the data file's pages go while ORT packs the weights from them, not after (paging_out): the load's
        # peak is the packed weights, not the packed weights and the file together
        pager = paging_out(folder / a["external_data"]) if lean and a.get("external_data") else nullcontext()
        try:
            with pager:
                self.sess = ort.InferenceSession(str(folder / a["file"]), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for damaged models
            raise EdgekvError(f"{folder / a['file']}: ONNX Runtime cannot load it ({type(e).__name__}: {e})") from None

        def io(values):
            return [(v.name, ORT_DTYPES.get(v.type, v.type), [d if isinstance(d, int) else None for d in v.shape])
                    for v in values]
        check_graph_io(manifest, "onnx", folder / a["file"],
                       {ep["name"]: (io(self.sess.get_inputs()), io(self.sess.get_outputs()))
                        for ep in a["entry_points"]})
        if lean and a.get("external_data"):
            # ORT maps model.onnx.data; packing the weights read all of it, but the packed copies are what the
            # kernels read, except for tables a Gather reads a row at a time (the embedding): give the pages back,
            # and read later rows page by page, so such a table costs the rows a run reads
            release_file_pages(folder / a["external_data"], sparse=True)
        ep = a["entry_points"][0]
        self.max_chunk = recorded_chunk(manifest, "onnx") or Stepper.max_chunk  # an old manifest records none
        self.in_names = [i["name"] for i in ep["inputs"]]
        self.out_names = [o["name"] for o in ep["outputs"]]
        self.ort, self.in_place = ort, bool(a.get("state_in_place"))
        # the sliding layers' rows in GroupQueryAttention's window order, not the eager ring's (manifest schema)
        self.window_order = bool(a.get("sliding_window_cache"))
        # a graph for ONNX Runtime GenAI (--runner genai) takes input_ids and attention_mask instead of tokens and pos
        self.genai_io = self.in_names[:2] == ["input_ids", "attention_mask"]
        super().__init__(manifest)
        self.rows_input = ROWS in self.in_names  # this graph's own inputs, whatever else the export holds

    def _zeros(self, shape, dtype):
        return np.zeros(shape, dtype=NP_DTYPES[dtype])

    def reset(self):
        super().reset()
        if self.in_place:  # OrtValues over our numpy arrays (no copy): bound as both past.* and present.*
            self.values = [self.ort.OrtValue.ortvalue_from_numpy(s) for s in self.state]
            # bound once per sequence: binding 2 x layers values every step costs far more than the three small
            # inputs a step rebinds (benchmarks/results/decode_speed_ort_bound_once_2048.json)
            self.binding = self.sess.io_binding()
            self.binding.bind_output(self.out_names[0])  # first: get_outputs()[0] is the logits
            for i_name, o_name, v in zip(self._state_inputs(), self.out_names[1:], self.values):
                self.binding.bind_ortvalue_input(i_name, v)
                self.binding.bind_ortvalue_output(o_name, v)

    def _state_inputs(self) -> list[str]:
        """The past.* input names, in the state's order (after tokens and pos)."""
        return self.in_names[2:2 + len(self.state_specs)]

    def _call(self, tokens, pos, rows):
        ids = np.asarray([tokens], dtype=np.int64)
        if self.genai_io:  # GenAI's feeds for one sequence: the mask covers every position so far and this call's
            small = {"input_ids": ids, "attention_mask": np.ones((1, pos + len(tokens)), dtype=np.int64)}
        else:
            small = {"tokens": ids, "pos": np.asarray([pos], dtype=np.int64)}
        if self.rows_input:
            small[ROWS] = np.asarray(rows, dtype=np.int64)
        if self.in_place:
            # the graph's attention nodes write their new rows into the bound present buffer, which is the past
            # buffer: the state is updated where it lies, with no per-step copy of the cache
            b = self.binding
            for name, value in small.items():
                b.bind_cpu_input(name, value)
            b.bind_output(self.out_names[0])  # rebound in its place: ORT allocates logits of this call's shape
            self.sess.run_with_iobinding(b)
            return self._pick(b.get_outputs()[0].numpy()[0], rows)
        feed = dict(small)
        feed.update(zip(self._state_inputs(), self.state))
        out = self.sess.run(self.out_names, feed)
        self.state = out[1:]
        return self._pick(out[0][0], rows)


class EagerStepper(Stepper):
    """The torch module behind the same interface (verify's reference); `chunk` mirrors the artifact's calls. A
    weight-quantized module's linears run through edgekv.export.eager_linear (torchao's numbers, bit for bit, at a
    fifth of its dequantization cost)."""

    runtime = "torch"

    def __init__(self, manifest: dict, module, chunk: int | None = None, tail: str = "pad",
                 max_chunk: int | None = None):
        import torch

        self.torch, self.module, self.chunk, self.tail = torch, module, chunk, tail
        self.max_chunk = max_chunk or Stepper.max_chunk
        super().__init__(manifest)

    def _zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype))

    def _call(self, tokens, pos, rows):
        from .eager_linear import fast_quantized_linear
        n, t = len(tokens), self.torch
        padded = list(tokens) + [0] * ((self.chunk - n) if self.chunk and 1 < n < self.chunk else 0)
        # torchao's quantized linears with their weight dequantized in a reused buffer: the same logits, bit for bit
        with t.no_grad(), fast_quantized_linear():
            out = self.module(t.tensor([padded], dtype=t.int64), t.tensor([pos], dtype=t.int64), *self.state,
                              rows=t.tensor(rows, dtype=t.int64))
        self.state = list(out[1:])
        return out[0][0].float().numpy()


ARTIFACT_STEPPERS = (OrtStepper, PteStepper)  # by their `runtime` name: the --runtime choices


def open_stepper(folder: Path, manifest: dict, runtime: str, threads: int | None = None) -> Stepper:
    """runtime: ort / executorch (edgekv's explicit-state steppers), genai / executorch-runner (the runtimes' LLM
    APIs' own state, edgekv.export.genai and et_runner: what `edgekv profile --runtime` measures them through)."""
    if runtime == "genai":
        from .genai import GenaiStepper
        return GenaiStepper(manifest, folder, threads)
    if runtime == "executorch-runner":
        from .et_runner import RunnerPteStepper
        return RunnerPteStepper(manifest, folder, threads)
    for cls in ARTIFACT_STEPPERS:
        if cls.runtime == runtime:
            return cls(manifest, folder, threads)
    raise EdgekvError(f"unknown runtime {runtime!r} ({', '.join(c.runtime for c in ARTIFACT_STEPPERS)}, genai, "
                      "executorch-runner)")


def state_as_numpy(stepper: Stepper) -> list[np.ndarray]:
    """The stepper's state tensors as numpy arrays in their own dtype (int8 codes stay int8, a quarter of their fp32
    copy; verify compares one tensor at a time); only bfloat16, which numpy lacks, becomes fp32. Torch tensors are
    shared, not copied."""
    def own(s):
        if isinstance(s, np.ndarray):
            return s
        s = s.detach()  # a torch tensor (the eager module's, ExecuTorch's outputs)
        return (s.float() if str(s.dtype) == "torch.bfloat16" else s).numpy()
    return [own(s) for s in stepper.state]
