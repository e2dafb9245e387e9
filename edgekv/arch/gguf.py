"""GGUF: the header gives the shapes and the exact stored bytes of every tensor, and its metadata (llama.cpp's key
names, gguf-py/gguf/constants.py Keys) the config. `gguf_config` is the one reader of that metadata: the planner's
read_gguf and the export's weight loader (edgekv.models.weights) both build on it. Torch-free (gguf-py needs numpy
only)."""
from __future__ import annotations

import re

import mmap
import os
import struct
from contextlib import contextmanager
from pathlib import Path

from ..errors import EdgekvError
from .model_types import GGUF_TYPES, Mamba
from .readers import arch_from_config
from .types import Arch, Weight
from .variants import GGUF_VARIANTS

# GGUF general.architecture -> the model_type read: the Llama-family variants that name one (edgekv.arch.variants),
# and Mamba-1 / Mamba-2
GGUF_ARCH = {a: v.model_type for a, v in (*GGUF_VARIANTS.items(), *GGUF_TYPES.items())}


# Bounds on what a GGUF header may claim, checked before gguf-py's GGUFReader sees the file: the reader trusts every
# count (an array claiming 2**62 items makes it loop past the end of the file, appending empty reads, without end).
# GGUF layout (ggml/docs/gguf.md): magic, version u32, tensor_count u64, kv_count u64; each KV a string key, a u32 type
# and a value; an array is an item type u32, a count u64 and the items; a string is a u64 length and the bytes; each
# tensor info a string name, n_dims u32, n_dims u64 dims, a u32 type and a u64 offset.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
MAX_ARRAY_ITEMS = 2**22  # the largest vocabulary config.py's LIMITS allows: llama.cpp's arrays are per token or less
MAX_TOTAL_ITEMS = 2**23  # all arrays together (tokens, scores, token types and merges of a 2**21-token vocabulary)
MAX_KV = 2**16           # real files carry tens of keys
MAX_TENSORS = 2**20      # real files carry thousands (DeepSeek-V3 with every expert apart: ~46k)
MAX_DIMS = 4             # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4      # arrays of arrays (the spec allows them; no writer nests them)


