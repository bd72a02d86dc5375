"""Strategies only assign layouts; the collectives must fall out of the shared rule table."""

import sympy

from model_zoo import load_model
from parallelism import sharding_spec
from stg.autodiff import training_graph
from stg.graph import OpKind, Phase
from stg.plan import Plan
from stg.redistribute import Collective
from stg.sharding import shard


def collectives(sharded):
    return [op for op in sharded.graph.ops if op.kind is OpKind.COLLECTIVE]


def test_data_parallel_all_reduces_every_weight_gradient_once_per_step(tiny_gpt):
    model = load_model(tiny_gpt)
    sharded = shard(training_graph(model.graph), sharding_spec(Plan(dp=4)))
    colls = collectives(sharded)
    assert all(op.phase is Phase.STEP for op in colls)
    assert all(op.attrs["collective"] is Collective.ALL_REDUCE and op.attrs["axes"] == ("dp",) for op in colls)
    assert len(colls) == len(model.graph.weights)
    # each carries its whole (bf16) gradient: together, the model's gradient bytes
    assert sympy.expand(sum(op.bytes for op in colls) - 2 * model.graph.parameter_count()) == 0


def test_batch_is_split_and_weights_replicated(tiny_llama):
    sharded = shard(training_graph(load_model(tiny_llama).graph), sharding_spec(Plan(dp=2)))
    assert sharded.describe("tokens") == "B@dp"
    assert sharded.describe("layers.0.mlp.up") == "B@dp"
    assert sharded.describe("layers.0.mlp.up.weight") == "R"
    assert sharded.describe("layers.0.mlp.up.weight.grad") == "P(dp)"
    dp = sympy.Symbol("dp", positive=True, integer=True)
    assert str(sharded.graph.tensors["layers.0.mlp.up"].shape[0]) == str(sympy.Symbol("B", positive=True) / dp)


def test_plan_rules_override_the_strategies(tiny_llama):
    """rules: {mlp: null} keeps the MLP whole under tp (only attention is split); the MLP
    then needs no tensor-parallel collectives of its own."""
    from stg import build

    default = build(tiny_llama, Plan(tp=2, sp=False, seq=32)).sharded
    custom = build(tiny_llama, Plan(tp=2, sp=False, seq=32, rules={"mlp": None})).sharded
    assert default.describe("layers.1.mlp.up.weight") == "F@tp"
    assert custom.describe("layers.1.mlp.up.weight") == "R"
    assert custom.describe("layers.1.attn.q.weight") == "Akv@tp"
    count = lambda s: sum(op.kind is OpKind.COLLECTIVE and op.layer == 2 and op.phase is not Phase.STEP for op in s.graph.ops)
    assert count(default) == 4 and count(custom) == 2  # only the attention block's all-reduces remain


def test_plan_rules_name_known_mesh_axes():
    import pytest

    from stg.errors import PlanError

    with pytest.raises(PlanError, match="rules: mlp: unknown mesh axes"):
        Plan(tp=2, rules={"mlp": "xp"})
