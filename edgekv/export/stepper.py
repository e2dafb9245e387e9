"""The Stepper base (one sequence's state fed back through an artifact's entry points; edgekv.export.runtime says how
each runtime runs it) and the manifest lookups every stepper shares: an artifact's entry, its graph I/O checked
against the manifest's StateLayout, the prefill chunk the export recorded."""
from __future__ import annotations

import numpy as np

from ..errors import EdgekvError
from .manifest import ROWS

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
    # a call gives the last token's logits only (the runtimes' LLM APIs: GenAI's get_logits, the runner .pte's
    # forward): every row of a prompt then takes one token per call, and its last row calls of max_chunk tokens
    last_row_only: bool = False
    # a call gives one row of logits (an entry point whose `rows` is [1]: edgekv.export.manifest.entry_point's
    # one_row, the .pte's forward): where every row is wanted, the tokens go one per call, as for last_row_only
    one_row: bool = False

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
        rows, n = [], 1 if (self.last_row_only or self.one_row) and not last else self.chunk or self.max_chunk
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
        if self.one_row and not last and n > 1:
            return np.concatenate([self._call([t], pos + i, [0]) for i, t in enumerate(tokens)])
        if self.last_row_only and not last and n > 1:
            raise EdgekvError(f"{self.runtime} gives the last token's logits only: step one token, or pass last=True")
        return self._call(tokens, pos, [n - 1] if last else list(range(n)))

    def state_arrays(self) -> list[np.ndarray]:
        """The state tensors as numpy arrays in the manifest's order, sharing memory with the buffers the next call
        reads (torch tensors through .numpy()): writing into them sets the state (edgekv.export.statefile)."""
        return [s if isinstance(s, np.ndarray) else s.numpy() for s in self.state]

    def own_tokenizer(self):
        """The runtime's own tokenizer (encode(text).ids, decode(ids)) where its LLM API has one an app uses (GenAI's
        og.Tokenizer), or None: edgekv's, from the export's tokenizer.json (edgekv.export.generate)."""
        return None

    def _pick(self, logits: np.ndarray, rows: list[int]) -> np.ndarray:
        """The artifact's logits [R, V] for `rows`; an export without the rows input gave every row: pick them."""
        return logits if self.rows_input else logits[rows]

    def _zeros(self, shape, dtype):
        raise NotImplementedError

    def _call(self, tokens, pos, rows: list[int]) -> np.ndarray:
        """One call of the artifact: logits [len(rows), V] of those rows of the call."""
        raise NotImplementedError
