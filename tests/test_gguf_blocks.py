"""--weights gguf (edgekv.export.gguf_codec, gguf_blocks): a GGUF's weight blocks carried into the ONNX graph, not
re-quantized.

Independent references: gguf's own quants.dequantize (llama.cpp's Python reference) on the same bytes, bit for bit,
for every type the module claims exact; ONNX Runtime running the rewritten graph against numpy's x @ W^T in float64."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from edgekv.export import gguf_blocks as gb  # noqa: E402
from edgekv.export import gguf_codec as gc  # noqa: E402

N, K = 24, 512  # rows (output channels) x inputs: two k-quant super-blocks per row


def gguf_rows(type_name: str, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows [n, bytes per row] of one matrix: gguf's own quantizer where it has one, else random bytes with
    ordinary fp16 scales (its k-quants have a dequantizer only)."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = (rng.standard_normal((n, k)) * 0.05 + rng.normal(0, 0.02, (n, 1))).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    size, per = gc.SIZES[type_name]
    b = rng.integers(0, 256, (n * k // per, size)).astype(np.uint8)
    at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]  # d (and dmin): positive fp16
    for o in at:
        b[:, o:o + 2] = (rng.random(len(b)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def reference(raw: np.ndarray, type_name: str, n: int = N, k: int = K) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)),
                      np.float32).reshape(n, k)


@pytest.mark.parametrize("type_name", gc.CARRIED)
def test_every_carried_type_dequantizes_bit_for_bit_as_gguf_does(type_name):
    raw = gguf_rows(type_name)
    p = gc.pack(gc.unpack(raw, type_name, K))
    want = reference(raw, type_name)
    got = p.dequantize()
    assert got.dtype == np.float32 and got.shape == want.shape
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{type_name}: {diff.size} weights differ, first {got.flat[diff[0]]} vs {want.flat[diff[0]]}"
    # the fast path's forms: codes in range, 4 bits only where the file has 4
    assert p.codes.max() < (1 << p.bits)
    assert p.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert p.block == (16 if type_name == "Q6_K" else 32)


def test_a_fractional_minimum_is_an_integer_zero_point_plus_a_small_remainder():
    raw = gguf_rows("Q4_1")
    f = gc.unpack(raw, "Q4_1", K)
    p = gc.pack(f)
    # hand arithmetic from the file's own fields: block 0 of row 0 holds d and m as its first two fp16 values
    d, m = raw[0, :4].view(np.float16).astype(np.float32)
    assert p.scales[0, 0] == d and p.zero_points[0, 0] == np.clip(np.rint(-m / d), 0, 15)
    assert np.all(np.abs(p.remainder) <= np.abs(p.scales) / 2 + 1e-12)  # the remainder is under half a step


def test_a_zero_point_clipped_far_from_the_minimum_falls_back_to_an_exact_block():
    raw = gguf_rows("Q4_1", n=1, k=32)
    # m = -5732 with d = 0.1791: z would be 32000, clipped at 15, and m + 15 d rounds in fp32 (codes 1, 2, 9, 10
    # then land one ulp off gguf's d * q + m)
    raw[0, 2:4] = np.array([-5732.0], np.float16).view(np.uint8)
    raw[0, 0:2] = np.array([0.1791], np.float16).view(np.uint8)
    raw[0, 4:] = (np.arange(16) * 17).astype(np.uint8)  # byte j holds code j twice: every code 0..15 appears
    p = gc.pack(gc.unpack(raw, "Q4_1", 32))
    want = reference(raw, "Q4_1", 1, 32)
    assert np.array_equal(p.dequantize().view(np.uint32), want.view(np.uint32))


def one_matmul(w: np.ndarray, tied_table: bool = False) -> onnx.ModelProto:
    """x [1, S, K] -> MatMul(x, W^T) as the exporter writes a linear (B an initializer); tied_table: a Gather on W
    (the embedding table) and the head MatMul(x, Transpose(W)), as the exporter writes a tied head."""
    n, k = w.shape
    nodes, inits = [], []
    if tied_table:
        inits.append(numpy_helper.from_array(w, "table"))
        nodes += [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
                  helper.make_node("Transpose", ["table"], ["table_t"], name="t", perm=[1, 0]),
                  helper.make_node("MatMul", ["x", "table_t"], ["y"], name="head")]
    else:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), "w_t"))
        nodes.append(helper.make_node("MatMul", ["x", "w_t"], ["y"], name="proj"))
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", k])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S", n])]
    if tied_table:
        ins.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "S"]))
        outs.append(helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, "S", k]))
    g = helper.make_graph(nodes, "g", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def run(model, **feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


@pytest.mark.parametrize("type_name", gc.CARRIED)
def test_the_rewritten_matmul_runs_in_onnx_runtime_as_x_times_the_gguf_weights(type_name):
    raw = gguf_rows(type_name, seed=1)
    w = reference(raw, type_name)
    model = one_matmul(w)
    record = gb.carry(model, gc.matrix("blk.0.ffn_up.weight", type_name, raw, N, K), accuracy_level=0)
    ops = [n.op_type for n in model.graph.node]
    with_minimum = type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # the remainder's small fp32 MatMul
    assert ops.count("MatMulNBits") == 1 and ops.count("MatMul") == int(with_minimum)
    assert not [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT and i.dims == [K, N]]
    assert record["tensors"]["blk.0.ffn_up.weight"]["exact"] and record["tensors"]["blk.0.ffn_up.weight"]["type"] \
        == type_name
    x = np.random.default_rng(2).standard_normal((1, 5, K)).astype(np.float32)
    (y,) = run(model, x=x)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)  # the sum's magnitude, for fp32 rounding
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-6), np.abs(y - want).max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K"])
def test_a_tied_table_is_gathered_bit_exactly_and_the_head_reads_the_same_codes(type_name):
    """The 8-bit types without a minimum: GatherBlockQuantized gives gguf's own values bit for bit (Q6_K with its
    blocks of 16); the head's MatMulNBits reads the same codes."""
    n, k = 40, 256
    raw = gguf_rows(type_name, n=n, k=k, seed=3)
    w = reference(raw, type_name, n, k)
    model = one_matmul(w, tied_table=True)
    record = gb.carry(model, gc.matrix("token_embd.weight", type_name, raw, n, k), accuracy_level=0)
    by_op = {nd.op_type: nd for nd in model.graph.node}
    assert by_op["GatherBlockQuantized"].input[0] == by_op["MatMulNBits"].input[1]  # one copy of the codes
    assert not [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT and n * k in
                (int(np.prod(i.dims)),)]  # no fp32 table left
    assert record["tensors"]["token_embd.weight (table)"]["exact"]
    ids = np.array([[0, n - 1, 7, 7]], np.int64)
    x = np.random.default_rng(4).standard_normal((1, 4, k)).astype(np.float32)
    y, emb = run(model, x=x, ids=ids)
    diff = np.flatnonzero(emb[0].view(np.uint32) != w[ids[0]].view(np.uint32))
    assert diff.size == 0, f"{type_name}: {diff.size} table values differ from gguf's"
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-6), np.abs(y - want).max()


