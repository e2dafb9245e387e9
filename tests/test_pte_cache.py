"""The .pte export's cost cuts: the cache of lowered programs (edgekv.export.pte_cache) and the XNNPACK passes the
lowering skips (edgekv.export.to_pte.needed_passes).

References: the cache key against hand-made changes (one weight element, the context, a flag: each must change it;
the same trace twice must not); the cache's bound against hand arithmetic on file sizes; the trimmed lowering against
ExecuTorch's own full pass list on the same program (the same .pte bytes)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from edgekv.errors import EdgekvError
from edgekv.export import pte_cache

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny" / "llama"


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(pte_cache.ENV, raising=False)
    return tmp_path / "xdg" / "edgekv" / "pte"


def _traced(max_ctx: int):
    from edgekv.export.trace import trace
    from edgekv.models import load_any
    from edgekv.strategies import parse_strategy
    loaded = load_any(str(TINY), parse_strategy("kv"), max_ctx)
    return trace(loaded.module, {"forward": None}, max_tokens=4)


def test_key_is_the_same_for_the_same_trace_and_changes_with_a_weight_the_context_or_a_flag():
    eps = _traced(16)
    base = pte_cache.program_key(eps, in_place=False)
    again = _traced(16)  # a fresh load and trace of the same model
    assert pte_cache.program_key(again, in_place=False) == base
    assert pte_cache.program_key(eps, in_place=True) != base
    w = next(iter(again["forward"].state_dict.values()))
    with torch.no_grad():
        w.view(-1)[7] += 1e-3  # one element of one weight
    assert pte_cache.program_key(again, in_place=False) != base
    assert pte_cache.program_key(_traced(32), in_place=False) != base  # the state's shape


def test_cache_folder_follows_xdg_and_store_fetch_round_trips(cache_home, tmp_path):
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\x01" * 1000)
    key = "ab" * 32
    assert pte_cache.store(key, pte, {"delegation": {"forward": {"delegate_calls": 3}}})
    assert (cache_home / f"{key}.pte").read_bytes() == pte.read_bytes()
    got = pte_cache.fetch(key, tmp_path / "copy.pte")
    assert got["delegation"] == {"forward": {"delegate_calls": 3}} and got["bytes"] == 1000
    assert (tmp_path / "copy.pte").read_bytes() == b"\x01" * 1000
    assert pte_cache.fetch("cd" * 32, tmp_path / "miss.pte") is None and not (tmp_path / "miss.pte").exists()


def test_an_entry_whose_file_changed_is_a_miss(cache_home, tmp_path):
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\x02" * 500)
    key = "ef" * 32
    pte_cache.store(key, pte, {"delegation": {}})
    cached = cache_home / f"{key}.pte"
    os.unlink(cached)  # a hard link to the export's file: write a different file in its place
    cached.write_bytes(b"\x02" * 499 + b"\x03")
    assert pte_cache.fetch(key, tmp_path / "copy.pte") is None
    assert not (tmp_path / "copy.pte").exists()


def test_the_cache_is_bounded_least_recently_used_first_and_removes_only_its_own_files(cache_home, tmp_path,
                                                                                         monkeypatch):
    src = tmp_path / "model.pte"
    src.write_bytes(b"\x00" * 1000)
    keys = [c * 64 for c in "abc"]
    # each entry: 1000 bytes of .pte + its .json (under 250 bytes): two fit in 2600 bytes, three do not
    monkeypatch.setenv(pte_cache.ENV, "2600B")
    cache_home.mkdir(parents=True)
    mine = cache_home / "notes.txt"
    mine.write_bytes(b"x" * 5000)  # not an entry: never counted, never removed
    dead, live = cache_home / f".{'d' * 64}.pte.tmp-999999999", cache_home / f".{'d' * 64}.pte.tmp-{os.getpid()}"
    dead.write_bytes(b"")  # a store killed midway (no such process) / one still running (this one)
    live.write_bytes(b"")
    pte_cache.store(keys[0], src, {"delegation": {}})
    os.utime(cache_home / f"{keys[0]}.json", (1, 1))
    pte_cache.store(keys[1], src, {"delegation": {}})
    os.utime(cache_home / f"{keys[1]}.json", (2, 2))
    assert pte_cache.fetch(keys[0], tmp_path / "hit.pte")  # a hit: keys[0] is now the most recently used
    pte_cache.store(keys[2], src, {"delegation": {}})
    left = sorted(p.name for p in cache_home.iterdir())
    assert left == sorted([f"{keys[0]}.json", f"{keys[0]}.pte", f"{keys[2]}.json", f"{keys[2]}.pte", "notes.txt",
                           live.name])
    assert json.loads((cache_home / f"{keys[2]}.json").read_text())["generator"].startswith("edgekv ")


def test_off_and_bad_settings(cache_home, tmp_path, monkeypatch):
    src = tmp_path / "model.pte"
    src.write_bytes(b"\x00" * 10)
    monkeypatch.setenv(pte_cache.ENV, "off")
    assert pte_cache.limit() is None
    assert not pte_cache.store("aa" * 32, src, {}) and not cache_home.exists()
    monkeypatch.setenv(pte_cache.ENV, "lots")
    with pytest.raises(EdgekvError, match="EDGEKV_PTE_CACHE"):
        pte_cache.limit()


class _Block(torch.nn.Module):
    """A convolution, batch norm and ReLU (what XNNPACK's Conv1dUnsqueezePass, FuseBatchNormPass and
    FuseActivationPass rewrite: the trimmed list must keep them here) before an LLM's ops (linear, rsqrt, silu)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.lin = torch.nn.Conv1d(4, 8, 3, padding=1), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).transpose(1, 2)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.lin(torch.nn.functional.silu(h))


