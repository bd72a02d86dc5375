"""validate() on small hand-made trace sets: a valid one, and one broken variant per check."""

import json

import pytest

from stg.chakra import et_def_pb2 as pb
from chakra_nodes import coll as shared_coll
from chakra_nodes import recv, send
from stg.chakra.reader import _encode_varint as _varint
from stg.chakra.reader import write_trace
from stg.chakra import load as load_module
from stg.chakra import validate as validate_module
from stg.chakra.replay import Replay
from stg.chakra.validate import Problem, validate

AR, AG, RS = pb.ALL_REDUCE, pb.ALL_GATHER, pb.REDUCE_SCATTER


@pytest.fixture(autouse=True, params=["python", "compiled"])
def zero_time_replay(request, monkeypatch):
    """Every test twice: as small sets replay (Replay alone), and as big ones do (the compiled
    zero-time run first, Replay only for a deadlock's report), whose verdict must be Replay's."""
    if request.param == "compiled":
        monkeypatch.setattr(validate_module, "COMPILED_FROM_NODES", 0)
        compiled = validate_module._completes

        def checked(loaded):
            verdict = compiled(loaded)
            assert verdict == (Replay(loaded.graphs, loaded.groups).run() == [])
            return verdict
        monkeypatch.setattr(validate_module, "_completes", checked)


@pytest.fixture(autouse=True, params=["protobuf", "skim"])
def rank_reading(request, monkeypatch):
    """Every test again with its rank files read as a big set's are, by the compiled skim,
    whose results must be protobuf's record-by-record reading's, file by file."""
    if request.param == "skim":
        monkeypatch.setattr(load_module, "SKIM_FROM_BYTES", 0)
        load_rank = load_module._load_rank

        def checked(*args):
            skimmed = load_rank(*args)
            assert skimmed == load_rank(*args[:-1], False)
            return skimmed
        monkeypatch.setattr(load_module, "_load_rank", checked)


def _a(name, **value):
    return pb.AttributeProto(name=name, **value)


def comp(nid, deps=()):
    return pb.Node(id=nid, name=f"comp{nid}", type=pb.COMP_NODE, data_deps=list(deps), duration_micros=5,
                   attr=[_a("is_cpu_op", bool_val=False), _a("num_ops", int64_val=1000),
                         _a("tensor_size", uint64_val=64), _a("op_type", string_val="GEMM")])


def coll(nid, ctype, size, pg="1", deps=()):
    return shared_coll(nid, ctype, size, pg, deps)


def program(rank):
    """compute, ALL_REDUCE and ALL_GATHER on group 1 (all 4), then 0->1 and 2->3, then compute."""
    nodes = [comp(0), coll(1, AR, 1024, deps=[0]), coll(2, AG, 512, deps=[1])]
    if rank % 2 == 0:
        nodes.append(send(3, rank, rank + 1, tag=10 + rank, deps=[2]))
    else:
        nodes.append(recv(3, rank - 1, rank, tag=10 + rank - 1, deps=[2]))
    nodes.append(comp(4, deps=[3]))
    return nodes


GROUPS = {"1": [0, 1, 2, 3]}


def write_set(out, ranks, groups=GROUPS):
    out.mkdir(exist_ok=True)
    if groups is not None:
        (out / "workload.json").write_text(json.dumps(groups))
    for rank, nodes in ranks.items():
        write_trace(out / f"workload.{rank}.et", pb.GlobalMetadata(version="0.0.4"), nodes)
    return out


def base():
    return {r: program(r) for r in range(4)}


def node(ranks, rank, nid):
    return next(n for n in ranks[rank] if n.id == nid)


def set_attr(n, name, **value):
    del_attr(n, name)
    n.attr.append(_a(name, **value))


def del_attr(n, name):
    keep = [a for a in n.attr if a.name != name]
    del n.attr[:]
    n.attr.extend(keep)


def has(problems, rank, nid, *words):
    return any(p.rank == rank and p.node == nid and all(w in p.reason for w in words) for p in problems)