def test_a_matrix_not_in_the_file_stays_float():
    w = np.random.default_rng(5).standard_normal((N, K)).astype(np.float32)
    model = one_matmul(w)
    record = gb.carry(model, gc.matrix("blk.0.ffn_up.weight", "Q8_0", gguf_rows("Q8_0"), N, K), accuracy_level=0)
    assert [n.op_type for n in model.graph.node] == ["MatMul"] and record["tensors"] == {}


def test_export_refuses_gguf_weights_for_an_hf_folder_and_for_the_pte_in_one_line(tmp_path):
    from conftest import run_cli, smollm2_gguf

    for model, extra, msg in (("fixtures/tiny/llama", [], "must be a .gguf file"),
                              (smollm2_gguf(), ["--format", "pte"], "onnx format only")):
        p = run_cli("export", "--model", model, "--out", tmp_path / "x", "--weights", "gguf", *extra)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
        # one error line; a loaded host may first print the export's progress heartbeat ("export  elapsed 0:00:30")
        lines = [ln for ln in p.stderr.strip().splitlines() if " elapsed " not in ln]
        assert len(lines) == 1, p.stderr
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_1", "Q6_K", "Q4_0"), ("Q4_K", "Q4_K", "Q5_1")])
def test_a_fused_projection_carries_each_of_its_gguf_matrices_exactly(types):
    """q, k and v in one MatMul (the export's fused projection for GroupQueryAttention): B = [Wq; Wk; Wv]^T, the
    parts of different types (4 and 8 bits, blocks of 16 and 32, with and without a minimum)."""
    rows = (32, 8, 8)
    raws = [gguf_rows(t, n=r, seed=10 + i) for i, (t, r) in enumerate(zip(types, rows))]
    ws = [reference(raw, t, r) for raw, t, r in zip(raws, types, rows)]
    mats = {}
    for i, (raw, t, r) in enumerate(zip(raws, types, rows)):
        mats.update(gc.matrix(f"blk.0.attn_{'qkv'[i]}.weight", t, raw, r, K))
    w = np.concatenate(ws)
    model = one_matmul(w)
    record = gb.carry(model, mats, accuracy_level=0)
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 1
    assert sorted(record["tensors"]) == [f"blk.0.attn_{c}.weight" for c in "kqv"]
    assert all(t["exact"] for t in record["tensors"].values()), record
    x = np.random.default_rng(6).standard_normal((1, 3, K)).astype(np.float32)
    (y,) = run(model, x=x)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-6), np.abs(y - want).max()


