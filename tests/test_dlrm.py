"""Recommendation models and embedding-table sharding (issue 5).

Expected numbers are written out from the models' published sizes and from the definitions of
the TorchRec sharding types, never read off stg's output."""

import random
from collections import Counter
from pathlib import Path

import pytest
import yaml

from model_zoo import load_model
from parallelism.embedding import Sharding, plan_embeddings
from stg.api import build, generate
from stg.chakra.validate import validate
from stg.errors import ModelSpecError, PlanError
from tests.helpers import block_collectives

ROOT = Path(__file__).resolve().parent.parent

KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
V1_ROWS = [45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209, 11267,
           128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35]
DCN_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
            155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
DCN_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def mlp_params(widths):
    """Weights and biases of Linear layers through `widths` (in, hidden..., out)."""
    return sum(i * o + o for i, o in zip(widths, widths[1:]))


def test_parameter_counts_are_the_published_sizes_summed_by_hand():
    # Kaggle: tables 33,762,577 rows x 16; bottom 13-512-256-64-16; top (16 + 27*26/2 = 367)-512-256-1
    assert sum(KAGGLE_ROWS) == 33762577
    kaggle = 33762577 * 16 + mlp_params([13, 512, 256, 64, 16]) + mlp_params([367, 512, 256, 1])
    assert kaggle == 540_201_232 + 155_984 + 320_001 == 540_677_217
    assert load_model("dlrm-kaggle").params == kaggle
    # MLPerf v1: 177,944,275 rows x 128; bottom 13-512-256-128; top (128 + 351 = 479)-1024-1024-512-256-1
    assert sum(V1_ROWS) == 177944275
    v1 = 177944275 * 128 + mlp_params([13, 512, 256, 128]) + mlp_params([479, 1024, 1024, 512, 256, 1])
    assert load_model("dlrm-mlperf-v1").params == v1 == 22_779_236_097
    # DCN-v2: 204,184,588 rows x 128; 3 cross layers of V [3456, 512], U [512, 3456], bias [3456];
    # top 3456-1024-1024-512-256-1
    assert sum(DCN_ROWS) == 204184588
    cross = 3 * (3456 * 512 + 512 * 3456 + 3456)
    dcn = 204184588 * 128 + mlp_params([13, 512, 256, 128]) + cross + mlp_params([3456, 1024, 1024, 512, 256, 1])
    assert load_model("dlrm-dcnv2").params == dcn == 26_151_671_809


@pytest.mark.parametrize("name, top_in, interaction", [
    ("dlrm-mlperf-v1", 479, lambda b: 3 * 2 * b * 27 * 27 * 128),  # DLRM's bmm T T^T forward, dT = dZ T + dZ^T T
    ("dlrm-dcnv2", 3456, lambda b: 3 * 3 * (2 * b * 3456 * 512 + 2 * b * 512 * 3456)),  # 3 cross layers, V then U
])
def test_dense_flops_of_a_step(name, top_in, interaction):
    """2 B sum(in x out) over the MLP layers, x 3 for forward and backward, minus the input
    gradient of the first bottom layer (dense inputs need none), plus the interaction."""
    b = 64
    workload = build(name, dict(dp=1, micro_batch=b, embedding_sharding="data_parallel", embedding_memory_gib=1e4))
    layers = list(zip([13, 512, 256], [512, 256, 128])) + list(zip([top_in, 1024, 1024, 512, 256], [1024, 1024, 512, 256, 1]))
    mlp = 3 * 2 * b * sum(i * o for i, o in layers) - 2 * b * 13 * 512
    assert workload.programs[0].stats.matmul_flops == mlp + interaction(b)


TOY = {"name": "toy", "family": "dlrm", "dense_features": 4, "embedding_dim": 16, "bottom_mlp": [16], "top_mlp": [1],
       "tables": [{"name": f"t{i}", "rows": 1000, "pooling": 2} for i in range(8)]}