def test_valid_set(tmp_path):
    calls = []
    out = write_set(tmp_path / "out", base())
    assert validate(out, progress=lambda done, total: calls.append((done, total))) == []
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_default_group_and_node_order_in_file(tmp_path):
    ranks = base()
    for r in ranks:
        ranks[r].append(coll(5, AR, 8, pg="" if r % 2 else "0", deps=[4]))
        ranks[r].reverse()  # children before parents in the file is fine
    assert validate(write_set(tmp_path / "out", ranks)) == []


def test_problem_str():
    p = Problem(3, 17, "RECV from rank 2 (tag 5, 1024 B) has no matching SEND")
    assert str(p) == "rank 3, node 17: RECV from rank 2 (tag 5, 1024 B) has no matching SEND"
    assert str(Problem(None, None, "x")) == "x"
    assert str(Problem(2, None, "x")) == "rank 2: x"


# --- d. collective sequences ----------------------------------------------------------------


def test_missing_collective(tmp_path):
    ranks = base()
    ranks[2] = [n for n in ranks[2] if n.id != 2]
    node(ranks, 2, 3).data_deps[:] = [1]
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 2, None, "issues 1 collectives on group 1 but rank 0 issues 2", "ALL_GATHER of 512 B")
    assert any(p.rank is None and "deadlock" in p.reason for p in problems)  # replay agrees


def test_size_mismatch(tmp_path):
    ranks = base()
    set_attr(node(ranks, 3, 1), "comm_size", int64_val=2048)
    problems = validate(write_set(tmp_path / "out", ranks), replay=False)
    assert [str(p) for p in problems] == [
        "rank 3, node 1: collective #1 on group 1 is ALL_REDUCE of 2048 B but rank 0 issues ALL_REDUCE of 1024 B"
    ]


def test_type_mismatch(tmp_path):
    ranks = base()
    set_attr(node(ranks, 1, 2), "comm_type", int64_val=RS)
    problems = validate(write_set(tmp_path / "out", ranks), replay=False)
    assert has(problems, 1, 2, "collective #2 on group 1 is REDUCE_SCATTER of 512 B",
               "rank 0 issues ALL_GATHER of 512 B")


def test_different_order(tmp_path):
    ranks = base()
    ranks[2][1:3] = [coll(1, AG, 512, deps=[0]), coll(2, AR, 1024, deps=[1])]
    problems = validate(write_set(tmp_path / "out", ranks), replay=False)
    assert has(problems, 2, 1, "collective #1 on group 1 is ALL_GATHER of 512 B but rank 0 issues ALL_REDUCE")


def test_extra_collective(tmp_path):
    ranks = base()
    ranks[1].append(coll(9, AR, 4, deps=[4]))
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 1, 9, "collective #3 on group 1", "no counterpart: rank 0 issues only 2")
    assert has(problems, 1, 9, "blocked in collective #3 on group 1", "ranks [0, 2, 3] have not issued it")


# --- e. point to point ----------------------------------------------------------------------


def test_send_without_recv(tmp_path):
    ranks = base()
    ranks[1][3] = comp(3, deps=[2])
    problems = validate(write_set(tmp_path / "out", ranks))
    assert [str(p) for p in problems] == ["rank 0, node 3: SEND to rank 1 (tag 10, 256 B) has no matching RECV"]


def test_recv_without_send(tmp_path):
    ranks = base()
    ranks[2][3] = comp(3, deps=[2])
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 3, 3, "RECV from rank 2 (tag 12, 256 B) has no matching SEND")
    assert has(problems, 3, 3, "waits in RECV from rank 2", "rank 2 has finished")


def test_recv_size_differs_from_send(tmp_path):
    ranks = base()
    set_attr(node(ranks, 1, 3), "comm_size", int64_val=128)
    problems = validate(write_set(tmp_path / "out", ranks), replay=False)
    assert has(problems, 1, 3, "RECV from rank 0 (tag 10, 128 B) has no matching SEND",
               "rank 0 has an unmatched SEND to rank 1 with tag 10, 256 B")
    assert has(problems, 0, 3, "SEND to rank 1 (tag 10, 256 B) has no matching RECV")


# --- b. structure ---------------------------------------------------------------------------


def test_cycle(tmp_path):
    ranks = base()
    node(ranks, 1, 0).data_deps[:] = [4]
    problems = validate(write_set(tmp_path / "out", ranks))
    assert [str(p) for p in problems] == [
        "rank 1, node 0: dependency cycle 0 -> 1 -> 2 -> 3 -> 4 -> 0; 5 nodes can never become ready"
    ]


