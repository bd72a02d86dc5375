"""`--simulate astra-sim` without ASTRA-sim: the network and system files derived from a network
description (numbers by hand), the models that match ASTRA-sim's algorithms (ring all-to-all,
per-tier collectives over every rank), the parsing of a captured ASTRA-sim log, and the
one-line error when no binary is found."""

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stg.chakra import et_def_pb2 as pb
from stg.cli import app
from stg.errors import PlanError
from stg.explore import load_network
from stg.explore.astra import ENV, find_binary, misaligned, network_config, network_yaml, parse_output, system_config
from stg.explore.network import network_from_dict

FIXTURES = Path(__file__).parent / "data"

TWO = network_from_dict({"hierarchical": True, "all_to_all": "ring", "tiers": [
    {"size": 4, "bandwidth_gbps": 100, "latency_us": 2, "efficiency": 1.0},
    {"size": None, "bandwidth_gbps": 10, "latency_us": 5, "efficiency": 1.0}]})


# --- the derived ASTRA-sim configuration --------------------------------------------------------

def test_dgx_h100_network_in_astra_units():
    config = network_config(load_network("dgx-h100-superpod"), 16)
    assert config["topology"] == ["Switch", "Switch"]
    assert config["npus_count"] == [8, 2]  # 8 GPUs a node, 16 / 8 nodes
    # 450 GB/s x 0.8 = 360e9 B/s and 50 x 0.9 = 45e9 B/s, in ASTRA-sim's GB of 2^30 bytes
    assert config["bandwidth"] == pytest.approx([360e9 / 1073741824, 45e9 / 1073741824])
    assert config["bandwidth"][1] == pytest.approx(41.9095, abs=1e-4)
    # a switch hop crosses two links: half of the per-step latency on each (3.4 us, 5 us)
    assert config["latency"] == pytest.approx([1700, 2500])
    assert network_yaml(config).splitlines()[:2] == ["topology: [ Switch, Switch ]", "npus_count: [ 8, 2 ]"]


def test_torus_has_three_ring_dimensions():
    config = network_config(load_network("torus-3d-4x4x4"), 64)
    assert config["topology"] == ["Ring", "Ring", "Ring"]
    assert config["npus_count"] == [4, 4, 4]
    assert config["latency"] == [1000, 1000, 1000]  # neighbours one link apart: 1 us per hop
    assert network_config(load_network("torus-3d-4x4x4"), 128)["npus_count"] == [4, 4, 8]  # z holds the rest
    assert network_config(load_network("dgx-h100-superpod"), 4)["npus_count"] == [4]  # inside one node


def test_system_file_matches_the_network_choices():
    system = system_config(TWO, 2, 3350)
    assert system["preferred-dataset-splits"] == 1  # one chunk: latency once per ring step, as stg
    assert system["all-to-all-implementation"] == ["ring", "ring"]
    assert system["all-reduce-implementation"] == ["ring", "ring"]
    assert system["collective-optimization"] == "localBWAware"
    # compute nodes take the durations stg wrote (GEMM efficiency included), not ASTRA-sim's roofline
    assert (system["local-mem-bw"], system["roofline-enabled"]) == (3350, 0)
    direct = system_config(load_network("fat-tree-400g"), 1, 1.0)
    assert direct["all-to-all-implementation"] == ["direct1"]  # n-1 exchanges, one at a time


def test_world_that_the_tiers_do_not_divide_names_the_field():
    with pytest.raises(PlanError, match="tiers"):
        network_config(load_network("dgx-h100-superpod"), 12)
    with pytest.raises(PlanError, match="at least 2 NPUs"):
        network_config(TWO, 1)


# --- the collective models that match ASTRA-sim ------------------------------------------------

def _cost(net, ctype, size, members, world):
    return net.bind({7: tuple(members)}, world=world).collective_us(ctype, size, 7)


def test_ring_all_to_all_relays_around_the_ring():
    # ASTRA-sim's ring all-to-all: n(n-1)/2 messages of S/n, one after the other
    S, n = 8 * 10**6, 4  # tier 0: 1e5 B/us, 2 us a step
    messages = n * (n - 1) // 2
    assert _cost(TWO, pb.ALL_TO_ALL, S, range(n), 16) == pytest.approx(messages * 2 + messages * (S / n) / 1e5)
    direct = network_from_dict({"tiers": [{"size": None, "bandwidth_gbps": 100, "latency_us": 2, "efficiency": 1}]})
    assert _cost(direct, pb.ALL_TO_ALL, S, range(n), n) == pytest.approx((n - 1) * 2 + (n - 1) * (S / n) / 1e5)


