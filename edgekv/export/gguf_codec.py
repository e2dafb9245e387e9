"""The GGUF block codec behind --weights gguf for ONNX: a GGUF matrix's blocks decoded, and re-expressed exactly in
MatMulNBits' form; the graph rewrite that carries them is edgekv.export.gguf_blocks.

Each GGUF row is decoded into the file's own form, w = scale * q + offset per block (unpack), and mapped onto what
ONNX Runtime's com.microsoft.MatMulNBits represents on its fast path, w = scale * (code - zero_point) (pack):

    Q4_0  d * (q - 8)                  4-bit, block 32, default zero point 8        codes and fp16 scale as they are
    Q8_0  d * q, q int8                8-bit, block 32, default zero point 128      codes + 128
    Q5_0  d * (q - 16)                 8-bit, block 32, default zero point 128      codes + 112
    Q6_K  d * sc * (q - 32)            8-bit, block 16 (its int8 sub-scales folded into per-16 fp32 scales)
    Q4_1  d * q + m                    4-bit, block 32, per-block uint4 zero point z = round(-m / d), and the
    Q4_K  d*sc * q - dmin*mn             remainder r = m + d * z as an fp32 term: sum over blocks of r times the
    Q5_1, Q5_K (8-bit, same form)        input's block sums (Reshape, ReduceSum, MatMul, Add)

The 5-bit and 6-bit types stay 8-bit codes, and the Q8_0 head 8-bit: an exact split into 4-bit plus 2-bit (Q5_0) or
two 4-bit parts (Q8_0) is two MatMulNBits calls and measured slower than the one 8-bit call on ONNX Runtime's CPU
kernels (benchmarks/gguf_blocks_speed.py; benchmarks/README.md, "Gemma's 8-bit codes").

A zero point alone cannot hold Q4_1 / Q4_K's fractional minimum, and MatMulNBits with float zero points leaves the
fast path (its CPU kernel dequantizes the whole matrix every call); the remainder term is small: one [K/32, N]
fp32 matrix per projection. z is the integer nearest the minimum, so the 4-bit part carries almost the whole weight
and the int8 activations of accuracy_level 4 see the same magnitudes as without the term.

Exact means: the packed form dequantized in the runtime's definition, fl(scale * (code - z) + r), is bit for bit the
fp32 weight gguf.quants.dequantize gives (the graph's own fp32 initializer, which edgekv traced from it). That holds
because scale * (code - z) and r are both exact in fp32 (a 17-bit scale times a 5-bit integer; r, a few ulps of the
scale) and the one rounding left is the same sum gguf rounds. gguf_blocks.carry checks it per tensor and records the
result; a block where r would round (a zero point clipped at 15) falls back to z = 0, r = minimum, exact by the same
argument.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..errors import EdgekvError

QK = 32  # elements per block of the simple types
QK_K = 256  # elements per super-block of the k-quants
# bytes per block and elements per block, per GGUF type name (ggml.h / gguf.constants.GGML_QUANT_SIZES)
SIZES = {"Q4_0": (18, QK), "Q4_1": (20, QK), "Q5_0": (22, QK), "Q5_1": (24, QK), "Q8_0": (34, QK),
         "Q4_K": (144, QK_K), "Q5_K": (176, QK_K), "Q6_K": (210, QK_K)}
CARRIED = tuple(SIZES)
FLOAT_TYPES = ("F32", "F16", "BF16")
# elements per slice where a matrix is dequantized, hashed or compared a part at a time (16 M: 64 MB of fp32), so a
# large table (Gemma-3's 262144 x 640) is never in memory as several fp32 copies at once
CHUNK_ELEMS = 1 << 24


@dataclass
class FileBlocks:
    """One GGUF matrix [N, K] in the file's own form: w = scale * q + offset, per block of `block` elements along K."""
    type: str
    q: np.ndarray  # int16 [N, K]
    scale: np.ndarray  # fp32 [N, K / block]
    offset: np.ndarray | None  # fp32 [N, K / block]: the block's minimum (Q4_1, Q5_1; -dmin*mn in the k-quants)
    block: int