def _lowered(trim: bool) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from edgekv.export.to_pte import _only_needed_xnnpack_passes
    ep = torch.export.export(_Block().eval(), (torch.randn(1, 4, 16),))
    if trim:
        with _only_needed_xnnpack_passes():
            edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()],
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
    else:
        edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    return edge.to_executorch().buffer


def test_trimmed_xnnpack_passes_give_the_same_pte_as_executorch_s_full_list():
    import executorch.backends.xnnpack.xnnpack_preprocess as xp

    from edgekv.export.to_pte import needed_passes
    base = xp.XNNPACKPassManager
    ran = []

    class Count(base):
        def transform(self):
            ran.append([p.__name__ for p in self.passes])
            return super().transform()
    xp.XNNPACKPassManager = Count
    try:
        full = _lowered(False)
        trimmed = _lowered(True)
    finally:
        xp.XNNPACKPassManager = base
    assert xp.XNNPACKPassManager is base
    assert trimmed == full
    half = len(ran) // 2
    kept = {p for r in ran[half:] for p in r}
    assert {"Conv1dUnsqueezePass", "FuseBatchNormPass", "FuseActivationPass"} <= kept
    # an LLM partition's ops (SmolLM2's, as the edge dialect names them): the 8 passes for other ops are left out
    llm = {f"aten.{op}.default" for op in ("linear", "rsqrt", "silu", "view_copy", "permute_copy", "mean")} | \
        {"aten.mul.Tensor", "aten.add.Tensor", "aten.pow.Tensor_Scalar"}
    names = [p for r in ran[:half] for p in r]
    left = [p.__name__ for p in needed_passes([type(n, (), {}) for n in dict.fromkeys(names)], llm)]
    # 8 passes for ops an LLM does not have, and the two for a softmax (ConvertToSDPAPass) and a concatenation
    assert len(dict.fromkeys(names)) - len(left) == 10 and "FuseActivationPass" not in left
    attention = llm | {"aten._softmax.default", "aten.cat.default"}
    assert {"ConvertToSDPAPass", "DecomposeConcatenate"} <= {
        p.__name__ for p in needed_passes([type(n, (), {}) for n in dict.fromkeys(names)], attention)}