def test_collective_over_every_rank_runs_tier_by_tier():
    S = 16 * 10**6  # 4 x 4 ranks; tier 0: 1e5 B/us, L 2; tier 1: 1e4 B/us, L 5
    rs0 = 3 * 2 + 3 / 4 * S / 1e5  # reduce-scatter over the node
    ar1 = 2 * 3 * 5 + 2 * 3 / 4 * (S / 4) / 1e4  # all-reduce of the quarter across nodes
    assert _cost(TWO, pb.ALL_REDUCE, S, range(16), 16) == pytest.approx(2 * rs0 + ar1)
    rs1 = 3 * 5 + 3 / 4 * (S / 4) / 1e4
    assert _cost(TWO, pb.REDUCE_SCATTER, S, range(16), 16) == pytest.approx(rs0 + rs1)
    s = 10**6  # all-gather: across nodes first (shard s), then inside the node (4 s)
    assert _cost(TWO, pb.ALL_GATHER, s, range(16), 16) == pytest.approx(3 * 5 + 3 * s / 1e4 + 3 * 2 + 3 * 4 * s / 1e5)
    a2a = (6 * 2 + 3 / 2 * S / 1e5) + (6 * 5 + 3 / 2 * S / 1e4)  # the whole buffer on each tier
    assert _cost(TWO, pb.ALL_TO_ALL, S, range(16), 16) == pytest.approx(a2a)
    # a sub-group still runs one ring on the outermost tier it spans
    assert _cost(TWO, pb.ALL_REDUCE, S, range(0, 16, 4), 16) == pytest.approx(6 * 5 + 2 * 3 / 4 * S / 1e4)
    flat = network_from_dict({"tiers": [{"size": 4, "bandwidth_gbps": 100, "latency_us": 2, "efficiency": 1.0},
                                        {"size": None, "bandwidth_gbps": 10, "latency_us": 5, "efficiency": 1.0}]})
    assert _cost(flat, pb.ALL_REDUCE, S, range(16), 16) == pytest.approx(30 * 5 + 2 * 15 / 16 * S / 1e4)