T, R, DIM, L = 8, 1000, 16, 2  # tables, rows, dim, ids per sample
N, MICRO = 8, 4
BATCH = N * MICRO  # samples per step over all ranks
DENSE = (4 * 16 + 16) + ((16 + 9 * 8 // 2) * 1 + 1)  # bottom 4-16; top on 16 + 36 pairs of the 9 vectors


def collectives(workload) -> Counter:
    """(F forward, B backward or S step, collective) -> bytes per rank per step, over the
    model's three layers (the tables' backward is a weight-gradient, W, pass)."""
    found = Counter()
    for layer in range(3):
        for (phase, kind, nbytes), count in block_collectives(workload, layer).items():
            found[("B" if phase == "W" else phase, kind)] += nbytes * count
    return found


LOCAL = BATCH // N  # samples per rank
IDS, LENGTHS = LOCAL * T * L * 8, LOCAL * T * 4  # a rank's int64 ids and int32 lengths (one per sample and feature)


@pytest.mark.parametrize("sharding, extra, expected", [
    # replicated: only the all-reduce of the dense table gradients (fp32), with the MLPs'
    ("data_parallel", {}, {("S", "ALL_REDUCE"): 4 * (T * R * DIM + DENSE)}),
    # one table per rank: ids and lengths of the local samples to their table's rank; pooled
    # vectors of the whole batch from the table's rank to the samples' ranks, and back
    ("table_wise", {}, {("F", "ALL_TO_ALL"): IDS + LENGTHS + BATCH * DIM * 4,
                        ("B", "ALL_TO_ALL"): BATCH * DIM * 4, ("S", "ALL_REDUCE"): 4 * DENSE}),
    # two 8-wide shards per table, two shards per rank: every shard needs its table's ids
    ("column_wise", {"column_shards": 2}, {("F", "ALL_TO_ALL"): 2 * (IDS + LENGTHS) + BATCH * 2 * (DIM // 2) * 4,
                                            ("B", "ALL_TO_ALL"): BATCH * 2 * (DIM // 2) * 4, ("S", "ALL_REDUCE"): 4 * DENSE}),
    # rows over all ranks: ids bucketized to their rows' ranks, every sample's lengths to
    # every rank; partial pooled sums of the whole batch reduce-scattered to the samples'
    # ranks; their gradients all-gathered back
    ("row_wise", {}, {("F", "ALL_TO_ALL"): IDS, ("F", "ALL_GATHER"): LENGTHS, ("F", "REDUCE_SCATTER"): BATCH * T * DIM * 4,
                      ("B", "ALL_GATHER"): LOCAL * T * DIM * 4, ("S", "ALL_REDUCE"): 4 * DENSE}),
    # 2 hosts x 4 ranks, 4 tables per host: ids to their rows' ranks, lengths to the table's
    # host (all-to-all across hosts) and all its ranks (all-gather inside); pooled partial
    # sums reduce-scattered inside the host, then all-to-all across hosts; backward the reverse
    ("table_row_wise", {"dp": 2, "local_world_size": 4},
     {("F", "ALL_TO_ALL"): IDS + LENGTHS + (BATCH // 4) * 4 * DIM * 4, ("F", "ALL_GATHER"): (BATCH // 4) * 4 * 4,
      ("F", "REDUCE_SCATTER"): BATCH * 4 * DIM * 4, ("B", "ALL_TO_ALL"): LOCAL * T * DIM * 4,
      ("B", "ALL_GATHER"): (BATCH // 4) * 4 * DIM * 4, ("S", "ALL_REDUCE"): 4 * DENSE}),
])
def test_collective_bytes_of_each_sharding_type_on_8_ranks(sharding, extra, expected):
    workload = build(TOY, {"dp": N, "micro_batch": MICRO, "embedding_sharding": sharding, **extra})
    assert workload.mesh.size == N
    assert dict(collectives(workload)) == expected
    summary = workload.summary()
    placed = [row["placed_on"] for row in summary["embedding_plan"]]
    if sharding == "table_wise":  # equal tables: one per rank, so every rank runs one program
        assert sorted(placed) == [f"rank {r}" for r in range(N)] and len(workload.programs) == 1
        slots = summary["embedding_slots"]["table_wise"]
        assert slots["features"]["overstatement"] == slots["ids"]["overstatement"] == 1  # no padding
    if sharding == "data_parallel":
        # fp32 AdamW on the dense part: two moments, the weight is its own master copy;
        # row-wise Adagrad on the tables: one fp32 per row
        assert summary["rank_classes"][0]["memory"]["optimizer_states"] == DENSE * 8 + T * R * 4
        # the step: AdamW's 15 FLOPs per dense parameter; row-wise Adagrad's 4 per table
        # element and 5 per row (FBGEMM: mean, s += mean, lr / (sqrt(s) + eps)) on the
        # all-reduced dense table gradient
        assert summary["rank_classes"][0]["flops_optimizer"] == 15 * DENSE + 4 * T * R * DIM + 5 * T * R
        adagrad = build(TOY, {"dp": N, "micro_batch": MICRO, "embedding_sharding": sharding,
                              "optimizer": "adagrad"}).summary()["rank_classes"][0]
        # MLPerf DCNv2's dense Adagrad: one fp32 state and 7 FLOPs per parameter (s += g^2,
        # p -= lr * g / (sqrt(s) + eps))
        assert adagrad["memory"]["optimizer_states"] == DENSE * 4 + T * R * 4
        assert adagrad["flops_optimizer"] == 7 * DENSE + 4 * T * R * DIM + 5 * T * R


def test_uneven_table_wise_slots_are_rank_classes_with_padded_all_to_alls():
    """Two tables with 1 and 3 ids per sample, one per rank: each rank looks up its own
    table's ids for the whole batch, while both ranks' all-to-alls are sized by the busier
    slot (Chakra's all-to-all is even) -- 3 ids per sample, 1.5x the mean."""
    model = {**TOY, "tables": [{"name": "a", "rows": 100, "pooling": 1}, {"name": "b", "rows": 100, "pooling": 3}]}
    plan = {"dp": 2, "micro_batch": 4, "embedding_sharding": "table_wise",
            "embeddings": {"a": {"sharding": "table_wise", "ranks": 0}, "b": {"sharding": "table_wise", "ranks": 1}}}
    workload = build(model, plan)
    assert len(workload.programs) == 2 and [workload.class_of(r) for r in (0, 1)] == [0, 1]
    batch = 8
    for rank, pooling in ((0, 1), (1, 3)):
        nodes = {n.name.split(" ", 1)[1]: n for n in workload.programs[workload.class_of(rank)].nodes}
        assert nodes["pooled.tw"].flops == batch * pooling * DIM
        assert nodes["ids.tw.all_to_all[dp]"].comm_bytes == (batch // 2) * 2 * 3 * 8  # each peer's share padded to 3
        assert nodes["pooled.tw.all_to_all[dp]"].comm_bytes == batch * 1 * DIM * 4  # one table each: even
    ids = workload.summary()["embedding_slots"]["table_wise"]["ids"]
    assert ids == {"most": 3.0, "mean": 2.0, "overstatement": 1.5}


@pytest.mark.parametrize("rows", [1000, 10])
def test_lookup_and_update_cost_the_touched_rows(rows):
    """Forward: every id reads one row (dim x fp32) and adds it. The fused row-wise Adagrad
    reads every id's pooled gradient and adds it into its row's; then each touched row -- at
    most one per id, at most all the table's rows -- is read and written with its fp32 state,
    4 FLOPs per element and 5 per row."""
    model = {**TOY, "tables": [{"name": f"t{i}", "rows": rows, "pooling": L} for i in range(T)]}
    workload = build(model, {"dp": N, "micro_batch": MICRO, "embedding_sharding": "table_wise"})
    nodes = {n.name.split(" ", 1)[1]: n for n in workload.programs[0].nodes}
    ids = BATCH * L  # one table per rank: the ids of the whole batch for it, and a length per sample
    lookup = nodes["pooled.tw"]
    assert lookup.flops == ids * DIM
    assert lookup.nbytes == ids * 8 + BATCH * 4 + ids * DIM * 4 + BATCH * DIM * 4
    touched = min(ids, rows)  # 64 ids; a 10-row table has only 10 rows to touch
    update = nodes["emb.tw.rowwise_adagrad"]
    assert update.flops == ids * DIM + touched * (4 * DIM + 5)
    assert update.nbytes == ids * 8 + BATCH * 4 + ids * DIM * 4 + 2 * touched * (DIM * 4 + 4)


def test_mixed_plan_on_16_ranks_validates_and_memory_matches_the_plan(tmp_path):
    plan = yaml.safe_load((ROOT / "examples" / "dlrm-mixed-plan.yaml").read_text())
    summary = generate("dlrm-kaggle", plan, tmp_path / "out")
    placed = build("dlrm-kaggle", plan).embeddings
    assert summary["world_size"] == 16
    assert validate(tmp_path / "out") == []
    rows = dict(zip([f"t{i}" for i in range(26)], KAGGLE_ROWS))
    sharding = {r["table"]: (r["sharding"], r["placed_on"]) for r in summary["embedding_plan"]}
    kinds = Counter(kind for kind, _ in sharding.values())
    assert kinds["table_wise"] and kinds["row_wise"] and kinds["data_parallel"] == 1
    assert sharding["t3"] == ("table_wise", "rank 5")  # as the plan file pins it
    row_wise = sum(-(-rows[t] // 16) for t, (kind, _) in sharding.items() if kind == "row_wise")
    for rank in range(16):
        # table-wise tables on this rank, whole; 1/16 of each row-wise table (padded up, as
        # TorchRec's row-wise blocks); the data-parallel table everywhere: 16 fp32 weights and
        # one fp32 Adagrad state per row
        held = sum(rows[t] for t, (kind, where) in sharding.items() if where == f"rank {rank}")
        held += row_wise + sum(rows[t] for t, (kind, _) in sharding.items() if kind == "data_parallel")
        memory = summary["rank_classes"][summary["rank_class"][rank]]["memory"]
        assert memory["embedding_weights"] == held * 16 * 4
        assert memory["embedding_optimizer_states"] == held * 4
        # the planner's accounting (what it holds to the memory limit) is the trace's
        planned = placed.rank_memory(rank)
        assert (planned["weights"], planned["optimizer_states"]) == (held * 16 * 4, held * 4)


@pytest.mark.parametrize("sharding, extra", [
    ("data_parallel", {}), ("table_wise", {}), ("column_wise", {"column_shards": 2}), ("row_wise", {}),
    ("table_row_wise", {"dp": 2, "local_world_size": 4}), ("auto", {"embedding_memory_gib": 0.4}),
])
def test_every_sharding_type_gives_a_consistent_trace_set(tmp_path, sharding, extra):
    plan = {"dp": 8, "micro_batch": 16, "global_batch": 256, "embedding_sharding": sharding, **extra}
    generate("dlrm-kaggle", plan, tmp_path / "out")
    assert validate(tmp_path / "out") == []


def test_recommendation_sets_are_byte_identical_run_to_run(tmp_path):
    from test_cli import stg_process

    for name, seed in (("a", "1"), ("b", "2")):
        done = stg_process("generate", "dlrm-dcnv2", "--dp", "2", "--local-world-size", "2", "--micro-batch", "8",
                           "--embedding-sharding", "auto", "--embedding-memory-gib", "40", "-o", tmp_path / name, "-q",
                           hash_seed=seed)
        assert done.returncode == 0, done.stderr
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_planner_respects_the_memory_limit_and_says_when_nothing_fits():
    config = load_model("dlrm-dcnv2").config
    rng = random.Random(5)
    fitted = refused = 0
    for _ in range(40):
        hosts, local = rng.choice([(1, 8), (2, 4), (4, 4), (16, 1)])
        limit = int(rng.uniform(0.5, 40) * 2**30)
        try:
            plan = plan_embeddings(config, default="auto", overrides=None, hosts=hosts, local=local, batch=65536,
                                   limit_bytes=limit)
        except PlanError as error:
            assert "fits on no rank" in str(error) and "GiB" in str(error)
            refused += 1
            continue
        fitted += 1
        assert len(plan.placements) == 26
        for rank in range(hosts * local):
            assert sum(plan.rank_memory(rank).values()) <= limit
    assert fitted and refused
    # a 40M-row table (20.6 GB with its state) does not fit a 16 GiB rank whole, but four
    # 32-wide column shards (5.2 GB each) do
    plan = plan_embeddings(config, default="auto", overrides=None, hosts=16, local=1, batch=65536,
                           limit_bytes=16 * 2**30)
    assert plan.placements[0].sharding is Sharding.COLUMN_WISE and len(set(plan.placements[0].slots)) == 4
    # the least any rank can hold: 1/16 of every table's rows (padded up), 128 fp32 + one
    # fp32 state each. With exactly that much, only the most even plan fits -- every table
    # row-wise; with a byte less, none does
    least = sum(-(-rows // 16) for rows in DCN_ROWS) * (128 * 4 + 4)
    tight = plan_embeddings(config, default="auto", overrides=None, hosts=16, local=1, batch=65536, limit_bytes=least)
    assert {p.sharding for p in tight.placements} == {Sharding.ROW_WISE}
    with pytest.raises(PlanError, match="fits on no rank under the 6.13 GiB"):
        plan_embeddings(config, default="auto", overrides=None, hosts=16, local=1, batch=65536, limit_bytes=least - 1)
    # four 40M-row tables (20.5 GB each with their state) cannot fit 8 ranks of 8 GiB
    with pytest.raises(PlanError, match=r"embedding table t\d+ \(40,000,000 rows x 128\) fits on no rank under the 8.00 GiB"):
        plan_embeddings(config, default="table_wise", overrides=None, hosts=8, local=1, batch=65536, limit_bytes=8 * 2**30)


def test_explicit_placements_and_their_errors():
    config = load_model("dlrm-kaggle").config
    plan = plan_embeddings(config, default="row_wise", overrides={"t2": {"sharding": "table_wise", "ranks": 3},
                                                                  "t5": "data_parallel"},
                           hosts=4, local=1, batch=1024, limit_bytes=2**34)
    assert plan.placements[2].sharding is Sharding.TABLE_WISE and plan.placements[2].slots == (3,)
    assert plan.placements[5].sharding is Sharding.DATA_PARALLEL and plan.placements[0].sharding is Sharding.ROW_WISE
    for overrides, message in [({"t99": "row_wise"}, "unknown table"), ({"t1": "sideways"}, "unknown embedding sharding"),
                               ({"t1": {"sharding": "table_wise", "ranks": 9}}, r"ranks \[9\] out of range 0..3"),
                               ({"t1": {"sharding": "row_wise", "ranks": 1}}, "takes no ranks")]:
        with pytest.raises(PlanError, match=message):
            plan_embeddings(config, default="auto", overrides=overrides, hosts=4, local=1, batch=1024, limit_bytes=2**34)


@pytest.mark.parametrize("plan, message", [
    ({"tp": 2}, "tp=2: model dlrm-kaggle is a recommendation model"),
    ({"embedding_sharding": "table_row_wise"}, "table_row_wise splits rows over the ranks of a host"),
    ({"column_shards": 3, "embedding_sharding": "column_wise"}, "column_shards=3 does not divide the embedding dim 16"),
])
def test_bad_recommendation_plans_name_the_field(plan, message):
    with pytest.raises(PlanError, match=message):
        build("dlrm-kaggle", {"dp": 2, **plan})


def test_embedding_options_are_refused_for_models_without_tables():
    with pytest.raises(PlanError, match="embedding_sharding: applies to models with embedding tables"):
        build("llama2-7b", {"embedding_sharding": "row_wise"})


@pytest.mark.parametrize("change, message", [
    ({"bottom_mlp": [16, 8]}, "bottom_mlp ends at 8"),
    ({"tables": [{"rows": 0}]}, r"tables\[0\].rows: must be a positive integer"),
    ({"tables": [{"rows": 5, "pooling": -1}]}, r"tables\[0\].pooling: must be a positive number"),
    ({"interaction": "cat"}, "interaction must be 'dot' or 'dcn'"),
])
def test_malformed_recommendation_models(change, message):
    with pytest.raises(ModelSpecError, match=message):
        load_model({**TOY, **change})
