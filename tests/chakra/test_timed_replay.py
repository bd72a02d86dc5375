"""timed_replay() on small hand-made trace sets whose timings can be worked out on paper."""

import json
from array import array

import pytest

from stg.chakra import et_def_pb2 as pb
from chakra_nodes import coll as shared_coll
from chakra_nodes import one_f_one_b_order, recv, send
from stg.chakra.reader import write_trace
from stg.chakra import load as load_module
from stg.chakra.validate import ReplayError, Timing, timed_replay, validate

AR, AG, RS, A2A = pb.ALL_REDUCE, pb.ALL_GATHER, pb.REDUCE_SCATTER, pb.ALL_TO_ALL
GB = 10**9


def _a(name, **value):
    return pb.AttributeProto(name=name, **value)


def comp(nid, us, deps=()):
    return pb.Node(id=nid, name=f"comp{nid}", type=pb.COMP_NODE, data_deps=list(deps), duration_micros=us,
                   attr=[_a("is_cpu_op", bool_val=False), _a("num_ops", int64_val=1000),
                         _a("tensor_size", uint64_val=64)])


def coll(nid, ctype, size, pg="", deps=()):
    return shared_coll(nid, ctype, size, pg, deps)


def write_set(out, ranks, groups=None):
    out.mkdir()
    (out / "workload.json").write_text(json.dumps(groups or {}))
    for rank, nodes in ranks.items():
        write_trace(out / f"workload.{rank}.et", pb.GlobalMetadata(version="0.0.4"), nodes)
    return out


def chain(durations):
    return [comp(i, us, deps=[i - 1] if i else []) for i, us in enumerate(durations)]


def test_two_compute_chains(tmp_path):
    timing = timed_replay(write_set(tmp_path / "out", {0: chain([10, 20, 30]), 1: chain([5, 5])}))
    assert timing == Timing(makespan_us=60, busy_us=[60, 10], idle_us=[0, 50], finish_us=[60, 10])
    assert timing.to_dict() == {"makespan_us": 60, "busy_us": [60, 10], "idle_us": [0, 50], "finish_us": [60, 10]}
    assert str(timing).splitlines()[:2] == ["makespan 60 us", "rank 0: busy 60 idle 0 (0.0%) finish 60"]


def test_compute_overlaps_an_independent_collective(tmp_path):
    # COMP and ALL_REDUCE need different units, so they run side by side (B.5: 100 000 cycles)
    ranks = {r: [comp(0, 100), coll(1, AR, GB)] for r in range(2)}
    timing = timed_replay(write_set(tmp_path / "out", ranks))
    assert timing.makespan_us == 100 and timing.finish_us == [100, 100] and timing.idle_us == [0, 0]
    # under alpha-beta the collective (20 005 us) is exposed; after a data dep it follows the COMP
    assert timed_replay(tmp_path / "out", comm="alpha-beta").makespan_us == pytest.approx(20_005)
    ranks = {r: [comp(0, 100), coll(1, AR, GB, deps=[0])] for r in range(2)}
    assert timed_replay(write_set(tmp_path / "dep", ranks), comm="alpha-beta").makespan_us == pytest.approx(20_105)


