"""The ExecuTorch stepper: a .pte run by ExecuTorch's Python runtime (its `forward`, `prefill` and `decode` methods as
the manifest lists them), with the state written in place where the export says so, the mapped weight pages given
back after loading (release_file_pages) and the runtime's native stderr kept quiet unless it fails."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import EdgekvError
from .manifest import ROWS
from .stepper import ET_DTYPES, NP_DTYPES, Stepper, check_graph_io, entry
from .to_pte import LLM_KERNELS

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


class paging_out:
    """Inside the block, a thread gives back this process's resident pages of `path`'s mappings every `every` seconds
    (Linux; elsewhere, or where the kernel refuses MADV_PAGEOUT, it does nothing). For a runtime that maps its
    weight file and packs every weight from the mapped pages while it loads (ONNX Runtime: MatMulNBits' prepacking):
    without it, the end of the load holds every page the packing read beside every packed copy, a peak of about the
    file plus the packed weights; with it, the pages go as the packing moves on, and the peak is the packed weights
    plus what the packing read in the last interval.

    MADV_PAGEOUT, not MADV_DONTNEED: the runtime maps the file private and writable, and DONTNEED would drop a page it
    had written (copy-on-write) back to the file's bytes; PAGEOUT reclaims only what it can keep correct (a clean
    file page is dropped; a written one stays, or goes to swap). A page read again later faults back in from the file.
    The thread runs while the load holds no GIL (ONNX Runtime's session constructor releases it)."""

    MADV_PAGEOUT = 21  # linux/mman-common.h (Linux 5.4)

    def __init__(self, path: Path, every: float = 0.002):
        self.target, self.every = str(Path(path).resolve()), every
        self.calls = 0
        self._stop = None
        self._thread = None

    def _spans(self) -> list[tuple[int, int]]:
        out = []
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith(self.target):
                    lo, hi = line.split(None, 1)[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
        return out

    def _run(self, libc) -> None:
        import ctypes
        import errno

        while not self._stop.is_set():
            try:
                spans = self._spans()
            except OSError:  # no /proc: nothing to give back
                return
            for lo, hi in spans:
                if libc.madvise(lo, hi - lo, self.MADV_PAGEOUT) != 0 and ctypes.get_errno() == errno.EINVAL:
                    return  # a kernel before 5.4 (ENOMEM: the mapping went between reading the maps and now)
                self.calls += 1
            self._stop.wait(self.every)

    def __enter__(self):
        import ctypes
        import sys
        import threading

        if not sys.platform.startswith("linux"):
            return self
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            return self
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(libc,), name="edgekv-paging-out", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return False


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
        self.one_row = any(i["name"] == ROWS and i["shape"] == [1] and ep["tokens"] != 1
                           for ep in a["entry_points"] for i in ep["inputs"])
        self.max_chunk = most
        # ExecuTorch's quantized kernels: an int8 cache's query (quantize_per_token) and a quantized embedding
        # table's gather (embedding_byte / embedding_4bit: edgekv.export.wquant.quantized_embedding)
        import executorch.kernels.quantized  # noqa: F401
        if a.get("custom_ops"):  # edgekv's own kernels (edgekv/native): this edgekv's build of them, never a file
            from .. import native  # from the export folder (nothing there is executed: SECURITY.md)
            unknown = [op for op in a["custom_ops"].get("ops", []) if op not in native.OUT_OPS]
            if unknown:
                raise EdgekvError(f"{where}: needs operator(s) {', '.join(map(str, unknown))[:200]}, which this edgekv "
                                  "does not provide")
            native.load()
        if a.get("attention") == LLM_KERNELS:
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 (registers the llama:: kernels)
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