@dataclass
class Packed:
    """MatMulNBits' form of one matrix [N, K]: w = scale * (code - zero_point) [+ remainder], per block along K."""
    type: str
    bits: int
    block: int
    codes: np.ndarray  # uint8 [N, K], one code per element (unpacked)
    scales: np.ndarray  # fp32 [N, n_blocks]
    zero_points: np.ndarray | None  # uint8 [N, n_blocks]; None: the default 2^(bits-1)
    remainder: np.ndarray | None  # fp32 [N, n_blocks]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """fl(scale * (code - zero_point) + remainder) in fp32: what the packed form holds, by MatMulNBits'
        definition (com.microsoft contrib ops), evaluated with numpy."""
        n, k = self.codes.shape
        zp = np.float32(1 << (self.bits - 1)) if self.zero_points is None else \
            self.zero_points.astype(np.float32)[:, :, None]
        c = self.codes.reshape(n, -1, self.block).astype(np.float32)
        w = (c - zp) * self.scales[:, :, None]
        if self.remainder is not None:
            w = w + self.remainder[:, :, None]
        return w.reshape(n, k)

    def nbytes(self) -> int:
        n, k = self.codes.shape
        b = n * k * self.bits // 8 + self.scales.nbytes
        b += 0 if self.zero_points is None else self.zero_points.size * self.bits // 8
        return b + (0 if self.remainder is None else self.remainder.nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> fp32 [n] (a little-endian fp16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: element j is byte j's low nibble, element j + 16 its high nibble (ggml's block_q4_0)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32]: bit j of element j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (ggml-quants.c get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.empty((len(s), 8), np.uint8)
    mn = np.empty((len(s), 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def unpack(raw: np.ndarray, type_name: str, k: int) -> FileBlocks:
    """A GGUF matrix's raw rows (uint8 [N, bytes per row], as gguf.GGUFReader gives them) -> its FileBlocks."""
    if type_name not in SIZES:
        raise EdgekvError(f"GGUF type {type_name} is not carried (carried: {', '.join(CARRIED)})")
    size, per = SIZES[type_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if k % per or raw.size != n * (k // per) * size:
        raise EdgekvError(f"a {type_name} matrix of {n} rows x {k} holds {raw.size} bytes, not "
                          f"{n * (k // max(per, 1)) * size}")
    b = raw.reshape(-1, size)  # one row per block
    offset = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # the legacy types: fp16 d (_1: and m), [Q5: 32 high bits,] nibbles
        symmetric, five = type_name.endswith("_0"), type_name.startswith("Q5")
        head = 2 if symmetric else 4
        q = _nibbles16(b[:, head + 4 * five:])
        if five:
            q = q | (_high_bits32(b[:, head:head + 4]) << 4)
        q = q.astype(np.int16)
        d = _f16(b[:, 0:2])
        if symmetric:
            q -= 16 if five else 8
        else:
            offset = _f16(b[:, 2:4])
        blk, scale = QK, d
    elif type_name == "Q8_0":
        q = b[:, 2:].view(np.int8).astype(np.int16)
        blk, scale = QK, _f16(b[:, 0:2])
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, 16 + (32 if type_name == "Q5_K" else 0):].reshape(-1, 4, 32)  # 4 chunks of 32 bytes
        # chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.int16)
        if type_name == "Q5_K":  # bit j of qh[l] is element l of sub-block j's fifth bit
            qh = b[:, 16:48]
            q |= ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).astype(np.int16) << 4
        q = q.reshape(-1, QK_K)
        blk = QK
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        offset = -(dmin[:, None] * mn.astype(np.float32)).reshape(-1)
    elif type_name == "Q6_K":
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        # each half of 128: elements 32j + l (j = 0..3) take ql's low/high nibbles of bytes l / l + 32 and qh's
        # bits 2j..2j+1 of byte l (ggml-quants.c dequantize_row_q6_K)
        lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        q = (lo | (hi << 4)).astype(np.int16).reshape(-1, QK_K) - 32
        blk = 16
        scale = (d[:, None] * sc).reshape(-1)
    return FileBlocks(type_name, q.reshape(n, k), scale.reshape(n, -1).astype(np.float32),
                      None if offset is None else offset.reshape(n, -1).astype(np.float32), blk)


