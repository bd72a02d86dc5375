"""A program's replay form (stg.program.program_replay): runs of compute nodes merged into
their first, checked against hand-counted programs and against the node-by-node form
(merged_runs, then replay_nodes) that lowering's timed flush still uses."""

import numpy as np

from stg.program import GroupHole, NodeType, TraceNode, merged_runs, program_replay, replay_nodes
from stg.redistribute import Collective

COMP, COLL = NodeType.COMP_NODE, NodeType.COMM_COLL_NODE


def _comp(n: int, deps: tuple[int, ...], duration: int) -> TraceNode:
    return TraceNode(n, f"op{n}", COMP, deps, duration_us=duration)


def _all_reduce(n: int, deps: tuple[int, ...]) -> TraceNode:
    return TraceNode(n, f"ar{n}", COLL, deps, collective=Collective.ALL_REDUCE, comm_bytes=64,
                     group=GroupHole(("dp",)))


def _form(replay) -> tuple:
    return (list(np.asarray(replay.ids)), list(np.asarray(replay.types)), list(np.asarray(replay.n_deps)),
            list(np.asarray(replay.deps)), [float(t) for t in np.asarray(replay.durations)], dict(replay.comm.items()))


def _by_nodes(nodes: list[TraceNode]) -> tuple:
    head = merged_runs([node.type is COMP for node in nodes], [node.deps for node in nodes])
    return _form(replay_nodes(nodes, head))


def test_a_chain_merges_up_to_a_node_read_twice():
    """op0 -> op1 -> op2 -> op3 on the compute stream, ar4 reading op2: op1 and op2 join op0's
    run (each the one reader of the one node it depends on); op3 does not (op2 has two
    readers), so the replay keeps op0 (lasting 1 + 2 + 3 us), op3 (4 us) and ar4 (reading the
    run that ends with op2, i.e. op0)."""
    nodes = [_comp(0, (), 1), _comp(1, (0,), 2), _comp(2, (1,), 3), _comp(3, (2,), 4), _all_reduce(4, (2,))]
    expected = ([0, 3, 4], [int(COMP), int(COMP), int(COLL)], [0, 1, 1], [0, 0], [6.0, 4.0, 0.0],
                {2: nodes[4].comm_key})
    assert _form(program_replay(nodes)) == expected == _by_nodes(nodes)


def test_two_compute_streams_merge_nothing():
    """Two chains of compute (op1 does not depend on op0): not lowering's single stream, so
    no run is merged and every node is kept with its own duration."""
    nodes = [_comp(0, (), 1), _comp(1, (), 2), _comp(2, (0,), 3), _comp(3, (1,), 4)]
    assert _form(program_replay(nodes)) == ([0, 1, 2, 3], [int(COMP)] * 4, [0, 0, 1, 1], [0, 1], [1.0, 2.0, 3.0, 4.0], {})


def test_a_repeated_dependency_counts_as_two_readers_and_is_kept_once():
    """op1 names op0 twice: one node with two dependencies, so it does not join op0's run, and
    its dependency is kept once; op2 then joins op1's run."""
    nodes = [_comp(0, (), 1), _comp(1, (0, 0), 2), _comp(2, (1,), 3)]
    expected = ([0, 1], [int(COMP)] * 2, [0, 1], [0], [1.0, 5.0], {})
    assert _form(program_replay(nodes)) == expected == _by_nodes(nodes)
