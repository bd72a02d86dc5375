"""Reading collectives and FLOPs off a built workload, per block and phase."""

from collections import Counter

from stg.graph import OpKind
from stg.lower import Evaluator


def block_collectives(workload, layer: int) -> Counter:
    """(phase letter, collective name, comm bytes) -> count, for one block's ops."""
    evaluate = Evaluator(workload.bindings)
    found = Counter()
    for op in workload.sharded.graph.ops:
        if op.kind is OpKind.COLLECTIVE and op.layer == layer:
            found[(op.phase.value, op.attrs["collective"].name, evaluate(op.bytes))] += 1
    return found


def op_flops(workload) -> Counter:
    """FLOPs per op of one rank (micro-batches and re-runs summed under the op's name)."""
    flops = Counter()
    for node in workload.programs[0].nodes:
        if node.type.name == "COMP_NODE":
            flops[node.name.split(" ", 1)[1]] += node.flops
    return flops



def longest_path_finish(graphs, groups, durations, cost) -> list[float]:
    """Each rank's last completion when every node starts as soon as its inputs are done:
    the longest path through the slice's nodes (a max-plus schedule), no resource held --
    an independent reference for the timed replay, which runs one COMP and one COLL/SEND at
    a time per rank and lowest id first, and so equals this only where lowering's chains
    order each resource completely. Matching is Chakra's: the k-th collective of a rank on
    a group joins the k-th of every member and ends its cost after the last member is
    ready; the n-th SEND of a (src, dst, tag, size) key in its rank's node order feeds the
    n-th RECV of that key, which ends when it is ready and the message has arrived."""
    from collections import defaultdict, deque

    from stg.chakra.rank_graph import COLL, COMP, RECV

    bound = cost.bind(groups)
    instance, members = {}, defaultdict(list)  # collective node -> (group, k); (group, k) -> nodes
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, g in enumerate(graphs):
        issued = defaultdict(int)
        for i in sorted(g.comm):
            key = g.comm[i]
            if g.types[i] == COLL:
                instance[r, i] = (key[0], issued[key[0]])
                members[instance[r, i]].append((r, i))
                issued[key[0]] += 1
            else:
                (recvs if g.types[i] == RECV else sends)[key].append((r, i))
    message = {recv: send for key in recvs for recv, send in zip(recvs[key], sends[key])}
    receivers = {send: recv for recv, send in message.items()}
    waits = {(r, i): g.n_parents[i] + ((r, i) in message) for r, g in enumerate(graphs) for i in range(len(g.ids))}
    ready, finish, joined = defaultdict(float), {}, defaultdict(list)
    queue = deque(node for node, n in waits.items() if not n)

    def release(node, at):
        ready[node] = max(ready[node], at)
        waits[node] -= 1
        if not waits[node]:
            queue.append(node)

    def settle(node, at):
        r, i = node
        g = graphs[r]
        finish[node] = at
        for child in g.children[g.child_start[i]:g.child_start[i + 1]]:
            release((r, child), at)
        if node in receivers:  # the message arrives when the SEND ends
            release(receivers[node], at)

    while queue:
        node = queue.popleft()
        r, i = node
        kind, key = graphs[r].types[i], graphs[r].comm.get(i)
        if kind == COMP:
            settle(node, ready[node] + durations[r][i])
        elif kind == RECV:
            settle(node, ready[node])
        elif kind == COLL:
            ready_members = joined[instance[node]]
            ready_members.append(node)
            if len(ready_members) == len(members[instance[node]]):
                end = max(ready[m] for m in ready_members) + bound.collective_us(key[1], key[2], key[0])
                for m in ready_members:
                    settle(m, end)
        else:
            settle(node, ready[node] + bound.send_us(key[0], key[1], key[3]))
    assert len(finish) == len(waits), "the slice does not complete"
    return [max((finish[r, i] for i in range(len(g.ids))), default=0.0) for r, g in enumerate(graphs)]