def file_dequantize(f: FileBlocks) -> np.ndarray:
    """fl(scale * q + offset) in fp32: the file's own definition, evaluated with numpy."""
    n, k = f.q.shape
    w = f.q.reshape(n, -1, f.block).astype(np.float32) * f.scale[:, :, None]
    if f.offset is not None:
        w = w + f.offset[:, :, None]
    return w.reshape(n, k)


def pack(f: FileBlocks) -> Packed:
    """FileBlocks -> MatMulNBits' form, exact (see the module docstring); 4 bits where the codes fit, else 8."""
    lo, hi = int(f.q.min(initial=0)), int(f.q.max(initial=0))
    if f.offset is None:  # symmetric around the default zero point
        bits = 4 if lo >= -8 and hi <= 7 and f.type in ("Q4_0",) else 8
        codes = (f.q + (1 << (bits - 1))).astype(np.uint8)
        return Packed(f.type, bits, f.block, codes, f.scale, None, None)
    bits = 4 if lo >= 0 and hi <= 15 and f.type in ("Q4_1", "Q4_K") else 8
    top = (1 << bits) - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(f.scale != 0, np.rint(-f.offset / f.scale), 0)
    z = np.clip(np.nan_to_num(z), 0, top).astype(np.float32)
    r = (f.offset + f.scale * z).astype(np.float32)
    # where r rounded in fp32 (z clipped far from the minimum), the block keeps z = 0 and r = its minimum
    n = f.q.shape[0]
    q = f.q.reshape(n, -1, f.block).astype(np.float32)
    want = q * f.scale[:, :, None] + f.offset[:, :, None]
    got = (q - z[:, :, None]) * f.scale[:, :, None] + r[:, :, None]
    bad = ~(got == want).all(-1)
    z[bad], r[bad] = 0, f.offset[bad]
    return Packed(f.type, bits, f.block, f.q.astype(np.uint8), f.scale, z.astype(np.uint8), r)


def pack_rows(raw: np.ndarray, type_name: str, k: int) -> Packed:
    """pack(unpack(raw)) a slice of rows at a time (a row's blocks are its own), so the int16 codes and fp32 temporaries
    of a large table are never whole; the same Packed (a type's bits do not depend on the rows: codes of Q4_0, Q4_1
    and Q4_K always fit 4 bits)."""
    parts = [pack(unpack(raw[a:b], type_name, k)) for a, b in row_steps(raw.shape[0], k)]
    if len(parts) == 1:
        return parts[0]
    if len({q.bits for q in parts}) > 1:  # not for the carried types; whole, to be sure
        return pack(unpack(raw, type_name, k))

    def cat(field):
        a = [getattr(q, field) for q in parts]
        return None if a[0] is None else np.concatenate(a)
    return Packed(type_name, parts[0].bits, parts[0].block, cat("codes"), cat("scales"), cat("zero_points"),
                  cat("remainder"))


