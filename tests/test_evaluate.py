"""stg.evaluate gives, per plan, what the written set's summary.json says."""

import json

import pytest

from stg import Plan, evaluate
from stg.errors import PlanError
from test_digests import DEEPSEEK, GPT, MIXTRAL, PLANS, LLAMA, model_of
from stg.api import build, generate
from helpers import longest_path_finish


def test_evaluate_equals_the_written_summary(tmp_path):
    names = ["dp", "tp-sp", "pp-interleaved", "zero3", "ep-skew", "dlrm-table_wise"]
    for name in names:
        model, plan = PLANS[name]
        row = next(evaluate(model, [{"seq": 32, **plan}]))
        generate(model, {"seq": 32, **plan}, tmp_path / name)
        written = json.loads((tmp_path / name / "summary.json").read_text())
        written.pop("rank_class")
        assert row == written, name


@pytest.mark.parametrize("name", sorted(PLANS))
def test_counting_without_nodes_equals_lowering_them(name, tmp_path):
    """evaluate lowers no nodes and counts a repeated action once: the same stats and groups
    as the programs `stg generate` writes, for every strategy of the digest matrix, with
    more micro-batches than stages (so that actions repeat), and for a second sequence length
    (the tallies of the first plan's actions bound to other numbers)."""
    model, plan = model_of(name, tmp_path), PLANS[name][1]
    for extra in ({}, {"global_batch": plan.get("global_batch", 1) * 4} if "micro_batch" not in plan else {},
                  {"seq": 64}):
        plan = {"seq": 32, **plan, **extra}
        assert build(model, plan, nodes=False).summary() == build(model, plan).summary(), (name, extra)


def test_copies_of_a_layer_are_tallied_once(monkeypatch):
    """Without nodes, a layer's run of an action is tallied once per distinct block: its copies
    (the same ops of one sharding template, ShardedGraph.origins) take that tally under their
    own names, so a model twice as deep runs no more tallies (their sums are checked above)."""
    from stg.lower import _ProgramBuilder

    runs, tallied = [], _ProgramBuilder._tallied
    monkeypatch.setattr(_ProgramBuilder, "_tallied", lambda self, *args: runs.append(1) or tallied(self, *args))
    counts = []
    for layers in (4, 8):
        runs.clear()
        build({**LLAMA, "name": f"deep-{layers}", "layers": layers}, {"tp": 2, "dp": 2, "seq": 32}, nodes=False)
        counts.append(len(runs))
    assert counts[0] == counts[1] > 0


def test_plans_of_degree_1_share_the_structure_of_degrees_above_1(monkeypatch):
    """Without nodes, a transformer's plan of tp, cp, ep or dp 1 binds the structure of plans above
    1 on them (stg/passes.py, unit_bound): a collective over a group of one rank moves
    nothing, so the plan's stats, groups and memory are those of its own structure --
    compared with its lowering with nodes, which keeps its own, for every pair of degrees,
    pipeline schedules, ZeRO stages and mixture-of-experts models -- and the sixteen plans of
    one model run the symbolic passes once."""
    from stg.passes import Structure

    passes, original = [], Structure.passes
    monkeypatch.setattr(Structure, "passes", lambda self: passes.append(1) or original(self))
    plans = [dict(tp=tp, cp=cp, dp=dp, pp=pp, zero=1, recompute="selective", global_batch=2 * dp, seq=32,
                  **({"schedule": "zb-h1"} if pp > 1 and dp > 1 else {}))
             for tp in (1, 2) for cp in (1, 2) for dp in (1, 2) for pp in (1, 2)]
    model = {**LLAMA, "name": "unit-degrees"}  # its own structures, not the other tests' cached ones
    for plan in plans:
        assert build(model, plan, nodes=False).summary() == build(model, plan).summary(), plan
    passes.clear()
    rows = list(evaluate({**LLAMA, "name": "unit-degrees-2"}, plans))
    assert len(passes) == 1 and all("error" not in row for row in rows)
    passes.clear()
    rows = list(evaluate({**MIXTRAL, "name": "unit-experts"}, [dict(dp=2, ep=ep, global_batch=2, seq=32) for ep in (1, 2)]))
    assert len(passes) == 1 and all("error" not in row for row in rows)
    for model, plan in ((MIXTRAL, dict(dp=2, ep=2, zero=3, global_batch=2)),
                        (MIXTRAL, dict(dp=2, ep=2, cp=2, global_batch=2, expert_skew=1.0)),
                        (DEEPSEEK, dict(dp=2, ep=2, pp=2, global_batch=4)),
                        (MIXTRAL, dict(dp=2, tp=2, zero=1, global_batch=2)),
                        (DEEPSEEK, dict(dp=2, pp=2, zero=1, global_batch=4)),
                        (GPT, dict(pp=2, dp=2, zero=1, recompute="full", global_batch=8))):
        plan = {"seq": 32, **plan}
        assert build(model, plan, nodes=False).summary() == build(model, plan).summary(), plan


