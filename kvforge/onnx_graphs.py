"""Walking an export's ONNX graph: the in-place layout puts nodes in If branches (the decode
span's, MLA's absorbed-or-decompressed), so whatever reads an export's nodes walks every
subgraph. Works on the protobuf objects; imports nothing."""
from __future__ import annotations


def subgraphs(graph):
    """The graph and every graph nested in its nodes' attributes (If branches, Loop bodies), depth first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from subgraphs(sub)


def all_nodes(graph):
    """Every node of the graph and of its subgraphs."""
    for sub in subgraphs(graph):
        yield from sub.node
