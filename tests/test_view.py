"""stg/view: the timeline (Chrome trace JSON) of a timed replay, the Gantt chart's data, plots
and the HTML report. Numbers come from outside stg's view code: node counts and durations read
back from the .et files, the replay's own busy times, the 1F1B bubble formula, the schedules."""

import json
import re
import shutil
from collections import Counter, defaultdict
from fractions import Fraction

import pytest
from typer.testing import CliRunner

from chakra.chakra_nodes import one_f_one_b_order
from stg import Plan, generate
from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import iter_nodes, node_attrs, write_trace
from stg.chakra.validate import timed_replay
from stg.cli import app
from stg.schedule import Kind, make_schedule
from stg.view.gantt import gantt
from stg.view.timeline import record_timeline, write_timeline

MODEL = dict(name="eight-blocks", family="llama", layers=8, hidden=256, ffn=704, heads=8, kv_heads=4, vocab=2000)
MOE = dict(name="tiny-moe", family="mixtral", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=512,
           experts=8, top_k=2, moe_ffn=96)
M = 8  # micro-batches


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Small generated sets, made once: pp=2 x dp=2 x tp=2 1F1B, pp=4 interleaved, DLRM, MoE."""
    root = tmp_path_factory.mktemp("sets")
    generate(MODEL, Plan(pp=2, dp=2, tp=2, global_batch=2 * M, seq=256, schedule="1f1b"), root / "hybrid")
    generate(MODEL, Plan(pp=4, vpp=2, schedule="interleaved", global_batch=M, seq=256), root / "interleaved")
    generate("dlrm-kaggle", {"dp": 4, "micro_batch": 16, "embedding_sharding": "table_wise"}, root / "dlrm")
    generate(MOE, Plan(dp=2, ep=2, global_batch=4, seq=16), root / "moe")
    return root


def events_of(path):
    return json.loads(path.read_text())["traceEvents"]


def file_nodes(out, rank):
    return list(iter_nodes(out / f"workload.{rank}.et"))


# --- timeline ------------------------------------------------------------------------------


def test_timeline_has_one_slice_per_node_and_the_replays_busy_time(sets, tmp_path):
    out = sets / "hybrid"
    path = tmp_path / "timeline.json"
    write_timeline(out, path, comm="alpha-beta", ranks=list(range(8)))
    events = events_of(path)
    slices = [e for e in events if e["ph"] == "X"]
    timing = timed_replay(out, comm="alpha-beta")
    for rank in range(8):
        nodes = file_nodes(out, rank)
        mine = [e for e in slices if e["pid"] == rank]
        assert len(mine) == len(nodes)
        assert Counter(e["cat"] for e in mine) == Counter(
            {pb.COMP_NODE: "compute", pb.COMM_COLL_NODE: "collective", pb.COMM_SEND_NODE: "send",
             pb.COMM_RECV_NODE: "recv"}[n.type] for n in nodes)
        busy = sum(e["dur"] for e in mine if e["cat"] == "compute")
        assert busy == pytest.approx(sum(n.duration_micros for n in nodes if n.type == pb.COMP_NODE), abs=1e-6)
        assert busy == pytest.approx(timing.busy_us[rank], abs=1e-6)
        assert busy > 0
    # args carry what the node says
    node = next(n for n in file_nodes(out, 0) if n.type == pb.COMM_COLL_NODE)
    event = next(e for e in slices if e["pid"] == 0 and e["args"]["node_id"] == node.id)
    attrs = node_attrs(node)
    assert event["name"] == node.name and event["args"]["bytes"] == attrs["comm_size"]
    assert event["args"]["comm_type"] == pb.CollectiveCommType.Name(attrs["comm_type"])
    assert event["args"]["group"] == int(attrs["pg_name"])


def test_flows_join_every_send_to_its_receive(sets, tmp_path):
    path = tmp_path / "timeline.json"
    write_timeline(sets / "hybrid", path, ranks=list(range(8)))
    slices = [e for e in events_of(path) if e["ph"] == "X"]
    outs = {e["bind_id"]: e for e in slices if e.get("flow_out")}
    ins = {e["bind_id"]: e for e in slices if e.get("flow_in")}
    sends = [e for e in slices if e["cat"] == "send"]
    assert len(sends) == 4 * 2 * M  # dp x tp = 4 stage-0/stage-1 pairs; M activations out, M gradients back
    assert set(outs) == set(ins) and len(outs) == len(sends) and all(e.get("flow_out") for e in sends)
    for bind, s in outs.items():
        r = ins[bind]
        assert (s["cat"], r["cat"]) == ("send", "recv")
        assert (s["args"]["peer"], r["args"]["peer"]) == (r["pid"], s["pid"])
        assert (s["args"]["tag"], s["args"]["bytes"]) == (r["args"]["tag"], r["args"]["bytes"])
        assert r["ts"] + r["dur"] >= s["ts"] + s["dur"] - 1e-9  # a message arrives after it is sent


def test_tracks_nest_and_markers_mark_every_micro_batch(sets, tmp_path):
    """Slices on one thread never overlap (Chrome trace X events must nest); the compute track
    has a marker where each of the M forwards and M backwards and the step begin."""
    path = tmp_path / "timeline.json"
    write_timeline(sets / "hybrid", path)
    events = events_of(path)
    assert sorted({e["pid"] for e in events}) == [0, 4]  # one rank of each class (pipeline stage)
    by_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(end <= nxt + 1e-9 for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for rank in (0, 4):
        marks = {e["name"] for e in events if e["ph"] == "i" and e["pid"] == rank}
        assert marks == {f"{k}{phase}0" for k in range(M) for phase in "FB"} | {"optimizer step", "step end"}


def test_timeline_is_byte_identical_run_to_run(sets, tmp_path):
    for name in ("a.json", "b.json"):
        write_timeline(sets / "hybrid", tmp_path / name, comm="alpha-beta")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_perfetto_trace_processor_reads_the_timeline(sets, tmp_path):
    """Perfetto's own trace processor: slices per rank = nodes, compute time = replay busy time,
    every flow from a send to its receive. Skipped only where its binary cannot start (the
    perfetto package downloads it on first use; PyPI ships no wheel with it)."""
    tp_module = pytest.importorskip("perfetto.trace_processor")
    out, path = sets / "hybrid", tmp_path / "timeline.json"
    write_timeline(out, path, ranks=list(range(8)))
    binary = shutil.which("trace_processor_shell") or shutil.which("trace_processor")
    try:
        tp = tp_module.TraceProcessor(trace=str(path), config=tp_module.TraceProcessorConfig(bin_path=binary))
    except Exception as error:  # noqa: BLE001 - any failure to start the binary is a skip
        pytest.skip("Perfetto's trace processor cannot start here (the perfetto package fetches its "
                    "trace_processor_shell binary on first use, and none is on PATH): "
                    f"{str(error).splitlines()[0][:160]}")
    try:
        rows = list(tp.query("""
            SELECT p.pid AS pid, COUNT(*) AS n,
                   SUM(CASE WHEN s.category = 'compute' THEN s.dur ELSE 0 END) AS busy_ns
            FROM slice s JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid)
            JOIN process p USING (upid)
            WHERE s.category != 'marker' GROUP BY p.pid ORDER BY p.pid"""))
        timing = timed_replay(out)
        assert [r.pid for r in rows] == list(range(8))
        assert [r.n for r in rows] == [len(file_nodes(out, rank)) for rank in range(8)]
        assert [r.busy_ns for r in rows] == [round(b * 1000) for b in timing.busy_us]
        flows = list(tp.query("""
            SELECT so.category AS out_cat, si.category AS in_cat,
                   EXTRACT_ARG(so.arg_set_id, 'args.tag') AS out_tag,
                   EXTRACT_ARG(si.arg_set_id, 'args.tag') AS in_tag
            FROM flow f JOIN slice so ON f.slice_out = so.id JOIN slice si ON f.slice_in = si.id"""))
        sends = sum(1 for r in range(8) for n in file_nodes(out, r) if n.type == pb.COMM_SEND_NODE)
        assert len(flows) == sends
        assert all((f.out_cat, f.in_cat) == ("send", "recv") and f.out_tag == f.in_tag for f in flows)
    finally:
        tp.close()


# --- Gantt ---------------------------------------------------------------------------------


def _node(nid, kind, name, deps=(), us=0, **attrs):
    values = {"is_cpu_op": {"bool_val": False}, **{k: v for k, v in attrs.items()}}
    return pb.Node(id=nid, name=name, type=kind, data_deps=list(deps), duration_micros=us,
                   attr=[pb.AttributeProto(name=k, **v) for k, v in values.items()])


def one_f_one_b_set(out, p, m):
    """A hand-made p-stage 1F1B pipeline with unit-cost forwards and backwards (1 µs each), its
    compute nodes named by their action as stg names them (`3F0 block`)."""
    out.mkdir()
    (out / "workload.json").write_text("{}")
    for s in range(p):
        nodes, last = [], []
        for kind, k in one_f_one_b_order(p, s, m):
            src, dst = (s - 1, s + 1) if kind == "F" else (s + 1, s - 1)
            tag = 2 * k + (kind == "B")

            def p2p(a, b):
                return dict(comm_src={"int32_val": a}, comm_dst={"int32_val": b}, comm_tag={"int32_val": tag},
                            comm_size={"int64_val": 64})
            deps = list(last)
            if 0 <= src < p:
                nodes.append(_node(len(nodes), pb.COMM_RECV_NODE, f"{k} recv", **p2p(src, s)))
                deps.append(nodes[-1].id)
            nodes.append(_node(len(nodes), pb.COMP_NODE, f"{k}{kind}0 block", deps, 1, num_ops={"int64_val": 1},
                               tensor_size={"uint64_val": 1}))
            last = [nodes[-1].id]
            if 0 <= dst < p:
                nodes.append(_node(len(nodes), pb.COMM_SEND_NODE, f"{k} send", last, **p2p(s, dst)))
        write_trace(out / f"workload.{s}.et", pb.GlobalMetadata(version="0.0.4"), nodes)
    return out


def test_replay_records_each_nodes_start_and_end(tmp_path):
    """Worked on paper: rank 0 computes 10 µs then sends 256 B to rank 1, which waits for it and
    computes 5 µs. Alpha-beta (5 µs, 50 GB/s): the message takes 5 + 256 / 50e3 µs."""
    out = tmp_path / "set"
    out.mkdir()
    (out / "workload.json").write_text("{}")
    comp = dict(num_ops={"int64_val": 1}, tensor_size={"uint64_val": 1})

    def p2p(a, b):
        return dict(comm_src={"int32_val": a}, comm_dst={"int32_val": b}, comm_tag={"int32_val": 7},
                    comm_size={"int64_val": 256})
    ranks = {0: [_node(0, pb.COMP_NODE, "0F0 a", (), 10, **comp),
                 _node(1, pb.COMM_SEND_NODE, "0 send", [0], **p2p(0, 1))],
             1: [_node(0, pb.COMM_RECV_NODE, "0 recv", **p2p(0, 1)),
                 _node(1, pb.COMP_NODE, "0F0 b", [0], 5, **comp)]}
    for rank, nodes in ranks.items():
        write_trace(out / f"workload.{rank}.et", pb.GlobalMetadata(version="0.0.4"), nodes)
    arrive = 10 + 5 + 256 / 50e3
    times = timed_replay(out, comm="alpha-beta", record=[0, 1]).nodes
    assert list(times.start_us[0]) == [0, 10] and list(times.end_us[0]) == pytest.approx([10, arrive])
    assert list(times.start_us[1]) == pytest.approx([0, arrive])
    assert list(times.end_us[1]) == pytest.approx([arrive, arrive + 5])
    assert times.messages == [(0, 1, 1, 0)]
    assert timed_replay(out).nodes is None  # nothing recorded unless asked
    assert set(timed_replay(out, record=[1]).nodes.start_us) == {1}


def test_gantt_of_1f1b_shows_the_textbook_bubble(tmp_path):
    """4 stages, 8 micro-batches, F = B = 1: every stage idles (p - 1) / (m + p - 1) of the step
    (Narayanan et al. 2021, eq. 1), and each row runs the actions in 1F1B order."""
    p, m = 4, 8
    chart = gantt(record_timeline(one_f_one_b_set(tmp_path / "set", p, m), ranks=list(range(p))))
    assert chart.makespan_us == 2 * (m + p - 1)
    for stage in range(p):
        assert Fraction(chart.idle_share(stage)).limit_denominator(1000) == Fraction(p - 1, m + p - 1)
        want = [str(a) for a in make_schedule("1f1b", p, m)[stage] if a.kind is not Kind.W]
        assert [b.label for b in chart.bars[stage]] == want
        assert all(b.busy_us == 1 for b in chart.bars[stage])


def test_gantt_of_a_generated_interleaved_set_follows_the_schedule(sets):
    """Without a split backward a stage's W runs inside its B (one autograd call), so the
    replayed rows are the schedule's actions less W, then the optimizer step."""
    chart = gantt(record_timeline(sets / "interleaved"))
    assert chart.ranks == (0, 1, 2, 3)
    schedule = make_schedule("interleaved", 4, M, 2)
    for stage in range(4):
        want = [str(a) for a in schedule[stage] if a.kind is not Kind.W] + ["S"]
        assert [b.label for b in chart.bars[stage]] == want
        assert 0 < chart.idle_share(stage) < 1


