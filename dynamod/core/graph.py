"""The dependency DAG: start order, reverse stop order, cycles spelled out. Pure logic."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class Cycle(Exception):
    def __init__(self, cycle: Sequence[str]) -> None:
        self.cycle = list(cycle)
        super().__init__(" -> ".join(self.cycle))


def start_order(edges: Mapping[str, Sequence[str]]) -> list[str]:
    """Topological order: every node after all of its dependencies.

    `edges[a]` lists what `a` depends on. Ties keep the mapping's order, so the
    output is deterministic. Raises Cycle with the cycle's nodes, first repeated last.
    """
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        mark = state.get(node)
        if mark == 2:
            return
        if mark == 1:
            start = path.index(node)
            raise Cycle([*path[start:], node])
        state[node] = 1
        path.append(node)
        for dep in edges.get(node, ()):
            visit(dep)
        path.pop()
        state[node] = 2
        order.append(node)

    for node in edges:
        visit(node)
    return order


def stop_order(edges: Mapping[str, Sequence[str]]) -> list[str]:
    """Reverse of start order: dependents stop before what they depend on."""
    return list(reversed(start_order(edges)))


def dependents(edges: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Invert the edges: for each node, the nodes that depend on it."""
    result: dict[str, list[str]] = {node: [] for node in edges}
    for node, deps in edges.items():
        for dep in deps:
            result.setdefault(dep, []).append(node)
    return result


def levels(edges: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Group nodes into waves that can start in parallel (for display and planning)."""
    depth: dict[str, int] = {}
    for node in start_order(edges):
        depth[node] = 1 + max((depth[d] for d in edges.get(node, ())), default=-1)
    waves: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for node, d in depth.items():
        waves[d].append(node)
    return waves
