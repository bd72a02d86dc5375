"""The compiled skim of rank files (stg/chakra/skim_kernel.py) that `stg validate` reads big
sets with: it reads what protobuf reads, or leaves the file to protobuf. tests/chakra/
test_validate.py runs every hand-made set both ways too."""

import random

import pytest

from stg.api import generate
from stg.chakra import et_def_pb2 as pb
from stg.chakra.load import _load_rank
from stg.chakra.skim_kernel import skim_file
from stg.chakra.writer import varint
from test_digests import EXAMPLES, PLANS, model_of


def key(field, wire):
    return varint(field << 3 | wire)


def record(payload):
    return varint(len(payload)) + payload


def comp(nid, deps=()):
    return pb.Node(id=nid, name=f"c{nid}", type=pb.COMP_NODE, data_deps=list(deps), duration_micros=7,
                   attr=[pb.AttributeProto(name="is_cpu_op", bool_val=False),
                         pb.AttributeProto(name="num_ops", int64_val=100),
                         pb.AttributeProto(name="tensor_size", uint64_val=8)]).SerializeToString()


ATTR_RECORDS = [key(10, 2) + record(a.SerializeToString()) for a in (
    pb.AttributeProto(name="is_cpu_op", bool_val=False), pb.AttributeProto(name="num_ops", int64_val=100),
    pb.AttributeProto(name="tensor_size", uint64_val=8))]
ATTRS = b"".join(ATTR_RECORDS)
HEAD = key(1, 0) + varint(1) + key(2, 2) + record(b"c1") + key(3, 0) + varint(pb.COMP_NODE)


def rank_file(tmp_path, *nodes):
    path = tmp_path / "workload.0.et"
    path.write_bytes(record(pb.GlobalMetadata(version="0.0.4").SerializeToString())
                     + b"".join(record(node) for node in nodes))
    return path


def read_alike(path, durations=True):
    """Both readings of rank file `path` of a 2-rank set give the same graph, problems and
    durations; whether the skim read it (False: it left it to protobuf)."""
    assert _load_rank(0, path, 2, None, durations, True) == _load_rank(0, path, 2, None, durations, False)
    return skim_file(path.read_bytes()) is not None


# records that protobuf reads as stg never writes them, which the skim reads too
READ = {
    "unpacked data_deps": HEAD + key(5, 0) + varint(0) + key(5, 0) + varint(300) + ATTRS,
    "packed and unpacked data_deps": HEAD + key(5, 2) + record(varint(0) + varint(2**40)) + key(5, 0) + varint(5)
                                     + ATTRS,
    "a repeated id: the last": HEAD + key(1, 0) + varint(2**63 + 5) + ATTRS,
    "no attributes": HEAD,
    "a type not allowed": key(1, 0) + varint(1) + key(3, 0) + varint(9) + ATTRS,
    "fields out of order": ATTRS + key(3, 0) + varint(pb.COMP_NODE) + key(7, 0) + varint(3) + key(1, 0) + varint(1),
    "an empty record": b"",
}
# and records the skim leaves to protobuf, which reads some and reports the others
LEFT = {
    "a name beyond ASCII": key(1, 0) + varint(1) + key(2, 2) + record("é".encode()) + key(3, 0) + varint(1) + ATTRS,
    "a name that is not UTF-8": key(1, 0) + varint(1) + key(2, 2) + record(b"\xff") + key(3, 0) + varint(1) + ATTRS,
    "ctrl_deps": HEAD + key(4, 2) + record(varint(0)) + ATTRS,
    "a field NodeSkim lacks": HEAD + key(6, 0) + varint(12) + ATTRS,
    "a known field's other wire type": HEAD + key(7, 2) + record(b"ab") + ATTRS,
    "attributes apart": HEAD + ATTR_RECORDS[0] + key(7, 0) + varint(3) + b"".join(ATTR_RECORDS[1:]),
    "a negative type": key(1, 0) + varint(1) + key(3, 0) + varint(2**64 - 1) + ATTRS,
    "a varint over 64 bits": key(1, 0) + b"\xff" * 9 + b"\x7f" + ATTRS,
    "a length past the record": HEAD + key(10, 2) + varint(200) + b"x",
    "a packed dependency cut short": HEAD + key(5, 2) + record(b"\x80") + ATTRS,
}


