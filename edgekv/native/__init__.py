"""edgekv's own ExecuTorch kernels: edgekv::int8_sdpa and edgekv::fp16_sdpa, attention over an int8 or fp16 KV cache
read in place.

Why: the .pte's default read of int8 codes, ExecuTorch's llama::custom_quantized_sdpa, multiplies an int8-rounded
query by the codes with torchao's quantized_matmul, which has NEON kernels only; on an x86 CPU it runs a scalar
fallback (docs/cache-kernels.md). This kernel converts a block of codes to fp32 and dots it with the fp32 query (AVX2
and FMA where the build has them, else portable loops), so the query is never rounded: it computes what edgekv's
eager layer computes (codes times their scales, softmax, values), to fp32 rounding. The .pte's default read of an fp16
cache casts the rows written so far to fp32 every call (a portable _to_copy: custom_sdpa takes fp32 or bf16);
edgekv::fp16_sdpa reads the fp16 values in place with the same tiles (F16C's exact conversion in registers).

Pieces:
  int8_sdpa_core.cpp   the attention (one token or several, causal; int8 codes with per-token or static
                       per-channel scales, or fp16 values)
  int8_sdpa_et.cpp     the ExecuTorch kernels edgekv::int8_sdpa.out and edgekv::fp16_sdpa.out (EXECUTORCH_LIBRARY
                       registers them when the library is loaded) and C entry points for tests
  this module          the op's schema for torch (torch.library: an eager reference and a fake impl, so torch.export
                       keeps it as one call and to_executorch finds its out variant), building the shared library
                       (build(): g++ against the pinned executorch wheel's headers and libexecutorch.so) and
                       loading it into this process (load(), for the pybindings runtime).

An app that runs a .pte calling edgekv::int8_sdpa or edgekv::fp16_sdpa links these two .cpp files beside ExecuTorch's runtime (the
manifest's `custom_ops` names them); a stock ExecuTorch app without them fails to load the method
("Missing operator: edgekv::int8_sdpa.out"), which is why the export takes this kernel only on request
(`--pte-kernel edgekv`)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from ..errors import EdgekvError

HERE = Path(__file__).resolve().parent
SOURCES = ("int8_sdpa_core.cpp", "int8_sdpa_et.cpp")
HEADERS = ("int8_sdpa_core.h",)
OP = "edgekv::int8_sdpa"
FP16_OP = "edgekv::fp16_sdpa"
PACKED_OP = "edgekv::packed_sdpa"
OUT_OPS = (OP + ".out", FP16_OP + ".out", PACKED_OP + ".out")  # the kernels the library registers, as a manifest's custom_ops names them
LIB_NAME = "libedgekv_ops.so"
SCHEMA = ("int8_sdpa(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor v_scale, SymInt start_pos, "
          "float scale, bool per_channel) -> Tensor")
OUT_SCHEMA = ("int8_sdpa.out(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor v_scale, "
              "SymInt start_pos, float scale, bool per_channel, *, Tensor(a!) out) -> Tensor(a!)")
FP16_SCHEMA = "fp16_sdpa(Tensor q, Tensor k, Tensor v, SymInt start_pos, float scale) -> Tensor"
FP16_OUT_SCHEMA = ("fp16_sdpa.out(Tensor q, Tensor k, Tensor v, SymInt start_pos, float scale, *, Tensor(a!) out) "
                   "-> Tensor(a!)")
_PACKED_ARGS = ("Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, Tensor k_zero, Tensor v_scale, "
                "Tensor v_zero, SymInt start_pos, float scale, int bits, int group")
PACKED_SCHEMA = f"packed_sdpa({_PACKED_ARGS}) -> Tensor"
PACKED_OUT_SCHEMA = f"packed_sdpa.out({_PACKED_ARGS}, *, Tensor(a!) out) -> Tensor(a!)"

BUILD_TIMEOUT_S = 600  # two small translation units: seconds on a laptop core
_loaded: Path | None = None  # the library whose kernel this process registered, and its sha256
_loaded_sha = ""
_defined = False


def _et_root() -> Path:
    try:
        import executorch
    except ImportError:
        raise EdgekvError("--pte-kernel edgekv: the executorch package is not installed") from None
    for root in executorch.__path__:  # a namespace package: the folder that holds the headers and libexecutorch.so
        if (Path(root) / "include").is_dir() and (Path(root) / "lib").is_dir():
            return Path(root).resolve()
    raise EdgekvError("--pte-kernel edgekv: the executorch package has no include/ and lib/ to build against")


def _simd_flags(cxx: str) -> list[str]:
    """-mavx2 -mfma -mf16c on an x86-64 CPU that has all three (the library is built for the machine that builds it;
    F16C converts the fp16 cache's values in registers), else none: the portable scalar loops."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= set(flags) else []


def compiler() -> str | None:
    """The C++ compiler builds use: $CXX (when it names one that exists), else g++ or c++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("c++")


def _command(cxx: str, out: Path) -> list[str]:
    et = _et_root()
    inc = et / "include"
    return [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", *_simd_flags(cxx),
            # the definitions the wheel's cmake config gives its imported targets (executorch-config.cmake)
            "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
            f"-I{inc}", f"-I{inc / 'executorch/runtime/core/portable_type/c10'}",
            *[str(HERE / s) for s in SOURCES], f"-L{et / 'lib'}", "-lexecutorch", f"-Wl,-rpath,{et / 'lib'}",
            "-o", str(out)]


def source_digest() -> str:
    """sha256 of the sources and the compile flags: the name of a build, so a changed source is never run stale."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    cxx = compiler() or ""
    h.update(" ".join(_simd_flags(cxx)).encode())
    return h.hexdigest()


def build_dir() -> Path:
    """Where builds go: $EDGEKV_NATIVE_DIR, else build/ beside the sources (ignored by git)."""
    return Path(os.environ.get("EDGEKV_NATIVE_DIR") or HERE / "build")


def library_path() -> Path:
    return build_dir() / source_digest()[:16] / LIB_NAME


def build(quiet: bool = True) -> Path:
    """The shared library for the current sources, compiled when missing (a few seconds); written atomically. One
    EdgekvError line when there is no C++ compiler or the compile fails."""
    lib = library_path()
    if lib.is_file():
        return lib
    cxx = compiler()
    if cxx is None:
        raise EdgekvError("--pte-kernel edgekv needs a C++ compiler (g++) to build edgekv's kernels; "
                          "none found (install g++, or use --pte-kernel executorch)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    from ..outputs import write_atomic

    def compile_to(tmp):
        from ..children import child_setup
        try:  # the compiler dies with edgekv (children.py); a hung one is stopped, not waited on forever
            r = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True, preexec_fn=child_setup(),
                               timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise EdgekvError(f"building edgekv's kernels ({cxx}) did not finish in {BUILD_TIMEOUT_S} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise EdgekvError(f"building edgekv's kernels failed ({cxx}): {last[:300]}")

    write_atomic(lib, writer=compile_to, package_file=True)
    if not quiet:
        print(f"built {lib}")
    return lib


def _define_op() -> None:
    """torch.ops.edgekv.int8_sdpa, fp16_sdpa and packed_sdpa and their out variants: eager references (reference(),
    packed_reference()) and fake impls."""
    global _defined
    if _defined:
        return
    import torch
    lib = torch.library.Library("edgekv", "DEF")
    for schema in (SCHEMA, OUT_SCHEMA, FP16_SCHEMA, FP16_OUT_SCHEMA, PACKED_SCHEMA, PACKED_OUT_SCHEMA):
        lib.define(schema)
    _register(lib, "int8_sdpa", lambda q, k, v, ks, vs, start, scale, per_channel:
              reference(q, k, v, ks, vs, int(start), scale, per_channel))
    _register(lib, "fp16_sdpa", lambda q, k, v, start, scale: reference(q, k, v, None, None, int(start), scale, False))
    _register(lib, "packed_sdpa", lambda q, k, v, ks, kz, vs, vz, start, scale, bits, group:
              packed_reference(q, k, v, ks, kz, vs, vz, int(start), scale, bits, group))
    _LIBS.append(lib)  # a Library unregisters its ops when collected
    _defined = True


def _register(lib, name: str, ref) -> None:
    """name and name.out on lib: ref(q, ...) as the eager kernel (the out variant copies it into out), and a fake
    kernel (an fp32 tensor of q's shape), so torch.export keeps the op as one call."""
    import torch

    def eager(*args):
        return ref(*args)

    def eager_out(*args, out):
        out.resize_(args[0].shape).copy_(ref(*args))
        return out

    def fake(*args):
        return torch.empty_like(args[0], dtype=torch.float32)

    def fake_out(*args, out):
        return out

    lib.impl(name, eager, "CompositeExplicitAutograd")
    lib.impl(f"{name}.out", eager_out, "CompositeExplicitAutograd")
    lib.impl(name, fake, "Meta")
    lib.impl(f"{name}.out", fake_out, "Meta")


_LIBS: list = []


def reference(q, k, v, ks, vs, start_pos: int, scale: float, per_channel: bool):
    """The op in plain torch, as edgekv's eager layer computes it: keys and values dequantized (codes times their
    scales, edgekv.quant's symmetric int8; ks None: an fp16 cache's values as they are, fp16_sdpa), token c of
    q [Hkv, C, G, D] attending slots 0..start_pos+c."""
    import torch
    hkv, c, g, d = q.shape
    t = k.numel() // (hkv * d)
    kf, vf = k.reshape(hkv, t, d).float(), v.reshape(hkv, t, d).float()
    if ks is None:
        pass
    elif per_channel:
        kf, vf = kf * ks.reshape(hkv, 1, d).float(), vf * vs.reshape(hkv, 1, d).float()
    else:
        kf, vf = kf * ks.reshape(hkv, t, 1).float(), vf * vs.reshape(hkv, t, 1).float()
    n = start_pos + c
    kf, vf = kf[:, :n], vf[:, :n]
    s = torch.einsum("hcgd,htd->hcgt", q.float(), kf) * scale
    masked = torch.arange(n)[None, :] > (start_pos + torch.arange(c))[:, None]  # [C, n]
    s = s.masked_fill(masked[None, :, None, :], float("-inf"))
    return torch.einsum("hcgt,htd->hcgd", s.softmax(-1), vf)


def packed_reference(q, k, v, ks, kz, vs, vz, start_pos: int, scale: float, bits: int, group: int):
    """packed_sdpa in plain torch: the packed codes dequantized as edgekv's eager layer reads them
    (edgekv.quant.dequantize: code * scale + zero per group), then reference()'s attention."""
    from ..quant import dequantize
    hkv, d = q.shape[0], q.shape[3]
    t = k.numel() * (8 // bits) // (hkv * d)
    kf, vf = (dequantize(c.reshape(hkv, t, -1), s.reshape(hkv, t, -1), z.reshape(hkv, t, -1), bits, group)
              for c, s, z in ((k, ks, kz), (v, vs, vz)))
    return reference(q, kf, vf, None, None, start_pos, scale, False)


def load(path: str | Path | None = None) -> Path:
    """Register edgekv::int8_sdpa for torch (schema, reference) and, for the ExecuTorch runtime in this process, load
    its kernel library (build() when path is None). The pybindings' runtime (executorch.extension.pybindings) and
    the library share one kernel registry (libexecutorch.so), so a .pte calling the op runs after this. A path that
    is missing or not a loadable library is one EdgekvError line."""
    global _loaded, _loaded_sha
    _define_op()
    lib = Path(path) if path is not None else build()
    if _loaded is not None and _loaded == lib.resolve():
        return _loaded
    if not lib.is_file():
        raise EdgekvError(f"edgekv's kernel library {lib} is missing (build it: make native)")
    sha = hashlib.sha256(lib.read_bytes()).hexdigest()
    if _loaded is not None:  # its kernel is registered already; a second copy would register it again (an abort)
        if sha == _loaded_sha:
            return _loaded
        raise EdgekvError(f"edgekv's kernel library {lib} differs from the one this process loaded "
                          f"({_loaded}): run it in a new process")
    from executorch.extension.pybindings import portable_lib  # noqa: F401 (the runtime's libexecutorch.so first)
    try:
        handle = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        handle.edgekv_int8_sdpa_simd  # noqa: B018 (its own entry point: a library of another name fails here)
    except (OSError, AttributeError) as e:
        raise EdgekvError(f"edgekv's kernel library {lib} cannot be loaded: {str(e).splitlines()[0][:200]}") \
            from None
    _loaded, _loaded_sha = lib.resolve(), sha
    return _loaded


def c_kernel(path: str | Path | None = None):
    """The kernel's C entry point (ctypes) as a function of torch tensors, for tests and benchmarks:
    f(q, k, v, ks, vs, start_pos, scale, per_channel) -> out, the same arguments as the op (scales as fp32)."""
    import torch
    handle = ctypes.CDLL(str(load(path)))  # once per process: loading registers the ExecuTorch kernel
    fn = handle.edgekv_int8_sdpa_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
    fn.restype = None

    def call(q, k, v, ks, vs, start_pos, scale, per_channel):
        hkv, c, g, d = q.shape
        t = k.numel() // (hkv * d)
        q, k, v = q.float().contiguous(), k.contiguous(), v.contiguous()
        ks, vs = ks.float().contiguous(), vs.float().contiguous()
        out = torch.empty_like(q)
        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), ks.data_ptr(), vs.data_ptr(), int(per_channel), hkv, c, g, d, t,
           int(start_pos), float(scale), out.data_ptr())
        return out

    call.simd = bool(handle.edgekv_int8_sdpa_simd())
    return call


def c_kernel_packed(path: str | Path | None = None):
    """edgekv::packed_sdpa's C entry point as a function of torch tensors: f(q, k, v, ks, kz, vs, vz, start_pos,
    scale, bits, group) -> out (codes uint8, scales and zeros fp16)."""
    import torch
    handle = ctypes.CDLL(str(load(path)))
    fn = handle.edgekv_packed_sdpa_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 7 + [i64] * 8 + [ctypes.c_float, ptr]
    fn.restype = None

    def call(q, k, v, ks, kz, vs, vz, start_pos, scale, bits, group):
        hkv, c, g, d = q.shape
        t = k.numel() * (8 // bits) // (hkv * d)
        q = q.float().contiguous()
        parts = [x.contiguous() for x in (k, v)] + [x.to(torch.float16).contiguous() for x in (ks, kz, vs, vz)]
        out = torch.empty_like(q)
        fn(q.data_ptr(), *(x.data_ptr() for x in parts), bits, group, hkv, c, g, d, t, int(start_pos), float(scale),
           out.data_ptr())
        return out

    return call


def c_kernel_fp16(path: str | Path | None = None):
    """edgekv::fp16_sdpa's C entry point as a function of torch tensors: f(q, k, v, start_pos, scale) -> out, k and v
    fp16."""
    import torch
    handle = ctypes.CDLL(str(load(path)))
    fn = handle.edgekv_fp16_sdpa_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
    fn.restype = None

    def call(q, k, v, start_pos, scale):
        hkv, c, g, d = q.shape
        t = k.numel() // (hkv * d)
        q = q.float().contiguous()
        k, v = k.to(torch.float16).contiguous(), v.to(torch.float16).contiguous()
        out = torch.empty_like(q)
        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), hkv, c, g, d, t, int(start_pos), float(scale), out.data_ptr())
        return out

    call.simd = bool(handle.edgekv_int8_sdpa_simd())
    return call
