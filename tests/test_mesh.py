import math

import pytest

from stg.errors import LayoutError
from stg.groups import GroupIds, ordinal_to_id
from stg.mesh import DeviceMesh, Layout, Partial, Shard


def test_rank_order_is_tp_fastest_then_cp_ep_dp_pp():
    mesh = DeviceMesh.standard(pp=2, dp=2, ep=1, cp=2, tp=2)
    # rank = tp + 2*(cp + 2*(dp + 2*pp))
    assert mesh.coords(0) == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0, "local": 0}
    assert mesh.coords(1)["tp"] == 1
    assert mesh.coords(2)["cp"] == 1
    assert mesh.coords(4)["dp"] == 1
    assert mesh.coords(8)["pp"] == 1
    for rank in range(mesh.size):
        assert mesh.rank(mesh.coords(rank)) == rank
    hosts = DeviceMesh.standard(dp=2, local=4)  # a recommendation model's hosts x ranks per host
    assert hosts.group(5, ["local"]) == [4, 5, 6, 7] and hosts.group(5, ["dp"]) == [1, 5]


def test_groups_are_derived_from_coordinates():
    mesh = DeviceMesh.standard(dp=2, tp=4, pp=2)
    assert mesh.group(13, ["tp"]) == [12, 13, 14, 15]
    assert mesh.group(13, ["dp"]) == [9, 13]
    assert mesh.group(13, ["dp", "tp"]) == list(range(8, 16))
    groups = list(mesh.groups(["dp"]))
    assert len(groups) == 8 and sorted(r for g in groups for r in g) == list(range(16))
    for index, members in enumerate(groups):
        assert all(mesh.group_index(r, ["dp"]) == index for r in members)


def test_a_group_is_spanned_without_listing_it():
    """A network costs a group by its size and its lowest and highest rank
    (Network.bound): counted from the coordinates, they are those of the listed members, for
    groups over one or several axes and for kept members (a tied embedding's first and last stage)."""
    from stg.program import GroupHole

    mesh = DeviceMesh.standard(pp=4, dp=3, cp=2, tp=2)
    kinds = [GroupHole(("tp",)), GroupHole(("dp",)), GroupHole(("pp",)), GroupHole(("dp", "cp")),
             GroupHole(("cp", "tp")), GroupHole(("pp",), (0, 3)), GroupHole(("dp",), (2, 1))]
    ids = GroupIds.for_kinds(mesh, kinds)
    for rank in range(mesh.size):
        for kind in kinds:
            members = ids.members(rank, kind)
            assert ids.span(rank, kind) == (len(members), min(members), max(members))
    assert ids.span(5, GroupHole(("pp",), (0, 3))) == (2, 5, 3 * 12 + 5)  # the first and last stage (pp stride 12)


def test_bad_mesh_sizes():
    with pytest.raises(LayoutError, match="size must be a positive integer"):
        DeviceMesh((("dp", 0),))
    with pytest.raises(LayoutError, match="unknown mesh axes"):
        DeviceMesh.standard(xp=2)


def test_group_ids_skip_multiples_of_500():
    ids = [ordinal_to_id(n) for n in range(2000)]
    assert ids[:3] == [1, 2, 3]
    assert all(i % 500 for i in ids)
    assert len(set(ids)) == len(ids)


def test_group_ids_cover_every_group_once():
    mesh = DeviceMesh.standard(dp=4, tp=2)
    ids = GroupIds.for_kinds(mesh, [("tp",), ("dp",)])
    table = dict(ids.table())
    assert sorted(table) == list(range(1, 7))  # 4 tp groups, 2 dp groups
    for rank in range(mesh.size):
        for kind in ids.kinds:
            assert rank in table[ids.id(rank, kind)]


def test_layout_local_shape_and_notation():
    import sympy

    B, S, H = sympy.symbols("B S H", positive=True)
    layout = Layout.of({"dp": Shard(0), "tp": Shard(1)}, ["dp", "tp"])
    dp, tp = sympy.symbols("dp tp", positive=True, integer=True)
    assert layout.local_shape((B, S, H)) == (B / dp, S / tp, H)
    assert layout.describe((B, S, H)) == "B@dp S@tp"
    assert Layout.of({"tp": Partial()}, ["tp"]).describe((B,)) == "P(tp)"


@pytest.mark.parametrize("count", [1, 9, 10, 499, 900, 5000, 123_456])
def test_group_ids_of_a_set_have_one_width(count):
    """Every rank of a class then patches the same byte layout (one skeleton per class)."""
    from stg.groups import first_ordinal

    first = first_ordinal(count)
    ids = [ordinal_to_id(first + i) for i in (0, count // 2, count - 1)]
    assert len({len(str(i)) for i in ids}) == 1
    assert all(i % 500 for i in ids) and ids[0] >= 1


def _share_two_ranks(mesh, a, b) -> bool:
    """Groups of kinds a and b can share two ranks iff the kinds span a common axis of size > 1."""
    return any(mesh.sizes[axis] > 1 for axis in set(a.axes) & set(b.axes))


def test_group_ids_keep_overlapping_groups_apart_modulo_500():
    """Property check over random meshes up to 1M ranks, arithmetically: kinds whose groups
    can share two ranks never share a residue; no id is a multiple of 500; ids are unique."""
    import itertools
    import random

    from stg.groups import MODULUS

    rng = random.Random(7)
    axes = ("pp", "dp", "ep", "cp", "tp")
    for _ in range(200):
        sizes = {axis: rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]) for axis in axes}
        while math.prod(sizes.values()) > 1 << 20:
            sizes[rng.choice(axes)] = 1
        mesh = DeviceMesh.standard(**sizes)
        live = [a for a in axes if sizes[a] > 1]
        kinds = [k for r in (1, 2) for k in itertools.combinations(live, r)]
        if not kinds:
            continue
        ids = GroupIds.for_kinds(mesh, rng.sample(kinds, rng.randint(1, len(kinds))))
        for a, b in itertools.combinations(ids.kinds, 2):
            if _share_two_ranks(mesh, a, b):
                assert not ids.residues(a) & ids.residues(b), (sizes, a, b)
        for kind in ids.kinds:
            n = ids.groups_of(kind)
            sample = {0, n - 1, n // 2, rng.randrange(n)}
            values = [ids.id_of(kind, i) for i in sample]
            assert all(v % MODULUS for v in values)
            assert len({len(str(v)) for v in values}) == 1
        firsts = [ids.id_of(k, 0) for k in ids.kinds] + [ids.id_of(k, ids.groups_of(k) - 1) for k in ids.kinds]
        assert len({len(str(v)) for v in firsts}) == 1


def test_group_ids_are_unique_on_a_materialised_mesh():
    mesh = DeviceMesh.standard(dp=64, cp=2, tp=8)
    ids = GroupIds.for_kinds(mesh, [("tp",), ("dp", "cp"), ("cp",), ("dp",)])
    table = dict(ids.table())
    assert len(table) == ids.count > 499
    assert all(gid % 500 for gid in table)