@pytest.mark.parametrize("name", READ)
def test_it_reads_what_protobuf_reads(name, tmp_path):
    assert read_alike(rank_file(tmp_path, comp(0), READ[name], comp(2, deps=[0])))


@pytest.mark.parametrize("name", LEFT)
def test_it_leaves_the_rest_to_protobuf(name, tmp_path):
    assert not read_alike(rank_file(tmp_path, comp(0), LEFT[name], comp(2, deps=[0])))


@pytest.mark.parametrize("data", [b"", record(b"\x0a\x05abc"), record(b"") + b"\x85", b"\x80" * 11,
                                  record(b"") + record(comp(0))[:-1]], ids=["empty", "metadata only",
                                  "a cut length", "a long length", "a cut record"])
def test_files_it_leaves_to_protobuf(data, tmp_path):
    path = tmp_path / "workload.0.et"
    path.write_bytes(data)
    assert not read_alike(path)


def test_a_thousand_damaged_files_read_alike(tmp_path):
    """Bytes flipped, cut out and put in (seeded) in a small file: each reading gives what
    protobuf's gives, read or left to protobuf."""
    good = rank_file(tmp_path, comp(0), comp(1, deps=[0]), READ["unpacked data_deps"], comp(3, deps=[1, 2]))
    data = good.read_bytes()
    assert read_alike(good)
    rng, skimmed = random.Random(0), 0
    for _ in range(1000):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(damaged))
            change = rng.randrange(3)
            if change == 0:
                damaged[at] = rng.randrange(256)
            elif change == 1:
                del damaged[at]
            else:
                damaged.insert(at, rng.randrange(256))
        good.write_bytes(bytes(damaged))
        skimmed += read_alike(good)
    assert 50 < skimmed < 950  # both ways taken (99 read by the skim)


@pytest.mark.parametrize("name", ["pp-zbh1", "zero3", "ep-skew", "dlrm-table_row_wise", "described"])
def test_it_reads_stgs_sets(name, tmp_path):
    """Every rank file of sets with every node type (sends and receives, collectives on many
    groups, all-to-alls, embedding lookups, a described model): read by the skim, alike."""
    out = tmp_path / "set"
    generate(model_of(name, tmp_path), {"seq": 32, **PLANS[name][1]}, out)
    for path in sorted(out.glob("workload.*.et")):
        assert read_alike(path)


@pytest.mark.parametrize("mode, plan", [("decode", dict(tp=2, pp=2)), (
    "serve", dict(tp=2, prefill_instances=1, decode_instances=1, max_num_batched_tokens=64))])
def test_it_reads_serving_sets(mode, plan, tmp_path):
    """Serving runs' sets: streamed iterations, whose ids, dependencies and durations are
    fixed-width varints (padding bytes with the continuation bit: hundreds of each in the
    decode set's files), and disaggregated instances' KV-cache transfers: read by the skim,
    alike."""
    from stg.serve import ServePlan, generate_serving

    tiny = dict(name="tiny-llama", family="llama", layers=2, hidden=64, ffn=176, heads=8, kv_heads=4, vocab=1000)
    out = tmp_path / "serve"
    generate_serving(tiny, ServePlan(**plan), out, mode=mode, batch=2, steps=3,
                     requests=str(EXAMPLES / "requests-azure.csv") if mode == "serve" else None)
    for path in sorted(out.glob("workload.*.et")):
        assert read_alike(path)


def test_kinds_that_share_a_hash_leave_the_file_to_protobuf(tmp_path, monkeypatch):
    """Nodes are grouped by a hash of their type and attribute bytes, then compared byte by byte:
    with every hash alike, a file of two kinds is left to protobuf, one of a single kind read."""
    import numpy as np
    from stg.chakra import skim_kernel

    monkeypatch.setattr(skim_kernel, "_kind_hashes", lambda buf, types, *_: np.zeros(types.size, np.uint64))
    assert read_alike(rank_file(tmp_path, comp(0), comp(1, deps=[0]), comp(2, deps=[1])))
    assert not read_alike(rank_file(tmp_path, comp(0), READ["no attributes"], comp(2, deps=[0])))
