"""Plan search: the network's collective times against NCCL's formulas by hand, the slice
estimate against the timed replay of the written set, the search's pruning and outputs."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from model_zoo import load_model
from stg.api import build, generate
from stg.chakra import et_def_pb2 as pb
from stg.chakra.validate import timed_replay
from stg.cli import app
from stg.device import DEVICES
from stg.errors import PlanError
from stg.explore import Cluster, Job, Space, explore, load_network, write_top
from stg.explore.cost import estimate, slice_timings
from stg.explore.network import network_from_dict
from stg.plan import Plan

# big enough that compute nodes last several µs, small enough to build in well under a second
MID = dict(name="mid-llama", family="llama", layers=4, hidden=1024, ffn=2816, heads=16, kv_heads=4, vocab=4096)
GIB = 2**30


# --- devices: the datasheets' numbers (dense = half the "with sparsity" figure) -------------------

def test_device_files_hold_the_datasheet_numbers():
    h100 = DEVICES["h100"]
    assert h100.peak_tflops == pytest.approx(1979 / 2, rel=1e-3)  # H100 SXM bf16 1,979 TF with sparsity
    assert h100.fp8_tflops == pytest.approx(3958 / 2, rel=1e-3)
    assert (h100.memory_gib, h100.memory_tbps) == (80, 3.35)
    assert DEVICES["a100"].peak_tflops == 312 and DEVICES["a100"].fp8_tflops is None
    assert (DEVICES["h200"].memory_gib, DEVICES["h200"].memory_tbps) == (141, 4.8)
    assert DEVICES["mi300x"].peak_tflops == 1307.4 and DEVICES["b200"].peak_tflops == 2250


# OpenXLA's measured bf16 GEMM throughputs on sm_90 (xla/service/gpu/model/
# matmul_interpolator_data.h): (b, m, n, k) -> TFLOP/s
XLA_SM90 = {(1, 1024, 1024, 2048): 349.98, (1, 2048, 2048, 2048): 631.98, (1, 4096, 4096, 4096): 783.33}


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_gemms_take_the_time_measured_for_their_size(name):
    """A GEMM of a measured size takes its measured time; sizes between interpolate in log
    size, larger ones run at the largest measured rate, and other ops are not GEMMs."""
    device = DEVICES[name]
    for (b, m, n, k), tflops in XLA_SM90.items():
        flops = 2 * b * m * n * k
        assert device.duration_us(flops, 0, matmul=True) == pytest.approx(flops / tflops / 1e6, rel=2e-4)
    between, large = 2 * 2048 * 2048 * 4096, 2 * 4096**3
    per_flop = device.duration_us(between, 0, matmul=True) / between
    assert 1 / 783.33e6 < per_flop < 1 / 631.98e6
    assert device.duration_us(8 * large, 0, matmul=True) == pytest.approx(8 * large / 783.33e6, rel=2e-4)
    assert device.duration_us(large, 0) == pytest.approx(large / 989.4e6)  # not a GEMM: the peak


def test_a_device_file_checks_its_gemm_efficiency(tmp_path):
    from stg.device import from_dict

    base = {"name": "g", "peak_tflops": {"bf16": 100, "tf32": 50}, "memory_gib": 8, "memory_tbps": 1}
    assert from_dict(base).duration_us(1e12, 0, matmul=True) == pytest.approx(1e4)  # no curve: the peak
    for bad in ([[10, 0.5], [1, 0.4]], [[1, 1.5]], [[0, 0.5]], [[1]]):
        with pytest.raises(PlanError, match="device"):
            from_dict({**base, "matmul_efficiency": bad})
    with pytest.raises(PlanError, match="memory_efficiency must be in"):
        from_dict({**base, "memory_efficiency": 0})
    slow = from_dict({**base, "matmul_efficiency": [[1, 0.25], [100, 0.5]], "memory_efficiency": 0.5})
    assert slow.duration_us(1e9, 0, matmul=True) == pytest.approx(1e9 / 25e12 * 1e6)
    assert slow.duration_us(1e10, 0, matmul=True) == pytest.approx(1e10 / 37.5e12 * 1e6)  # log-midway: 0.375
    assert slow.duration_us(0, 1e9) == pytest.approx(1e9 / 0.5e12 * 1e6)


# --- the network: NCCL's ring and tree formulas, by hand ---------------------------------------

NET = network_from_dict({"name": "two-tier", "tiers": [
    {"name": "nvlink", "size": 8, "bandwidth_gbps": 400, "latency_us": 2, "efficiency": 0.5},
    {"name": "ib", "size": None, "bandwidth_gbps": 50, "latency_us": 10, "efficiency": 1.0}]})


def _us(ctype, size, members, net=NET):
    cost = net.bind({7: tuple(members)})
    return cost.collective_us(ctype, size, 7)


def test_ring_collectives_inside_one_nvlink_domain():
    S = 8 * 10**8  # bytes; nvlink: 400 GB/s x 0.5 = 2e5 B/us
    # all-reduce, 8 ranks: 2(n-1) steps of latency + 2(n-1)/n S / B (nccl-tests busbw factor)
    assert _us(pb.ALL_REDUCE, S, range(8)) == pytest.approx(14 * 2 + 2 * 7 / 8 * S / 2e5)
    assert _us(pb.REDUCE_SCATTER, S, range(8)) == pytest.approx(7 * 2 + 7 / 8 * S / 2e5)
    # Chakra's all-gather size is the shard: (n-1) shards cross each link
    assert _us(pb.ALL_GATHER, S // 8, range(8)) == pytest.approx(7 * 2 + 7 * (S // 8) / 2e5)
    assert _us(pb.ALL_TO_ALL, S, range(0, 8, 2)) == pytest.approx(3 * 2 + 3 / 4 * S / 2e5)
    assert _us(pb.ALL_REDUCE, S, [5]) == 0


def test_a_group_spanning_nodes_pays_the_slowest_tier():
    S = 10**9
    # ranks 4..11 straddle two 8-GPU nodes: the whole ring runs at the IB tier's 5e4 B/us
    assert _us(pb.ALL_REDUCE, S, range(4, 12)) == pytest.approx(14 * 10 + 2 * 7 / 8 * S / 5e4)
    assert _us(pb.ALL_REDUCE, S, range(8, 16)) == pytest.approx(14 * 2 + 2 * 7 / 8 * S / 2e5)
    send = NET.bind({}, ranks=[3, 11])
    assert send.send_us(0, 1, S) == pytest.approx(10 + S / 5e4)
    assert NET.bind({}, ranks=[3, 4]).send_us(0, 1, S) == pytest.approx(2 + S / 2e5)


def test_tree_all_reduce_trades_bandwidth_for_log_latency():
    tree = network_from_dict({"all_reduce": "tree", "tiers": [
        {"size": None, "bandwidth_gbps": 50, "latency_us": 10, "efficiency": 1.0}]})
    # double binary tree: 2 ceil(log2 n) latency steps, each rank sends S up and down
    assert _us(pb.ALL_REDUCE, 10**6, range(64), tree) == pytest.approx(2 * 6 * 10 + 2 * 10**6 / 5e4)
    ring = _us(pb.ALL_REDUCE, 10**6, range(64), network_from_dict({"tiers": [
        {"size": None, "bandwidth_gbps": 50, "latency_us": 10, "efficiency": 1.0}]}))
    assert ring == pytest.approx(2 * 63 * 10 + 2 * 63 / 64 * 10**6 / 5e4)
    assert _us(pb.ALL_REDUCE, 10**6, range(64), tree) < ring  # small message: latency wins


@pytest.mark.parametrize("bad, field", [
    ({"tiers": []}, "tiers"),
    ({"tiers": [{"size": 8, "bandwidth_gbps": -1, "latency_us": 1, "efficiency": 1}]}, "bandwidth_gbps"),
    ({"tiers": [{"size": 8, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1.5}]}, "efficiency"),
    ({"tiers": [{"size": None, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1},
                {"size": 8, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1}]}, "size null"),
    ({"all_reduce": "mesh", "tiers": [{"size": 8, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1}]}, "all_reduce"),
])
def test_bad_network_files_name_the_field(bad, field):
    with pytest.raises(PlanError, match=field):
        network_from_dict(bad)


# --- the estimate is the timed replay of the written set ------------------------------------

MOE = dict(name="mid-moe", family="mixtral", layers=4, hidden=1024, ffn=2048, heads=16, kv_heads=4, vocab=4096,
           experts=8, top_k=2, moe_ffn=1024)


@pytest.mark.parametrize("model, plan", [
    (MID, Plan(dp=2, tp=2, pp=2, zero=1, micro_batch=1, global_batch=8, seq=512)),
    (MID, Plan(dp=2, tp=2, pp=2, schedule="interleaved", vpp=2, global_batch=8, seq=512, recompute="full")),
    (MID, Plan(dp=4, cp=2, zero=3, global_batch=8, seq=512)),
    (MID, Plan(dp=2, tp=2, pp=2, schedule="zb-h1", global_batch=8, seq=512)),
    (MOE, Plan(dp=4, ep=4, tp=2, global_batch=8, seq=512)),
    (MOE, Plan(dp=4, ep=2, pp=2, global_batch=8, seq=512, expert_skew=1.0)),  # variants: skewed expert loads
    ("dlrm-kaggle", Plan(dp=8, global_batch=8 * 2048, micro_batch=2048, embedding_sharding="table_wise")),
    (MID, Plan(dp=8, global_batch=16, seq=512)),
    (MID, Plan(dp=4, zero=2, global_batch=8, seq=512)),
    (MID, Plan(tp=4, sp=False, dp=2, global_batch=4, seq=512)),
    (MID, Plan(tp=4, sp=True, dp=2, global_batch=4, seq=512, recompute="selective")),
    (MID, Plan(tp=2, pp=4, schedule="gpipe", global_batch=8, seq=512)),
    (MID, Plan(dp=2, pp=4, schedule="1f1b", global_batch=16, seq=512, micro_batch=2)),
    (MID, Plan(pp=2, dp=2, tp=2, schedule="interleaved", vpp=2, global_batch=8, seq=512)),
    (MID, Plan(pp=4, dp=2, schedule="zb-h1", global_batch=8, seq=512, recompute="full")),
    (MID, Plan(tp=2, cp=2, dp=2, global_batch=4, seq=1024)),
    (MID, Plan(cp=2, pp=2, dp=2, zero=1, global_batch=8, seq=1024)),
    (MID, Plan(tp=2, dp=4, zero=3, global_batch=8, seq=512, recompute="full")),
    (MID, Plan(pp=2, dp=4, zero=2, schedule="gpipe", global_batch=8, seq=512)),
    (MOE, Plan(dp=8, ep=8, global_batch=8, seq=512)),
    (MOE, Plan(dp=4, ep=4, zero=1, global_batch=8, seq=512)),
    (MOE, Plan(tp=2, sp=True, dp=4, ep=2, pp=2, global_batch=8, seq=512)),
    (MOE, Plan(dp=2, ep=2, cp=2, global_batch=4, seq=1024)),
    (MOE, Plan(dp=4, ep=4, pp=2, schedule="interleaved", vpp=2, global_batch=8, seq=512)),
    (MOE, Plan(dp=8, ep=4, zero=3, global_batch=8, seq=512)),
    ("dlrm-kaggle", Plan(dp=8, global_batch=8 * 2048, micro_batch=2048, embedding_sharding="row_wise")),
    ("dlrm-kaggle", Plan(dp=4, global_batch=4 * 2048, micro_batch=2048, embedding_sharding="column_wise")),
    ("dlrm-kaggle", Plan(dp=8, global_batch=8 * 2048, micro_batch=2048, embedding_sharding="data_parallel")),
    ("dlrm-kaggle", Plan(dp=2, local_world_size=4, global_batch=8 * 2048, micro_batch=2048,
                         embedding_sharding="table_row_wise")),
    (MID, Plan(dp=4, pp=2, tp=2, schedule="1f1b", global_batch=16, seq=512, zero=1, recompute="selective")),
], ids=["tp-pp-zero1", "interleaved-recompute", "cp-zero3", "zb-h1", "moe-ep-tp", "moe-skew-pp", "dlrm",
        "dp", "zero2", "tp", "tp-sp-selective", "gpipe", "1f1b-mb2", "interleaved-tp", "zb-h1-full", "tp-cp",
        "cp-pp-zero1", "tp-zero3-full", "gpipe-zero2", "moe-ep8", "moe-ep-zero1", "moe-tp-sp-ep-pp", "moe-cp",
        "moe-interleaved", "moe-zero3", "dlrm-row", "dlrm-column", "dlrm-dp", "dlrm-table-row", "dp-pp-tp-selective"])
def test_estimate_equals_the_timed_replay_of_the_written_set(model, plan, tmp_path):
    network = load_network("dgx-h100-superpod")
    # 4 GPUs per node here, so the dp and pp groups cross the slow tier
    small_nodes = network_from_dict({"tiers": [
        {"size": 4, "bandwidth_gbps": 450, "latency_us": 3.4, "efficiency": 0.8},
        {"size": None, "bandwidth_gbps": 50, "latency_us": 5, "efficiency": 0.9}]})
    # ASTRA-sim's choices: groups of every rank tier by tier, all-to-all relayed around the ring
    astra_like = network_from_dict({"hierarchical": True, "all_to_all": "ring", "tiers": [
        {"size": 2, "bandwidth_gbps": 200, "latency_us": 2, "efficiency": 0.9},
        {"size": None, "bandwidth_gbps": 25, "latency_us": 5, "efficiency": 0.9}]})
    workload = build(model, plan)
    generate(model, plan, tmp_path)
    # the ASTRA-like paths (per-tier collectives over every rank, ring all-to-all) where they apply
    astra = (astra_like,) if plan.ep > 1 or plan.dp * plan.local_world_size == workload.mesh.size else ()
    for net in (network, small_nodes, *astra):
        ours = estimate(workload, net).step_us
        replayed = timed_replay(tmp_path, comm="alpha-beta", network=net).makespan_us
        assert ours == pytest.approx(replayed, rel=0.02)
    free = timed_replay(tmp_path, comm="free").makespan_us
    assert estimate(workload, small_nodes).exposed_comm_us == pytest.approx(
        timed_replay(tmp_path, comm="alpha-beta", network=small_nodes).makespan_us - free, rel=0.02, abs=1)


def test_a_program_with_rows_of_its_own_is_swept_from_its_rows():
    """A timed program is its repeats (stg.program.Repeats), read as they are by the sweep
    (stg/chakra/repeat_paths.py); one that also holds rows of its own (an action lowering could
    not record) is swept from its rows made (stg/chakra/longest_paths.py), to the same times."""
    from dataclasses import replace

    from stg.chakra.longest_paths import SlicePaths
    from stg.chakra.repeat_paths import RepeatPaths
    from stg.chakra.replay import CommCost
    from stg.explore.cost import group_spans
    from stg.program import ReplayChunks
    from stg.slice_check import slice_paths, slice_ranks

    network = load_network("dgx-h100-superpod")
    workload = build(MID, Plan(dp=2, tp=2, pp=2, zero=1, global_batch=8, seq=512), timing=True)
    ranks = slice_ranks(workload)
    swept = slice_paths(workload, ranks)
    assert isinstance(swept, RepeatPaths)
    programs = list(workload.programs)
    mixed = ReplayChunks()
    for part in programs[0].timed.parts:  # the first stage's first repeats as rows of its own
        rows, comm = part.rows()
        mixed.add(*rows, comm) if not mixed.parts else mixed.add_repeats(part)
    mixed.ids = programs[0].timed.ids
    assert mixed.repeats is None and programs[0].timed.repeats is not None
    programs[0] = replace(programs[0], timed=mixed)
    rows = slice_paths(replace(workload, programs=tuple(programs)), ranks)
    assert isinstance(rows, SlicePaths)
    assert len(programs[0].replay.ids) == len(workload.programs[0].replay.ids)
    costs = [CommCost(), network.bound(group_spans(workload, ranks), ranks, workload.mesh.size)]
    assert rows.runs(costs) == swept.runs(costs)


def test_a_slice_whose_tags_do_not_fit_the_sweep_is_timed_by_the_event_queue(monkeypatch):
    """The repeats' sweep keys a message by its pair and tag in 64 bits; a slice whose tags,
    shifted, would not fit is not swept (None), and the event queue times it, to the same
    numbers."""
    import stg.chakra.repeat_paths
    from stg.chakra.replay import CommCost
    from stg.slice_check import slice_paths, slice_ranks

    network = load_network("dgx-h100-superpod")
    workload = build(MID, Plan(dp=2, tp=2, pp=2, zero=1, global_batch=8, seq=512), timing=True)
    swept = slice_timings(workload, network)
    monkeypatch.setattr(stg.chakra.repeat_paths, "TAG_LIMIT", 1)
    ranks = slice_ranks(workload)
    assert slice_paths(workload, ranks).runs([CommCost()]) == [None]
    assert slice_timings(workload, network) == swept


def test_a_slice_the_sweep_cannot_order_is_timed_by_the_event_queue(monkeypatch):
    """slice_timings runs the longest-path sweep first (stg/chakra/longest_paths.py, of
    programs lowered for timing stg/chakra/repeat_paths.py); where it stalls (None), the
    compiled event queue times the slice, with the same numbers."""
    from stg.chakra.longest_paths import SlicePaths
    from stg.chakra.repeat_paths import RepeatPaths

    network = load_network("dgx-h100-superpod")
    plan = Plan(dp=2, tp=2, pp=2, zero=1, global_batch=8, seq=512)
    runs = []

    def stalled(self, costs):
        runs.extend(costs)
        return [None] * len(costs)

    for workload in build(MID, plan, timing=True), build(MID, plan):
        swept = slice_timings(workload, network)
        runs.clear()
        for sweep in SlicePaths, RepeatPaths:
            monkeypatch.setattr(sweep, "runs", stalled)
        assert slice_timings(workload, network) == swept and len(runs) == 2
        monkeypatch.undo()


# --- the search ----------------------------------------------------------------------------

def test_search_drops_by_reason_and_ranks_by_step_time():
    result = explore(MID, Cluster(gpus=8), Job(global_batch=8, seq=512),
                     Space(tp=(1, 2, 3), pp=(1, 2), recompute=("none",), micro_batch=(1, 3), schedule=("1f1b",)))
    # tp=3 never divides 8 GPUs (2 pp values); micro_batch 3 never divides the batch of 8
    assert result.dropped["gpus: tp*cp*pp does not divide them"] == 2
    assert result.dropped["global_batch (PlanError)"] == 4
    assert len(result.rows) == 4 and result.considered == 10
    steps = [r.estimate.step_us for r in result.rows]
    assert steps == sorted(steps)
    for row in result.rows:
        e = row.estimate
        assert e.tokens == 8 * 512 and e.tokens_per_s == pytest.approx(8 * 512 / (e.step_us / 1e6))
        assert e.compute_us <= e.step_us and 0 <= e.bubble < 1


def test_workers_do_not_change_the_result():
    """Forked workers take chunks of one structure each, the heaviest replays first, and
    return them as they finish; the ranking and the drops are the same."""
    from stg.evaluation import structure_order
    from stg.explore.search import _chunks, _work

    args = (MID, Cluster(gpus=8), Job(global_batch=8, seq=512),
            Space(tp=(1, 2), pp=(1, 2), zero=(0, 1), recompute=("none", "full"), micro_batch=(1, 3),
                  schedule=("1f1b",)))
    alone, forked = explore(*args), explore(*args, workers=2)
    assert forked.to_dict() == alone.to_dict() and len(alone.rows) == 16
    candidates = [row.plan for row in alone.rows]
    chunks = _chunks(candidates, 2)
    assert sorted(map(id, sum(chunks, []))) == sorted(map(id, candidates))
    assert all(len({structure_order(plan)[:2] for plan in chunk}) == 1 for chunk in chunks)
    work = [sum(map(_work, chunk)) for chunk in chunks]
    assert work == sorted(work, reverse=True)
    with pytest.raises(PlanError, match="workers: must be a positive integer"):
        explore(*args, workers=0)


def test_python_api_is_stg_explore():
    import stg

    result = stg.explore(MID, Cluster(gpus=2), Job(global_batch=2, seq=512),
                         Space(tp=(2,), pp=(1,), recompute=("none",), micro_batch=(1,)))
    assert [(r.plan.tp, r.plan.dp) for r in result.rows] == [(2, 1)]


def test_memory_over_the_device_is_dropped(tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"name": "tiny-gpu", "peak_tflops": {"bf16": 100, "tf32": 50},
                                     "memory_gib": 0.05, "memory_tbps": 1}))
    result = explore(MID, Cluster(gpus=4, device=str(small)), Job(global_batch=4, seq=512),
                     Space(tp=(1, 4), pp=(1,), recompute=("none",), micro_batch=(1,)))
    # dp=4 replicates ~44M params in bf16 + fp32 Adam states (~0.5 GiB); tp=4 a quarter: both over 50 MiB
    assert result.rows == () and result.dropped == {"memory (over the device)": 2} and result.considered == 2


def test_a_device_files_gemm_efficiency_slows_its_gemms_only(tmp_path):
    """A device file's matmul_efficiency: at a flat half of peak, every GEMM of a compute-bound
    device takes twice as long and every other op as long (whole microseconds, the rounding
    carried along the chain)."""
    from stg.device import register_device
    from stg.program import NodeType

    base = {"peak_tflops": {"bf16": 100, "tf32": 50}, "memory_gib": 80, "memory_tbps": 1000}
    for name, curve in (("peak-gpu", {}), ("half-gpu", {"matmul_efficiency": [[1, 0.5]]})):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, **base, **curve}))
        register_device(str(tmp_path / f"{name}.yaml"))
    at_peak, at_half = ([n for n in build(MID, Plan(global_batch=1, seq=512, device=name)).programs[0].nodes
                         if n.type is NodeType.COMP_NODE] for name in ("peak-gpu", "half-gpu"))
    gemm_us = 0
    for fast, slow in zip(at_peak, at_half, strict=True):
        gemm = fast.op_type.startswith("einsum")
        gemm_us += fast.duration_us if gemm else 0
        assert slow.duration_us == pytest.approx(fast.duration_us * (2 if gemm else 1), abs=2)
    assert gemm_us > 500  # (mlp.up alone: 2 x 512 x 1024 x 2816 FLOPs at 100 TFLOP/s, 30 us)


def test_build_refuses_over_its_memory_limit_with_the_summary_peak():
    from stg.api import MemoryLimitError

    plan = Plan(dp=2, global_batch=2, seq=512)
    peak = max(c["memory"]["peak"] for c in build(MID, plan).summary()["rank_classes"])
    build(MID, plan, memory_limit=peak)  # exactly at the limit fits
    with pytest.raises(MemoryLimitError, match="memory: peak") as refused:
        build(MID, plan, memory_limit=peak - 1)
    assert refused.value.peak == peak


def test_written_winners_carry_their_plan_and_the_same_memory(tmp_path):
    result = explore(MID, Cluster(gpus=4), Job(global_batch=4, seq=512),
                     Space(tp=(2, 4), pp=(1,), recompute=("none",), micro_batch=(1,)))
    folders = write_top(MID, result, 2, tmp_path)
    assert len(folders) == 2
    for row, folder in zip(result.rows, folders):
        assert Plan.from_yaml(folder / "plan.yaml") == row.plan
        summary = json.loads((folder / "summary.json").read_text())
        assert max(c["memory"]["peak"] for c in summary["rank_classes"]) == row.estimate.peak_memory


def test_pareto_front_keeps_the_plans_nothing_beats_on_both(tmp_path):
    from stg.explore.cost import Estimate
    from stg.explore.plot import pareto
    from stg.explore.search import Row

    def row(step, mem):
        return Row(Plan(dp=step), Estimate(step, step, 0, 0, 1, mem, {}, 1, 1, 1.0))

    rows = [row(3, 10), row(1, 50), row(2, 60), row(4, 10), row(5, 5), row(2, 40)]
    # (2, 60) is beaten by (1, 50); (4, 10) by (3, 10)
    assert [(r.estimate.step_us, r.estimate.peak_memory) for r in pareto(rows)] == [(1, 50), (2, 40), (3, 10), (5, 5)]


def test_cli_explore_json_and_validate_with_the_same_network(tmp_path):
    runner = CliRunner()
    args = ["explore", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "1024", "--tp", "8",
            "--pp", "1", "--recompute", "full", "--micro-batch", "1", "--json", "-q", "--top", "1",
            "--write", str(tmp_path), "--plot", str(tmp_path / "front.svg")]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    again = runner.invoke(app, args[:-4])  # the same search, not written: the same JSON
    assert again.stdout == done.stdout
    rows = json.loads(done.stdout)["rows"]
    assert len(rows) == 1 and rows[0]["tp"] == 8 and rows[0]["dp"] == 1
    assert (tmp_path / "front.svg").read_bytes().startswith(b"<?xml")
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    timed = runner.invoke(app, ["validate", str(folder), "--timed", "alpha-beta", "--network",
                                "dgx-h100-superpod", "--json"])
    assert timed.exit_code == 0, timed.output
    free = runner.invoke(app, ["validate", str(folder), "--timed", "free", "--network", "dgx-h100-superpod"])
    assert free.exit_code == 2 and "error: network" in free.output
    makespan = json.loads(timed.stdout.splitlines()[-1])["makespan_us"]
    assert makespan == pytest.approx(rows[0]["step_ms"] * 1e3, rel=0.02)
    # MFU's model FLOPs against PaLM's count (Chowdhery et al. 2022, App. B): 6 x the matmul
    # parameters (8.03e9 for Llama 3 8B less the 128256 x 4096 input embedding, a lookup) per
    # token, plus attention 12 L h s per token, halved for the causal mask; peak: H100 bf16 dense
    tokens, L, h, s = 8 * 1024, 32, 4096, 1024
    palm = 6 * (8.03e9 - 128256 * 4096) * tokens + 12 * L * h * s * tokens / 2
    flops = rows[0]["mfu"] * rows[0]["step_ms"] / 1e3 * 8 * 1979e12 / 2
    assert flops == pytest.approx(palm, rel=0.03)


@pytest.mark.parametrize("args, field", [
    (["--tp", "4,x"], "tp: expected a comma-separated list of integers"),
    (["--sp", "maybe"], "sp: expected a comma-separated list of true or false"),
    (["--zero", "1,5"], "zero: 5 is not a ZeRO stage"),
    (["--network", "nowhere"], "network"),
    (["--device", "tpu9"], "device"),
    (["--recompute", "most"], "recompute"),
    (["--global-batch-tokens", "1000"], "global_batch"),
    (["--top", "0"], "top"),
    (["--headroom", "1.5"], "headroom"),
    (["--nodes", "2"], "gpus"),  # --gpus and --nodes both given
])
def test_cli_explore_bad_input_is_one_line_exit_2(args, field):
    base = ["explore", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "1024", "-q"]
    done = CliRunner().invoke(app, base + args)
    assert done.exit_code == 2
    assert f"error: {field}" in done.output and "Traceback" not in done.output


def test_cli_nodes_count_gpus_per_node(tmp_path):
    """--nodes 2 --gpus-per-node 4 is an 8-GPU cluster, as --gpus 8 is."""
    args = ["explore", str(_mid_file(tmp_path)), "--global-batch", "8", "--seq", "512", "--tp", "2", "--pp", "1",
            "--recompute", "none", "--micro-batch", "1", "--json", "--workers", "1"]
    by_nodes = CliRunner().invoke(app, args + ["--nodes", "2", "--gpus-per-node", "4"])
    by_gpus = CliRunner().invoke(app, args + ["--gpus", "8", "--gpus-per-node", "4"])
    assert by_nodes.exit_code == 0, by_nodes.output
    rows = json.loads(by_nodes.output)["rows"]
    assert by_nodes.output == by_gpus.output and [(r["dp"], r["tp"]) for r in rows] == [(4, 2)]


def _mid_file(tmp_path):
    path = tmp_path / "mid.yaml"
    path.write_text(yaml.safe_dump(MID))
    return path


def test_recommendation_models_search_their_table_sharding():
    """A DLRM is searched over TorchRec's sharding types (and stg's planner): tp/pp/ZeRO do
    not apply; table-row-wise gets a host of gpus_per_node ranks; every type is a valid plan
    on 8 GPUs in hosts of 4, one micro-batch of 64 / 8 = 8 samples per rank."""
    from test_digests import DLRM

    result = explore(DLRM, Cluster(gpus=8, gpus_per_node=4), Job(global_batch=64, seq=4096),
                     Space(embedding_sharding=("auto", "table_wise", "row_wise", "table_row_wise", "data_parallel")))
    assert result.considered == 5 and not result.dropped
    by_type = {r.plan.embedding_sharding: r.plan for r in result.rows}
    assert set(by_type) == {"auto", "table_wise", "row_wise", "table_row_wise", "data_parallel"}
    assert (by_type["table_row_wise"].dp, by_type["table_row_wise"].local_world_size) == (2, 4)
    assert all(p.micro_batch == 8 and p.tp == p.pp == 1 and p.zero == 0 for p in by_type.values())
    assert all(r.estimate.tokens == 64 for r in result.rows)  # samples, not seq x samples
    with pytest.raises(PlanError, match="embedding_sharding: 'diagonal' is not one of"):
        Space(embedding_sharding=("diagonal",))


@pytest.mark.parametrize("schedule, zero, tp, pp", [("1f1b", 1, 2, 2), ("interleaved", 0, 1, 2), ("zb-h1", 3, 1, 2),
                                                    ("gpipe", 3, 2, 2), ("1f1b", 3, 2, 1), ("1f1b", 1, 1, 1)])
def test_a_long_pipeline_is_timed_from_two_probes_as_its_whole_replay(schedule, zero, tp, pp):
    """With m > 12 pp micro-batches the search replays 3 pp and 6 pp (the interleaved schedule
    2 pp and 4 pp, from m > 8 pp) and extends the times linearly (stg/explore/probe.py); the
    step stays within 0.5 % of replaying all m (the periodic regime of a max-plus system), the
    memory and FLOPs are the plan's own. Without a pipeline (pp = 1: gradient accumulation) too."""
    from stg.explore.probe import plan_timings, probe_counts

    m = 26 if pp == 2 else 20
    plan = Plan(dp=2, tp=tp, pp=pp, schedule=schedule, vpp=2 if schedule == "interleaved" else 1, zero=zero,
                global_batch=2 * m, seq=512)
    assert probe_counts(plan) == ((2 * pp, 4 * pp) if schedule == "interleaved" else (3 * pp, 6 * pp))
    network = load_network("dgx-h100-superpod")
    whole = estimate(build(MID, plan), network)
    probed = estimate(build(MID, plan, nodes=False), network, plan_timings(MID, plan, network))
    assert probed.step_us == pytest.approx(whole.step_us, rel=0.005)
    assert probed.compute_us == pytest.approx(whole.compute_us, rel=0.005)
    assert (probed.peak_memory, probed.model_flops) == (whole.peak_memory, whole.model_flops)