class _Attention(torch.nn.Module):
    """A causal attention over a dynamic token axis, with a rotate-half concatenation: what an LLM's layer gives
    ExecuTorch's decompositions (matmul, softmax, cat, the token axis's symbolic sizes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).split(8, dim=-1)
        q = q + torch.cat([-q[..., 4:], q[..., :4]], dim=-1)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        w = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.out(w @ v)


def test_lowering_decomposes_each_program_once_and_gives_executorch_s_bytes():
    """ExecuTorch 1.5's to_edge_transform_and_lower re-traces a program three times (run_decompositions with an empty
    table, with the default table less XNNPACK's ops, with the default table: _gen_edge_manager_for_partitioners);
    lower_pte re-traces it once, and the .pte is byte for byte the one ExecuTorch's own three calls give."""
    from torch.export import ExportedProgram

    from edgekv.export import to_pte
    base = ExportedProgram.run_decompositions
    calls = []

    def counted(self, *a, **k):
        calls.append(self)
        return base(self, *a, **k)

    def lowered(once: bool) -> tuple[bytes, int]:
        ep = torch.export.export(_Attention().eval(), (torch.randn(1, 5, 8),),
                                 dynamic_shapes=({1: torch.export.Dim("t", min=2, max=64)},))
        calls.clear()
        ExportedProgram.run_decompositions = counted
        try:
            edge = to_pte.lower_pte({"forward": ep}, decompose_once=once)
            # the pattern graphs XNNPACK's ConvertToSDPAPass builds once per process are not this program's
            n = sum(c.graph_signature.user_inputs == ep.graph_signature.user_inputs for c in calls)
        finally:
            ExportedProgram.run_decompositions = base
        return to_pte.to_buffer(edge), n

    executorch_s, n3 = lowered(False)
    ours, n1 = lowered(True)
    assert ExportedProgram.run_decompositions is base
    assert (n3, n1) == (3, 1)
    assert ours == executorch_s


@pytest.mark.slow
def test_a_second_export_of_the_same_model_takes_the_cached_pte_and_still_verifies(cache_home, tmp_path):
    """Two exports of the tiny Llama to .pte: the second copies the first's model.pte from the cache (the same
    bytes, lower-pte in well under a second) and is verified against eager torch as the first was."""
    from click.testing import CliRunner

    from edgekv.cli import main
    runs = []
    for name in ("a", "b"):
        r = CliRunner().invoke(main, ["export", "--model", str(TINY), "--format", "pte", "--max-ctx", "64",
                                      "--out", str(tmp_path / name), "--verify-steps", "2", "--threads", "1", "--json"])
        assert r.exit_code == 0, r.output
        runs.append(json.loads((tmp_path / name / "manifest.json").read_text()))
    first, second = runs
    assert first["files"]["model.pte"]["sha256"] == second["files"]["model.pte"]["sha256"]
    assert second["timings_s"]["lower-pte"] < 1 < first["timings_s"]["lower-pte"]
    assert second["verification"]["pte"]["passed"]
    assert len(list(cache_home.glob("*.pte"))) == 1


class _HeadsBack(torch.nn.Module):
    """Heads split and merged back over a dynamic token axis with sizes taken from the input's shape, as an LLM's
    layers write them (a per-head RMSNorm's `x.view(b, -1, 1, d)`, an attention output's merge before o_proj):
    views to [s, -1, 4] and [1, s, 8], s the token count's symbol."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        t = x.shape[1]
        h = self.a(x).view(t, -1, 4).permute(1, 0, 2) * 2.0  # [2, T, 4]
        return self.b(h.permute(1, 0, 2).reshape(1, t, 8))


def test_a_view_with_a_symbolic_size_stays_inside_xnnpack_and_runs_as_eager_torch():
    """XNNPACK refuses a view whose shape holds a symbolic size; lower_pte writes it with that size inferred (-1), so
    the module above is one XNNPACK partition with no portable view between its two linears (ExecuTorch's own
    partitioner makes two, the view between them), and the .pte's outputs at two token counts are eager torch's."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from edgekv.export import to_pte
    m = _HeadsBack().eval()
    ep = torch.export.export(m, (torch.randn(1, 5, 8),), dynamic_shapes=({1: torch.export.Dim("t", min=2, max=64)},))
    edge = to_pte.lower_pte({"forward": ep})
    summary = to_pte.delegation_summary(edge)["forward"]
    assert summary["delegate_calls"] == 1 and not any("view" in op for op in summary["portable_ops"]), summary
    buf = to_pte.to_buffer(edge)  # outlives the program, which reads the XNNPACK weights from it
    program = _load_for_executorch_from_buffer(buf)
    for t in (3, 7):
        x = torch.randn(1, t, 8)
        with torch.no_grad():
            want = m(x)
        got = program.run_method("forward", (x,))[0]
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