def test_zero_2_and_3_under_a_pipeline_are_grouped_with_zero_1(monkeypatch):
    """Under a pipeline ZeRO-2/3 store what ZeRO-1 stores (parallelism/zero.py, as
    torch.distributed.pipelining and TorchTitan run FSDP under pp), so they are one structure
    with zero 1's: evaluate groups them with it and runs the passes once; without a pipeline
    each stage is its own."""
    from stg.evaluation import structure_order
    from stg.passes import Structure

    def group(**fields):
        return structure_order(Plan(dp=2, global_batch=4, seq=32, **fields))[0]
    assert group(zero=3, pp=2) == group(zero=2, pp=2) == group(zero=1, pp=2) == group(zero=1)
    assert len({group(zero=1), group(zero=2), group(zero=3)}) == 3
    passes, original = [], Structure.passes
    monkeypatch.setattr(Structure, "passes", lambda self: passes.append(1) or original(self))
    rows = list(evaluate({**LLAMA, "name": "zero-under-pp"},
                         [dict(dp=2, pp=2, zero=zero, global_batch=4, seq=32) for zero in (1, 2, 3)]))
    assert len(passes) == 1 and all("error" not in row for row in rows)


def test_invalid_plans_say_why():
    rows = list(evaluate(LLAMA, [Plan(tp=3, global_batch=1, seq=32), Plan(dp=2, global_batch=2, seq=32)]))
    assert "tp=3 does not divide" in rows[0]["error"] and "error" not in rows[1]


def test_plans_run_grouped_by_structure_are_answered_in_the_order_given():
    """evaluate runs plans grouped by structure (zero 1 apart from zero 0 here) and still
    yields row i for plan i; an invalid plan keeps its place too."""
    plans = [dict(dp=2, zero=0, global_batch=4, seq=32), dict(dp=2, zero=1, global_batch=4, seq=32),
             dict(dp=3, global_batch=4, seq=32), dict(dp=4, zero=0, global_batch=8, seq=32)]
    rows = list(evaluate(LLAMA, plans))
    assert [row.get("plan", {}).get("dp") for row in rows] == [2, 2, 3, 4]
    assert "error" in rows[2] and all("error" not in rows[i] for i in (0, 1, 3))
    assert [row["plan"].get("zero", 0) for row in rows] == [0, 1, 0, 0]
    assert rows[0] == next(evaluate(LLAMA, [plans[0]]))


def test_workers_give_the_rows_of_one_process_in_the_order_given():
    """Forked workers, each taking whole structures, answer row i for plan i with the rows one
    process gives, an invalid plan's error in its place. With 5 workers a worker's share is 3
    of the 14 plans, so the structure of 4 (zero 0, no recomputation: dp 1, 2, 4 and the pp 2
    plan) is cut in two."""
    plans = [dict(dp=dp, zero=zero, recompute=recompute, global_batch=4 * dp, seq=32)
             for dp in (1, 2, 4) for zero in (0, 1) for recompute in ("none", "full")]
    plans += [dict(dp=2, pp=2, global_batch=8, seq=32), dict(dp=3, global_batch=4, seq=32)]
    one = list(evaluate(LLAMA, plans))
    assert list(evaluate(LLAMA, plans, workers=5)) == one
    assert [row.get("plan", {}).get("dp") for row in one] == [plan["dp"] for plan in plans]
    assert "error" in one[-1] and all("error" not in row for row in one[:-1])
    with pytest.raises(PlanError, match="workers: must be a positive integer, got 0"):
        next(evaluate(LLAMA, plans, workers=0))