def test_reduction_steps_read_two_and_write_one_message_at_memory_bandwidth():
    # ASTRA-sim's local-mem-bw: each of the n-1 reducing steps moves 3 messages of S/n
    slow = network_from_dict({"reduction_gbps": 1000, "tiers": [
        {"size": None, "bandwidth_gbps": 100, "latency_us": 2, "efficiency": 1.0}]})
    S = 8 * 10**6  # 4 ranks; network 1e5 B/us, memory 1e6 B/us
    extra = 3 * 3 / 4 * S / 1e6
    assert _cost(slow, pb.ALL_REDUCE, S, range(4), 4) == pytest.approx(6 * 2 + 2 * 3 / 4 * S / 1e5 + extra)
    assert _cost(slow, pb.REDUCE_SCATTER, S, range(4), 4) == pytest.approx(3 * 2 + 3 / 4 * S / 1e5 + extra)
    assert _cost(slow, pb.ALL_GATHER, S // 4, range(4), 4) == pytest.approx(3 * 2 + 3 * (S // 4) / 1e5)  # no reduction


def test_groups_that_astra_routes_on_another_tier_are_flagged():
    groups = {1: list(range(4)), 2: [0, 4, 8, 12], 3: list(range(8)), 4: list(range(16)), 5: [1, 5, 9, 13]}
    # ranks 3 -> 4 differ first in dimension 0: ASTRA-sim charges the node tier, stg the fabric
    assert misaligned(TWO, groups, 16) == [3]
    flat = network_from_dict({"tiers": [{"size": 4, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1},
                                        {"size": None, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1}]})
    assert misaligned(flat, groups, 16) == [3, 4]  # every rank: ASTRA-sim goes per dimension


@pytest.mark.parametrize("bad, field", [
    ({"all_to_all": "mesh"}, "all_to_all"),
    ({"hierarchical": "yes"}, "hierarchical"),
    ({"reduction_gbps": 0}, "reduction_gbps"),
    ({"tiers": [{"size": None, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1, "topology": "star"}]}, "topology"),
])
def test_bad_astra_choices_name_the_field(bad, field):
    data = {"tiers": [{"size": None, "bandwidth_gbps": 1, "latency_us": 1, "efficiency": 1}], **bad}
    with pytest.raises(PlanError, match=field):
        network_from_dict(data)


# --- ASTRA-sim's output ----------------------------------------------------------------------

def test_parse_captured_log():
    # ASTRA-sim 518bd51's stdout on a 4-rank dp2 x tp2 set (ranks report in reverse order)
    text = (FIXTURES / "astra_sim_4ranks.log").read_text()
    run = parse_output(text, 4)
    assert run.finished_ns == (156328, 156328, 156328, 156328)
    assert run.complete and run.problem() is None and run.time_us == 156.328
    assert parse_output(text, 5).problem().startswith("1 of 5 ranks did not finish (ranks 4;")


def test_missing_finished_lines_and_critical_lines_are_problems():
    text = ("[2026-12-01T09:00:00] [workload] [info] sys[0] finished, 2000 cycles, exposed communication 5 cycles.\n"
            "[2026-12-01T09:00:00] [workload] [info] sys[2] finished, 3500 cycles, exposed communication 5 cycles.\n")
    run = parse_output(text, 3, returncode=134)
    assert run.finished_ns == (2000, None, 3500) and run.time_us == 3.5
    assert not run.complete and "1 of 3 ranks did not finish (ranks 1; exit 134)" in run.problem()
    broken = parse_output(text.replace("sys[2]", "sys[1]") + "[system] [critical] warning! a callable is removed\n", 2)
    assert broken.finished_ns == (2000, 3500) and "logged an error" in broken.problem()


# --- the flag ---------------------------------------------------------------------------------

def test_simulate_without_a_binary_is_one_line_exit_2(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    base = ["explore", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "1024", "-q", "--simulate", "astra-sim"]
    done = CliRunner().invoke(app, base)
    assert done.exit_code == 2 and "Traceback" not in done.output
    assert done.output.strip().count("\n") == 0 and "error: astra_sim" in done.output and ENV in done.output
    missing = CliRunner().invoke(app, base + ["--astra-sim", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "error: astra_sim" in missing.output and "not an executable" in missing.output
    other = CliRunner().invoke(app, base[:-1] + ["ns-3"])
    assert other.exit_code == 2 and "error: simulate" in other.output


def test_binary_from_the_environment(monkeypatch, tmp_path):
    binary = tmp_path / "AstraSim_Analytical_Congestion_Unaware"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(ENV, str(binary))
    assert find_binary(None) == binary
    binary.chmod(0o644)
    with pytest.raises(PlanError, match="astra_sim"):
        find_binary(None)


# --- with a binary ($STG_ASTRA_SIM), the real thing; skipped without one ----------------------

@pytest.mark.skipif(not os.environ.get(ENV), reason=f"no ASTRA-sim binary (set {ENV})")
def test_astra_sim_agrees_with_the_estimate_on_an_aligned_plan(tmp_path):
    from stg.api import build, generate
    from stg.explore.astra import simulate
    from stg.explore.cost import estimate
    from stg.plan import Plan

    model = dict(name="mid-llama", family="llama", layers=4, hidden=1024, ffn=2816, heads=16, kv_heads=4, vocab=4096)
    plan = Plan(tp=2, dp=2, pp=2, global_batch=8, seq=512)  # 2-GPU nodes: tp inside, dp and pp across
    network = network_from_dict({"hierarchical": True, "all_to_all": "ring", "reduction_gbps": 3350, "tiers": [
        {"size": 2, "bandwidth_gbps": 200, "latency_us": 2, "efficiency": 0.9},
        {"size": None, "bandwidth_gbps": 25, "latency_us": 5, "efficiency": 0.9}]})
    ours = estimate(build(model, plan), network).step_us
    generate(model, plan, tmp_path)
    run = simulate(find_binary(None), tmp_path, network, 3350, timeout_s=600)
    assert run.problem() is None
    assert ours == pytest.approx(run.time_us, rel=0.10)