@pytest.mark.slow
def test_smollm2_exported_with_its_own_blocks_is_exact_and_within_the_quality_target(tmp_path):
    """`edgekv export -m smollm2-135m --weights gguf`: every 2-D tensor of the Q4_1 file (gguf's reader, not the
    export, counts them) is carried and recorded exact, no fp32 matrix is left, the manifest validates, and the
    artifact is within issue 38's target against the file's own fp32 weights over real text (KL <= 0.01)."""
    import json

    import jsonschema

    from conftest import run_cli, smollm2_gguf
    from edgekv.export import manifest as mf

    out = tmp_path / "gguf"
    p = run_cli("export", "--model", "smollm2-135m", "--weights", "gguf", "--max-ctx", "320", "--verify-steps", "0",
                "--threads", "1", "--out", out, check=True)
    m = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(m, json.loads(mf.SCHEMA_PATH.read_text()))
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    matrices = {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    q = m["weights"]["quantization"]["onnx"]
    carried = {n.removesuffix(" (table)") for n in q["tensors"]}
    assert carried == set(matrices) and all(t["exact"] for t in q["tensors"].values())
    assert {n: t["type"] for n, t in q["tensors"].items() if "(table)" not in n} == matrices
    assert q["matmuls_left_float"] == 0 and "GatherBlockQuantized" in q["new_ops"]
    v = m["weight_quality"]["onnx"]
    assert v["kl_mean"] <= 0.01 and v["top1_agreement"] >= 0.95, v
    assert "the GGUF's own blocks" in p.stdout and "KL mean" in p.stdout


def stored_bytes(model) -> int:
    """The bytes of a carried graph's weights: its initializers other than the int64 shape and axis constants."""
    return sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer if i.data_type != TensorProto.INT64)


@pytest.mark.parametrize("type_name", gc.CARRIED)
def test_the_planners_bytes_per_type_are_what_carry_writes(type_name):
    """edgekv.memory's arithmetic for --weights gguf on ONNX Runtime against the initializers carry() really writes."""
    from edgekv.memory import carried_matrix_bytes
    raw = gguf_rows(type_name, seed=5)
    model = one_matmul(reference(raw, type_name))
    gb.carry(model, gc.matrix("blk.0.ffn_up.weight", type_name, raw, N, K), accuracy_level=0)
    assert stored_bytes(model) == carried_matrix_bytes(type_name, N, K)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_the_planners_bytes_for_a_tied_table_are_what_carry_writes(type_name):
    """A tied table: Q8_0 gathered from the head's codes (GatherBlockQuantized's own scales), Q4_1 kept fp32."""
    from edgekv.arch import Arch, Weight
    from edgekv.memory import GGUF_CARRIED, weight_bytes
    raw = gguf_rows(type_name, n=40, k=64, seed=6)
    model = one_matmul(reference(raw, type_name, 40, 64), tied_table=True)
    gb.carry(model, gc.matrix("token_embd.weight", type_name, raw, 40, 64), accuracy_level=0)
    arch = Arch("tiny", "llama", "transformer", 64, 40, (), (Weight("token_embd.weight", (40, 64), "embedding",
                                                                      gguf_type=type_name, gguf_bytes=raw.size),))
    assert stored_bytes(model) == weight_bytes(arch, "gguf", GGUF_CARRIED)["total"]