# --- plots and report ------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["interleaved", "dlrm", "moe"])
def test_plots_of_pipeline_dlrm_and_moe_sets(sets, tmp_path, name):
    pytest.importorskip("matplotlib")
    from stg.view.plots import save_plot

    for kind, suffix in (("memory", "png"), ("gantt", "svg"), ("comm", "png")):
        path = tmp_path / f"{kind}.{suffix}"
        save_plot(sets / name, kind, path)
        data = path.read_bytes()
        if suffix == "png":
            assert data.startswith(PNG)
        else:
            assert b"<svg" in data[:400] and data.rstrip().endswith(b"</svg>")


def test_comm_by_axis_adds_up_to_comm_by_type(sets):
    """Per class, bytes by mesh axis and by collective type are two splits of the same nodes;
    send/recv all cross pipeline stages; collective bytes by type are summary.json's."""
    from stg.view.comm import comm_by_class
    from stg.view.traceset import TraceSet

    trace_set = TraceSet.open(sets / "hybrid")
    for c, found in enumerate(comm_by_class(trace_set)):
        assert sum(found.by_axis.values()) == sum(found.by_type.values())
        assert found.by_axis["pp"] == found.by_type["SEND"] + found.by_type["RECV"]
        assert set(found.by_axis) <= {"dp", "tp", "dp+tp", "pp"}
        expected = trace_set.summary["rank_classes"][c]["comm_bytes"]
        assert {k: v for k, v in found.by_type.items() if k not in ("SEND", "RECV")} == expected


