"""The streamed ONNX export's weights while it traces and lowers: each large fp32 weight kept as its exact bf16 / fp16
copy (half the bytes), the module tracing over an untouched placeholder of the fp32 shape, and the fp32 values
written from the narrow copy one tensor at a time when model.onnx is saved.

Why it is exact: an HF checkpoint in bf16 or fp16 (every published 1B-4B model here) loads into an fp32 module whose
values are bf16 / fp16 numbers, so narrowing and widening again gives back the same fp32 bits; that is checked for
each tensor, and one that does not round-trip keeps its fp32 storage. Why it is safe: torch.export and the ONNX
exporter read a weight's shape, dtype and strides, never its values (they trace with fake tensors; the exporter's
initializers wrap the module's tensors without copying, and lowering with fold_weights=False folds no op that reads a
weight larger than to_onnx.FOLD_LIMIT, which every stashed one is). A placeholder is a private anonymous mapping
that nothing writes: its pages are never resident (a read maps the kernel's shared zero page), so the lower-onnx
stage holds half the fp32 module instead of all of it. A Llama-3.2-1B export then holds its 2.47 GB of bf16 weights
where it held 4.94 GB of fp32 (benchmarks/README.md, "What an export costs").

From the load on (narrow_loading): a bf16 / fp16 safetensors checkpoint's large tensors are never widened at all. The
loader keeps each as read (its exact narrow values) and hands the module a placeholder; the eager passes that need
values (verify-quant's fp32 reference, kv-int8c's calibration) run under materialized(), which widens one decoder
layer's weights to fp32 while that layer runs and drops them after, so their logits are today's fp32 logits bit for
bit, and the fused q/k/v of the ONNX module are stacked from the narrow copies (fused_rows). A 3B model's fp32 module
(12.85 GB) is then never in memory: its bf16 weights (6.4 GB) are, and at most the embedding table and one layer
widened beside them.
"""
from __future__ import annotations

import mmap
from contextlib import contextmanager

import torch

# a weight smaller than this stays fp32 in the module (norms, biases): the stash is for the bytes that matter, and
# every stashed weight must be larger than the lowering's fold limit (to_onnx.FOLD_LIMIT elements)
MIN_ELEMS = 1 << 18
NARROW = (torch.bfloat16, torch.float16)
ROWS_ELEMS = 1 << 22  # elements narrowed and checked at a time (16 MB of fp32)


class Stash:
    """{placeholder storage's address: (placeholder, its exact narrow copy)}; what save_onnx writes in their place."""

    def __init__(self):
        self.by_ptr: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fp32_bytes = 0  # the fp32 bytes the stash stands in for
        self.kept_bytes = 0  # the narrow copies' bytes
        self._maps: list = []  # the placeholders' anonymous mappings
        self.taken: set[int] = set()  # placeholders whose narrow copy take() dropped

    def add(self, small: torch.Tensor) -> torch.Tensor:
        """A new fp32 placeholder of small's shape standing for small's values (small: exact bf16 / fp16)."""
        ph = _placeholder(small.shape, self._maps)
        self.by_ptr[ph.untyped_storage().data_ptr()] = (ph, small)
        self.fp32_bytes += small.numel() * 4
        self.kept_bytes += small.numel() * small.element_size()
        return ph

    def narrow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The narrow copy t stands for, where t is a whole placeholder (not a view of part of one); else None."""
        hit = self.by_ptr.get(t.untyped_storage().data_ptr())
        if hit is None or t.storage_offset() or t.shape != hit[0].shape or not t.is_contiguous():
            return None
        return hit[1]

    def release(self) -> None:
        """Drop the narrow copies once the graph is written: the exporter keeps references to the lowered graph
        (whose lazy initializers read this stash) past the graph's last use, so dropping the Stash is not enough."""
        global CURRENT
        self.by_ptr.clear()
        self._maps = []
        if CURRENT is self:
            CURRENT = None
        from .wquant import trim
        trim()

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """value_of(t), and t's narrow copy dropped from the stash: its last read (the .pte's quantizer, one linear
        at a time, so the narrow bytes fall as the codes grow). Only for a whole placeholder; else value_of."""
        if self.narrow_of(t) is None:
            return self.value_of(t)
        v = self.value_of(t)
        ptr = t.untyped_storage().data_ptr()
        del self.by_ptr[ptr]
        self.taken.add(ptr)
        return v

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The fp32 values of t, a tensor (or a view) over a placeholder; None if t is not over one."""
        hit = self.by_ptr.get(t.untyped_storage().data_ptr())
        if hit is None:
            return None
        full = hit[1].to(torch.float32)
        return full.as_strided(t.size(), t.stride(), t.storage_offset())


# the stash the export in progress loaded its weights into (narrow_loading), until it is released: what the loader
# (edgekv.models.weights.load_hf_folder) and the fused q/k/v (fused_rows) add to
CURRENT: Stash | None = None
_LOADING = False


@contextmanager
def narrow_loading():
    """While active, load_hf_folder keeps each large bf16 / fp16 tensor as read and returns a placeholder for it
    (keep_narrow); the yielded Stash holds them, and stays CURRENT after the block until released."""
    global CURRENT, _LOADING
    stash = CURRENT = Stash()
    _LOADING = True
    try:
        yield stash
    finally:
        _LOADING = False


def keep_narrow(t: torch.Tensor) -> torch.Tensor:
    """What the loader puts in the state dict for t (a tensor as stored): under narrow_loading, a large bf16 / fp16
    one becomes a placeholder standing for it; anything else (or outside narrow_loading) is widened to fp32."""
    if _LOADING and CURRENT is not None and t.dtype in NARROW and t.numel() >= MIN_ELEMS:
        return CURRENT.add(t.contiguous())
    return t.to(torch.float32)


def fused_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along rows (the fused q/k/v). Where a part is a placeholder of CURRENT, a new placeholder
    standing for the stacked narrow copies (a part kept fp32, too small to be stashed, narrowed exactly with it): no
    fp32 copy of the stacked weights is made; where one does not narrow exactly, the stacked fp32 values."""
    s = CURRENT
    over = [s is not None and p.untyped_storage().data_ptr() in s.by_ptr for p in parts]
    if not any(over):
        return torch.cat(parts)
    narrow = [s.narrow_of(p) if o else _narrow(p) for p, o in zip(parts, over)]
    if all(n is not None for n in narrow) and len({n.dtype for n in narrow}) == 1:
        return s.add(torch.cat(narrow))
    return torch.cat([s.value_of(p) if o else p for p, o in zip(parts, over)])


