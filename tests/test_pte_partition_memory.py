"""The .pte lowering's partitioners hold each node's reachable nodes as bits, not as Python sets
(edgekv.export.to_pte.CompactDependencyViewer): torch.fx's and ExecuTorch's _DependencyViewer keep the transitive
closure of the graph as one set per node, memory that grows with the node count squared (three of them per
XNNPACK partitioning), which stopped SmolLM2's kv-int4 .pte export at 8k above 4 GB
(benchmarks/results/pte_export_smollm2_8k_kv_int4_killed.json). The answers are checked against a breadth-first
search written here and against torch's own viewer; the memory against hand arithmetic."""
import operator
import random
import tracemalloc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("executorch")

import torch.fx as fx  # noqa: E402
from torch.fx.passes.infra.partitioner import _DependencyViewer as TorchViewer  # noqa: E402

from edgekv.export import to_pte  # noqa: E402


def dag(n: int, seed: int = 0, fan: int = 3) -> fx.GraphModule:
    """n nodes: 2 placeholders, then adds of up to `fan` earlier nodes each, and the output of the last."""
    rng, g = random.Random(seed), fx.Graph()
    nodes = [g.placeholder("a"), g.placeholder("b")]
    for _ in range(n - 3):
        args = rng.sample(nodes[-40:], min(len(nodes[-40:]), rng.randint(1, fan)))
        x = args[0]
        for y in args[1:]:
            x = g.call_function(operator.add, (x, y))
            nodes.append(x)
        if len(args) == 1:
            nodes.append(g.call_function(operator.neg, (x,)))
    g.output(nodes[-1])
    return fx.GraphModule(torch.nn.Module(), g)


def reach(node, step) -> set:
    seen, todo = set(), list(step(node))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def test_downstreams_and_upstreams_are_what_a_search_of_the_graph_finds():
    gm = dag(300)
    v, ref = to_pte.CompactDependencyViewer(gm), TorchViewer(gm)
    for node in gm.graph.nodes:
        down = reach(node, lambda n: n.users)
        assert set(v.downstreams_of(node)) == down == ref.downstreams_of(node)
        assert len(v.downstreams_of(node)) == len(down)
        assert set(v.upstreams_of(node)) == reach(node, lambda n: n.all_input_nodes)
    first, last = list(gm.graph.nodes)[0], list(gm.graph.nodes)[-1]
    assert last in v.downstreams_of(first) and first not in v.downstreams_of(last)
    assert not v.downstreams_of(object())  # a node of another graph: nothing, as the originals' defaultdict


def test_a_long_graph_partitions_in_memory_linear_in_its_size_squared_bits():
    """A chain of 1500 nodes: every node reaches all after it, 1500 x 1499 / 2 = 1.12 M pairs, once in torch's
    viewer and twice in ExecuTorch's (it holds the upstreams too), both built by a GroupBasedPartitioner: 3.4 M
    references in sets, over 8 bytes each (> 27 MB; the originals take some 160 MB here). As bits: 3 tables of 1500
    ints of 750 bits on average, 0.42 MB."""
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
    from torch.fx.passes.operator_support import OperatorSupportBase

    g = fx.Graph()
    x = g.placeholder("x")
    for _ in range(1498):
        x = g.call_function(operator.neg, (x,))
    g.output(x)
    gm = fx.GraphModule(torch.nn.Module(), g)

    class Every(OperatorSupportBase):
        def is_node_supported(self, submodules, node) -> bool:
            return True

    tracemalloc.start()
    try:
        with to_pte.compact_dependency_viewers():
            p = GroupBasedPartitioner(gm, Every())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(p.dependency_viewer.downstreams_of(list(gm.graph.nodes)[0])) == 1499
    assert peak < 4e6, peak


def test_lower_pte_partitions_with_the_compact_viewers(monkeypatch):
    import executorch.exir as exir
    import torch.fx.passes.infra.partitioner as fx_part
    from executorch.exir.backend.canonical_partitioners import group_partitioner as et_part

    seen = []
    monkeypatch.setattr(exir, "to_edge_transform_and_lower",
                        lambda *a, **k: seen.append((fx_part._DependencyViewer, et_part._DependencyViewer)))
    to_pte.lower_pte({}, decompose_once=False)
    assert seen == [(to_pte.CompactDependencyViewer, to_pte.CompactDependencyViewer)]
    assert fx_part._DependencyViewer is TorchViewer  # restored after