def test_report_is_self_contained_and_reports_the_replay(sets, tmp_path):
    pytest.importorskip("matplotlib")
    from stg.view.report import make_report

    page = make_report(sets / "interleaved")
    assert not re.search(r"https?://", page)  # no scripts, styles, images or anything else fetched
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert page.count("<svg") == 3
    free = timed_replay(sets / "interleaved")
    bubble = sum(i / free.makespan_us for i in free.idle_us) / len(free.idle_us)
    assert f"{bubble:.1%}" in page and f"{free.makespan_us:,.1f} µs" in page
    assert make_report(sets / "interleaved") == page  # deterministic


# --- CLI -----------------------------------------------------------------------------------


def test_cli_writes_timeline_plot_and_report_and_refuses_bad_input(sets, tmp_path):
    pytest.importorskip("matplotlib")
    runner = CliRunner()
    out = str(sets / "hybrid")
    ok = [["timeline", out, "-o", str(tmp_path / "t.json"), "--ranks", "0,4:6", "--comm", "alpha-beta"],
          ["plot", out, "gantt", "-o", str(tmp_path / "g.svg")],
          ["report", out, "-o", str(tmp_path / "r.html")]]
    for args in ok:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    assert sorted({e["pid"] for e in events_of(tmp_path / "t.json")}) == [0, 4, 5]
    bad = [(["timeline", out, "-o", str(tmp_path / "x.json"), "--comm", "slow"], "comm"),
           (["timeline", out, "-o", str(tmp_path / "x.json"), "--ranks", "9"], "ranks"),
           (["timeline", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.json")], "not a trace set"),
           (["plot", out, "pie", "-o", str(tmp_path / "x.png")], "kind"),
           (["plot", out, "memory", "-o", str(tmp_path / "x.pdf")], ".png or .svg"),
           (["report", out, "-o", str(tmp_path / "no" / "r.html")], "cannot write"),
           (["report", out, "-o", str(tmp_path / "x.html"), "--bandwidth-gbps", "0"], "bandwidth_gbps"),
           (["plot", out, "gantt", "-o", str(tmp_path / "x.png"), "--comm", "alpha-beta", "--alpha-us", "-1"],
            "alpha_us")]
    for args, message in bad:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not any((tmp_path / name).exists() for name in ("x.json", "x.png", "x.html"))
    help_text = runner.invoke(app, ["timeline", "--help"]).output
    for option in ("--output", "--comm", "--ranks", "--alpha-us", "--bandwidth-gbps"):
        assert option in help_text
