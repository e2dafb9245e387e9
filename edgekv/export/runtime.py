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

import os
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .manifest import ROWS
from .to_pte import LLM_KERNELS

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int8": np.int8, "uint8": np.uint8}


def entry(manifest: dict, fmt: str) -> dict:
    for a in manifest["artifacts"]:
        if a["format"] == fmt:
            return a
    have = ", ".join(a["format"] for a in manifest["artifacts"])
    raise EdgekvError(f"this export has no {fmt} artifact (it has: {have})")


ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8"}
ET_DTYPES = {0: "uint8", 1: "int8", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 15: "bfloat16"}  # ScalarType


def check_graph_io(manifest: dict, fmt: str, where, graph: dict) -> None:
    """The manifest's entry points against the graph's own inputs and outputs, before any state is allocated.
    graph: {entry point name: (inputs, outputs)}, each a list of (name or None, dtype, shape), a shape's dynamic
    axis None (ONNX) or its upper bound (a .pte method's sizes). Names, dtypes and ranks must agree, and every fixed
    axis the manifest states; the state's tensors (which the stepper allocates from the manifest) must be fixed in
    the graph and equal. A mismatch is one EdgekvError line."""
    a = entry(manifest, fmt)
    n_state = len(manifest["state"]["tensors"])
    for ep in a["entry_points"]:
        if ep["name"] not in graph:
            raise EdgekvError(f"{where}: the graph has no entry point {ep['name']!r} that the manifest lists")
        g_ins, g_outs = graph[ep["name"]]
        for kind, want, got in (("input", ep["inputs"], g_ins), ("output", ep["outputs"], g_outs)):
            if len(want) != len(got):
                raise EdgekvError(f"{where}: {ep['name']} has {len(got)} {kind}s, the manifest lists {len(want)}")
            first, last = (2, 2 + n_state) if kind == "input" else (1, 1 + n_state)
            for k, (w, (g_name, g_dtype, g_shape)) in enumerate(zip(want, got)):
                state = first <= k < last
                bad = ((g_name is not None and g_name != w["name"]) or g_dtype != w["dtype"]
                       or len(g_shape) != len(w["shape"])
                       or any(isinstance(wd, int) and isinstance(gd, int) and gd != wd
                              for wd, gd in zip(w["shape"], g_shape))
                       or (state and any(not isinstance(gd, int) for gd in g_shape)))
                if bad:
                    raise EdgekvError(f"{where}: the manifest's {ep['name']} {kind} {w['name']} {w['dtype']}"
                                      f"{w['shape']} is not the graph's {g_name or '#' + str(k)} {g_dtype}"
                                      f"{list(g_shape)}: the manifest does not describe this graph")


def recorded_chunk(manifest: dict, fmt: str) -> int | None:
    """The prefill call size the export planned this format for (manifest deployment.formats.FMT.prefill_chunk)."""
    c = ((manifest.get("deployment") or {}).get("formats") or {}).get(fmt, {}).get("prefill_chunk")
    return int(c) if c else None