@pytest.mark.parametrize("name", sorted(PLANS))
def test_repeated_actions_lower_the_nodes_they_would_run(name, tmp_path, monkeypatch):
    """Lowering repeats the nodes of an action already run with the same key instead of
    running its ops again (stg.repeats.ActionNodes): numbered on, renamed and re-tagged for its
    micro-batch, dependencies found by role, durations rounded on the running carry. For
    every strategy of the digest matrix with 6 micro-batches per stage, every program's
    nodes are those that running every action gives, and actions were repeated."""
    import stg.repeats

    model, plan = model_of(name, tmp_path), PLANS[name][1]
    if "micro_batch" not in plan:
        plan = {**plan, "global_batch": plan.get("global_batch", 1) * 6}
    plan = {"seq": 32, **plan}
    repeated = []
    replay = stg.repeats.ActionNodes.replay

    def counted(self, *args):
        repeated.append(replay(self, *args))
        return repeated[-1]

    monkeypatch.setattr(stg.repeats.ActionNodes, "replay", counted)
    programs = build(model, plan).programs
    monkeypatch.setattr(stg.repeats.ActionNodes, "replay", lambda self, *args: False)
    fresh = build(model, plan).programs
    assert [p.nodes for p in programs] == [p.nodes for p in fresh]
    assert [p.stats for p in programs] == [p.stats for p in fresh]
    if not name.startswith("dlrm"):  # one micro-batch per step: nothing repeats
        assert sum(repeated) >= 1


def test_a_plan_with_another_pp_binds_the_layers_tallies():
    """Without nodes an action's stats are its layers' tallies (kept per structure: a layer's
    ops are the same on whichever stage holds it) plus its own receives, sends and buckets:
    plans of one structure with pp 2, 4 and interleaved 4 x 2 equal their lowered nodes'
    summaries, and the later plans derive no layer's tally again."""
    from stg.repeats import tallies

    model = {**LLAMA, "layers": 8}
    layer_keys = []
    for plan in (dict(pp=2, dp=2, zero=1), dict(pp=4, dp=2, zero=1),
                 dict(pp=4, vpp=2, schedule="interleaved", dp=2, zero=1)):
        plan = {"seq": 32, "global_batch": 8, **plan}
        workload = build(model, plan, nodes=False)
        assert workload.summary() == build(model, plan).summary(), plan
        layer_keys.append({key for key in tallies(workload.sharded) if key[0] == "layer"})
    assert layer_keys[0] and layer_keys[0] == layer_keys[1] == layer_keys[2]


def test_gradient_buckets_are_cut_by_each_plans_sizes():
    """Without a pipeline the last backward sends the gradient buckets as it finishes them
    (PyTorch DDP); plans of one structure and cut whose bucket caps differ cut them apart. In
    one process, a plan with one bucket per gradient and one with all in one bucket each equal
    their lowered nodes' summaries (the first plan's action tallies hold for the second, its
    buckets do not)."""
    base = {"seq": 32, "dp": 2, "global_batch": 4}
    few, many = ({**base, "bucket_mb": size} for size in (1000.0, 1e-6))
    counts = []
    for plan in (few, many, few):
        counted = build(LLAMA, plan, nodes=False).summary(per_rank=False)
        assert counted == build(LLAMA, plan).summary(per_rank=False), plan
        counts.append(counted["rank_classes"][0]["comm_count"])
    assert counts[0] == counts[2] and sum(counts[1].values()) > sum(counts[0].values())


DEEP = {**LLAMA, "layers": 8}
TIMING_CASES = {  # beyond the digest matrix: stages 1 and 2 of a 4-stage pipeline run alike
    "gpt-tied-pp-dp1": (GPT, dict(pp=2, global_batch=1)),
    "pp4-tp-zero1": (DEEP, dict(pp=4, tp=2, dp=2, zero=1, global_batch=4)),
    "pp4-interleaved": (DEEP, dict(pp=4, vpp=2, schedule="interleaved", global_batch=4)),
    "pp4-zbh1-tp": (DEEP, dict(pp=4, tp=2, dp=2, zero=1, schedule="zb-h1", global_batch=4)),
    "pp4-recompute-full": (DEEP, dict(pp=4, tp=2, recompute="full", global_batch=4)),
}


