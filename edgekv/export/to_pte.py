"""Stage 2b, lower to ExecuTorch: one .pte, XNNPACK-delegated (to_edge_transform_and_lower + XnnpackPartitioner,
then to_executorch), with one method `forward` (a dynamic token axis, 1..C) when the state is caches only (written in
place for a plain or quantized cache, below; else copied in and out of the method's planned buffers), else methods
`prefill` (fixed chunk of tokens) and `decode` (one token): a recurrent scan traces as an unrolled loop.
Weights are stored once in the file and shared by the methods, but XNNPACK packs them once per method at load. Ops
XNNPACK does not take (embedding, RoPE cos/sin, and either the cache blend or the in-place cache writes and
ExecuTorch's attention kernel) run on ExecuTorch's portable / LLM kernels.

State in place (custom_sdpa in every attention layer, edgekv.models.swaps): each state tensor (a cache; a quantized
cache's codes, scales and zeros) is written by an index_put of this call's rows and read by llama::custom_sdpa. Here
that index_put becomes index_put_ on the method's own past.* input, the graph output present.* is that input (ExecuTorch
aliases an in-place op's result with its argument), and inputs are not memory-planned (the runtime uses the caller's
tensors instead of copying them into its arena): the method writes C rows into the caller's cache and returns it, with
no copy of the state per call. ExecuTorch plans the method's other buffers for its largest call (C tokens).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Set
from contextlib import contextmanager, nullcontext

from .manifest import ROWS

# the manifest's `attention` for a .pte with custom_sdpa layers (edgekv.models.swaps): the runtime must have
# ExecuTorch's LLM custom-op kernels linked (extension/llm/custom_ops; in Python, import
# executorch.extension.llm.custom_ops.custom_ops)
LLM_KERNELS = "llama.custom_sdpa"


# ops that read a written state in the in-place graph: the view of a cache ([1, Hkv, T, D] -> [Hkv, T, 1, D],
# custom_sdpa's layout) and, for a fp16 or quantized cache, the read-back of the written rows (edgekv.quant's
# dequantizers on a slice: casts, a packed cache's planes and their concatenation, the scale multiply, the zero add)
_STATE_READS = ("view", "slice", "_to_copy", "dim_order", "bitwise", "mul", "add", "unsqueeze", "cat")
# ops between a new key / value and its index_put: a quantized cache's quantizer and packer
# (edgekv.quant.quantize), shape changes
_STATE_WRITES = ("abs", "amax", "amin", "sub", "div", "clamp", "round", "mul", "sum", "_to_copy", "dim_order",
                 "view", "reshape", "squeeze", "permute", "unsqueeze")


def _is_index_put(n) -> bool:
    return n.op == "call_function" and "index_put" in str(n.target)


def _reads_written_state(node, depth: int = 10) -> bool:
    """Whether node reads an index_put's result directly or through other _STATE_READS ops."""
    import torch

    for a in node.args:
        for src in (a if isinstance(a, (list, tuple)) else (a,)):
            if not isinstance(src, torch.fx.Node) or src.op != "call_function":
                continue
            name = str(src.target)
            if _is_index_put(src) or (depth > 1 and any(k in name for k in _STATE_READS)
                                      and _reads_written_state(src, depth - 1)):
                return True
    return False


def _feeds_state_write(node, depth: int = 12) -> bool:
    """Whether node's result reaches an index_put only through _STATE_WRITES ops."""
    for u in node.users:
        if _is_index_put(u) or (depth > 1 and u.op == "call_function"
                                and any(k in str(u.target) for k in _STATE_WRITES)
                                and _feeds_state_write(u, depth - 1)):
            return True
    return False


def writes_state(eps: dict) -> bool:
    """Whether any of the traced programs writes a state tensor with an index_put: a layer swapped for ExecuTorch's
    custom_sdpa (edgekv.models.swaps; the eager layers blend, they have no index_put), in place or not."""
    return any(_is_index_put(n) for ep in eps.values() for n in ep.graph.nodes)