class Stepper:
    """The state of one sequence plus the artifact's step function."""

    chunk: int | None = None  # fixed prefill length, or None when any C in 1..max_ctx works
    tail: str = "pad"  # how a call of 1 < C < chunk tokens runs: "pad" to chunk, or "decode" token by token
    in_place: bool = False  # the artifact writes its state where it lies (manifest state_in_place)
    # split a longer prompt into calls of at most this many tokens. ORT takes any C, so this is ORT's prefill call
    # size: an export records it in its manifest (deployment.formats.onnx.prefill_chunk; the planner predicts with
    # it) and OrtStepper uses the recorded one. A call's scores are H x C x max_ctx fp32, so memory grows with C;
    # every call also handles the whole state, so prefill speed grows with C too: 128 is the knee between the two
    # (benchmarks/plan_accuracy.py measures the peak this default gives)
    max_chunk: int = 128
    runtime: str = ""  # what `edgekv run --runtime` calls it

    def __init__(self, manifest: dict):
        self.manifest = manifest
        self.state_specs = manifest["state"]["tensors"]
        # an export made before `rows` existed returns every row; the rows asked for are then picked here
        self.rows_input = any(i["name"] == ROWS for a in manifest["artifacts"] for e in a["entry_points"]
                              for i in e["inputs"])
        self.max_ctx = int(manifest["max_ctx"])
        self.reset()

    def reset(self):
        self.state = [self._zeros(t["shape"], t["dtype"]) for t in self.state_specs]

    def prefill(self, tokens: list[int], pos: int = 0, last: bool = False, after_call=None) -> np.ndarray:
        """Logits [len(tokens), V], or with last=True only the last token's [1, V] (what generation needs, as an
        app keeps it: every row costs len x vocab x 4 B, which is the caller's memory, not the model's). after_call: called with no arguments after each chunk (the profile trims the heap)."""
        if pos + len(tokens) > self.max_ctx:
            raise EdgekvError(f"{pos + len(tokens)} tokens exceed this export's max_ctx {self.max_ctx}")
        rows, n = [], self.chunk or self.max_chunk
        for s in range(0, len(tokens), n):
            part = tokens[s:s + n]
            out = self.step(part, pos + s, last=last)
            if after_call:
                after_call()
            if last:
                rows = [out[-1:].copy()]
            else:
                rows.append(out)
        return np.concatenate(rows)

    def step(self, tokens: list[int], pos: int, last: bool = False) -> np.ndarray:
        """logits [C, V] of the C tokens, or with last=True [1, V] of the last one."""
        if not tokens:
            raise EdgekvError("a step needs at least one token")
        if pos < 0 or pos + len(tokens) > self.max_ctx:
            raise EdgekvError(f"positions {pos}..{pos + len(tokens) - 1} are outside this export's max_ctx "
                              f"{self.max_ctx}")
        # a short chunk goes token by token where padding would corrupt the state: a recurrent state or a rolling
        # window (tail "decode"; the Android app's StepPlan has the same rule)
        if self.chunk and 1 < len(tokens) < self.chunk and self.tail == "decode":
            outs = [self._call([t], pos + i, [0]) for i, t in enumerate(tokens)]
            return outs[-1] if last else np.concatenate(outs)
        n = len(tokens)
        return self._call(tokens, pos, [n - 1] if last else list(range(n)))

    def state_arrays(self) -> list[np.ndarray]:
        """The state tensors as numpy arrays in the manifest's order, sharing memory with the buffers the next call
        reads (torch tensors through .numpy()): writing into them sets the state (edgekv.export.statefile)."""
        return [s if isinstance(s, np.ndarray) else s.numpy() for s in self.state]

    def _pick(self, logits: np.ndarray, rows: list[int]) -> np.ndarray:
        """The artifact's logits [R, V] for `rows`; an export without the rows input gave every row: pick them."""
        return logits if self.rows_input else logits[rows]

    def _zeros(self, shape, dtype):
        raise NotImplementedError

    def _call(self, tokens, pos, rows: list[int]) -> np.ndarray:
        """One call of the artifact: logits [len(rows), V] of those rows of the call."""
        raise NotImplementedError