def one_f_one_b(p, m, f_us, b_us):
    """A p-stage pipeline, one rank a stage, in 1F1B order, with sends and receives between stages.

    Stage s runs min(p - s - 1, m) forwards, then alternates forward/backward, then drains the
    backwards. A forward (backward) on a non-first (non-last) stage starts with a RECV of its
    activation (gradient) and every stage but the edge one SENDs its result on. Ids follow the
    program order; RECVs depend on nothing (they occupy no unit), everything else on its predecessor.
    """
    ranks = {}
    for s in range(p):
        nodes, last = [], []
        for kind, k in one_f_one_b_order(p, s, m):
            fwd = kind == "F"
            src, dst = (s - 1, s + 1) if fwd else (s + 1, s - 1)
            tag = 2 * k + (not fwd)
            deps = list(last)
            if 0 <= src < p:
                nodes.append(recv(len(nodes), src, s, tag))
                deps.append(nodes[-1].id)
            nodes.append(comp(len(nodes), f_us if fwd else b_us, deps=deps))
            last = [nodes[-1].id]
            if 0 <= dst < p:
                nodes.append(send(len(nodes), s, dst, tag, deps=last))
        ranks[s] = nodes
    return ranks


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (3, 3), (4, 8)])
def test_1f1b_pipeline_matches_the_bubble_formula(tmp_path, p, m):
    f_us, b_us = 1, 2
    timing = timed_replay(write_set(tmp_path / "out", one_f_one_b(p, m, f_us, b_us)))
    makespan = (m + p - 1) * (f_us + b_us)  # the 1F1B step time with equal stages
    assert timing.makespan_us == makespan
    assert timing.busy_us == [m * (f_us + b_us)] * p
    assert timing.idle_us == [(p - 1) * (f_us + b_us)] * p  # the bubble
    assert timing.finish_us[0] == makespan


@pytest.mark.parametrize("ctype, factor", [(AR, 2 * 3 / 4), (RS, 3 / 4), (AG, 3), (A2A, 3 / 4)])
def test_alpha_beta_collective_on_four_ranks(tmp_path, ctype, factor):
    out = write_set(tmp_path / "out", {r: [coll(0, ctype, GB)] for r in range(4)})
    timing = timed_replay(out, comm="alpha-beta", alpha_us=5, bandwidth_gbps=50)
    assert timing.makespan_us == pytest.approx(5 + factor * 1e9 / 50e9 * 1e6)
    assert timed_replay(out).makespan_us == 0


def test_alpha_beta_all_reduce_of_1_gb(tmp_path):
    out = write_set(tmp_path / "out", {r: [coll(0, AR, GB, pg="1")] for r in range(2)}, {"1": [0, 1]})
    timing = timed_replay(out, comm="alpha-beta", alpha_us=5, bandwidth_gbps=50)
    assert timing.makespan_us == pytest.approx(5 + 2 * (1 / 2) * 1e9 / 50e9 * 1e6)
    assert timing.busy_us == [0, 0] and timing.idle_us == [timing.makespan_us] * 2


def test_alpha_beta_send_delays_the_recv(tmp_path):
    ranks = {0: [send(0, 0, 1, tag=1, size=10**6)], 1: [recv(0, 0, 1, tag=1, size=10**6), comp(1, 10, deps=[0])]}
    timing = timed_replay(write_set(tmp_path / "out", ranks), comm="alpha-beta")
    assert timing.finish_us == pytest.approx([25, 35])  # 5 + 1e6 B / 50 GB/s = 25 us, then 10 us


def test_a_send_waits_for_the_collective_holding_the_comm_slot(tmp_path):
    # rank 0's ALL_REDUCE holds the slot until rank 1 joins at t=50; only then can its SEND go
    ranks = {0: [coll(0, AR, 64), send(1, 0, 1, tag=1), comp(2, 10, deps=[0, 1])],
             1: [comp(0, 50), coll(1, AR, 64, deps=[0]), recv(2, 0, 1, tag=1), comp(3, 0, deps=[1, 2])]}
    assert timed_replay(write_set(tmp_path / "out", ranks)).finish_us == [60, 50]


@pytest.mark.parametrize("after, receiver_done", [(1, 25), (0, 15)])
def test_ready_compute_is_issued_in_ascending_id(tmp_path, after, receiver_done):
    # two independent 10 us COMPs: node 0 runs first, so a SEND after node 0 goes at 10, after node 1 at 20
    ranks = {0: [comp(0, 10), comp(1, 10), send(2, 0, 1, tag=1, deps=[after])],
             1: [recv(0, 0, 1, tag=1), comp(1, 5, deps=[0])]}
    assert timed_replay(write_set(tmp_path / "out", ranks)).finish_us == [20, receiver_done]


