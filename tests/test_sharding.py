"""Strategies only assign layouts; the collectives must fall out of the shared rule table."""

from collections import Counter

import pytest
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


def _equal(a, b) -> bool:
    return (a.graph.ops == b.graph.ops and list(a.graph.tensors.items()) == list(b.graph.tensors.items())
            and list(a.layouts.items()) == list(b.layouts.items())
            and list(a.global_tensors.items()) == list(b.global_tensors.items()))


def _digest_plans():
    from test_digests import PLANS

    return sorted(PLANS)


@pytest.mark.parametrize("name", _digest_plans())
def test_a_replayed_block_is_the_block_made_afresh(name, monkeypatch, tmp_path):
    """Autodiff and sharding replay a block's work under the next block's names when their
    signatures match (stg/blocks.py). Over every strategy of the digest matrix, with 8 blocks
    so that blocks repeat, each pass's graph is the one that running every op gives: the
    same ops in the same order, names, local and global shapes, layouts; and it passes
    Graph.verify (shard() itself no longer walks its result to verify it)."""
    import stg.api
    import stg.passes
    from stg.autodiff import _Backward
    from stg.sharding import _Sharder
    from test_digests import PLANS, model_of

    model = model_of(name, tmp_path)
    resized = isinstance(model, dict) and "layers" in model
    if resized:
        model = {**model, "layers": 8}
    replayed, compared, split = Counter(), [], []

    def counting(cls):
        replay = cls.replay

        def counted(self, *args):
            done = replay(self, *args)
            replayed[cls] += done
            return done
        monkeypatch.setattr(cls, "replay", counted)

    def both_trained(*args, **kwargs):
        templated = training_graph(*args, **kwargs)
        fresh = training_graph(*args, **kwargs, templates=False)
        assert templated.ops == fresh.ops and list(templated.tensors.items()) == list(fresh.tensors.items())
        compared.append("autodiff")
        return templated

    def both_sharded(graph, spec):
        templated = shard(graph, spec)
        assert _equal(templated, shard(graph, spec, templates=False))
        templated.graph.verify()
        compared.append("shard")
        split.extend(spec.mesh_axes)
        return templated

    counting(_Sharder)
    counting(_Backward)
    monkeypatch.setattr(stg.passes, "training_graph", both_trained)
    monkeypatch.setattr(stg.passes, "shard", both_sharded)
    monkeypatch.setattr(stg.passes, "_CACHE", {})
    monkeypatch.setattr(stg.passes, "_TRAINING", {})
    monkeypatch.setattr(stg.passes, "_RECOMPUTED", {})  # a new graph: no earlier sharding of it to resume
    monkeypatch.setattr(stg.passes, "_UNTIED", {})
    stg.api.build(model, {"seq": 32, **PLANS[name][1]}, nodes=False)
    assert set(compared) == {"autodiff", "shard"}
    if resized:  # blocks 2..7 repeat (the first and last differ: embedding, head)
        assert replayed[_Backward] >= 4
        assert replayed[_Sharder] >= 4 or not split  # (pp alone splits no tensor: nothing to shard)
    elif not name.startswith("dlrm"):  # a recommendation model has no repeated blocks
        assert sum(replayed.values()) >= 1


def test_a_sharding_resumed_from_another_plans_is_the_sharding_made_afresh(tiny_llama):
    """Plans that differ only in their ZeRO stage share the sharding of their first blocks
    (_Sharder.resume): ZeRO-1 shards the forward and backward as ZeRO-0 does (only the
    optimizer states are laid out otherwise), ZeRO-2 the forward (its gradients are anchored
    to shards), ZeRO-3 nothing (its weights are sharded). Each resumed graph is the one a
    sharding of its own gives: ops, tensors, layouts, origins, in order."""
    from stg.sharding import _DONATED, _block_bodies, _Sharder

    graph = training_graph(load_model(tiny_llama).graph)
    specs = [sharding_spec(Plan(dp=2, tp=2, zero=zero), frozenset({"tp"})) for zero in range(4)]
    resumed, made = [], []
    for spec in specs:
        sharder = _Sharder(graph, spec)
        made.append(sharder.run())
        resumed.append(sharder.resumed)
    # a block is a run of one layer's ops: the head's forward and backward are one block
    phases = [{op.phase for op in ops} for ops, _, _, _ in _block_bodies(graph)]
    first = lambda kept: next(n for n, block in enumerate(phases) if not block <= kept)  # noqa: E731
    assert resumed == [0, first({Phase.FORWARD, Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT}), first({Phase.FORWARD}), 0]
    assert 0 < resumed[2] < resumed[1] < len(phases)
    for spec, sharded in zip(specs, made):
        _DONATED.clear()
        fresh = shard(graph, spec)
        assert _equal(sharded, fresh) and list(sharded.origins.items()) == list(fresh.origins.items())
        assert _equal(sharded, shard(graph, spec, templates=False))


def test_a_recomputation_resumes_the_sharding_of_its_forward(tiny_llama):
    """A graph with full recomputation keeps the forward's ops (stg/recompute.py copies them
    before the backward): its sharding takes the forward blocks of the graph without
    recomputation sharded by the same spec, and is the sharding it would make itself."""
    from stg.plan import Recompute
    from stg.recompute import recompute
    from stg.sharding import _DONATED, _block_bodies, _Sharder

    model = load_model(tiny_llama)
    graph = training_graph(model.graph)
    rerun = recompute(graph, Recompute.FULL, last_block=model.config.layers)
    spec = sharding_spec(Plan(dp=2, tp=2), frozenset({"tp"}))
    _Sharder(graph, spec).run()
    sharder = _Sharder(rerun, spec)
    sharded = sharder.run()
    # up to the first block with a re-run op: the last block's (the head's forward and backward are
    # one block, which nothing re-runs)
    blocks = [ops for ops, _, _, _ in _block_bodies(rerun)]
    assert sharder.resumed == next(n for n, ops in enumerate(blocks) if any(op.name.endswith(".recompute") for op in ops))
    assert {op.phase for ops in blocks[:sharder.resumed - 1] for op in ops} == {Phase.FORWARD}
    _DONATED.clear()
    fresh = shard(rerun, spec)
    assert _equal(sharded, fresh) and list(sharded.origins.items()) == list(fresh.origins.items())
