"""DESIGN.md's rule table, and comm sizes in ASTRA-sim's convention (bytes each rank puts in),
measured by the rule production uses (stg/costs.py's op_cost of the inserted COLLECTIVE)."""

import pytest
import sympy

from stg.costs import op_cost
from stg.errors import LayoutError
from stg.graph import DType, OpKind, Role, Tensor
from stg.mesh import Layout, Partial, Shard
from stg.redistribute import Collective, plan_redistribution

B, S, H = sympy.symbols("B S H", positive=True, integer=True)
tp, dp = sympy.symbols("tp dp", positive=True, integer=True)
SHAPE = (B, S, H)
ORDER = ("dp", "tp")


def L(**placements):
    return Layout.of(placements, ORDER)


def comm_elements(step):
    """comm_size of the collective the sharding pass inserts for `step`, in bf16 elements."""
    local = Tensor("x", step.before, ("batch", "seq", "embed"), DType.BF16, Role.ACTIVATION)
    out = Tensor("y", step.after, ("batch", "seq", "embed"), DType.BF16, Role.ACTIVATION)
    _, nbytes = op_cost(OpKind.COLLECTIVE, {"collective": step.collective}, [local], [out])
    return nbytes / 2


@pytest.mark.parametrize(
    "src, dst, collective, elements",
    [
        (L(tp=Partial()), L(), Collective.ALL_REDUCE, B * S * H),  # full buffer
        (L(tp=Partial()), L(tp=Shard(1)), Collective.REDUCE_SCATTER, B * S * H),  # full input
        (L(tp=Shard(1)), L(), Collective.ALL_GATHER, B * S * H / tp),  # the shard
        (L(tp=Shard(1)), L(tp=Shard(2)), Collective.ALL_TO_ALL, B * S * H / tp),  # full local input
        (L(), L(tp=Shard(1)), None, B * S * H),  # a local slice
    ],
)
def test_rule_table(src, dst, collective, elements):
    (step,) = plan_redistribution("x", SHAPE, src, dst, ORDER)
    assert step.collective is collective
    assert step.axes == ("tp",)
    assert sympy.simplify(comm_elements(step) - elements) == 0
    assert step.layout == dst


def test_axes_needing_the_same_collective_go_together():
    (step,) = plan_redistribution("g", SHAPE, L(dp=Partial(), tp=Partial()), L(), ORDER)
    assert step.collective is Collective.ALL_REDUCE and step.axes == ("dp", "tp")


def test_reduce_before_gather():
    steps = plan_redistribution("x", SHAPE, L(dp=Shard(0), tp=Partial()), L(), ORDER)
    assert [s.collective for s in steps] == [Collective.ALL_REDUCE, Collective.ALL_GATHER]
    # the all-reduce runs on the dp-sharded tensor, the gather then contributes that shard
    assert sympy.simplify(comm_elements(steps[0]) - B * S * H / dp) == 0
    assert sympy.simplify(comm_elements(steps[1]) - B * S * H / dp) == 0


def test_impossible_redistribution_is_a_layout_error():
    with pytest.raises(LayoutError, match="cannot turn R into P on mesh axis tp"):
        plan_redistribution("x", SHAPE, L(), L(tp=Partial()), ORDER)
