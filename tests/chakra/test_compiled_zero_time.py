"""The compiled zero-time run (stg/chakra/replay_kernel.py, CompiledReplay.completes) that
validate runs first on big sets, on every strategy's set. tests/chakra/test_validate.py runs
each of its hand-made sets, deadlocks too, both ways and checks the verdicts agree."""

import pytest

from stg.api import build
from stg.chakra.replay import Replay
from stg.chakra.replay_kernel import CompiledReplay
from stg.slice_check import rank_graphs
from test_digests import PLANS, model_of


@pytest.mark.parametrize("name", sorted(PLANS))
def test_it_completes_every_strategys_set_as_replay_does(name, tmp_path):
    """Every rank of each set of the digest matrix (dp, tp, cp, every pipeline schedule, ZeRO,
    ep, DLRM, a described model, an HF config): Replay finds no deadlock, and neither does
    the compiled run."""
    workload = build(model_of(name, tmp_path), {"seq": 32, **PLANS[name][1]})
    graphs, members = rank_graphs(workload, list(range(workload.mesh.size)))
    assert Replay(graphs, members).run() == []
    assert CompiledReplay(graphs, members, []).completes()