def test_dangling_dep(tmp_path):
    ranks = base()
    node(ranks, 2, 4).data_deps.append(99)
    problems = validate(write_set(tmp_path / "out", ranks))
    assert [str(p) for p in problems] == ["rank 2, node 4: data_deps [99] are not nodes of this file (ASTRA-sim aborts at load)"]


def test_duplicate_id(tmp_path):
    ranks = base()
    ranks[3].append(comp(4, deps=[0]))
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 3, 4, "node id 4 appears 2 times")


def test_ctrl_deps_and_node_type(tmp_path):
    ranks = base()
    node(ranks, 0, 4).ctrl_deps.append(0)
    ranks[1].append(pb.Node(id=7, type=pb.METADATA_NODE, attr=[_a("is_cpu_op", bool_val=False)]))
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 0, 4, "ctrl_deps [0]")
    assert has(problems, 1, 7, "node type METADATA_NODE is not allowed")


# --- c. attributes --------------------------------------------------------------------------


@pytest.mark.parametrize("rank, nid, name, value, words", [
    (0, 1, "comm_size", {"double_val": 1024.0}, ("comm_size is double_val, must be int64_val",)),
    (1, 2, "pg_name", {"int32_val": 1}, ("pg_name is int32_val, must be string_val",)),
    (2, 0, "num_ops", {"double_val": 1.0}, ("num_ops is double_val",)),
    (2, 0, "tensor_size", {"uint64_val": 0}, ("tensor_size is 0",)),
    (3, 3, "comm_tag", {"int64_val": 12}, ("comm_tag is int64_val, must be int32_val",)),
    (0, 1, "comm_type", {"int64_val": pb.BARRIER}, ("comm_type BARRIER is not one of",)),
    (0, 1, "is_cpu_op", {"bool_val": True}, ("is_cpu_op is true",)),
    (0, 3, "comm_src", {"int32_val": 1}, ("COMM_SEND_NODE has comm_src=1, must be its own rank 0",)),
    (1, 3, "comm_dst", {"int32_val": 0}, ("COMM_RECV_NODE has comm_dst=0, must be its own rank 1",)),
    (0, 3, "comm_dst", {"int32_val": 4}, ("comm_dst=4 is out of range for 4 ranks",)),
    (0, 3, "comm_tag", {"int32_val": 500_000_000}, ("comm_tag 500000000 is outside",)),
    (0, 1, "pg_name", {"string_val": "7"}, ("pg_name '7' is not a group in workload.json",)),
])
def test_wrong_attribute(tmp_path, rank, nid, name, value, words):
    ranks = base()
    set_attr(node(ranks, rank, nid), name, **value)
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, rank, nid, *words), problems
    assert not any("deadlock" in p.reason for p in problems)  # structural problems skip the replay


@pytest.mark.parametrize("rank, nid, name", [(0, 0, "is_cpu_op"), (1, 1, "comm_size"), (3, 3, "comm_src")])
def test_missing_attribute(tmp_path, rank, nid, name):
    ranks = base()
    del_attr(node(ranks, rank, nid), name)
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, rank, nid, f"attribute {name}", "is missing")


def test_repeated_unset_and_unparsable_attributes(tmp_path):
    """Attribute records each rank repeats (their parses are shared across ranks) still give
    each node its own problems: a name twice, no value set, bytes that are no AttributeProto."""
    ranks = base()
    for rank in (0, 2):
        node(ranks, rank, 0).attr.append(_a("num_ops", int64_val=5))
        del_attr(node(ranks, rank, 1), "comm_size")
        node(ranks, rank, 1).attr.append(_a("comm_size"))
    out = write_set(tmp_path / "out", ranks)
    path = out / "workload.3.et"
    records = [pb.GlobalMetadata(version="0.0.4").SerializeToString()]
    for n in ranks[3]:
        payload = n.SerializeToString()
        records.append(payload + b"\x52\x02\x0a\xff" if n.id == 4 else payload)  # attr: a name cut short
    path.write_bytes(b"".join(_varint(len(r)) + r for r in records))
    problems = validate(out)
    for rank in (0, 2):
        assert has(problems, rank, 0, "attribute num_ops appears more than once")
        assert has(problems, rank, 1, "attribute comm_size is unset, must be int64_val")
    assert has(problems, 3, 4, "an attribute record (2 bytes) is not a valid AttributeProto")
    assert not has(problems, 1, 0, "more than once") and not has(problems, 3, 0, "not a valid")