def concat(parts: list[Packed]) -> Packed:
    """Packed matrices stacked along N (a fused projection: q, k and v in one MatMul), still exact: the widest bits
    (a 4-bit code is an 8-bit code of the same value), the smallest block (a block's scale, zero point and remainder
    repeated over its halves), explicit zero points (the default 2^(bits-1) of the part's own bits) and zero
    remainders where a part had none (fl(x + 0) = x)."""
    if len(parts) == 1:
        return parts[0]
    bits, block = max(p.bits for p in parts), min(p.block for p in parts)
    zps = any(p.zero_points is not None for p in parts) or len({p.bits for p in parts}) > 1
    rem = any(p.remainder is not None for p in parts)

    def per_block(a, p):
        return np.repeat(a, p.block // block, axis=1)

    codes, scales, zp, r = [], [], [], []
    for p in parts:
        codes.append(p.codes)
        scales.append(per_block(p.scales, p))
        z = p.zero_points if p.zero_points is not None else np.full(p.scales.shape, 1 << (p.bits - 1), np.uint8)
        zp.append(per_block(z, p))
        r.append(per_block(p.remainder if p.remainder is not None else np.zeros(p.scales.shape, np.float32), p))
    return Packed("+".join(dict.fromkeys(p.type for p in parts)), bits, block, np.concatenate(codes),
                  np.concatenate(scales), np.concatenate(zp) if zps else None, np.concatenate(r) if rem else None)


# ---- ONNX tensors of a Packed matrix ----


def nbits_b(p: Packed) -> np.ndarray:
    """MatMulNBits' B: uint8 [N, n_blocks, block * bits / 8]; 4-bit codes two to a byte, the even element in the low
    nibble."""
    n, k = p.codes.shape
    c = p.codes.reshape(n, k // p.block, p.block)
    if p.bits == 8:
        return np.ascontiguousarray(c)
    return np.ascontiguousarray(c[..., 0::2] | (c[..., 1::2] << 4))


def nbits_zero_points(p: Packed) -> np.ndarray:
    """MatMulNBits' zero_points: uint8 [N * ceil(n_blocks * bits / 8)]; 4-bit ones two to a byte per row (the even
    block in the low nibble, a row's odd last block padded)."""
    z = p.zero_points
    if p.bits == 8:
        return np.ascontiguousarray(z).reshape(-1)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)


def fingerprint(a: np.ndarray) -> str:
    """The bytes of a fp32 array in C order, hashed: how a graph's initializer is matched to its GGUF tensor."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return f"{a.shape}:" + hashlib.blake2b(memoryview(a).cast("B"), digest_size=16).hexdigest()


def _fingerprint_rows(shape: tuple, rows) -> str:
    """fingerprint of an [N, K] array given as consecutive row slices (the same hash: C order is row after row), so a
    large matrix need not be in memory whole."""
    h = hashlib.blake2b(digest_size=16)
    for r in rows:
        h.update(memoryview(np.ascontiguousarray(r, dtype=np.float32)).cast("B"))
    return f"{tuple(shape)}:" + h.hexdigest()


def row_steps(n: int, k: int):
    """(a, b) row ranges of an [n, k] matrix, CHUNK_ELEMS elements or fewer each (at least one row)."""
    step = max(1, CHUNK_ELEMS // max(k, 1))
    return ((a, min(n, a + step)) for a in range(0, n, step))


def gguf_matrices(path) -> dict:
    """A GGUF file's 2-D tensors -> {fingerprint of the fp32 matrix edgekv's loader builds from it (transformers'
    row order): (name, type name, raw rows in that order, K)}. Raw rows are the GGUF's, permuted like the loader's
    q/k rows (edgekv.models.weights.unpermute_qk) where the architecture needs it."""
    import gguf

    from ..arch.variants import GGUF_VARIANTS
    from ..models.weights import gguf_config, unpermute_qk

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    cfg = gguf_config(reader, str(path))
    out = {}
    for t in reader.tensors:
        dims = [int(d) for d in t.shape.tolist()]
        if len(dims) != 2:
            continue
        k, n = dims
        if t.tensor_type.name not in SIZES and t.tensor_type.name not in FLOAT_TYPES:
            continue
        raw = np.asarray(t.data).reshape(n, -1)  # one GGUF row per matrix row (a view of the mapped file)
        part = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        v = GGUF_VARIANTS.get(arch)
        if v is not None and v.gguf_permuted and part in ("attn_q", "attn_k"):  # as the loader does
            heads = cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"]
            raw = unpermute_qk(raw, heads)  # a permutation of whole rows: the same on the raw rows as on W's
        # the fp32 matrix hashed a slice of rows at a time (a row's values depend on its own bytes only)
        key = _fingerprint_rows((n, k), (np.asarray(gguf.quants.dequantize(raw[a:b], t.tensor_type), np.float32)
                                         for a, b in row_steps(n, k)))
        out[key] = (t.name, t.tensor_type.name, raw, k)
    return out


def matrix(name: str, type_name: str, raw: np.ndarray, n: int, k: int) -> dict:
    """One entry of gguf_matrices for a matrix [n, k] of raw GGUF rows (what a test builds without a file)."""
    import gguf

    raw = np.asarray(raw).reshape(n, -1)
    w = np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)), np.float32)
    return {fingerprint(w.reshape(n, k)): (name, type_name, raw, k)}