def test_a_stage_that_does_not_wire_is_lowered_action_by_action(monkeypatch):
    """stg/borrowed.py repeats a stage's templates all at once only where every action and the
    step resolve; where they do not, nothing of the attempt stays and the stage is lowered
    action by action. With the compiled loop made to report a role that does not resolve, and
    again with a kept stage missing one action's template, a 4-stage pipeline, lowered after a
    plan of other sizes of its cut, times and counts as it does wired."""
    import stg.borrowed
    import stg.lower
    from stg.explore.cost import slice_timings
    from stg.explore.network import load_network

    network = load_network("dgx-h100-superpod")
    plan = dict(pp=4, tp=2, dp=2, zero=1, global_batch=24, seq=32)
    resized = {**plan, "seq": 64}

    def timed() -> tuple:
        build(DEEP, plan, nodes=False, timing=True)  # leaves its stages' templates (StageTemplates)
        workload = build(DEEP, resized, nodes=False, timing=True)
        return [p.stats for p in workload.programs], slice_timings(workload, network)

    attempts, wire, wire_own = [], stg.lower.wire, stg.lower.wire_own
    monkeypatch.setattr(stg.lower, "wire", lambda b: attempts.append(wire(b)) or attempts[-1])
    monkeypatch.setattr(stg.lower, "wire_own", lambda b, k: attempts.append(wire_own(b, k)) or attempts[-1])
    wired = timed()
    assert attempts and all(attempts)
    loop = stg.borrowed._wire()
    with monkeypatch.context() as failing:
        failing.setattr(stg.borrowed, "_wire", lambda: lambda *args: (*loop(*args)[:2], False))
        attempts.clear()
        assert timed() == wired
        assert attempts and not any(attempts)
    with monkeypatch.context() as missing:
        init = stg.borrowed.StageTemplates.__init__

        def without_one(self, made, step):
            init(self, dict(list(made.items())[1:]), step)
        missing.setattr(stg.borrowed.StageTemplates, "__init__", without_one)
        missing.setattr(stg.lower, "_lowered_stages", lambda *key, kept={}: kept)
        attempts.clear()
        assert timed() == wired
        assert False in attempts


