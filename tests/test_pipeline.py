"""Pipeline parallelism lowered: stage placement, send/recv pairs, memory by schedule, and
every schedule combined with the other strategies passing `stg validate`."""

import itertools

import pytest

from model_zoo import load_model
from stg import Plan, build, generate
from stg.chakra.validate import validate
from stg.program import NodeType

MODEL = dict(name="four-blocks", family="llama", layers=4, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
B, S, H = 2, 32, 64


def ops_of(workload, rank):
    return {n.name.split(" ", 1)[1] for n in workload.programs[rank].nodes}


def test_three_stages_with_four_blocks_put_the_head_last():
    workload = build(MODEL, Plan(pp=3, layers_per_stage=[1, 2, 1], global_batch=3, seq=S))
    first, middle, last = (ops_of(workload, r) for r in range(3))
    assert "embed" in first and "layers.0.mlp.up" in first
    assert "layers.1.attn.q" in middle and "layers.2.mlp.up" in middle
    assert "logits" in last and "loss" in last and "layers.3.attn.q" in last
    assert not ({"logits", "loss"} & (first | middle))


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_send_bytes_per_micro_batch_per_boundary(tp, sp):
    """B.S.H activation bytes, split by tp under sequence parallelism (the stream is seq-split)."""
    m = 4
    workload = build(MODEL, Plan(pp=2, tp=tp, sp=sp, micro_batch=B, global_batch=B * m, seq=S))
    per_boundary = B * S * H * 2 // (tp if sp else 1)
    for rank in range(2):
        sends = [n for n in workload.programs[rank].nodes if n.type is NodeType.COMM_SEND_NODE]
        assert len(sends) == m  # stage 0 sends activations, stage 1 their gradients
        assert {n.comm_bytes for n in sends} == {per_boundary}
    tags = [n.tag for p in workload.programs for n in p.nodes if n.type is NodeType.COMM_SEND_NODE]
    assert len(tags) == len(set(tags)) and max(tags) < 400_000_000


@pytest.mark.parametrize("schedule, in_flight", [
    ("1f1b", lambda p, m, r: p - r),
    ("gpipe", lambda p, m, r: m),
])
def test_activation_memory_follows_the_schedule(schedule, in_flight):
    p, m = 2, 6
    workload = build(MODEL, Plan(pp=p, schedule=schedule, micro_batch=B, global_batch=B * m, seq=S))
    for r in range(p):
        memory = workload.memory[r]
        per_micro_batch = sum(memory.activations_by_layer.values())
        assert memory.activations == in_flight(p, m, r) * per_micro_batch


PLANS = [
    dict(schedule=schedule, dp=dp, tp=tp, zero=zero, **({"vpp": 2} if schedule == "interleaved" else {}))
    for schedule, dp, tp, zero in itertools.product(("gpipe", "1f1b", "interleaved", "zb-h1"), (1, 2), (1, 2), (0, 1))
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_every_schedule_with_other_strategies_validates(tmp_path, plan):
    out = tmp_path / "set"
    generate(MODEL, Plan(pp=2, global_batch=4 * plan["dp"], seq=16, **plan), out)  # 4 micro-batches
    assert validate(out) == []


def test_weights_and_optimizer_states_split_over_stages():
    one = build(MODEL, Plan(seq=S)).memory[0]
    two = build(MODEL, Plan(pp=2, global_batch=2, seq=S)).memory
    assert two[0].weights + two[1].weights == one.weights
    assert two[0].optimizer_states + two[1].optimizer_states == one.optimizer_states


def test_timed_replay_reads_the_bubble_off_a_generated_set(tmp_path):
    """With the durations in the traces and free communication, GPipe and 1F1B take equally
    long (the same (p - 1)(F + B) bubble), ZB-H1 less; each rank's busy time is the sum of
    its compute durations, read independently from the files."""
    from stg.chakra.reader import iter_nodes
    from stg.chakra.validate import timed_replay

    model = dict(MODEL, hidden=512, ffn=1408, vocab=4000)
    timings = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        out = tmp_path / schedule
        generate(model, Plan(pp=4, layers_per_stage=[1, 1, 1, 1], global_batch=8, seq=512, schedule=schedule), out)
        timings[schedule] = timed_replay(out, comm="free")
        for rank in range(4):
            busy = sum(n.duration_micros for n in iter_nodes(out / f"workload.{rank}.et") if n.type == 4)
            assert timings[schedule].busy_us[rank] == busy
            assert timings[schedule].idle_us[rank] == pytest.approx(timings[schedule].makespan_us - busy)
    assert timings["gpipe"].makespan_us == timings["1f1b"].makespan_us
    assert timings["zb-h1"].makespan_us < timings["1f1b"].makespan_us


def test_tied_embeddings_keep_a_copy_on_the_last_stage(tmp_path):
    """GPT's output layer is the embedding: under pp the last stage holds a copy (Megatron),
    and both copies' gradients are all-reduced over the first and last stage each step, so
    they take the same optimizer step."""
    gpt = dict(name="tiny-gpt", family="gpt", layers=4, hidden=64, ffn=256, heads=4, vocab=1000, max_positions=128)
    workload = build(gpt, Plan(pp=4, tp=2, global_batch=4, seq=32))
    tied = [[n for n in p.nodes if n.name.endswith(".tied_all_reduce")] for p in workload.programs]
    assert [len(nodes) for nodes in tied] == [1, 0, 0, 1]
    for nodes in (tied[0], tied[3]):
        assert nodes[0].group.members == (0, 3) and nodes[0].comm_bytes == 1000 * 64 // 2 * 2  # V.H/tp bf16
    assert workload.summary()["model"]["params"] == load_model(gpt).params  # the copy is not a new parameter
    assert workload.memory[3].weights > workload.memory[1].weights  # but the last stage stores it
    out = tmp_path / "set"
    generate(gpt, Plan(pp=2, dp=2, zero=1, global_batch=8, seq=32), out)
    assert validate(out) == []


def test_a_tied_model_runs_its_passes_once_per_tie_pattern(monkeypatch):
    """Cuts that tie the same blocks (the embedding on the first stage, the output layer on the
    last) share one run of the symbolic passes; another cut renames the copies
    (embed.weight@stage3 -> @stage7) in every tensor and op made from them, and equals its own
    passes exactly."""
    import stg.passes

    gpt = load_model(dict(name="tiny-gpt", family="gpt", layers=8, hidden=64, ffn=256, heads=4, vocab=1000,
                          max_positions=128))
    plans = [Plan(pp=4, dp=2, zero=1, global_batch=8, seq=32), Plan(pp=8, dp=2, zero=1, global_batch=16, seq=32),
             Plan(pp=4, vpp=2, dp=2, zero=1, schedule="interleaved", global_batch=16, seq=32)]

    def forget():
        for cache in ("_CACHE", "_UNTIED", "_TRAINING", "_RECOMPUTED"):
            monkeypatch.setattr(stg.passes, cache, {})
    fresh = []
    for plan in plans:
        forget()
        fresh.append(build(gpt, plan).sharded)
    forget()
    passes = []
    run = stg.passes.Structure.untied
    monkeypatch.setattr(stg.passes.Structure, "untied", lambda self: passes.append(1) or run(self))
    shared = [build(gpt, plan).sharded for plan in plans]
    assert len(passes) == 1
    copies = {n for n in shared[1].graph.tensors if "@" in n}
    assert copies and all("@stage7" in n for n in copies)  # the last of 8 stages holds the copy
    for mine, theirs in zip(shared, fresh):
        assert mine.graph.tensors == theirs.graph.tensors
        assert mine.graph.ops == theirs.graph.ops
        assert (mine.layouts, mine.global_tensors) == (theirs.layouts, theirs.global_tensors)


def test_pp_is_no_structure_of_an_untied_model(monkeypatch):
    """pp cuts stages and splits no tensor: a plan of an untied model with pp and one without
    run the symbolic passes once, and each plan's summary is the one its own passes give."""
    import stg.passes

    llama = dict(name="tiny-llama", family="llama", layers=4, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512)
    plans = [Plan(tp=2, dp=2, global_batch=8, seq=32), Plan(tp=2, pp=2, dp=2, global_batch=8, seq=32)]
    for cache in ("_CACHE", "_TRAINING", "_RECOMPUTED"):
        monkeypatch.setattr(stg.passes, cache, {})
    fresh = []
    for plan in plans:
        fresh.append(build(llama, plan).summary(per_rank=False))
        monkeypatch.setattr(stg.passes, "_CACHE", {})
    passes = []
    run = stg.passes.Structure.untied
    monkeypatch.setattr(stg.passes.Structure, "untied", lambda self: passes.append(1) or run(self))
    assert [build(llama, plan).summary(per_rank=False) for plan in plans] == fresh
    assert len(passes) == 1


@pytest.mark.parametrize("costs, stages, split", [
    ([0] + [2] * 6 + [0], 3, (2, 2, 2)),
    # the head costs 2.5 blocks: a block beside it (3.5) is the least bottleneck; of the
    # splits that reach it, the fewest blocks first
    ([0] + [2] * 6 + [5], 3, (2, 3, 1)),
    # an embedding of 2.5 blocks: the first stage gets one block (3.5 is then the bottleneck)
    ([25] + [10] * 6 + [0], 3, (1, 2, 3)),
    # Llama 3 405B-like: 126 equal blocks on 16 stages, a head of 0.6 block: 8 per stage is
    # unavoidable (126/16 > 7); the first and last stages get 7 (Llama 3 paper, sec. 3.3.2)
    ([0] + [10] * 126 + [6], 16, (7,) + (8,) * 14 + (7,)),
])
def test_balanced_split_by_hand(costs, stages, split):
    from parallelism.pipeline import balanced_split

    assert balanced_split(costs, stages) == split


def test_balanced_split_is_the_least_bottleneck_then_the_fewest_blocks_first():
    """Against its definition, by enumerating every split of up to 9 blocks: the least
    costliest stage (the first paying the embedding, the last the head), and of the splits
    that reach it the lexicographically least. Costs include zeros and ties."""
    import random
    from itertools import combinations

    from parallelism.pipeline import balanced_split

    draw = random.Random(0)
    for _ in range(300):
        n = draw.randint(1, 9)
        stages = draw.randint(1, n)
        blocks = [draw.choice((0, 1, 2, 5, 5, 9)) for _ in range(n)]
        costs = [draw.randint(0, 12), *blocks, draw.randint(0, 12)]
        splits = []
        for cuts in combinations(range(1, n), stages - 1):
            edges = (0, *cuts, n)
            split = tuple(b - a for a, b in zip(edges, edges[1:]))
            loads = [sum(blocks[a:b]) for a, b in zip(edges, edges[1:])]
            loads[0] += costs[0]
            loads[-1] += costs[-1]
            splits.append((max(loads), split))
        assert balanced_split(costs, stages) == min(splits)[1], (costs, stages)


def test_auto_split_counts_the_output_layer_on_the_last_stage(tmp_path):
    """Per token the output layer costs 2HV = 128,000 FLOPs, between one block's (about
    2(2H^2 + 2H.Hkv + 3HF) = 92,160 plus attention) and two: on pp=2 the last stage takes one
    block (max(3b, b + head) = 3b < 2b + head)."""
    out = tmp_path / "set"
    summary = generate(MODEL, Plan(pp=2, layers_per_stage="auto", global_batch=4, seq=S), out, workers=1)
    assert summary["layers_per_stage"] == [3, 1]
    assert validate(out) == []


def test_auto_split_needs_a_block_per_stage():
    from stg.errors import PlanError

    with pytest.raises(PlanError, match="auto needs a block per stage, but the model has 4 blocks for 8 stages"):
        build(MODEL, Plan(pp=8, layers_per_stage="auto", global_batch=8, seq=S))


def test_llama3_405b_on_16_stages_drops_a_block_from_the_first_and_last():
    """126 blocks on 16 stages: some stage runs 8 (126/16 > 7); the output layer (2HV =
    2 x 16384 x 128256 per token, 0.6 of a block) fits beside 7 blocks, and the fewest blocks
    go first: 7, 14 x 8, 7, the split of the Llama 3 paper (sec. 3.3.2)."""
    from parallelism.pipeline import balanced_split
    from stg.api import _block_costs

    costs = _block_costs(load_model("llama3-405b"), Plan(pp=16, layers_per_stage="auto", seq=8192, global_batch=16))
    assert 0.5 < costs[-1] / costs[1] < 0.7
    assert balanced_split(costs, 16) == (7,) + (8,) * 14 + (7,)


def test_a_tied_model_over_a_memory_limit_is_refused_from_its_graph_without_a_cut(monkeypatch):
    """The cut's copy of the embedding (the last stage's, for the tied output layer) adds to the
    last stage only its gradient and its Adam state (hand count: vocab 1,000 x hidden 64
    parameters, 2 bytes each of bf16 gradient and, ZeRO-1 over dp=2, half of 12 bytes of fp32
    master weight and two moments): the graph without a cut (no copies), under the same cut,
    is a lower bound of every stage's memory, so a plan over it is refused without the cut's
    own passes, and a plan between it and the peak by the cut's exact peak."""
    import stg.passes
    from stg.api import MemoryLimitError

    gpt = load_model(dict(name="tiny-gpt", family="gpt", layers=8, hidden=64, ffn=256, heads=4, vocab=1000,
                          max_positions=128))
    plan = Plan(pp=4, dp=2, zero=1, global_batch=8, seq=32, layers_per_stage=[1, 1, 1, 5])  # the last stage peaks
    peaks = [m.peak for m in build(gpt, plan).memory]
    bound = max(peaks[:-1] + [peaks[-1] - 1000 * 64 * (2 + 12 // 2)])
    assert peaks[-1] > bound
    for cache in ("_CACHE", "_UNTIED", "_BOUNDS"):
        monkeypatch.setattr(stg.passes, cache, {})
    with pytest.raises(MemoryLimitError, match="peak at least") as refused:
        build(gpt, plan, memory_limit=bound - 1)
    assert refused.value.peak == bound and not stg.passes._UNTIED  # the cut's own passes never ran
    with pytest.raises(MemoryLimitError, match=r"peak \d") as refused:
        build(gpt, plan, memory_limit=peaks[-1] - 1)
    assert refused.value.peak == peaks[-1] and stg.passes._UNTIED
    build(gpt, plan, memory_limit=peaks[-1])  # exactly at the limit fits


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_a_pipeline_stage_sends_its_gradient_buckets_after_its_last_action(schedule):
    """A rank runs one collective or send at a time (the comm chain): a bucket sent inside the
    last backward would hold up the collectives and the send behind it. With a pipeline every
    step collective (buckets, then the gathers) comes after the stage's last send, receive and
    micro-batch compute."""
    plan = Plan(pp=2, dp=2, tp=2, zero=1, schedule=schedule, vpp=2 if schedule == "interleaved" else 1,
                global_batch=8, seq=S)
    workload = build(MODEL, plan)
    for program in workload.programs:
        step = [n.id for n in program.nodes if n.type is NodeType.COMM_COLL_NODE and n.name.startswith("S ")]
        actions = [n.id for n in program.nodes if n.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)
                   or n.type is NodeType.COMP_NODE and not n.name.startswith("S ")]
        assert step and min(step) > max(actions)


def test_a_pipelines_gradient_buckets_cost_the_step_no_more_than_their_own_time(monkeypatch):
    """After the last backward, a stage's data-parallel reductions overlap the cool-down of
    the stages still running; only the stage that finishes last waits for its own. Inside the
    backward each stage would hand the wait on to the one before it (pp - 1 times over)."""
    from stg.explore.cost import estimate
    from stg.explore.network import NetworkCost, network_from_dict

    model = dict(MODEL, hidden=1024, ffn=2816, heads=16, kv_heads=8, layers=8)
    plan = Plan(pp=4, dp=4, tp=2, micro_batch=1, global_batch=32, seq=512)
    network = network_from_dict({"tiers": [  # tp inside a node; dp and pp across, at 1 GB/s
        {"size": 2, "bandwidth_gbps": 400, "latency_us": 2, "efficiency": 1},
        {"size": None, "bandwidth_gbps": 1, "latency_us": 5, "efficiency": 1}]})
    workload = build(model, plan)
    fabric = network.tiers[-1]
    own = max(sum(network.collective_us(n.collective.value, n.comm_bytes, plan.dp, fabric)
                  for n in program.nodes if n.type is NodeType.COMM_COLL_NODE and "dp" in n.group.axes)
              for program in workload.programs)
    step = estimate(workload, network).step_us
    costed = NetworkCost.collective_us
    monkeypatch.setattr(NetworkCost, "collective_us", lambda self, ctype, size, group:
                        0.0 if self.spans[group][0] == plan.dp else costed(self, ctype, size, group))
    without = estimate(workload, network).step_us
    assert own > 0.05 * step  # the reductions weigh
    assert step - without <= 1.01 * own