class OrtStepper(Stepper):
    """spin=False stops ORT's worker threads from busy-waiting between calls: needed when another compute library
    (verify's eager torch) runs in the same process in between, or both slow down by an order of magnitude on a
    small machine.

    lean=True (the default) gives back the pages of model.onnx.data that loading read (release_file_pages, sparse),
    and turns off ORT's CPU memory arena and memory-pattern planning: with them on, ORT keeps the blocks of earlier
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
        try:
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


def pte_calls(manifest: dict, where="model.pte") -> tuple[dict, int | None, str, int]:
    """How the .pte's methods are called, from its manifest entry points: ({"prefill": method, "decode": method},
    fixed prefill length or None, tail rule, most tokens per call). One `forward` with a dynamic token axis (1..its
    max_tokens, else max_ctx), or a fixed-size `prefill` + a one-token `decode` of a state not written in place."""
    a = entry(manifest, "pte")
    if a.get("state_location") == "mutable_buffers":
        raise EdgekvError(f"{where}: this .pte keeps its cache inside the program for ExecuTorch's LLM runner "
                          "(--runner executorch): run it with --runtime executorch-runner")
    eps = {ep["name"]: ep for ep in a["entry_points"]}
    in_place = bool(a.get("state_in_place"))
    if set(eps) == {"forward"} and isinstance(eps["forward"]["tokens"], str):
        most = int(eps["forward"].get("max_tokens") or manifest["max_ctx"])
        return {"prefill": "forward", "decode": "forward"}, None, "pad", most
    if set(eps) == {"prefill", "decode"} and not in_place:
        chunk = int(eps["prefill"]["tokens"])
        return {"prefill": "prefill", "decode": "decode"}, chunk, eps["prefill"].get("tail", "pad"), chunk
    raise EdgekvError(f"{where}: the manifest lists methods {', '.join(sorted(eps))}"
                      f"{' with the state in place' if in_place else ''}; this edgekv runs `forward` (dynamic tokens) "
                      "or `prefill` + `decode` (export it again with this edgekv)")


def release_file_pages(path: Path, sparse: bool = False) -> int:
    """Drop this process's resident pages of every mapping of `path` (Linux; elsewhere a no-op returning 0) and
    return how many bytes were resident. For a .pte: ExecuTorch's Python loader maps the program's constant
    segment and mlocks it (which succeeds for root, whatever RLIMIT_MEMLOCK says). Only the embedding gather reads
    that segment, a row per token (XNNPACK packs its weights from the delegates' own data): munlock + MADV_DONTNEED
    give the pages back (the kernel keeps them in its page cache; a read faults a row back in), so the table costs
    what the gather touches, as in an app that maps the .pte without mlock (ExecuTorch Android's LOAD_MODE_MMAP).
    This lowers both the resident memory after loading and the peak of the method's load (XNNPACK packing).

    sparse=True (once loading has read what it packs) also makes later reads cost their own page: a read fault maps
    the cached pages around it too (the kernel's fault-around, 64 KiB), so over real text the gather brought most of
    a table back. MADV_RANDOM on the mappings (no read-ahead) and
    the file's clean pages dropped from the page cache (POSIX_FADV_DONTNEED, after an fsync so that a file just
    written is clean) leave no neighbour to map. The cost is a read from storage the first time a row is
    read."""
    import ctypes
    import re

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        smaps = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    target, released, span, mapped = str(Path(path).resolve()), 0, None, False
    for line in smaps:
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            span = (int(head[1], 16), int(head[2], 16)) if head[3] == target else None
            if span and sparse:
                libc.madvise(span[0], span[1] - span[0], 1)  # MADV_RANDOM
            mapped |= span is not None
        elif span and line.startswith("Rss:"):
            lo, hi = span
            libc.munlock(lo, hi - lo)
            if libc.madvise(lo, hi - lo, 4) == 0:  # MADV_DONTNEED
                released += int(line.split()[1]) * 1024
    if mapped and sparse and hasattr(os, "posix_fadvise"):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return released


class quiet_native_stderr:
    """Discard what native code writes to file descriptor 2 inside the block. ExecuTorch's runtime logs from C++
    (ET_LOG) when its threadpool starts: cpuinfo's probes of ARM-only /sys files on x86 and the thread count, five
    lines on a user's terminal between generated tokens that say nothing about the run."""

    def __enter__(self):
        import sys
        import tempfile

        sys.stderr.flush()
        self._saved = os.dup(2)
        self._sink = tempfile.TemporaryFile()
        os.dup2(self._sink.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._sink.close()
        return False


class PteStepper(Stepper):
    """ExecuTorch through its pybindings' Program / Method objects: a `forward` method with a dynamic token axis
    (1..max_tokens), or a fixed-size `prefill` and a one-token `decode`. Outputs are taken without the runtime's
    clone (clone_outputs=True copies every output, the whole state included, on every step).

    Not the pybindings' Module.run_method: on every call it allocates (and zero-fills) a fresh buffer for each output
    the method's memory plan does not hold, which for a state written in place is every present.*: a transient copy
    of the whole state per step (benchmarks/profile_pte.py measures it with ETDump). A loaded Method allocates those buffers once, on its first call, and points the
    in-place outputs at them; the method then reads and writes its state there, so after each call this stepper
    takes the returned present.* as its state (no copy) wherever they lie. Its own first state is numpy's lazily
    zeroed memory, which costs nothing resident if the method never touches it.

    A .pte whose manifest says state_in_place (custom_sdpa in every attention layer, edgekv.models.swaps; always the
    one `forward` method) writes each call's rows into the state and returns it as present.*. Otherwise present.*
    alias the method's planned buffers, which the next call overwrites: they are copied at once into this stepper's
    state tensors. The in-place graph runs ExecuTorch's LLM kernels (llama::custom_sdpa) and, for an int8 cache's
    read-back, its quantized kernels, registered by importing their libraries before loading. etdump=True records
    ExecuTorch's per-operator profile (write_etdump; benchmarks/profile_pte.py)."""

    runtime = "executorch"

    def __init__(self, manifest: dict, folder: Path, threads: int | None = None, etdump: bool = False):
        import torch  # the ExecuTorch Python runtime takes torch tensors
        from executorch.extension.pybindings import portable_lib

        with quiet_native_stderr():
            if threads:
                portable_lib._unsafe_reset_threadpool(threads)  # XNNPACK's threadpool is process-wide
            pool_threads = portable_lib._threadpool_get_thread_count()
        self.torch = torch
        a = entry(manifest, "pte")
        where = folder / a["file"]
        self.in_place = bool(a.get("state_in_place"))
        self.methods, self.chunk, self.tail, most = pte_calls(manifest, where)
        self.max_chunk = most
        if a.get("attention") == LLM_KERNELS:
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers the llama:: kernels)
            import executorch.kernels.quantized  # noqa: F401 (an int8 cache's read-back: dequantize_per_token)
            # in this Python build the llama:: kernels parallelise with torch's OpenMP pool, not XNNPACK's: two pools
            # on the same cores oversubscribe them and stall each other, so torch gets as many threads as XNNPACK
            torch.set_num_threads(threads or pool_threads)
        try:
            self.program = portable_lib._load_program(
                str(where), enable_etdump=etdump,
                program_verification=portable_lib.Verification.InternalConsistency)
            names = {self.program.get_method_name(i) for i in range(self.program.num_methods())}
        except Exception as e:  # the runtime raises RuntimeError/ValueError on damaged programs
            raise EdgekvError(f"{where}: ExecuTorch cannot load it ({type(e).__name__}: {e})") from None
        def io(n, get):
            return [(None, ET_DTYPES.get(int(get(i).dtype()), str(get(i).dtype())), [int(d) for d in get(i).sizes()])
                    for i in range(n)]
        graph = {}
        try:
            for m in names & {ep["name"] for ep in a["entry_points"]}:
                meta = self.program.method_meta(m)
                graph[m] = (io(meta.num_inputs(), meta.input_tensor_meta),
                            io(meta.num_outputs(), meta.output_tensor_meta))
        except Exception as e:  # a method whose inputs are not all tensors
            raise EdgekvError(f"{where}: cannot read its methods' inputs and outputs ({type(e).__name__}: {e})"
                              ) from None
        check_graph_io(manifest, "pte", where, graph)
        release_file_pages(where)  # before packing, so the table and XNNPACK's unpacked weights do not add up
        if not set(self.methods.values()) <= names:
            raise EdgekvError(f"{where}: needs method(s) {', '.join(sorted(set(self.methods.values())))} "
                              f"(has {', '.join(sorted(names))})")
        try:
            self.loaded = {m: self.program.load_method(m) for m in set(self.methods.values())}
        except Exception as e:
            raise EdgekvError(f"{where}: ExecuTorch cannot load its methods ({type(e).__name__}: {e})") from None
        super().__init__(manifest)
        self.warm_up()
        release_file_pages(where, sparse=True)  # packed: the gather reads its table's rows page by page from now on

    def warm_up(self):
        """One call of each method, then a zeroed state: XNNPACK packs a method's weights on its first call, which
        belongs to loading, as ONNX Runtime's prepacking does, not to the first
        prompt's prefill time."""
        self.step([0], 0)
        if self.chunk:
            self.step([0] * self.chunk, 0)
        self.reset()

    def reset(self):
        if getattr(self, "state", None) is not None and self.in_place:
            for s in self.state:  # zeroed where the method keeps them: a fresh set would not be what it reads
                s.zero_()
        else:
            super().reset()

    def _zeros(self, shape, dtype):
        if dtype in NP_DTYPES:  # calloc'd: no page is resident until something writes it
            return self.torch.from_numpy(np.zeros(shape, dtype=NP_DTYPES[dtype]))
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype))

    def write_etdump(self, path: Path) -> None:
        self.program.write_etdump_result_to_file(str(path))

    def _call(self, tokens, pos, rows):
        n = len(tokens)
        most = self.chunk or self.max_chunk
        if n > most:
            raise EdgekvError(f"the pte takes at most {most} tokens per call, got {n}")
        method = self.loaded[self.methods["decode" if n == 1 else "prefill"]]
        padded = list(tokens) + [0] * ((self.chunk - n) if self.chunk and n > 1 else 0)
        t = self.torch
        inputs = [t.tensor([padded], dtype=t.int64), t.tensor([pos], dtype=t.int64), *self.state]
        if self.rows_input:
            inputs.append(t.tensor(rows, dtype=t.int64))
        method.set_inputs(inputs)  # the method keeps pointers into inputs (unplanned ones): alive until execute ends
        method.execute()
        out = method.get_outputs(clone_outputs=False)
        if self.in_place:
            self.state = list(out[1:])
        else:
            for mine, theirs in zip(self.state, out[1:]):
                # numpy's single-threaded memcpy: torch's copy_ of a small tensor goes through an OpenMP parallel
                # region that stalls for milliseconds whenever another process holds a core
                np.copyto(mine.numpy(), theirs.numpy())
        if self.rows_input:
            return out[0][0].float().numpy().copy()
        return out[0][0, :n].float().numpy()[rows]


class EagerStepper(Stepper):
    """The torch module behind the same interface (verify's reference); `chunk` mirrors the artifact's calls."""

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
        n, t = len(tokens), self.torch
        padded = list(tokens) + [0] * ((self.chunk - n) if self.chunk and 1 < n < self.chunk else 0)
        with t.no_grad():
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
    return [s if isinstance(s, np.ndarray) else s.float().numpy() for s in stepper.state]