def dequantize_spy(monkeypatch) -> list:
    """gguf.quants.dequantize, recording the number of values each call returns."""
    whole, sizes = gguf.quants.dequantize, []

    def spy(data, qtype):
        out = whole(data, qtype)
        sizes.append(np.asarray(out).size)
        return out
    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    return sizes


def test_the_files_matrices_are_keyed_as_the_loader_builds_them_llamas_q_and_k_unpermuted(monkeypatch):
    """gguf_matrices on SmolLM2's GGUF (a llama file: convert_hf_to_gguf.py permuted its q/k rows for llama.cpp's
    interleaved RoPE): each 2-D tensor keyed by the fp32 matrix in transformers' row order. By hand: q's rows
    [heads, D/2, 2] read back as [heads, 2, D/2]; v is stored as it is. The keys are hashed a slice of rows at a time
    (no more than CHUNK_ELEMS values dequantized at once: the Q8_0 table in 28 slices here), the same keys as the
    whole matrices'."""
    from conftest import smollm2_gguf

    path = smollm2_gguf()
    reader = gguf.GGUFReader(str(path))
    t = {x.name: x for x in reader.tensors}
    heads, dim = 9, 576  # SmolLM2-135M: 9 query heads of 64
    monkeypatch.setattr(gc, "CHUNK_ELEMS", 1 << 20)
    sizes = dequantize_spy(monkeypatch)
    mats = gc.gguf_matrices(path)
    assert max(sizes) <= 1 << 20, max(sizes)
    monkeypatch.undo()
    table = np.asarray(gguf.quants.dequantize(t["token_embd.weight"].data, t["token_embd.weight"].tensor_type),
                       np.float32).reshape(49152, dim)
    assert gc.fingerprint(table) in mats
    names = {v[0]: (key, v) for key, v in mats.items()}
    assert len(names) == 211 and names["token_embd.weight"][1][1] == "Q8_0"
    for part, want_permuted in (("attn_q", True), ("attn_v", False)):
        x = t[f"blk.0.{part}.weight"]
        k, n = (int(d) for d in x.shape.tolist())
        w = np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float32).reshape(n, k)
        if want_permuted:
            w = w.reshape(heads, dim // heads // 2, 2, k).swapaxes(1, 2).reshape(n, k)
        key, (_, type_name, raw, kk) = names[f"blk.0.{part}.weight"]
        assert key == gc.fingerprint(w) and type_name == "Q4_1" and kk == k
        assert np.array_equal(gc.file_dequantize(gc.unpack(raw, type_name, k)), w)  # the raw rows in that order too


def test_a_saved_graph_is_carried_one_matrix_at_a_time_into_a_new_data_file(tmp_path, monkeypatch):
    """The export's path (quantize_onnx on a saved model.onnx): the graph loaded without its weights, each matrix read
    from the old data file, carried and appended to the new one, compared a few rows at a time (CHUNK_ELEMS made
    small here). A tied Q8_0 table (Gather + head) and a Q4_1 projection (remainder): the table gathered bit for bit
    as gguf dequantizes it, both MatMuls as numpy's x @ W^T, and the new data file holds no fp32 copy of either."""
    from edgekv.export.onnx_stream import _Data, _publish
    from edgekv.export.to_onnx import EXTERNAL_DATA, save_onnx

    monkeypatch.setattr(gc, "CHUNK_ELEMS", 3 * 256)  # three rows of the table per slice
    n, k = 40, 256
    table_raw, proj_raw = gguf_rows("Q8_0", n=n, k=k, seed=7), gguf_rows("Q4_1", n=n, k=k, seed=8)
    table, proj = reference(table_raw, "Q8_0", n, k), reference(proj_raw, "Q4_1", n, k)
    model = one_matmul(table, tied_table=True)
    # the projection as a streamed export lowers it: MatMul(x, Transpose(W)) over the module's own W
    model.graph.initializer.append(numpy_helper.from_array(proj, "proj_w"))
    model.graph.node.append(helper.make_node("Transpose", ["proj_w"], ["proj_t"], name="proj_t", perm=[1, 0]))
    model.graph.node.append(helper.make_node("MatMul", ["emb", "proj_t"], ["z"], name="proj"))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, "S", n]))
    src = tmp_path / "src"
    src.mkdir()
    save_onnx(model, src / "model.onnx")
    graph = onnx.load(str(src / "model.onnx"), load_external_data=False)
    mats = {**gc.matrix("token_embd.weight", "Q8_0", table_raw, n, k),
            **gc.matrix("blk.0.ffn_up.weight", "Q4_1", proj_raw, n, k)}
    dst = tmp_path / "dst"
    dst.mkdir()
    data = _Data(src, dst / ".tmp", EXTERNAL_DATA)
    record = gb.carry(graph, mats, accuracy_level=0, data=data)
    data.f.close()
    _publish(graph, dst / ".tmp", dst / "model.onnx")
    assert record["exact"] and set(record["tensors"]) == {"token_embd.weight", "token_embd.weight (table)",
                                                          "blk.0.ffn_up.weight"}
    assert not [i.name for i in graph.graph.initializer if i.data_type == TensorProto.FLOAT and len(i.dims) == 2
                and ".remainder." not in i.name]  # neither W is left
    assert (dst / EXTERNAL_DATA).stat().st_size < table.nbytes  # codes, scales, remainder: no fp32 matrix
    s = ort.InferenceSession(str(dst / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[0, n - 1, 7, 7]], np.int64)
    x = np.random.default_rng(9).standard_normal((1, 4, k)).astype(np.float32)
    y, emb, z = s.run(None, {"x": x, "ids": ids})
    assert np.array_equal(emb[0].view(np.uint32), table[ids[0]].view(np.uint32))
    for got, a, w in ((y, x, table), (z, emb, proj)):
        want = a.astype(np.float64) @ w.T.astype(np.float64)
        scale = np.abs(a).astype(np.float64) @ np.abs(w.T).astype(np.float64)
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), np.abs(got - want).max()