def test_rank_not_in_group(tmp_path):
    ranks = base()
    set_attr(node(ranks, 2, 2), "pg_name", string_val="2")
    problems = validate(write_set(tmp_path / "out", ranks, {"1": [0, 1, 2, 3], "2": [0, 1]}))
    assert has(problems, 2, 2, "issues ALL_GATHER on group 2, which does not contain rank 2")


# --- a. directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("groups, words", [
    (None, "workload.json is missing"),
    ({"0": [0, 1]}, "group '0': id must be a positive integer"),
    ({"1": [0, 1, 2, 3], "2": [3]}, "group '2': 1-rank group"),
    ({"1": [0, 1, 2, 3], "2": [3, 4]}, "group '2': ranks [4] out of range for 4 rank files"),
    ({"1": [0, 1, 2, 3], "2": [1, 1, 2]}, "group '2': ranks [1] listed more than once"),
    ({"1": [0, 1, 2, 3], "2": "0,1"}, "group '2': members must be a list"),
    ({"1": [0, 1, 2, 3], "501": [0, 1]}, "group 501 aliases group 1"),
    ({"1": [0, 1, 2, 3], "1000": [0, 1]}, "group 1000 aliases the all-ranks group"),
])
def test_bad_workload_json(tmp_path, groups, words):
    problems = validate(write_set(tmp_path / "out", base(), groups))
    assert any(p.rank is None and words in p.reason for p in problems), problems


def test_unparsable_workload_json(tmp_path):
    out = write_set(tmp_path / "out", base())
    (out / "workload.json").write_text("{1: [0, 1]")
    assert "not valid JSON" in validate(out)[0].reason


def test_missing_rank_file(tmp_path):
    ranks = base()
    ranks[4] = ranks.pop(2)
    problems = validate(write_set(tmp_path / "out", ranks))
    assert has(problems, 2, None, "workload.2.et is missing")
    assert has(problems, 4, None, "workload.4.et is out of range")


def test_empty_and_truncated_rank_files(tmp_path):
    ranks = base()
    ranks[1] = []
    out = write_set(tmp_path / "out", ranks)
    data = (out / "workload.2.et").read_bytes()
    (out / "workload.2.et").write_bytes(data[:-3])
    problems = validate(out)
    assert has(problems, 1, None, "workload.1.et has no nodes")
    assert has(problems, 2, None, "workload.2.et: at byte", "record declares")


def test_no_rank_files(tmp_path):
    out = write_set(tmp_path / "out", {})
    assert any("no workload.<rank>.et files" in p.reason for p in validate(out))


# --- f. replay ------------------------------------------------------------------------------


def test_recv_recv_deadlock(tmp_path):
    """Sends and receives match pairwise, but each rank receives before it sends."""
    ranks = {
        0: [recv(0, 1, 0, tag=1), send(1, 0, 1, tag=2, deps=[0])],
        1: [recv(0, 0, 1, tag=2), send(1, 1, 0, tag=1, deps=[0])],
    }
    out = write_set(tmp_path / "out", ranks, {})
    assert validate(out, replay=False) == []
    problems = validate(out)
    assert [str(p) for p in problems] == [
        "replay deadlocks: 2 of 2 ranks stuck, 4 nodes never run",
        "rank 0, node 0: waits in RECV from rank 1 (tag 1, 256 B), which was never sent; "
        "rank 1 is stuck too (2 of 2 nodes unfinished)",
        "rank 1, node 0: waits in RECV from rank 0 (tag 2, 256 B), which was never sent; "
        "rank 0 is stuck too (2 of 2 nodes unfinished)",
    ]


def _slot_case(send_id, coll_id, send_after_coll=False):
    """Rank 0 has an ALL_REDUCE on {0, 1} and a SEND to 1; rank 1 receives, then all-reduces."""
    sender = [coll(coll_id, AR, 64), send(send_id, 0, 1, tag=3, deps=[coll_id] if send_after_coll else [])]
    sender.append(comp(5, deps=[send_id, coll_id]))
    return {0: sender, 1: [recv(0, 0, 1, tag=3), coll(1, AR, 64, deps=[0])]}