def test_deadlock_raises_with_the_stuck_ranks(tmp_path):
    ranks = {0: [recv(0, 1, 0, tag=1), send(1, 0, 1, tag=2, deps=[0])],
             1: [recv(0, 0, 1, tag=2), send(1, 1, 0, tag=1, deps=[0])]}
    with pytest.raises(ReplayError) as caught:
        timed_replay(write_set(tmp_path / "out", ranks))
    assert str(caught.value).splitlines()[:2] == [
        "the timed replay deadlocks:", "  replay deadlocks: 2 of 2 ranks stuck, 4 nodes never run"]
    assert [(p.rank, p.node) for p in caught.value.problems] == [(None, None), (0, 0), (1, 0)]


def test_an_invalid_set_is_refused(tmp_path):
    out = write_set(tmp_path / "out", {0: [recv(0, 1, 0, tag=1), comp(1, 5, deps=[0])], 1: chain([1])})
    with pytest.raises(ReplayError, match="has 1 problem; fix them before a timed replay") as caught:
        timed_replay(out)
    assert "has no matching SEND" in caught.value.problems[0].reason


@pytest.mark.parametrize("options, message", [
    ({"comm": "ideal"}, "comm must be one of"),
    ({"alpha_us": -1}, "alpha_us must be >= 0"),
    ({"bandwidth_gbps": 0}, "bandwidth_gbps must be > 0"),
])
def test_bad_options(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        timed_replay(tmp_path, **options)


def test_a_deadlock_that_only_time_reveals(tmp_path):
    # Rank 0's SEND (id 1) outranks its ALL_REDUCE (id 2) but becomes ready only when the 10 us COMP
    # ends; by then the ALL_REDUCE, ready at t=0, holds the comm slot waiting for rank 1, which
    # waits for the SEND. The zero-time replay runs the COMP instantly and misses it.
    ranks = {0: [comp(0, 10), send(1, 0, 1, tag=1, deps=[0]), coll(2, AR, 64, pg="1")],
             1: [recv(0, 0, 1, tag=1), coll(1, AR, 64, pg="1", deps=[0])]}
    out = write_set(tmp_path / "out", ranks, {"1": [0, 1]})
    assert validate(out) == []
    with pytest.raises(ReplayError) as caught:
        timed_replay(out)
    assert [str(p) for p in caught.value.problems[1:]] == [
        "rank 0, node 2: blocked in collective #1 on group 1 (ALL_REDUCE of 64 B); ranks [1] have not issued "
        "it; node 1 (COMM_SEND_NODE) waits for the comm slot (2 of 3 nodes unfinished)",
        "rank 1, node 0: waits in RECV from rank 0 (tag 1, 256 B), which was never sent; rank 0 is stuck too "
        "(2 of 2 nodes unfinished)",
    ]


def test_parallel_load_gives_the_same_timing(tmp_path, monkeypatch):
    out = write_set(tmp_path / "out", one_f_one_b(2, 3, 1, 2))
    sequential = timed_replay(out, comm="alpha-beta")
    monkeypatch.setattr(load_module, "PARALLEL_LOAD_BYTES", 0)
    monkeypatch.setattr(load_module, "_cpu_count", lambda: 2)
    assert timed_replay(out, comm="alpha-beta") == sequential


def test_the_compiled_loop_gives_the_replays_numbers_and_none_when_it_hangs(tmp_path):
    """TimedReplay's loop compiled (stg/chakra/replay_kernel.py, what explore runs): on a 1F1B
    set both give the same floats, free and under alpha-beta; on a set that hangs the compiled
    run returns None (TimedReplay then says why)."""
    from stg.chakra.replay import CommCost, CommModel, TimedReplay
    from stg.chakra.validate import load_set
    from stg.chakra.replay_kernel import CompiledReplay

    for name, ranks, groups in [("1f1b", one_f_one_b(2, 3, 1, 2), None),
                                ("hang", {0: [comp(0, 10), send(1, 0, 1, tag=1, deps=[0]), coll(2, AR, 64, pg="1")],
                                          1: [recv(0, 0, 1, tag=1), coll(1, AR, 64, pg="1", deps=[0])]}, {"1": [0, 1]})]:
        loaded = load_set(write_set(tmp_path / name, ranks, groups), durations=True)
        compiled = CompiledReplay(loaded.graphs, loaded.groups, loaded.durations)
        for cost in (CommCost(), CommCost(CommModel.ALPHA_BETA)):
            if name == "hang":
                assert compiled.run(cost) is None
            else:
                assert compiled.run(cost) == TimedReplay(loaded.graphs, loaded.groups, loaded.durations, cost).run()


def _replay_nodes(nodes):
    """ReplayNodes of (type, duration, deps, comm key) tuples, ids 0..n-1 (comm keys as the
    replay numbers ranks and groups)."""
    from stg.program import CommNodes, ReplayNodes

    return ReplayNodes(list(range(len(nodes))), [t for t, *_ in nodes], [len(d) for _, _, d, _ in nodes],
                       [x for _, _, d, _ in nodes for x in d], [us for _, us, *_ in nodes],
                       CommNodes.of({i: key for i, (_, _, _, key) in enumerate(nodes) if key is not None}))


@pytest.mark.parametrize("case", ["pipeline", "joined collective", "out of order", "hang", "two compute streams",
                                  "two sends at once"])
def test_the_longest_path_sweep_gives_the_replays_numbers_or_none(case):
    """The sweep explore runs first (stg/chakra/longest_paths.py): where every rank's nodes can
    end in their order without waiting for the rank's compute or comm slot -- two stages
    passing a micro-batch forward and back, a collective both join at different times -- it
    gives TimedReplay's floats, free and under alpha-beta. Where the event queue must run a
    rank's later node first (rank 0 sends before its earlier RECV's message, which waits on
    that send, comes in), nothing can run (each RECV's message is sent after the other), or a
    node would wait for its rank's compute (two COMP nodes ready at once) or comm slot (two
    SENDs ready at once), it returns None: the caller replays with the event queue."""
    from stg.chakra.load import build_graph
    from stg.chakra.longest_paths import SlicePaths
    from stg.chakra.replay import CommCost, CommModel, TimedReplay

    C, S, R, L = pb.COMP_NODE, pb.COMM_SEND_NODE, pb.COMM_RECV_NODE, pb.COMM_COLL_NODE
    groups = {}
    if case == "pipeline":  # stage 0: F, send; recv grad, B. stage 1: recv, F, B, send grad
        ranks = [[(C, 10.0, [], None), (S, 0, [0], (0, 1, 1, GB)), (R, 0, [], (1, 0, 2, GB)), (C, 20.0, [0, 2], None)],
                 [(R, 0, [], (0, 1, 1, GB)), (C, 15.0, [0], None), (C, 30.0, [1], None), (S, 0, [2], (1, 0, 2, GB))]]
    elif case == "joined collective":
        groups = {7: (0, 1)}
        # rank 0 is swept first but joins later (40 us against 10): the collective ends a slot after
        # the later join, not after the last one swept
        ranks = [[(C, 40.0, [], None), (L, 0, [0], (7, AR, GB)), (C, 5.0, [0, 1], None)],
                 [(C, 10.0, [], None), (L, 0, [0], (7, AR, GB)), (C, 1.0, [1], None)]]
    elif case == "out of order":
        ranks = [[(R, 0, [], (1, 0, 1, GB)), (S, 0, [], (0, 1, 2, GB))],
                 [(R, 0, [], (0, 1, 2, GB)), (S, 0, [0], (1, 0, 1, GB))]]
    elif case == "hang":
        ranks = [[(R, 0, [], (1, 0, 1, GB)), (S, 0, [0], (0, 1, 2, GB))],
                 [(R, 0, [], (0, 1, 2, GB)), (S, 0, [0], (1, 0, 1, GB))]]
    elif case == "two compute streams":  # the event queue runs 10 us then 20 us: the step is 30 us, not 20
        ranks = [[(C, 10.0, [], None), (C, 20.0, [], None)]]
    else:
        ranks = [[(S, 0, [], (0, 1, 1, GB)), (S, 0, [], (0, 1, 2, GB))], [(R, 0, [], (0, 1, 1, GB)),
                                                                       (R, 0, [], (0, 1, 2, GB))]]
    programs = [_replay_nodes(nodes) for nodes in ranks]
    graphs = [build_graph(r, p.ids, p.types, p.n_deps, p.deps, dict(p.comm.items()), [])[0]
              for r, p in enumerate(programs)]
    durations = [array("d", p.durations) for p in programs]
    paths = SlicePaths(programs, [p.comm.keys for p in programs], groups)
    for cost in (CommCost(), CommCost(CommModel.ALPHA_BETA)):
        if case == "hang":
            assert paths.run(cost) is None
            with pytest.raises(ReplayError, match="deadlocks"):
                TimedReplay(graphs, groups, durations, cost).run()
            continue
        replayed = TimedReplay(graphs, groups, durations, cost).run()
        swept = paths.run(cost)
        if case in ("pipeline", "joined collective"):
            assert swept == replayed
        elif case == "two sends at once" and cost.model is CommModel.FREE:
            assert swept == replayed  # free sends end as they start: nothing waits
        else:
            assert swept is None
    if case == "two compute streams":
        assert replayed.makespan_us == 30


def test_a_big_set_is_timed_by_the_compiled_loop_with_the_same_numbers(tmp_path, monkeypatch):
    """From COMPILED_FROM_NODES nodes on (here: every set) timed_replay runs the compiled loop
    unless nodes are recorded: the 1F1B set's timings are the Python replay's, free and under
    alpha-beta; a set that hangs is still reported by TimedReplay, stuck ranks and all."""
    import stg.chakra.validate as validate_module
    from stg.chakra.replay_kernel import CompiledReplay

    one = write_set(tmp_path / "1f1b", one_f_one_b(2, 3, 1, 2))
    python = {comm: timed_replay(one, comm=comm) for comm in ("free", "alpha-beta")}
    monkeypatch.setattr(validate_module, "COMPILED_FROM_NODES", 0)
    runs = []
    run = CompiledReplay.run
    monkeypatch.setattr(CompiledReplay, "run", lambda self, cost: runs.append(cost) or run(self, cost))
    for comm, timing in python.items():
        assert timed_replay(one, comm=comm) == timing
    assert len(runs) == 2
    assert timed_replay(one, record=[0]).nodes is not None and len(runs) == 2  # recording: TimedReplay
    ranks = {0: [comp(0, 10), send(1, 0, 1, tag=1, deps=[0]), coll(2, AR, 64, pg="1")],
             1: [recv(0, 0, 1, tag=1), coll(1, AR, 64, pg="1", deps=[0])]}
    with pytest.raises(ReplayError, match="the timed replay deadlocks") as caught:
        timed_replay(write_set(tmp_path / "hang", ranks, {"1": [0, 1]}))
    assert [(p.rank, p.node) for p in caught.value.problems] == [(None, None), (0, 2), (1, 0)]


def test_the_cli_reads_a_set_once_and_checks_its_options_first(tmp_path, monkeypatch):
    """`stg validate --timed` checks and times one reading of the set (each rank file is read
    once, not once for the checks and again for the timing), and a bad option is refused
    before any file is read."""
    from typer.testing import CliRunner

    from stg.cli import app

    out = write_set(tmp_path / "1f1b", one_f_one_b(2, 3, 1, 2))
    expected = timed_replay(out).to_dict()
    reads = []
    records = load_module.iter_node_records
    monkeypatch.setattr(load_module, "iter_node_records", lambda path: reads.append(path) or records(path))
    done = CliRunner().invoke(app, ["validate", str(out), "--timed", "free", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout.splitlines()[-1]) == expected
    assert sorted(path.name for path in reads) == ["workload.0.et", "workload.1.et"]
    reads.clear()
    bad = CliRunner().invoke(app, ["validate", str(out), "--timed", "ideal"])
    assert bad.exit_code == 2 and "timed: must be free or alpha-beta" in bad.output and reads == []