def test_the_loader_dequantizes_a_slice_of_rows_at_a_time_and_bit_for_bit(monkeypatch):
    """The export's load of a GGUF (the fp32 state dict) never dequantizes more than GGUF_CHUNK_ELEMS values at
    once, so a large table (Gemma-3's 262144 x 640) is not several fp32 copies in memory; the sliced results are
    gguf's own whole-tensor dequantization bit for bit (SmolLM2's Q8_0 table in 28 slices here, its q rows
    unpermuted as the loader does)."""
    from conftest import smollm2_gguf

    from edgekv.models import weights as mw

    monkeypatch.setattr(mw, "GGUF_CHUNK_ELEMS", 1 << 20)
    whole = gguf.quants.dequantize
    sizes = dequantize_spy(monkeypatch)
    path = smollm2_gguf()
    _, sd, _, _ = mw.load_gguf(path)
    assert max(sizes) <= 1 << 20, max(sizes)
    t = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}
    table = np.asarray(whole(t["token_embd.weight"].data, t["token_embd.weight"].tensor_type), np.float32)
    table = table.reshape(49152, 576)
    assert np.array_equal(sd["model.embed_tokens.weight"].numpy().view(np.uint32), table.view(np.uint32))
    x = t["blk.0.attn_q.weight"]
    q = np.asarray(whole(x.data, x.tensor_type), np.float32).reshape(576, 576)
    q = q.reshape(9, 32, 2, 576).swapaxes(1, 2).reshape(576, 576)  # llama.cpp's permute undone by hand
    assert np.array_equal(sd["model.layers.0.self_attn.q_proj.weight"].numpy().view(np.uint32), q.view(np.uint32))