def test_comm_slot_deadlock(tmp_path):
    # The ALL_REDUCE has the lower id, so it takes rank 0's comm slot first; the SEND, though
    # independent of it, can't issue until rank 1 joins, and rank 1 waits for that SEND.
    problems = validate(write_set(tmp_path / "out", _slot_case(send_id=1, coll_id=0), {"1": [0, 1]}))
    assert [str(p) for p in problems] == [
        "replay deadlocks: 2 of 2 ranks stuck, 5 nodes never run",
        "rank 0, node 0: blocked in collective #1 on group 1 (ALL_REDUCE of 64 B); ranks [1] have not "
        "issued it; node 1 (COMM_SEND_NODE) waits for the comm slot (3 of 3 nodes unfinished)",
        "rank 1, node 0: waits in RECV from rank 0 (tag 3, 256 B), which was never sent; rank 0 is stuck "
        "too (2 of 2 nodes unfinished)",
    ]


def test_comm_slot_no_deadlock_when_send_has_priority(tmp_path):
    # Same nodes, but the SEND has the lower id: it issues first (eager) and everything completes.
    assert validate(write_set(tmp_path / "out", _slot_case(send_id=0, coll_id=1), {"1": [0, 1]})) == []


def test_send_data_dependent_on_collective_deadlocks(tmp_path):
    # Whatever the ids, a SEND that waits for the ALL_REDUCE that waits for its RECV can't finish.
    problems = validate(write_set(tmp_path / "out", _slot_case(1, 0, send_after_coll=True), {"1": [0, 1]}))
    assert has(problems, 0, 0, "blocked in collective #1 on group 1")
    assert has(problems, 1, 0, "waits in RECV from rank 0")


def test_collectives_on_two_groups_in_crossed_order(tmp_path):
    # Per-group sequences agree, but rank 0 enters group 1 first and rank 1 group 2 first.
    ranks = {0: [coll(0, AR, 8, pg="1"), coll(1, AR, 8, pg="2")],
             1: [coll(0, AR, 8, pg="2"), coll(1, AR, 8, pg="1")]}
    out = write_set(tmp_path / "out", ranks, {"1": [0, 1], "2": [1, 0]})
    assert validate(out, replay=False) == []
    problems = validate(out)
    assert has(problems, 0, 0, "blocked in collective #1 on group 1", "ranks [1] have not issued it")
    assert has(problems, 1, 0, "blocked in collective #1 on group 2", "ranks [0] have not issued it")


def test_deadlock_report_is_capped(tmp_path):
    ranks = {r: [recv(0, (r + 1) % 12, r, tag=1), send(1, r, (r - 1) % 12, tag=1, deps=[0])] for r in range(12)}
    problems = validate(write_set(tmp_path / "out", ranks, {}))
    assert problems[0].reason == "replay deadlocks: 12 of 12 ranks stuck, 24 nodes never run"
    assert len(problems) == 12 and problems[-1].reason == "... and 2 more stuck ranks"


def test_parallel_load_gives_the_same_answer(tmp_path, monkeypatch):
    ranks = base()
    set_attr(node(ranks, 3, 1), "comm_size", int64_val=2048)
    del_attr(node(ranks, 1, 0), "is_cpu_op")
    out = write_set(tmp_path / "out", ranks)
    sequential = validate(out)
    monkeypatch.setattr(load_module, "PARALLEL_LOAD_BYTES", 0)
    monkeypatch.setattr(load_module, "_cpu_count", lambda: 2)
    calls = []
    assert validate(out, progress=lambda done, total: calls.append((done, total))) == sequential
    assert len(sequential) == 2 and calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_long_chain_replays(tmp_path):
    n = 3000
    ranks = {}
    for r in range(2):
        nodes = [comp(0)]
        for i in range(1, n):
            nodes.append(coll(i, AR, i, pg="") if i % 10 == 0 else comp(i, deps=[i - 1]))
            if i % 10 == 0:
                nodes[-1].data_deps.append(i - 1)
        ranks[r] = nodes
    assert validate(write_set(tmp_path / "out", ranks, {})) == []

