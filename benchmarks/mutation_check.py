"""Does the property sweep (tests/test_property_sweep.py) catch deliberate bugs?

Each mutation below breaks stg in one place, the way a real bug would; the sweep's seeded
plans run under it and the script reports how many plans fail. A mutation that no plan
catches is a hole in the net. Run: python benchmarks/mutation_check.py
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import properties  # noqa: E402
import stg.passes  # noqa: E402
import stg.lower as lower  # noqa: E402
from stg.mesh import axis_symbol  # noqa: E402
from stg.redistribute import Collective  # noqa: E402
from test_property_sweep import SEEDS, test_random_plan_obeys_the_laws  # noqa: E402
from test_zero_traffic import CASES, test_zero_ring_traffic  # noqa: E402


@contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def expert_work_on_every_tp_rank():
    """Issue 19's MoE bug: each tp rank computes all of its tokens' expert GEMMs."""
    real = lower._ProgramBuilder.compute
    tp = axis_symbol("tp")

    def compute(self, op, label, where):
        if ".experts." in op.name and op.kind.value == "einsum":
            op = replace(op, flops=op.flops * self.ev.bindings.get(tp, 1))
        return real(self, op, label, where)
    return patched(lower._ProgramBuilder, "compute", compute)


def receive_nobody_waits_for():
    def recv(self, edge, microbatch, where):  # emitted, but consumers do not depend on it
        saved = dict(where)
        self._recv_orig(edge, microbatch, where)
        where.clear()
        where.update(saved)
    lower._ProgramBuilder._recv_orig = lower._ProgramBuilder.recv
    return patched(lower._ProgramBuilder, "recv", recv)


def all_gather_twice_as_big():
    real = lower._ProgramBuilder.collective

    def collective(self, name, members, where, extra_deps=()):
        node = real(self, name, members, where, extra_deps)
        if self.nodes[node].collective is Collective.ALL_GATHER:
            self.nodes[node] = replace(self.nodes[node], comm_bytes=2 * self.nodes[node].comm_bytes)
        return node
    return patched(lower._ProgramBuilder, "collective", collective)


def boundary_sent_at_half_size():
    """Sends and receives agree (validate cannot see it), but carry half the boundary tensor."""
    def halve(real):
        def wrapper(self, edge, microbatch, where):
            real(self, edge, microbatch, where)
            node = next(n for n in reversed(self.nodes) if n.tag == self._tag(edge, microbatch))
            self.nodes[node.id] = replace(node, comm_bytes=node.comm_bytes // 2)
            self.stats.send_bytes -= (node.comm_bytes - node.comm_bytes // 2) if real is real_send else 0
        return wrapper
    real_send, real_recv = lower._ProgramBuilder.send, lower._ProgramBuilder.recv
    stack = ExitStack()
    stack.enter_context(patched(lower._ProgramBuilder, "send", halve(real_send)))
    stack.enter_context(patched(lower._ProgramBuilder, "recv", halve(real_recv)))
    return stack


def run_all() -> dict[str, int]:
    caught = {}
    for mutation in (expert_work_on_every_tp_rank, receive_nobody_waits_for, all_gather_twice_as_big,
                     boundary_sent_at_half_size):
        failures = 0
        with mutation():
            stg.passes._CACHE.clear()
            properties._ALONE.clear()  # the single-rank references, made under this mutation
            for seed in SEEDS:
                try:
                    test_random_plan_obeys_the_laws(seed)
                except (AssertionError, Exception):
                    failures += 1
            for case in CASES:
                try:
                    test_zero_ring_traffic(*case)
                except (AssertionError, Exception):
                    failures += 1
        stg.passes._CACHE.clear()
        caught[mutation.__name__] = failures
        print(f"{mutation.__name__:28s} {failures:3d} of {len(SEEDS) + len(CASES)} plans fail", flush=True)
    return caught


if __name__ == "__main__":
    results = run_all()
    sys.exit(0 if all(results.values()) else 1)