@pytest.mark.parametrize("name", sorted(PLANS) + sorted(TIMING_CASES))
def test_a_plan_lowered_for_timing_replays_as_its_nodes(name, tmp_path, monkeypatch):
    """stg explore times a plan from programs lowered for the replay only (build(timing=True):
    a repeated action adds its merged replay nodes, no trace node is made). For every strategy
    of the digest matrix with 6 micro-batches per stage, the slice replay of those programs
    times every stage as the replay of the lowered nodes does, under free communication
    (whole microseconds: equal) and on a network, and the programs' stats and holes are the
    same; the compiled replay (stg/chakra/replay_kernel.py) gives TimedReplay's numbers.
    Without dp the step reads the last micro-batch's tied-embedding gradient itself
    (gpt-tied-pp-dp1): its producer must stay a node of its own in that action. In a 4-stage
    pipeline the second middle stage repeats the actions and the step of the stage before it,
    found alike as a whole, in that stage's names, only its sends and receives moved
    (_ProgramBuilder._alike_stage, ActionNodes.rekeyed), every action wired in one compiled
    loop (stg/borrowed.py). While an action is recorded, its layers alike to an earlier one of it
    repeat that layer's nodes (LayerNodes). The replay's times are those of the longest paths
    through the slice (tests/helpers.py): a max-plus system, so an action's effect on the times
    composes from its own."""
    import stg.lower
    import stg.repeats
    from stg.chakra.replay import CommCost, TimedReplay
    from stg.chakra.replay_kernel import CompiledReplay
    from stg.explore.cost import group_spans, slice_timings
    from stg.explore.network import load_network
    from stg.chakra.longest_paths import SlicePaths
    from stg.chakra.repeat_paths import RepeatPaths
    from stg.slice_check import rank_graphs, replay_durations, slice_paths, slice_ranks

    model, plan = TIMING_CASES[name] if name in TIMING_CASES else (model_of(name, tmp_path), PLANS[name][1])
    if "micro_batch" not in plan:
        plan = {**plan, "global_batch": plan.get("global_batch", 1) * 6}
    plan = {"seq": 32, **plan}
    ran = {True: 0, False: 0}
    steps = {True: 0, False: 0}
    action, step = stg.lower._ProgramBuilder.action, stg.lower._ProgramBuilder.step

    def counted(self, *args, **kwargs):
        ran[self.timing] += 1
        return action(self, *args, **kwargs)

    def counted_step(self, *args, **kwargs):
        steps[self.timing] += 1
        return step(self, *args, **kwargs)

    layers_repeated = []
    repeat_layer = stg.repeats.LayerNodes.repeat

    def counted_layer(self, *args):
        layers_repeated.append(repeat_layer(self, *args))
        return layers_repeated[-1]

    monkeypatch.setattr(stg.lower._ProgramBuilder, "action", counted)
    monkeypatch.setattr(stg.lower._ProgramBuilder, "step", counted_step)
    monkeypatch.setattr(stg.repeats.LayerNodes, "repeat", counted_layer)
    siblings, alike_stage = [], stg.lower._ProgramBuilder._alike_stage

    def found_sibling(self, *args):
        alike_stage(self, *args)
        siblings.append((self.rank, self.sibling is not None))

    wired, wire = [], stg.lower.wire

    def counted_wire(builder):
        wired.append((builder.rank, wire(builder)))
        return wired[-1][1]

    monkeypatch.setattr(stg.lower._ProgramBuilder, "_alike_stage", found_sibling)
    monkeypatch.setattr(stg.lower, "wire", counted_wire)
    nodes, timing = build(model, plan), build(model, plan, nodes=False, timing=True)
    if name.startswith("pp4"):  # the middle stages' actions and steps are alike
        assert ran[True] < ran[False] and steps[True] < steps[False] == 4
        # stage 2 takes stage 1's, all of them, in stage 1's names (stg/borrowed.py)
        assert siblings == [(0, False), (1, False), (2, True), (3, False)] and wired == [(2, True)]
    if name in ("dp", "cp", "tp-sp", "zero3", "ep-skew"):  # a recorded action's middle layers repeat the first's nodes
        assert any(layers_repeated)
    assert [p.stats for p in timing.programs] == [p.stats for p in nodes.programs]
    assert [p.holes for p in timing.programs] == [p.holes for p in nodes.programs]
    assert all(len(p.replay.ids) and not p.nodes for p in timing.programs)
    network = load_network("dgx-h100-superpod")
    for variant in range(nodes.variants):
        ranks = slice_ranks(timing, variant)
        graphs, members = rank_graphs(timing, ranks)
        durations = [replay_durations(timing.programs[timing.class_of(rank)]) for rank in ranks]
        # programs lowered for timing are all repeats: the sweep reads them as they are
        paths, rows = slice_paths(timing, ranks), slice_paths(timing, ranks, repeats=False)
        assert isinstance(paths, RepeatPaths) and isinstance(rows, SlicePaths)
        costs = (CommCost(), network.bound(group_spans(timing, ranks), ranks, timing.mesh.size))
        # the repeats' sweep times every cost in one pass, each as its own pass would
        assert paths.runs(costs) == [paths.run(cost) for cost in costs]
        for cost in costs:
            # the longest-path sweep explore runs (of the repeats, and of their rows), and the
            # compiled loop it falls back on, are TimedReplay's, to the last bit; the sweep does
            # not stall on lowered programs
            replayed = TimedReplay(graphs, members, durations, cost).run()
            assert paths.run(cost) == replayed and rows.run(cost) == replayed
            assert CompiledReplay(graphs, members, durations).run(cost) == replayed
            # and a longest-path schedule: every node starts when its inputs are done, never
            # waiting for its rank's compute or comm slot (lowering's chains order both)
            assert longest_path_finish(graphs, members, durations, cost) == replayed.finish_us
        free, costed = slice_timings(nodes, network, variant)
        free_t, costed_t = slice_timings(timing, network, variant)
        assert free_t == free
        assert costed_t.makespan_us == pytest.approx(costed.makespan_us, rel=1e-12)
        assert costed_t.finish_us == pytest.approx(costed.finish_us, rel=1e-12)
        assert costed_t.busy_us == costed.busy_us
    # a plan that differs only in its micro-batch count (a folded plan's probes) repeats this
    # one's action templates, its first actions too, without running their ops: its replay
    # is a fresh lowering's (the step still finds producers through views, e.g. the tied
    # embedding gradient of gpt-tied-pp-dp1)
    import stg.api
    longer = {**plan, "global_batch": 2 * Plan.from_dict(plan).global_batch}
    before = ran[True]
    reused = build(model, longer, nodes=False, timing=True)
    reused_runs, before = ran[True] - before, ran[True]
    with monkeypatch.context() as fresh_templates:
        fresh_templates.setattr(stg.api, "_timing_templates", lambda *key: {})
        fresh_templates.setattr(stg.api, "_rebindable_templates", lambda *key: {})
        fresh_templates.setattr(stg.lower, "_lowered_stages", lambda *key: {})
        fresh = build(model, longer, nodes=False, timing=True)
    assert reused_runs < ran[True] - before
    assert [p.stats for p in reused.programs] == [p.stats for p in fresh.programs]
    for variant in range(fresh.variants):
        assert slice_timings(reused, network, variant) == slice_timings(fresh, network, variant)
    # a plan of the same structure and stage cut with other sizes (the sequence doubled: every
    # duration and byte count changes) takes the templates of this one's actions and steps,
    # rebound to its sizes (ActionNodes.rebound), and runs none of its own, a stage's template
    # taken unmoved where its names are the stage's own (shapes.moved_here: an interleaved
    # first stage receives from the last one a tensor its shape does not name): it times as
    # its written programs replay
    rebound, rebind = [], stg.repeats.ActionNodes.rebound
    monkeypatch.setattr(stg.repeats.ActionNodes, "rebound", lambda self, builder: rebound.append(1) or
                        rebind(self, builder))
    own, wire_own = [], stg.lower.wire_own
    monkeypatch.setattr(stg.lower, "wire_own", lambda builder, kept: own.append(wire_own(builder, kept)) or own[-1])
    resized = {**plan, "seq": 2 * plan["seq"]}
    before = ran[True]
    timing, nodes = build(model, resized, nodes=False, timing=True), build(model, resized)
    assert rebound and ran[True] == before  # none of its actions runs its ops
    if Plan.from_dict(resized).pp > 1:  # (without a pipeline the last backward sends buckets: not wired)
        assert own and all(own)  # its stages repeat the templates they were lowered with (stg/borrowed.py)
    assert [p.stats for p in timing.programs] == [p.stats for p in nodes.programs]
    for variant in range(nodes.variants):
        free, costed = slice_timings(nodes, network, variant)
        free_t, costed_t = slice_timings(timing, network, variant)
        assert free_t == free and costed_t.busy_us == costed.busy_us
        assert costed_t.makespan_us == pytest.approx(costed.makespan_us, rel=1e-12)