def _partitioner(guard_state: bool):
    """XNNPACK's partitioner, its configs _partition_configs(guard_state)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner(configs=_partition_configs(guard_state))


def _partition_configs(guard_state: bool) -> list | None:
    """XNNPACK's partitioner configs (None: its own list); guard_state: with the state reads and writes of
    custom_sdpa layers left to ExecuTorch's kernels (leaves_state_io). Needed wherever such a layer is, not only when every layer is one (the state written
    in place): Gemma 3's global layers take custom_sdpa while its sliding layers keep the eager ring, and a kv-int8
    cache there stopped the plain partitioner with the same dependency cycle (docs/upstream_xnnpack_partition_cycle.md)."""
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

    if not guard_state:
        return None

    def leaves_state_io(config, rule):
        """config, except for a node that rule picks: that stays on ExecuTorch's kernels.
        Reads (_reads_written_state): a view there is a zero-copy view (executorch_prim::et_view), inside XNNPACK a
        copy of the whole cache; and a partition that took the read-back of a fp16 or quantized cache (casts,
        unpacking, scale and zero) would both read the state that a portable index_put_ writes and feed custom_sdpa.
        Writes (_feeds_state_write): a quantized cache's quantizer of the new rows alternates XNNPACK ops (abs,
        sub, div, clamp, mul, casts) with portable ones (amax, amin, round, sum) on its way to the portable
        index_put_. In either case the partitioner refuses the dependency cycle between partitions ("Invalid
        partition, found dependency cycles"); the rows are C x Hkv x D values, so their portable kernels cost
        little."""

        class Leaves(config):
            def check_constraints(self, node, ep) -> bool:
                return not rule(node) and super().check_constraints(node, ep)

        Leaves.__name__ = config.__name__
        return Leaves

    reads = {"ViewCopyConfig", "SliceCopyConfig", "ToDimOrderCopyConfig", "MulConfig", "AddConfig",
             "UnsqueezeCopyConfig", "CatConfig"}
    writes = {"AbsConfig", "SubConfig", "DivConfig", "ClampConfig", "MulConfig", "ToDimOrderCopyConfig"}
    configs = []
    for c in ALL_PARTITIONER_CONFIGS:
        if c.__name__ in reads:
            c = leaves_state_io(c, _reads_written_state)
        if c.__name__ in writes:
            c = leaves_state_io(c, _feeds_state_write)
        configs.append(c)
    return configs


def in_head_block(node) -> bool:
    """Whether a traced node belongs to an output-layer block (edgekv.models.head.HeadBlocks: each block is called as
    its module, so its nodes carry the block's place in nn_module_stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    return any("HeadBlocks" in str(kind) for _, kind in stack.values())


def _head_block_partitioner(guard_state: bool):
    """XNNPACK's partitioner for the output layer's blocks alone, each block's linear (with its activation's
    quantization) its own partition, so its own delegate: ExecuTorch maps a delegate's weights while XNNPACK packs
    them and unmaps them after, so the program's load holds one block's unpacked bytes, not the head's
    (edgekv.arch.variants.PTE_HEAD_BLOCK_BYTES). Runs before the model's partitioner, which then never sees them."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from torch.fx.passes.infra.partitioner import Partition

    class HeadBlockPartitioner(XnnpackPartitioner):
        def generate_per_op_partitions(self, ep):
            blocks = [m for m in self.get_matched_nodes_from_configs(ep)
                      if any(n.op == "call_function" and "linear" in str(n.target) and in_head_block(n) for n in m)]
            return [Partition(id=i, nodes=dict.fromkeys(m)) for i, m in enumerate(blocks)]

    return HeadBlockPartitioner(configs=_partition_configs(guard_state), per_op_mode=True)


def inferred_view_shape(node) -> list[int] | None:
    """A view_copy whose target shape holds symbolic sizes (`[1, s, 640]`, `[s, -1, 1, 256]`: torch.export writes
    what the model's reshape(1, -1, D) resolved to) -> the same view written with its one symbolic size as -1 and
    every other size as the constant it is (read from the view's own output, node.meta["val"]); None when the shape
    is constant already or more than one output size is symbolic.

    Why: XNNPACK's ViewCopyConfig refuses a symbolic size ("Symbolic reshape is not supported") but takes one
    inferred dimension, so each such view (after every attention, in every RMSNorm of a per-head norm) was left to
    ExecuTorch's portable kernel and cut its layer into more XNNPACK partitions than it needs (what that saves:
    benchmarks/README.md, "The .pte export's time"; the partitions fall, the CPU hardly). The view itself is the same:
    one size inferred from the element count is the size the symbolic expression has at run time, and ExecuTorch's
    portable view_copy and its zero-copy view infer a -1 the same way."""
    import torch

    shape = node.args[1]
    val = node.meta.get("val")
    if all(isinstance(d, int) for d in shape) or not isinstance(val, torch.Tensor) or len(val.shape) != len(shape):
        return None
    sizes = [d if isinstance(d, int) else None for d in val.shape]
    if sizes.count(None) != 1:
        return None
    return [-1 if d is None else d for d in sizes]


def infer_view_sizes(graph_module):
    """A transform pass (to_edge_transform_and_lower's transform_passes, run before partitioning): each view whose
    shape inferred_view_shape can write with constants and one -1 is written so, except a view of a written state
    (_reads_written_state: those stay ExecuTorch's zero-copy views of the caller's cache, as before)."""
    from torch.fx.passes.infra.pass_base import PassResult

    import torch

    sizes, changed = set(), False  # the symbolic sizes the rewritten views read
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or "view_copy" not in str(node.target) or _reads_written_state(node):
            continue
        shape = inferred_view_shape(node)
        if shape is not None:
            sizes.update(d for d in node.args[1] if isinstance(d, torch.fx.Node))
            node.args = (node.args[0], shape, *node.args[2:])
            changed = True
    for n in sizes:  # a sym_size that only those views read
        if not n.users and "sym_size" in str(n.target):
            graph_module.graph.erase_node(n)
    if changed:
        graph_module.recompile()
    return PassResult(graph_module, changed)


def lower_pte(eps: dict, in_place: bool = False, decompose_once: bool = True):
    """{method: ExportedProgram} -> EdgeProgramManager (inspect it with delegation_summary). in_place: the programs
    were traced with custom_sdpa in every attention layer (edgekv.models.swaps): every state input is written in
    place. decompose_once=False: ExecuTorch's three re-decompositions as it runs them (_decompose_once; for
    benchmarks/pte_export_cost.py --lowering)."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # _check_ir_validity=False: the edge-dialect verifier re-walks every graph after each step (a measurable part of
    # the lowering's CPU time: benchmarks/results/pte_lowering_tiny_llama.json); it checks, it does not change the program (the same .pte bytes either way), and the
    # export's verify-pte stage runs the lowered program against eager torch anyway
    guard = in_place or writes_state(eps)
    partitioner = _partitioner(guard)
    with _only_needed_xnnpack_passes(), compact_dependency_viewers(), _preprocess_copies_share_weights(), \
            (_decompose_once() if decompose_once else nullcontext()):
        if decompose_once:
            eps = _decomposed_for(eps, partitioner)
        blocks = any(in_head_block(n) for ep in eps.values() for n in ep.graph.nodes)
        first = [_head_block_partitioner(guard)] if blocks else []
        edge = to_edge_transform_and_lower(eps, partitioner=first + [partitioner], transform_passes=[infer_view_sizes],
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False))
    if in_place:
        for method in edge.methods:
            write_state_in_place(edge.exported_program(method))
    return edge


def shared_weights_copy(program):
    """copy.deepcopy of an ExportedProgram that keeps its weight tensors (state_dict and constants) as they are: the
    graph, signature and dicts are the copy's own."""
    import copy

    import torch
    memo = {id(t): t for t in (*program.state_dict.values(), *program.constants.values())
            if isinstance(t, torch.Tensor)}
    return copy.deepcopy(program, memo)


@contextmanager
def _preprocess_copies_share_weights():
    """While lowering: the copy ExecuTorch makes of each XNNPACK partition's program before preprocessing it
    (BackendDetails.copy_exported_program_for_preprocess, a copy.deepcopy "in case backends change graph inside
    preprocess", made for every partition before the first is preprocessed: ExecuTorch 1.5,
    backend_api.lower_all_submodules_to_backend) shares the partition's weight tensors (shared_weights_copy).
    XNNPACK's preprocessing rewrites the copy's graph and reads its weights into new serialized buffers; it writes into
    no weight (the .pte bytes are the same: tests/test_pte_edge_copy.py). Why: the copies held every delegated weight
    a second time from the start of XNNPACK's preprocessing to the end of lower-pte (int4 codes are one byte per weight
    there, so a 1B model's codes twice; benchmarks/README.md, the 1B .pte export)."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    had = "copy_exported_program_for_preprocess" in XnnpackBackend.__dict__
    base = XnnpackBackend.__dict__.get("copy_exported_program_for_preprocess")
    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(
        lambda cls, edge_program, compile_specs: shared_weights_copy(edge_program))
    try:
        yield
    finally:
        if had:
            XnnpackBackend.copy_exported_program_for_preprocess = base
        else:
            del XnnpackBackend.copy_exported_program_for_preprocess


# XNNPACK's passes (executorch/backends/xnnpack/_passes) that rewrite only nodes of the listed ops: a partition with
# none of them is left exactly as it was, but each pass still re-traces the partition with fake tensors and rebuilds
# its ExportedProgram. XnnpackBackend.preprocess runs all 17 passes on each of a model's partitions (about 2 per
# layer): these 8 cannot change an LLM's partitions, which hold no convolution, pooling, batch norm, upsampling,
# padding, PReLU or ReLU (what skipping them saves: benchmarks/pte_export_cost.py --lowering), and 2 more run only on a
# partition with an attention's softmax or a concatenation. A pass not listed here always runs.
XNNPACK_PASS_OPS = {
    "ConvertToUpsampleBilinear2d": ("upsample",), "FuseBatchNormPass": ("batch_norm",),
    "DecomposeBatchNorm": ("batch_norm",), "Conv1dUnsqueezePass": ("convolution",), "PReLUReshapePass": ("prelu",),
    "InsertPadQDQPass": ("constant_pad_nd",), "RemoveGetItemPass": ("max_pool",),
    "FuseActivationPass": ("relu", "hardtanh"),
    # the attention pattern it fuses (backends/xnnpack/partition/graphs/sdpa.py, torch's math SDPA) has a softmax;
    # it splits only concatenations (of quantized inputs with more inputs than XNNPACK takes)
    "ConvertToSDPAPass": ("softmax",), "DecomposeConcatenate": ("cat",),
}


def needed_passes(passes: list, op_names: set[str]) -> list:
    """passes (XNNPACK pass classes) less the ones XNNPACK_PASS_OPS says cannot change a graph of these ops."""
    return [p for p in passes if p.__name__ not in XNNPACK_PASS_OPS
            or any(w in op for w in XNNPACK_PASS_OPS[p.__name__] for op in op_names)]


@contextmanager
def _only_needed_xnnpack_passes():
    """While lowering: XnnpackBackend.preprocess runs, per partition, only the passes that can change it
    (needed_passes); the default pass list is restored after."""
    import executorch.backends.xnnpack.xnnpack_preprocess as xp

    base = xp.XNNPACKPassManager

    class Needed(base):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            if not passes:  # the default list (a compile spec's own list runs as given)
                self.passes = needed_passes(self.passes, {str(n.target) for n in exported_program.graph.nodes
                                                          if n.op == "call_function"})

    xp.XNNPACKPassManager = Needed
    try:
        yield
    finally:
        xp.XNNPACKPassManager = base


class NodeBits(Set):
    """A set of an fx graph's nodes held as the bits of one int over the graph's node order (iteration, `in`, len,
    and collections.abc.Set's operators)."""

    def __init__(self, nodes: list, index: dict, bits: int):
        self._nodes, self._index, self._bits = nodes, index, bits

    def __iter__(self):
        import numpy as np

        if not self._bits:
            return iter(())
        raw = np.frombuffer(self._bits.to_bytes((self._bits.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        return iter([self._nodes[i] for i in np.flatnonzero(np.unpackbits(raw, bitorder="little"))])

    def __contains__(self, node) -> bool:
        i = self._index.get(node)
        return i is not None and bool(self._bits >> i & 1)

    def __len__(self) -> int:
        return self._bits.bit_count()


class CompactDependencyViewer:
    """What torch.fx's and ExecuTorch's partitioners' _DependencyViewer answer (downstreams_of, upstreams_of: every
    node reachable from a node through its users / its inputs), with each node's set held as one int of N bits
    (N nodes: N^2 / 8 bytes at most) instead of a Python set of node references. The originals hold the transitive
    closure as N sets that grow with the graph's size squared, one viewer in CapabilityBasedPartitioner and one more
    (downstreams and upstreams) in ExecuTorch's GroupBasedPartitioner, which XNNPACK's partitioner builds on each
    program: SmolLM2-135M's kv-int4 .pte graph at 8k passed 4 GB there
    (benchmarks/results/pte_export_smollm2_8k_kv_int4_killed.json; the stack: XnnpackPartitioner.generate_partitions
    -> GroupBasedPartitioner.__init__ -> _DependencyViewer). The partitioners only iterate these sets or test
    membership, and every answer is a union or an any() over them, so the partitions are the same."""

    def __init__(self, graph_module):
        nodes = list(graph_module.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        down, up = [0] * len(nodes), [0] * len(nodes)
        for i in range(len(nodes) - 1, -1, -1):
            for u in nodes[i].users:
                j = index[u]
                down[i] |= down[j] | 1 << j
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                j = index[a]
                up[i] |= up[j] | 1 << j
        self._nodes, self._index, self._down, self._up = nodes, index, down, up

    def _view(self, table, node) -> NodeBits:
        i = self._index.get(node)
        return NodeBits(self._nodes, self._index, 0 if i is None else table[i])

    def downstreams_of(self, node) -> NodeBits:
        return self._view(self._down, node)

    def upstreams_of(self, node) -> NodeBits:
        return self._view(self._up, node)


@contextmanager
def compact_dependency_viewers():
    """While lowering: the partitioners' dependency viewers are CompactDependencyViewer; the originals are restored
    after."""
    import torch.fx.passes.infra.partitioner as fx_part
    from executorch.exir.backend.canonical_partitioners import group_partitioner as et_part

    base = fx_part._DependencyViewer, et_part._DependencyViewer
    fx_part._DependencyViewer = et_part._DependencyViewer = CompactDependencyViewer
    try:
        yield
    finally:
        fx_part._DependencyViewer, et_part._DependencyViewer = base


# ops that a decomposition leaves as they were: tracing their decomposition (the size, stride, ... of a tensor with
# a symbolic shape) records the same op again, so a graph holding them has nothing left for a table to decompose
_FIXED_POINTS = ("aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default",
                 "aten.sym_storage_offset.default")


def _nothing_to_decompose(ep, table) -> bool:
    """Whether no call in ep's graph is an op of table (a decomposition table) but those in _FIXED_POINTS."""
    import torch

    for n in ep.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "_op", n.target)
        if t in table and str(t) not in _FIXED_POINTS:
            return False
    return True


def _decomposed_for(eps: dict, partitioner) -> dict:
    """Each program decomposed, in one re-trace, as to_edge_transform_and_lower's first two run_decompositions leave
    it for partitioner (ExecuTorch 1.5, _gen_edge_manager_for_partitioners: the default table less the ops the
    partitioner keeps, as _remove_invalid_ops_for_not_decompose filters them). Decomposing with a table also
    functionalizes, which is all that its first call, with an empty table, does."""
    from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose
    from executorch.exir.tracer import _default_decomposition_table

    out = {}
    for name, ep in eps.items():
        keep, check = partitioner.ops_to_not_decompose(ep)
        table = _default_decomposition_table()
        for op in (_remove_invalid_ops_for_not_decompose(keep) if check is not None else keep):
            table.pop(op, None)
        out[name] = ep.run_decompositions(table)
    return out


@contextmanager
def _decompose_once():
    """While lowering: ExportedProgram.run_decompositions returns its program unchanged when that program is already
    the result of a run_decompositions here and holds no op the table would decompose (_nothing_to_decompose).

    Why: to_edge_transform_and_lower (ExecuTorch 1.5, _gen_edge_manager_for_partitioners, the path of a partitioner
    with check_op_support such as XNNPACK's) re-traces each program three times with fake tensors: run_decompositions({})
    to functionalize it, run_decompositions(the default table less the ops XNNPACK keeps), then, after swapping the kept
    ops it accepts for placeholders, run_decompositions(the default table) for the kept ops it refused. lower_pte
    makes the first two one call (_decomposed_for), and on a program that is already functional, a table none of whose
    ops is in the graph changes nothing: an empty table decomposes no operator (torch.export's run_decompositions
    docstring), and ExecuTorch skips the same call on its other path for the same reason (its "safe to skip when none
    of those targets occur in the graph"). The .pte bytes are the same (benchmarks/pte_export_cost.py --lowering
    compares their sha256 with ExecuTorch's own path)."""
    import weakref

    from torch.export import ExportedProgram

    base = ExportedProgram.run_decompositions
    done: dict[int, weakref.ref] = {}  # id -> a program that a run_decompositions here returned

    def run_decompositions(self, decomp_table=None, decompose_custom_triton_ops=False):
        ref = done.get(id(self))
        if (ref is not None and ref() is self and decomp_table is not None and not decompose_custom_triton_ops
                and _nothing_to_decompose(self, decomp_table)):
            return self
        out = base(self, decomp_table, decompose_custom_triton_ops)
        done[id(out)] = weakref.ref(out)
        return out

    ExportedProgram.run_decompositions = run_decompositions
    try:
        yield
    finally:
        ExportedProgram.run_decompositions = base


def _ancestors(node) -> set:
    """Every node that node depends on, directly or not."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def write_state_in_place(ep) -> None:
    """Every index_put whose target is a state input (the user inputs between tokens, pos and rows: trace.trace)
    -> index_put_ on that input. Refuses (AssertionError: a tracing bug, not a user error) unless each state input
    is written exactly once and every other reader of it is an ancestor of its write (an eager ring read before it
    is overwritten: edgekv.models.swaps.RingSdpaAttention): a reader the write does not depend on could run after it
    and see the written cache where the traced graph meant the old one."""
    from executorch.exir.dialects._ops import ops as exir_ops

    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    states = set(user[2:]) - {ROWS}  # tokens, pos, *state, rows (trace.trace)
    written = set()
    for node in list(ep.graph.nodes):
        if node.op != "call_function" or node.target != exir_ops.edge.aten.index_put.default:
            continue
        base = node.args[0]
        if base.op != "placeholder" or base.name not in states:
            continue
        others = [u for u in base.users if u is not node]
        assert base.name not in written and (not others or set(others) <= _ancestors(node)), \
            f"{base.name} is read or written elsewhere"
        with ep.graph.inserting_before(node):
            new = ep.graph.call_function(exir_ops.edge.aten.index_put_.default, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        ep.graph.erase_node(node)
        written.add(base.name)
    assert written == states, f"state inputs not written in place: {sorted(states - written)}"
    ep.graph_module.recompile()


def delegation_summary(edge) -> dict:
    """Per method: XNNPACK delegate calls and the ops left to portable kernels (op name -> count) in the method's
    graph and, where it has torch.cond nodes, in their branches (branch_ops: both branches' graphs together, a
    branch's XNNPACK calls under executorch_call_delegate)."""
    def count(gm):
        ops, branches = Counter(), Counter()
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            name = getattr(n.target, "__name__", str(n.target))
            ops[name.removeprefix("aten.").removesuffix(".default")] += 1
            if name == "cond":  # args: predicate, true branch, false branch, operands (get_attr of submodules)
                for b in n.args[1:3]:
                    inner, deeper = count(getattr(gm, b.target))
                    branches.update(inner)
                    branches.update(deeper)
        return ops, branches

    out = {}
    for method in edge.methods:
        ops, branches = count(edge.exported_program(method).graph_module)
        out[method] = {"delegate_calls": ops.pop("executorch_call_delegate", 0),
                       "portable_ops": dict(sorted((k, v) for k, v in ops.items() if k != "getitem"))}
        if branches:
            out[method]["branch_ops"] = dict(sorted((k, v) for k, v in branches.items() if k != "getitem"))
    return out


def _in_place_planning():
    """A MemoryPlanningPass that leaves graph inputs unplanned (the runtime uses the caller's tensors, so the
    in-place cache writes land in the caller's state) and points each view of an in-place result at its input.

    Why the second part (ExecuTorch 1.5.1): ReplaceViewCopyWithViewPass gives a view a _ViewSpec over its base
    node's spec; the planner later re-aliases an in-place op's result spec onto its mutated input, but the view keeps
    the old spec, which then gets its own arena slot: with an unplanned input the view (custom_sdpa's [Hkv, T, 1, D]
    cache) read that slot, not the caller's cache. Aliasing first makes the view share the input's (unplanned) spec,
    so it is emitted as executorch_prim::et_view, which takes the input's data pointer at run time."""
    import torch
    from executorch.exir import memory
    from executorch.exir.memory_planning import _alias_inplace_result_specs, _is_inplace_node
    from executorch.exir.passes import MemoryPlanningPass

    class InPlaceStatePlanning(MemoryPlanningPass):
        def run(self, graph_module, graph_signature=None):
            graph = graph_module.graph
            for node in graph.nodes:
                if _is_inplace_node(node):
                    _alias_inplace_result_specs(node)
                elif node.op == "call_function" and node.target == memory.view and _is_inplace_node(node.args[0]):
                    node.meta["spec"]._base = node.args[0].meta["spec"]
            out = graph.output_node()  # its spec list still holds the results' old specs: they would get slots too
            out.meta["spec"] = [a.meta["spec"] if isinstance(a, torch.fx.Node) else s
                                for a, s in zip(out.args[0], out.meta["spec"])]
            return super().run(graph_module, graph_signature)

    return InPlaceStatePlanning(alloc_graph_input=False)


def to_buffer(edge, in_place: bool = False) -> bytes:
    """in_place: a program lowered with in_place (its state inputs are written in place): inputs are not
    memory-planned, so the runtime works on the caller's state tensors (_in_place_planning)."""
    if not in_place:
        return edge.to_executorch().buffer
    from executorch.exir import ExecutorchBackendConfig

    return edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=_in_place_planning())).buffer