class _Scan:
    """A walk over a GGUF header that checks every count against the bytes left before reading on."""

    def __init__(self, buf, where: str):
        self.buf, self.where, self.off, self.items = buf, where, 0, 0
        self.order = "<"

    def fail(self, what: str):
        raise EdgekvError(f"{self.where}: not a readable GGUF file ({what} at byte {self.off:,}, "
                          f"file size {len(self.buf):,})")

    def need(self, n: int, what: str):
        if n > len(self.buf) - self.off:
            self.fail(f"{what} ({n:,} bytes) runs past the end of the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from(self.order + "I", self.buf, self.off)
        self.off += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from(self.order + "Q", self.buf, self.off)
        self.off += 8
        return v

    def string(self, what: str) -> bytes:
        """Skip a string; -> its first 80 bytes (for naming a key)."""
        n = self.u64(f"{what}'s length")
        self.need(n, what)
        self.off += n
        return bytes(self.buf[self.off - n:self.off - n + min(n, 80)])

    def count(self, what: str, n: int, least: int, limit: int):
        """A claimed number of items, each at least `least` bytes: refused past `limit` or the bytes left."""
        if n > limit:
            self.fail(f"{what} {n:,} is more than any real model's ({limit:,} at most)")
        if n * least > len(self.buf) - self.off:
            self.fail(f"{what} {n:,} needs at least {n * least:,} bytes, more than are left")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR_BYTES:
            self.need(_SCALAR_BYTES[vtype], what)
            self.off += _SCALAR_BYTES[vtype]
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
            itype = self.u32(f"{what}'s item type")
            n = self.u64(f"{what}'s item count")
            least = _SCALAR_BYTES.get(itype, 8 if itype == _STRING else 12)  # a string's length; an array's head
            self.count(f"{what}'s item count", n, least, MAX_ARRAY_ITEMS)
            self.items += n
            if self.items > MAX_TOTAL_ITEMS:
                self.fail(f"more than {MAX_TOTAL_ITEMS:,} array items in all")
            if itype in _SCALAR_BYTES:
                self.off += n * _SCALAR_BYTES[itype]
            else:
                for _ in range(n):
                    self.value(itype, what, depth + 1)
        else:
            self.fail(f"{what} has unknown value type {vtype}")


def check_gguf_header(path: Path, where: str | None = None) -> None:
    """Refuse a GGUF whose header claims more than the file holds (or than any real model has), in one line, before
    GGUFReader reads it: every count is checked against the bytes left, so nothing here or in the reader grows with a
    claimed count beyond the file's size."""
    where = where or str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise EdgekvError(f"{where}: not a readable GGUF file ({size} bytes: shorter than a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _scan(buf, where)
    except OSError as e:
        raise EdgekvError(f"{where}: cannot read the GGUF file ({e.strerror or e})") from None


def _scan(buf, where: str) -> None:
    s = _Scan(buf, where)
    if bytes(buf[:4]) != b"GGUF":
        s.fail("no GGUF magic")
    s.off = 4
    version = s.u32("version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as GGUFReader detects it)
        s.order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        s.fail(f"GGUF version {version} (edgekv reads versions 2 and 3)")
    n_tensors = s.u64("tensor count")
    n_kv = s.u64("key/value count")
    s.count("key/value count", n_kv, 8 + 4 + 1, MAX_KV)  # a key's length, a type, the smallest value
    for i in range(n_kv):
        key = s.string(f"key {i}").decode("utf-8", "replace")
        s.value(s.u32(f"key {i}'s type"), f"metadata {key!r}" if key.isprintable() else f"metadata value {i}")
    s.count("tensor count", n_tensors, 8 + 4 + 4 + 8, MAX_TENSORS)  # a name's length, n_dims, a type, an offset
    for i in range(n_tensors):
        s.string(f"tensor {i}'s name")
        n_dims = s.u32(f"tensor {i}'s dimension count")
        if n_dims > MAX_DIMS:
            s.fail(f"tensor {i} has {n_dims:,} dimensions (GGML has at most {MAX_DIMS})")
        s.need(8 * n_dims + 4 + 8, f"tensor {i}'s dimensions, type and offset")
        s.off += 8 * n_dims + 4 + 8


_KEPT: dict | None = None  # while kept_readers() is on: the file's identity -> its reader (the last file only)


@contextmanager
def kept_readers():
    """Within: open_gguf of an unchanged file (same device, inode, size and mtime) returns the reader it made before.
    GGUFReader parses every metadata array (a 262k vocabulary: ~10 s of CPU and ~0.7 GB of objects), and an export
    opens its GGUF three times before the weights are in memory (check_applies, check_export, load). release_readers
    ends the sharing (the export calls it after load, before the reader's memory would count in the lowering's)."""
    global _KEPT
    before, _KEPT = _KEPT, {}
    try:
        yield
    finally:
        _KEPT = before


def release_readers() -> None:
    """The kept reader (kept_readers) is dropped, and no other is kept until the next kept_readers()."""
    global _KEPT
    _KEPT = None


def open_gguf(path: str | Path, where: str | None = None):
    """gguf-py's GGUFReader on a file whose header was checked first (check_gguf_header); any error is one line."""
    p = Path(path)
    where = where or str(p)
    key = None
    if _KEPT is not None:
        try:
            st = p.stat()
            key = (str(p.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            pass
        if key is not None and key in _KEPT:
            return _KEPT[key]
    check_gguf_header(p, where)
    try:
        import gguf  # pure Python, numpy only
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises many kinds of error on a damaged file
        raise EdgekvError(f"{where}: not a readable GGUF file (truncated or corrupt?: {type(e).__name__}: "
                          f"{e})") from None
    if key is not None and _KEPT is not None:
        _KEPT.clear()
        _KEPT[key] = reader
    return reader


def _gguf_class(name: str) -> str:
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "lm_head"
    if name.endswith(".bias") or "norm" in name or any(t in name for t in ("ssm_conv", "ssm_a", "ssm_d", "ssm_dt.bias")):
        return "small"
    return "linear"


def gguf_field(reader, where: str):
    """field(key[, default]): a metadata value, or a one-line error naming the missing key when there is no default."""
    def field(key, default=...):
        f = reader.fields.get(key)
        if f is None:
            if default is ...:
                raise EdgekvError(f"{where}: GGUF metadata lacks '{key}'")
            return default
        return f.contents()
    return field


def gguf_arch(reader, where: str) -> str:
    """general.architecture, refused unless edgekv reads it."""
    arch = gguf_field(reader, where)("general.architecture")
    if arch not in GGUF_ARCH:
        raise EdgekvError(f"{where}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(sorted(GGUF_ARCH))}")
    return arch


def gguf_config(reader, where: str) -> dict:
    """A transformers-style config dict from a GGUF's metadata; a malformed value is one line naming the file."""
    arch = gguf_arch(reader, where)
    try:
        return _config(arch, gguf_field(reader, where), reader)
    except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, AttributeError) as e:
        raise EdgekvError(f"{where}: malformed GGUF metadata ({type(e).__name__}: {e})") from None


def _config(arch: str, field, reader) -> dict:
    names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size", None) or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {"model_type": GGUF_ARCH[arch], "vocab_size": int(vocab),
           "hidden_size": int(field(f"{arch}.embedding_length")), "num_hidden_layers": int(field(f"{arch}.block_count")),
           "max_position_embeddings": field(f"{arch}.context_length", None),
           "tie_word_embeddings": "output.weight" not in names}
    if issubclass(GGUF_TYPES.get(arch, object), Mamba):
        cfg.update(intermediate_size=field(f"{arch}.ssm.inner_size"), state_size=field(f"{arch}.ssm.state_size"),
                   conv_kernel=field(f"{arch}.ssm.conv_kernel"), time_step_rank=field(f"{arch}.ssm.time_step_rank"))
        return cfg
    heads = field(f"{arch}.attention.head_count")
    if not heads:
        raise ValueError(f"{arch}.attention.head_count is {heads!r}")
    heads = int(heads)
    eps = field(f"{arch}.attention.layer_norm_rms_epsilon", None)
    cfg.update(num_attention_heads=heads, num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
               head_dim=int(field(f"{arch}.attention.key_length", cfg["hidden_size"] // heads)),
               intermediate_size=int(field(f"{arch}.feed_forward_length")),
               rms_norm_eps=None if eps is None else float(eps),
               rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
               attention_bias="blk.0.attn_output.bias" in names,
               sliding_window=field(f"{arch}.attention.sliding_window", None))
    v = GGUF_VARIANTS[arch]
    if v.gguf_defaults:  # what the header does not carry, as llama.cpp's loader fixes it (the variant's declaration)
        cfg.update(v.gguf_defaults)
    elif v.act_field == "hidden_act":  # transformers' default activation
        cfg["hidden_act"] = v.act
    if v.qkv_bias is not None:  # q/k/v always biased (Qwen2): its config has no attention_bias
        cfg.pop("attention_bias")
    if v.gguf_scale_by_head_dim:  # llama.cpp scales the scores by 1/sqrt(head_dim) (f_attention_scale)
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    rtype = field(f"{arch}.rope.scaling.type", "none")
    if rtype not in ("none", ""):
        factor = field(f"{arch}.rope.scaling.factor", None)
        cfg["rope_scaling"] = {"rope_type": rtype, "factor": None if factor is None else float(factor)}
    rot = int(field(f"{arch}.rope.dimension_count", cfg["head_dim"]))
    if rot != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
    return cfg


# what a GGUF file name adds to the model's name: the quantization (Q4_K_M, q4_1, IQ4_XS, f16, bf16) and the tuning
# (instruct, it, chat), e.g. gemma-3-270m-it-Q4_K_M.gguf, SmolLM2-135M-Instruct.Q4_1.gguf
_GGUF_TAGS = re.compile(r"[-._](?:i?q\d[a-z0-9_]*|f16|f32|bf16|fp16|instruct|it|chat)$")


def catalog_name_for(stem: str, cfg: dict) -> str:
    """The catalog name of the model a GGUF file holds (gemma-3-270m for gemma-3-270m-q4_k_m.gguf), so that the plan
    and the report cite what is stored under that name (analyzer measurements, weight costs): the file name without
    its quantization and tuning tags, where the catalog has that name with the same layers, hidden size and vocabulary.
    Else the file name as it is."""
    from .catalog import catalog_entry, catalog_names
    name = stem.lower()
    while True:
        cut = _GGUF_TAGS.sub("", name)
        if cut == name:
            break
        name = cut
    if name == stem.lower() or name not in catalog_names():
        return stem
    ref = catalog_entry(name)["config"]
    ref = ref.get("text_config", ref)
    same = all(ref.get(k) == cfg.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    return name if same else stem


def read_gguf(path: str | Path) -> Arch:
    p = Path(path)
    if not p.is_file():
        raise EdgekvError(f"{path}: no such GGUF file")
    reader = open_gguf(p)
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise EdgekvError(f"{p}: truncated GGUF (tensor {t.name} ends past the end of the file)")
    cfg = gguf_config(reader, str(p))
    # the planner takes context_length as the trained length: a GGUF header rarely names the length a rope scaling
    # stretched (rope.scaling.original_context_length), so its scaling is not passed on to trained_ctx_of
    cfg.pop("rope_scaling", None)
    base = arch_from_config(cfg, catalog_name_for(p.stem, cfg), str(p))
    # rope_freqs.weight (Llama 3's rope scaling as per-frequency factors, convert_hf_to_gguf.py's
    # generate_extra_tensors) is a rope table, not a parameter: an HF folder computes it at load and is planned
    # without it, so the GGUF is too
    weights = tuple(Weight(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), _gguf_class(t.name),
                           gguf_type=t.tensor_type.name, gguf_bytes=int(t.n_bytes)) for t in reader.tensors
                    if t.name != "rope_freqs.weight")
    ftype = gguf_field(reader, str(p))("general.file_type", None)
    base.weights = weights
    base.gguf_path = str(p)
    base.notes.append(f"weights as stored in the GGUF (file_type {ftype}): exact bytes per tensor")
    return base
