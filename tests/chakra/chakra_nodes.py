"""Hand-made Chakra nodes for the validator's and the replays' tests."""

from stg.chakra import et_def_pb2 as pb


def attr(name, **value):
    return pb.AttributeProto(name=name, **value)


def _p2p(kind, nid, src, dst, tag, size, deps):
    return pb.Node(id=nid, name=f"p2p{nid}", type=kind, data_deps=list(deps),
                   attr=[attr("is_cpu_op", bool_val=False), attr("comm_src", int32_val=src),
                         attr("comm_dst", int32_val=dst), attr("comm_tag", int32_val=tag),
                         attr("comm_size", int64_val=size)])


def send(nid, src, dst, tag, size=256, deps=()):
    return _p2p(pb.COMM_SEND_NODE, nid, src, dst, tag, size, deps)


def recv(nid, src, dst, tag, size=256, deps=()):
    return _p2p(pb.COMM_RECV_NODE, nid, src, dst, tag, size, deps)


def coll(nid, ctype, size, pg="1", deps=()):
    return pb.Node(id=nid, name=f"coll{nid}", type=pb.COMM_COLL_NODE, data_deps=list(deps),
                   attr=[attr("is_cpu_op", bool_val=False), attr("comm_type", int64_val=ctype),
                         attr("comm_size", int64_val=size), attr("pg_name", string_val=pg)])


def one_f_one_b_order(p: int, s: int, m: int) -> list[tuple[str, int]]:
    """Stage s of a p-stage 1F1B pipeline over m micro-batches, by hand (Narayanan et al. 2019):
    min(p - s - 1, m) warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards; ("F" | "B", micro-batch) per action."""
    warm = min(p - s - 1, m)
    order = [("F", k) for k in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", k) for k in range(m - warm, m)]