@pytest.mark.parametrize("plan", [dict(pp=1, global_batch=16), dict(pp=4, schedule="zb-h1", global_batch=8)])
def test_a_bound_reduction_view_passes_on_its_producer_when_timed(plan):
    """Timed, a plan of cp = 1 binds the structure of cp above 1 (stg/passes.py, unit_bound):
    there Mixtral's expert-gradient reduction over dp and cp (dp = ep: no expert data
    parallelism) is a step-phase view, which the tp all-reduce after it reads. That all-reduce
    goes out in a bucket after the last backward (without a pipeline) or before the optimizer,
    and must wait for the gradient through the view, as in the written programs: before the
    step's views were noted up front it went early (1.75 % off the written set's step without
    a pipeline, 3 us under ZB-H1)."""
    from stg.explore.cost import slice_timings
    from stg.explore.network import load_network

    plan = dict(dp=4, tp=2, ep=4, zero=1, seq=512, **plan)
    timed, written = build("mixtral-8x7b", plan, nodes=False, timing=True), build("mixtral-8x7b", plan)
    assert any(op.kind.name == "CONSTRAIN" and op.name.endswith(".reduce_scatter[dp,cp].S")
               for op in timed.sharded.graph.ops)
    network = load_network("dgx-h100-superpod")
    assert slice_timings(timed, network, 0) == slice_timings(written, network, 0)