def _blocks(module) -> list:
    """The decoder layers: the children of the module's largest nn.ModuleList (by parameter count)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _unmap_freed() -> None:
    """glibc: serve every allocation of 1 MiB or more by its own mmap from now on, so a widened layer's fp32 goes back
    to the kernel as soon as it is dropped. glibc's adaptive threshold would otherwise rise to the size of the first
    such block freed and serve the next ones from its heap, where the freed space stays resident (mallopt
    M_MMAP_THRESHOLD, which also turns the adaptation off). A no-op where there is no glibc."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 1 << 20)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@contextmanager
def materialized(module, stash: Stash | None):
    """The module's placeholders hold their fp32 values while it runs eagerly: each decoder layer's part (each direct
    child of a layer: its attention, its MLP) widened from the narrow copies just before that part runs and dropped
    after it; everything outside the layers (the embedding table, also the tied head) widened for the whole block.
    The values are the stored bf16 / fp16 widened, as the fp32 load made them, so the logits are the same."""
    if stash is None or not stash.by_ptr:
        yield
        return

    def fill(params) -> list:
        saved = []
        for p in params:
            v = stash.value_of(p.data)
            if v is not None:
                saved.append((p, p.data))
                p.data = v
        return saved

    def restore(saved) -> None:
        for p, ph in saved:
            p.data = ph

    _unmap_freed()
    blocks = _blocks(module)
    inner = {id(p) for b in blocks for p in b.parameters()}
    outer = fill(p for p in module.parameters() if id(p) not in inner)
    handles, live = [], {}
    for b in blocks:
        for child in b.children():
            ps = list(child.parameters())
            if not any(p.untyped_storage().data_ptr() in stash.by_ptr for p in ps):
                continue

            def pre(m, args, ps=ps):
                live[id(m)] = fill(ps)

            def post(m, args, out):
                restore(live.pop(id(m), []))
            handles += [child.register_forward_pre_hook(pre), child.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for saved in live.values():
            restore(saved)
        restore(outer)


def _placeholder(shape, keep: list) -> torch.Tensor:
    """An fp32 tensor of shape over a private anonymous mapping never written: no resident page."""
    n = 1
    for d in shape:
        n *= int(d)
    buf = mmap.mmap(-1, max(n * 4, 1), flags=mmap.MAP_PRIVATE)
    keep.append(buf)
    return torch.frombuffer(buf, dtype=torch.float32, count=n).view(*shape)


def _narrow(p: torch.Tensor) -> torch.Tensor | None:
    """p's exact bf16 / fp16 copy, or None where neither holds p's values bit for bit. Checked and copied in slices
    of ROWS_ELEMS (no second fp32 copy of a large table beside it)."""
    flat = p.reshape(-1)
    step = ROWS_ELEMS
    for dt in NARROW:
        out = torch.empty(flat.shape, dtype=dt)
        for a in range(0, flat.numel(), step):
            part = flat[a:a + step]
            out[a:a + step] = part
            if not torch.equal(out[a:a + step].to(torch.float32), part):  # NaN never equals itself: kept fp32
                break
        else:
            return out.view(p.shape)
        del out
    return None


def stash_weights(*modules) -> Stash:
    """Every large fp32 parameter of modules[0] (the module being traced) swapped for a placeholder, its exact narrow
    copy kept in the returned Stash (CURRENT, with what narrow_loading already put there, if any); a parameter of the
    other modules (the eager one it was made from) over the same storage gets the same placeholder, so the fp32
    storage is freed as each is replaced (one tensor's copy at a time). The other modules' own weights are left to
    the caller (narrow_route.release_weights)."""
    stash = CURRENT if CURRENT is not None else Stash()
    groups: dict[int, list] = {}
    for p in modules[0].parameters():
        ptr = p.untyped_storage().data_ptr()
        if p.dtype == torch.float32 and p.numel() >= MIN_ELEMS and p.is_contiguous() and p.storage_offset() == 0 \
                and ptr not in stash.by_ptr:
            groups.setdefault(ptr, []).append(p)
    for m in modules[1:]:
        for p in m.parameters():
            if p.untyped_storage().data_ptr() in groups:
                groups[p.untyped_storage().data_ptr()].append(p)
    # the smallest first: by the time the largest (the embedding table) is copied, the rest are already half size
    for params in sorted(groups.values(), key=lambda ps: ps[0].numel()):
        first = params[0]
        if any(p.shape != first.shape for p in params):
            continue  # views of one storage at other shapes: left as they are
        with torch.no_grad():
            small = _narrow(first.detach())
            if small is None:
                continue
            ph = stash.add(small)
            for p in dict.fromkeys(params):  # the same Parameter object may appear in both modules
                p.data = ph
    from .wquant import trim
    trim()
    return stash


def fill_initializers(model, stash: Stash) -> int:
    """Each initializer of an onnx_ir model whose tensor lies over a placeholder gets the fp32 values of its narrow
    copy, computed when it is written (onnx_ir.LazyTensor: one tensor's fp32 at a time). Returns how many."""
    import onnx_ir as ir
    n = 0
    for v in model.graph.initializers.values():
        cv = v.const_value
        raw = getattr(cv, "raw", None)
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.float32:
            continue
        if stash.value_of(raw) is None:
            continue

        def values(raw=raw):
            return ir.Tensor(stash.value_of(raw).contiguous().numpy())
        v.const_value = ir.LazyTensor(values, dtype=ir.DataType.FLOAT, shape=ir.Shape(list(raw.shape)),
                                      name=cv.name)
        n += 1
    return n


def unfilled(model, stash: Stash) -> list[str]:
    """Names of initializers still over a placeholder (would be written as zeros): must be none."""
    out = []
    for v in model.graph.initializers.values():
        raw = getattr(v.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.untyped_storage().data_ptr() in stash.by_ptr:
            out.append(v.name)
    return out


def sharing_copy(module, stash: Stash):
    """A deep copy of module that shares the tensors standing for stash's narrow copies (the placeholders: nothing
    is copied, so nothing of them becomes resident) and copies the rest (norms, biases: small). The .pte's module is
    then quantized from it (quantize_module with fp32_value), and the fp32 module stays the reference."""
    import copy
    memo = {}
    for t in (*module.parameters(), *module.buffers()):
        if type(t.data) is torch.Tensor and t.untyped_storage().data_ptr() in stash.by_ptr:
            memo[id(t)] = t
    return copy.deepcopy(module, memo)


def fp32_value(stash: Stash):
    """quantize_module's value: a tensor over a placeholder -> a new fp32 tensor of its values (widened from the
    narrow copy), the narrow copy dropped where last (the tensor's last read: Stash.take); any other tensor ->
    itself."""
    def value(t: torch.Tensor, last: bool = False) -> torch.Tensor:
        v = stash.take(t.data) if last else stash.value_of(t.data)
        return t if v is None else v.contiguous()
    return value


def widen_left(module, stash: Stash) -> int:
    """Every parameter and buffer of module still over a placeholder (what the quantizer did not take: a linear whose
    width is no multiple of its group) replaced, in module only, by its fp32 values: a traced module must never read
    a placeholder's zeros. Returns how many."""
    n = 0
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in list(table.items()):
                if t is None or type(t.data) is not torch.Tensor or stash.value_of(t.data) is None:
                    continue  # a quantized weight (a tensor subclass) is no placeholder
                v = stash.value_of(t.data).contiguous()
                table[name] = torch.nn.Parameter(v, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else v
                n += 1
    return n


def over_placeholders(module, stash: Stash) -> list[str]:
    """Names of module's parameters and buffers still over one of stash's placeholders: must be none before it is
    traced."""
    return [n for n, t in (*module.named_parameters(), *module.named_buffers())
            if type(t.data) is torch.Tensor and (t.untyped_storage().data_ptr() in stash.by_ptr
                                                 or t.untyped_storage().data_ptr() in stash.taken)]