def _folded_as_whole(model: dict, plan: Plan, counts: tuple) -> None:
    """`plan` is folded at `counts` (fold_counts), and its folded timings are within 0.5 % of
    its whole replay: the step and each stage's busy time, with free and costed communication."""
    from stg.explore.probe import fold_counts, folded_timings

    network = load_network("dgx-h100-superpod")
    counted = build(model, plan, nodes=False)
    assert fold_counts(counted, network) == counts
    whole = slice_timings(build(model, plan, timing=True), network)
    folded = folded_timings(load_model(model), counted, network)[0]
    for f, w in zip(folded, whole):
        assert f.makespan_us == pytest.approx(w.makespan_us, rel=0.005)
        assert f.busy_us == pytest.approx(w.busy_us, rel=0.005)


@pytest.mark.parametrize("schedule, zero, layers, layers_per_stage, seq", [
    ("1f1b", 1, 12, None, 512), ("zb-h1", 3, 12, None, 512), ("gpipe", 0, 12, None, 512), ("1f1b", 1, 22, "auto", 512),
    ("interleaved", 1, 24, None, 2048), ("interleaved", 3, 48, None, 512)])
def test_a_long_pipeline_is_timed_from_four_folded_ones_as_its_whole_replay(schedule, zero, layers, layers_per_stage,
                                                                            seq):
    """A pipeline whose middle stages hold the same blocks, with m >= 2 pp micro-batches, is
    timed from four shorter ones of fewer blocks (stg/explore/probe.py, fold_counts); the
    step stays within 0.5 % of replaying the whole plan (0.11 % at most here, 360
    micro-batches: this small model's COMP nodes last a few µs, rounded to whole ones), each
    stage's busy time too. The balanced cut of 22 blocks is 1, 2 x 10, 1. The interleaved
    schedule (two virtual stages a stage) folds too, its micro-batches whole groups of both
    folds' stages (36, 72): 0.02 % and 0.05 % off here (at seq 512 with one block a virtual
    stage, 0.56 %: its step's slope in pp settles only past 8 stages when p2p latency weighs
    this much)."""
    model = dict(MID, layers=layers)
    # tp 2 x dp 2: four ranks a stage, so the stages alternate NVLink and InfiniBand links (period 2)
    plan = Plan(dp=2, tp=2, pp=12, schedule=schedule, vpp=2 if schedule == "interleaved" else 1, zero=zero,
                global_batch=2 * 360, seq=seq, layers_per_stage=layers_per_stage)
    _folded_as_whole(model, plan, ((4, 6), (36, 72)))


@pytest.mark.parametrize("schedule, m, counts", [("1f1b", 32, (32,)), ("gpipe", 48, (48,)),
                                                ("1f1b", 16, (16,)), ("1f1b", 128, (36, 72))])
def test_a_short_1f1b_or_gpipe_pipeline_is_folded_too(schedule, m, counts):
    """Under 1F1B and GPipe a pipeline of m = pp micro-batches (or fewer, or a few more) is
    folded too, at its own micro-batch count alone (two folds of 4 and 6 stages, the fit
    linear in pp: it pays from 40 stages on), and one of more than 18 micro-batches per stage
    of the longer fold (6 x 18 = 108) at 6 and 12 per stage (36 and 72), which replay fewer;
    the step and each stage's busy time stay within 0.5 % of the whole replay (0.05 % here).
    An interleaved or ZB-H1 plan needs m >= 2 pp (stg/explore/probe.py: 0.8-6.8 % and 1 %
    off)."""
    from stg.explore.probe import may_fold

    model = dict(MID, layers=40)
    plan = Plan(dp=2, tp=2, pp=40, schedule=schedule, zero=1, global_batch=2 * m, seq=512)
    _folded_as_whole(model, plan, ((4, 6), counts))
    for other in ("zb-h1", "interleaved") if m < 2 * plan.pp else ():
        assert not may_fold(Plan(dp=2, tp=2, pp=40, schedule=other, vpp=2 if other == "interleaved" else 1,
                                 global_batch=2 * m, seq=512))
