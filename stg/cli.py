"""The `stg` command line. Same names as plan.yaml and the Python API.

Exit codes: 0 success; 1 a trace set failed validation; 2 bad input (one line on stderr
naming the field and the reason, no traceback, no partial output).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stg.errors import OutputError, PlanError, StgError
from stg.interrupts import OneLineGroup

app = typer.Typer(
    cls=OneLineGroup,  # argument errors and interrupts: one line, not click's usage block
    help="Synthesize per-rank Chakra execution traces of distributed training and inference from a model description.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts print as written: rich markup ate "[default: 1]", markdown "<rank>"
)
err = Console(stderr=True, soft_wrap=True)  # an error is one line, however narrow the terminal or pipe

# generate's help panels, in print order (typer draws panels only in rich markup mode)
PANELS = ("Model & batch", "Parallelism", "Memory & precision", "MoE", "Recommendation models", "Output & scale")


class _PanelledCommand(typer.core.TyperCommand):
    """Help printed as written (no markup), options grouped under their rich_help_panel."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panel = getattr(param, "rich_help_panel", None) or "Options"
                sections.setdefault(panel, []).append(record)
        for title in sorted(sections, key=lambda t: PANELS.index(t) if t in PANELS else len(PANELS)):
            with formatter.section(title):
                formatter.write_dl(sections[title])


def _stdout() -> Console:
    """Tables on stdout: as wide as they need when piped (rich would cut them at 80 columns)."""
    return Console() if sys.stdout.isatty() else Console(width=200)


@contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except StgError as error:
        err.print(f"[red]error:[/red] {escape(' '.join(str(error).split()))}", highlight=False)
        raise typer.Exit(2)


@contextmanager
def _progress(description: str, quiet: bool):
    """A progress callback(done, total); a live bar only when stderr is a terminal."""
    if quiet or not err.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# commands of the rooms above the passes live with them and use this module's helpers lazily
from stg.explore.cli import explore as _explore  # noqa: E402
from stg.serve.cli import serve as _serve  # noqa: E402
from stg.view.cli import plot as _plot, report as _report, timeline as _timeline  # noqa: E402

app.command("serve")(_serve)


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Print a JSON list of {name, family, layers, params}.")):
    """List the model zoo with parameter counts."""
    from model_zoo import load_model, zoo_names

    rows = [load_model(name).describe() for name in zoo_names()]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table("name", "family", "layers", "params")
    for row in rows:
        table.add_row(row["name"], row["family"], str(row["layers"]), f"{row['params']:,}")
    _stdout().print(table)


# options of recommendation models, shared by `generate` and `plan-embeddings`
EMBEDDING_SHARDING = typer.Option(None, help="Recommendation models: every table's sharding (TorchRec's): data_parallel, table_wise, column_wise, row_wise, table_row_wise, or auto (a greedy planner: small tables data parallel, the rest largest first table-wise on the least-loaded rank with room, else column-wise, else table-row-wise, else row-wise; falling back to more even plans when it runs out of room). Per-table choices go in the plan YAML under `embeddings:`. [default: auto]", rich_help_panel="Recommendation models")
LOCAL_WORLD_SIZE = typer.Option(None, help="Recommendation models: ranks per host (the mesh axis `local`); dp then counts hosts and the ranks are dp x local-world-size. table_row_wise splits a table's rows over one host's ranks. [default: 1]", rich_help_panel="Recommendation models")
COLUMN_SHARDS = typer.Option(None, help="Recommendation models: column shards per column_wise table (each dim/shards wide). [default: as many 32-wide shards as the dim allows, at most the ranks]", rich_help_panel="Recommendation models")
EMBEDDING_MEMORY_GIB = typer.Option(None, help="Recommendation models: per-rank memory limit, GiB, for embedding tables and their optimizer state; no plan may exceed it. [default: the device's memory]", rich_help_panel="Recommendation models")


@app.command(cls=_PanelledCommand)
def generate(
    model: str = typer.Argument(..., help="A zoo name (see `stg models`) or a path to a model YAML.", rich_help_panel="Model & batch"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory; replaced atomically if it holds an earlier trace set. Required unless --count-only.", rich_help_panel="Output & scale"),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="A plan YAML with the same keys as these options; options given here override it.", rich_help_panel="Model & batch"),
    dp: Optional[int] = typer.Option(None, help="Data-parallel degree (Megatron-Core's): every rank of a tp x cp x pp model replica takes its own data; world = tp x cp x pp x dp. [default: 1]", rich_help_panel="Parallelism"),
    tp: Optional[int] = typer.Option(None, help="Tensor-parallel degree (Megatron: heads, MLP and vocabulary split). [default: 1]", rich_help_panel="Parallelism"),
    sp: Optional[bool] = typer.Option(None, "--sp/--no-sp", help="Sequence parallelism: the residual stream split on the sequence over tp. [default: on when tp > 1]", rich_help_panel="Parallelism"),
    cp: Optional[int] = typer.Option(None, help="Context-parallel degree: the sequence split over cp, keys and values all-gathered. [default: 1]", rich_help_panel="Parallelism"),
    pp: Optional[int] = typer.Option(None, help="Pipeline stages; blocks split evenly (first stage + embedding, last + head). [default: 1]", rich_help_panel="Parallelism"),
    vpp: Optional[int] = typer.Option(None, help="Virtual stages (model chunks) per pipeline stage, for --schedule interleaved. [default: 1]", rich_help_panel="Parallelism"),
    schedule: Optional[str] = typer.Option(None, help="Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1 (see `stg schedule`). [default: 1f1b]", rich_help_panel="Parallelism"),
    layers_per_stage: Optional[str] = typer.Option(None, help="Uneven split: blocks per virtual stage, comma-separated (e.g. 9,10,10,3), or auto: balanced by compute, the embedding counted on the first stage and the output layer + loss on the last (Megatron's --account-for-embedding/loss-in-pipeline-split, by FLOPs); the split is in summary.json. [default: even]", rich_help_panel="Parallelism"),
    ep: Optional[int] = typer.Option(None, help="Expert-parallel degree (Megatron-Core's): routed experts split over ep ranks carved out of the dp data-parallel ranks (ep must divide dp; dp x cp / ep ranks hold each expert); token dispatch and combine are all-to-alls. [default: 1]", rich_help_panel="MoE"),
    zero: Optional[int] = typer.Option(None, help="ZeRO stage over dp (x cp): 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (FSDP). With --pp > 1, 2 and 3 act as 1 (torch pipelining keeps FSDP's gradients and parameters whole through the micro-batches and reduces once; DeepSpeed refuses them). [default: 0]", rich_help_panel="Memory & precision"),
    recompute: Optional[str] = typer.Option(None, help="Activation recomputation: none, selective (the attention core) or full (each layer). [default: none]", rich_help_panel="Memory & precision"),
    flash_attention: Optional[bool] = typer.Option(None, "--flash-attention/--no-flash-attention", help="Fused attention: scores and probabilities stay on chip (no memory traffic, not saved). [default: on]", rich_help_panel="Memory & precision"),
    dtype: Optional[str] = typer.Option(None, help="Dtype of weights, activations and their communication: bf16, fp16 or fp32 (Megatron's --bf16/--fp16; fp32 GEMMs run at the device's TF32 peak). 16-bit weights get fp32 master copies and moments (16 bytes/param with AdamW), fp32 ones only moments (also 16). fp16's loss scaler costs nothing in the trace. [default: the model's, bf16 unless its YAML says]", rich_help_panel="Memory & precision"),
    fp8: Optional[bool] = typer.Option(None, "--fp8/--no-fp8", help="FP8 linear layers, Transformer Engine's recipe (Megatron's --fp8-format): each block's linear GEMMs (forward, input and weight gradient) at the device's fp8 peak, their inputs cast to fp8 once and kept in fp8 for the backward (sequence parallelism gathers the fp8 copy), weights keep their 16-bit copy plus an fp8 copy cast once per step. Routed/shared experts, MLA projections and the output layer stay 16-bit. Needs an fp8 device (h100, h200, b200, mi300x). [default: off]", rich_help_panel="Memory & precision"),
    fp8_param_gather: Optional[bool] = typer.Option(None, "--fp8-param-gather/--no-fp8-param-gather", help="With --fp8 and --zero >= 1 (Megatron's flag): the fp8 layers' weights are kept in fp8 only (no 16-bit copy) and gathered in fp8; the optimizer updates them from its fp32 master copy. [default: off]", rich_help_panel="Memory & precision"),
    grad_dtype: Optional[str] = typer.Option(None, help="Dtype of weight gradients, their accumulation and reduction: bf16 or fp32. [default: the weights' dtype]", rich_help_panel="Memory & precision"),
    optimizer: Optional[str] = typer.Option(None, help="Optimizer of the dense weights: adamw (fp32 moments, and an fp32 master copy of bf16 weights) or adagrad (one fp32 state per parameter; MLPerf DLRM-DCNv2's). Embedding tables use row-wise Adagrad. [default: adamw]", rich_help_panel="Memory & precision"),
    etp: Optional[int] = typer.Option(None, help="Expert tensor parallelism (Megatron-Core's --expert-tensor-parallel-size): 1, or tp to split every expert's MLP dimension over the tp ranks (tokens all-gathered over tp after the dispatch all-to-all, partial outputs reduce-scattered before the combine). Megatron-Core's default is tp; stg's is 1 (each tp rank routes its own tokens to whole experts), so plans keep their meaning; other sizes are not implemented. [default: 1]", rich_help_panel="MoE"),
    expert_skew: Optional[float] = typer.Option(None, help="Routing skew: expert e gets tokens in proportion to 1/(e+1)^s (Zipf); each expert-parallel slot then computes its own load (a rank class per slot), while all-to-alls stay capacity-padded. [default: 0, balanced]", rich_help_panel="MoE"),
    capacity_factor: Optional[float] = typer.Option(None, help="Expert buffer slots per routed token (balanced routing): all-to-all sizes and expert compute scale with it. [default: 1.0]", rich_help_panel="MoE"),
    make_vocab_divisible_by: Optional[int] = typer.Option(None, help="Pad the vocabulary to a multiple of this times tp (Megatron's flag; its default is 128). [default: 1: only what tp needs]", rich_help_panel="Model & batch"),
    micro_batch: Optional[int] = typer.Option(None, help="Sequences per rank per forward/backward. [default: 1]", rich_help_panel="Model & batch"),
    global_batch: Optional[int] = typer.Option(None, help="Sequences per optimizer step over all ranks; micro-batches per rank = global / (micro * dp). [default: micro-batch * dp]", rich_help_panel="Model & batch"),
    seq: Optional[int] = typer.Option(None, help="Sequence length in tokens. [default: 2048]", rich_help_panel="Model & batch"),
    attention_flops: Optional[str] = typer.Option(None, help="Count causal attention's score matrices as 'causal' (the unmasked half, as FlashAttention runs and Megatron-LM counts) or 'full' (the whole square, as PyTorch's FlopCounterMode). [default: causal]", rich_help_panel="Model & batch"),
    bucket_mb: Optional[float] = typer.Option(None, help="Gradient bucket size in MiB for the data-parallel all-reduce, sent as the last backward finishes its gradients (with pp > 1: after the stage's last backward; see README, Conventions). [default: 25, PyTorch DDP's]", rich_help_panel="Parallelism"),
    device: Optional[str] = typer.Option(None, help="Device spec for compute durations (a roofline of its peak per dtype and HBM bandwidth; on h100 and h200 each GEMM at the fraction of peak measured for its size): h100, h200, a100, b200, mi300x. [default: h100]", rich_help_panel="Memory & precision"),
    embedding_sharding: Optional[str] = EMBEDDING_SHARDING,
    local_world_size: Optional[int] = LOCAL_WORLD_SIZE,
    column_shards: Optional[int] = COLUMN_SHARDS,
    embedding_memory_gib: Optional[float] = EMBEDDING_MEMORY_GIB,
    workers: Optional[int] = typer.Option(None, help="Processes that stamp rank files (with --count-only: that lower the rank classes). [default: all cores]", rich_help_panel="Output & scale"),
    ranks: Optional[str] = typer.Option(None, help="Write only ranks A:B (A included, B excluded) into OUT, each file byte-identical to a full run's; workload.json and summary.json are written too, the same for every range. Split a large set over machines this way.", rich_help_panel="Output & scale"),
    count_only: bool = typer.Option(False, "--count-only", help="Do everything but write: print the bytes and nodes a full set would have (JSON).", rich_help_panel="Output & scale"),
    executor: str = typer.Option("local", help="Where ranks are written: local (processes on this machine) or dask (a Dask cluster; pip install 'stg[dask]').", rich_help_panel="Output & scale"),
    scheduler: Optional[str] = typer.Option(None, help="With --executor dask: the scheduler address, e.g. tcp://HOST:8786; without it a LocalCluster starts. Workers must share OUT's storage.", rich_help_panel="Output & scale"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary line.", rich_help_panel="Output & scale"),
):
    """Write OUT/workload.<rank>.et for every rank, OUT/workload.json (communicator groups) and OUT/summary.json."""
    import os

    from stg.api import count
    from stg.api import generate as run
    from stg.plan import Plan

    given = dict(dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, vpp=vpp, schedule=schedule, ep=ep, etp=etp, zero=zero, recompute=recompute,
                 flash_attention=flash_attention, dtype=dtype, fp8=fp8, fp8_param_gather=fp8_param_gather, grad_dtype=grad_dtype, optimizer=optimizer, micro_batch=micro_batch,
                 make_vocab_divisible_by=make_vocab_divisible_by, capacity_factor=capacity_factor,
                 expert_skew=expert_skew,
                 global_batch=global_batch, seq=seq, attention_flops=attention_flops, bucket_mb=bucket_mb,
                 device=device, embedding_sharding=embedding_sharding, local_world_size=local_world_size,
                 column_shards=column_shards, embedding_memory_gib=embedding_memory_gib)
    with _user_errors():
        if layers_per_stage is not None:
            given["layers_per_stage"] = (layers_per_stage if layers_per_stage == "auto"
                                         else _int_list("layers_per_stage", layers_per_stage))
        if workers is not None and workers < 1:
            raise PlanError(f"workers: must be a positive integer, got {workers}")
        if executor not in ("local", "dask"):
            raise PlanError(f"executor: must be local or dask, got {executor!r}")
        if scheduler is not None and executor != "dask":
            raise PlanError("scheduler: applies to --executor dask only")
        if workers is not None and executor == "dask":
            raise PlanError("workers: applies to --executor local only (a Dask cluster has its own workers)")
        overrides = {k: v for k, v in given.items() if v is not None}
        plan = Plan.from_yaml(plan_file, overrides) if plan_file else Plan.from_dict(overrides)
        if count_only:
            counted = count(model, plan, workers=workers or os.cpu_count() or 1)
            counted.pop("summary")
            typer.echo(json.dumps(counted, indent=1))
            return
        if out is None:
            raise PlanError("out: give an output directory with -o/--out (or use --count-only)")
        span = _rank_range(ranks) if ranks is not None else None
        with _progress("writing ranks", quiet) as progress:
            if executor == "dask":
                from model_zoo import load_model
                from stg.distributed import generate_on_dask

                summary = generate_on_dask(load_model(model), plan, out, scheduler=scheduler, ranks=span,
                                           progress=progress)
            else:
                summary = run(model, plan, out, progress, ranks=span, workers=workers or os.cpu_count() or 1)
    if not quiet:
        totals = summary["totals"]
        scale, unit = next(((s, u) for s, u in ((1e15, "PFLOP"), (1e12, "TFLOP")) if totals["flops"] >= s), (1e9, "GFLOP"))
        err.print(
            f"{summary['world_size']} ranks, {summary['microbatches']} micro-batches/rank, "
            f"{totals['flops'] / scale:.3f} {unit} per step -> {out}", highlight=False,
        )


@app.command("plan-embeddings")
def plan_embeddings(
    model: str = typer.Argument(..., help="A recommendation model: a zoo name (dlrm-dcnv2, ...) or a model YAML."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="A plan YAML (its embeddings: section gives per-table choices); options given here override it."),
    dp: Optional[int] = typer.Option(None, help="Data-parallel degree (hosts when --local-world-size > 1). [default: 1]"),
    micro_batch: Optional[int] = typer.Option(None, help="Samples per rank per step. [default: 1]"),
    embedding_sharding: Optional[str] = EMBEDDING_SHARDING,
    local_world_size: Optional[int] = LOCAL_WORLD_SIZE,
    column_shards: Optional[int] = COLUMN_SHARDS,
    embedding_memory_gib: Optional[float] = EMBEDDING_MEMORY_GIB,
    device: Optional[str] = typer.Option(None, help="Device whose memory is the default limit. [default: h100]"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: {tables: one row per table, ranks: memory per rank}."),
):
    """Print how each embedding table is sharded and placed, and the embedding memory of every rank."""
    from model_zoo import load_model
    from stg.api import embedding_plan
    from stg.plan import Plan

    given = dict(dp=dp, micro_batch=micro_batch, embedding_sharding=embedding_sharding,
                 local_world_size=local_world_size, column_shards=column_shards,
                 embedding_memory_gib=embedding_memory_gib, device=device)
    with _user_errors():
        overrides = {k: v for k, v in given.items() if v is not None}
        plan = Plan.from_yaml(plan_file, overrides) if plan_file else Plan.from_dict(overrides)
        loaded = load_model(model)
        placed = embedding_plan(loaded, plan)
        if placed is None:
            raise PlanError(f"model {loaded.name} (family {loaded.family}) has no embedding tables to shard")
    tables = placed.table()
    ranks = [{"rank": r, **placed.rank_memory(r)} for r in range(placed.world)]
    if as_json:
        typer.echo(json.dumps({"tables": tables, "ranks": ranks}, indent=1))
        return
    mib = 2**20
    table = Table("table", "rows", "dim", "pooling", "sharding", "placed on", "MiB per shard", "lookup MiB/step")
    for row in tables:
        table.add_row(row["table"], f"{row['rows']:,}", str(row["dim"]), f"{row['pooling']:g}", row["sharding"],
                      row["placed_on"], f"{row['shard_bytes'] / mib:,.1f}", f"{row['lookup_bytes'] / mib:,.1f}")
    _stdout().print(table)
    totals = [r["weights"] + r["optimizer_states"] + r["gradients"] for r in ranks]
    fullest = max(range(len(ranks)), key=totals.__getitem__)
    typer.echo(f"{len(ranks)} ranks; embedding memory per rank (tables, optimizer state, data-parallel "
               f"gradients): min {min(totals) / 2**30:.3f} GiB, max {totals[fullest] / 2**30:.3f} GiB "
               f"(rank {fullest}), limit {plan.embedding_memory_gib or device_memory(plan.device):g} GiB")


def _read_summary(out: Path) -> dict:
    """OUT/summary.json, checked enough that every figure `stg summary` prints is there."""
    path = out / "summary.json"
    if not path.is_file():
        raise OutputError(f"{out}: not a trace set (no summary.json)")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as error:
        raise OutputError(f"{path}: not readable JSON ({type(error).__name__})") from None
    serving = isinstance(data, dict) and "mode" in data  # stg serve: no per-step memory, no micro-batches
    ok = isinstance(data, dict) and isinstance(data.get("world_size"), int) and isinstance(data.get("rank_class"), list) \
        and isinstance(data.get("rank_classes"), list) and isinstance(data.get("model"), dict) and all(
            isinstance(c, dict) and isinstance(c.get("comm_bytes"), dict) and isinstance(c.get("comm_count"), dict)
            and (serving or isinstance(c.get("memory"), dict)) and all(k in c for k in ("flops", "send_bytes", "recv_bytes"))
            for c in data["rank_classes"]) and "name" in data["model"] and (serving or "microbatches" in data) \
        and len(data["rank_class"]) == data["world_size"] \
        and all(isinstance(k, int) and 0 <= k < len(data["rank_classes"]) for k in data["rank_class"])
    if not ok:
        raise OutputError(f"{path}: not an stg summary (fields missing or of the wrong type)")
    return data


def device_memory(name: str) -> float:
    from stg.device import device_spec

    return device_spec(name).memory_gib


def _rank_range(text: str) -> range:
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise PlanError(f"ranks: expected A:B (e.g. 0:1024), got {text!r}") from None
    return range(start, stop)


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise PlanError(f"{name}: expected comma-separated integers, got {text!r}") from None


@app.command("schedule")
def show_schedule(
    pp: int = typer.Option(..., help="Pipeline stages."),
    microbatches: int = typer.Option(..., help="Micro-batches per step."),
    schedule: str = typer.Option("1f1b", help="gpipe, 1f1b, interleaved or zb-h1."),
    vpp: int = typer.Option(1, help="Virtual stages per stage (interleaved)."),
):
    """Print a pipeline schedule as a step-by-stage grid of actions (3F1: micro-batch 3,
    forward, chunk 1; B input gradient; W weight gradient), its unit-cost makespan and bubble."""
    from stg.schedule import SPLIT_BACKWARD, grid, make_schedule, simulate

    with _user_errors():
        plan = make_schedule(schedule, pp, microbatches, vpp)
    typer.echo(grid(plan))
    makespan, busy = simulate(plan, lambda a: 1.0 / vpp, vpp, schedule in SPLIT_BACKWARD)
    ideal = busy[0]
    typer.echo(f"unit costs (F = B = W = 1 per stage, free communication): makespan {makespan:g}, "
               f"bubble {(makespan - ideal) / ideal:.1%} of the ideal {ideal:g}")


@app.command()
def summary(
    out: Path = typer.Argument(..., help="A trace set directory written by `stg generate`."),
    rank: Optional[int] = typer.Option(None, help="Only this rank (default: one line per rank class)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: one object per rank class (or for --rank)."),
):
    """Per rank: FLOPs, bytes per collective type, send/recv bytes and memory
    {weights, gradients, optimizer_states, activations, peak}, from OUT/summary.json. For a
    serving set (stg serve): the whole run's figures per rank, and the KV-cache pool."""
    with _user_errors():
        data = _read_summary(out)
    classes = data["rank_classes"]
    if rank is not None:
        if not 0 <= rank < data["world_size"]:
            err.print(f"[red]error:[/red] rank: {rank} is not in 0..{data['world_size'] - 1}", highlight=False)
            raise typer.Exit(2)
        classes = [{**classes[data["rank_class"][rank]], "rank": rank}]
    if as_json:
        typer.echo(json.dumps(classes if rank is None else classes[0], indent=1))
        return
    # one column per rank class, one row per figure
    gib = 2**30
    def head(c: dict) -> str:
        if "rank" in c:
            return f"rank {c['rank']}"
        if "variant" in c:
            return f"rank {c['first_rank']}" + (f" (+{c['count'] - 1} alike)" if c["count"] > 1 else "")
        if "ranks" in c:
            return "ranks " + ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in c["ranks"])
        if "coords" in c:
            return " ".join(f"{axis}={value}" for axis, value in c["coords"].items())
        where = [f"{c['kind']} {c['instance']}" if "kind" in c else None,  # serving: instance, replica, stage
                 f"replica {c['replica']}" if c.get("replica") is not None else None, f"stage {c.get('stage', 0)}"]
        return " ".join(w for w in where if w) + (f" (x{c['count']})" if c.get("count", 1) > 1 else "")

    serving = "mode" in data
    heads = [head(c) for c in classes]
    table = Table("whole run, per rank" if serving else "per step, per rank", *heads)
    kinds = sorted({k for c in classes for k in c["comm_bytes"]})
    rows = [("TFLOP", lambda c: f"{c['flops'] / 1e12:,.3f}")]
    rows += [(f"{k} GiB (count)", lambda c, k=k: f"{c['comm_bytes'].get(k, 0) / gib:,.3f} ({c['comm_count'].get(k, 0)})")
             for k in kinds]
    rows += [("send / recv GiB", lambda c: f"{c['send_bytes'] / gib:,.3f} / {c['recv_bytes'] / gib:,.3f}")]
    if not serving:
        memory = ["weights", "gradients", "optimizer_states", "activations", "peak"]
        if any("embedding_weights" in c["memory"] for c in classes):  # recommendation models: tables apart
            memory[3:3] = ["embedding_weights", "embedding_optimizer_states"]
        rows += [(f"memory {k} GiB", lambda c, k=k: f"{c['memory'].get(k, 0) / gib:,.2f}") for k in memory]
    for label, cell in rows:
        table.add_row(label, *(cell(c) for c in classes))
    _stdout().print(table)
    if not serving:
        typer.echo(f"{data['model']['name']} on {data['world_size']} ranks, {data['microbatches']} micro-batches per rank")
        return
    typer.echo(f"{data['model']['name']} serving ({data['mode']}) on {data['world_size']} ranks")
    for key, kind in (("kv_cache", "KV cache"), ("kv_cache_prefill", "prefill instances' KV cache")):
        pool = data.get(key)
        if isinstance(pool, dict) and {"blocks", "block_size", "tokens"} <= set(pool):
            typer.echo(f"{kind}: {pool['blocks']:,} blocks of {pool['block_size']} tokens ({pool['tokens']:,} tokens) "
                       "per replica")


@app.command()
def validate(
    out: Path = typer.Argument(..., help="A trace set directory written by `stg generate`."),
    replay: bool = typer.Option(True, help="Also replay all ranks together to prove the set runs to completion."),
    timed: Optional[str] = typer.Option(None, help="Then replay with time: compute nodes take their duration_micros, communication is 'free' or 'alpha-beta'; prints each rank's busy and idle time and the makespan (the pipeline bubble is the idle time under free communication)."),
    as_json: bool = typer.Option(False, "--json", help="With --timed: print the timing as JSON."),
    network: Optional[str] = typer.Option(None, help="With --timed alpha-beta: a network (name in stg/data/networks or a YAML path) whose tiers and NCCL algorithms cost the communication, as `stg explore` does."),
):
    """Check a trace set: per-rank structure and attribute types, identical collective sequences within every group, every send matched by a receive, and (replay) no deadlock; --timed also measures busy and idle time per rank."""
    from stg.chakra.validate import load_set, timed_replay, validate as check

    if not (out / "workload.json").is_file():
        err.print(f"[red]error:[/red] {escape(str(out))}: not a trace set (no workload.json)", highlight=False)
        raise typer.Exit(2)
    # the options are checked before the set is read (a big set takes minutes)
    if timed is not None and timed not in ("free", "alpha-beta"):
        err.print(f"[red]error:[/red] timed: must be free or alpha-beta, got {timed!r}", highlight=False)
        raise typer.Exit(2)
    if network is not None and timed != "alpha-beta":
        err.print("[red]error:[/red] network: costs communication only with --timed alpha-beta", highlight=False)
        raise typer.Exit(2)
    links = None
    if network is not None:
        with _user_errors():
            from stg.explore.network import load_network

            links = load_network(network)
    with _progress("loading ranks", False) as progress:
        loaded = load_set(out, progress=progress, durations=timed is not None)  # read once for both
        problems = check(out, replay=replay, loaded=loaded)
    if problems:
        for problem in problems[:50]:
            err.print(escape(str(problem)), highlight=False, soft_wrap=True)
        if len(problems) > 50:
            err.print(f"... and {len(problems) - 50} more", highlight=False)
        err.print(f"[red]invalid:[/red] {len(problems)} problem(s) in {escape(str(out))}", highlight=False)
        raise typer.Exit(1)
    ranks = len(list(out.glob("workload.*.et")))
    typer.echo(f"ok: {ranks} ranks in {out} are consistent" + (" and replay to completion" if replay else ""))
    _warn_version(out / "workload.0.et")
    if timed is not None:
        with _user_errors():
            timing = timed_replay(out, comm=timed, network=links, loaded=loaded)
        typer.echo(json.dumps(timing.to_dict()) if as_json else str(timing))


CHAKRA_VERSIONS = ("0.0.4", "1.0.0")  # what mlcommons/chakra's generators write (shared/reference, A.3)


def _warn_version(path: Path) -> None:
    """ASTRA-sim ignores GlobalMetadata.version, so an unknown one is a warning, not a problem."""
    from stg.chakra.reader import TraceFormatError, read_metadata

    try:
        version = read_metadata(path).version
    except (OSError, TraceFormatError):
        return  # validate reported whatever is wrong with the file
    if version not in CHAKRA_VERSIONS:
        err.print(f"warning: {escape(str(path))}: GlobalMetadata version {escape(repr(version))} is not a Chakra "
                  f"schema version ({', '.join(CHAKRA_VERSIONS)}); ASTRA-sim ignores it", highlight=False)


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="One rank's .et file."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per node (JSON Lines)."),
    limit: Optional[int] = typer.Option(None, help="Show at most this many nodes."),
):
    """Print the nodes of one rank's trace, one a line."""
    from stg.chakra.reader import TraceFormatError, format_node, iter_nodes, node_to_dict

    if not file.is_file():
        err.print(f"[red]error:[/red] {escape(str(file))}: no such file", highlight=False)
        raise typer.Exit(2)
    if limit is not None and limit < 0:
        err.print(f"[red]error:[/red] limit: must be an integer >= 0, got {limit}", highlight=False)
        raise typer.Exit(2)
    try:
        for count, node in enumerate(iter_nodes(file)):
            if limit is not None and count >= limit:
                break
            typer.echo(json.dumps(node_to_dict(node)) if as_json else format_node(node))
    except TraceFormatError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(2)
    except BrokenPipeError:
        sys.stderr.close()


@app.command()
def describe(
    model: str = typer.Argument(..., help="A zoo name or a path to a model YAML."),
    layers: int = typer.Option(1, help="How many repeated blocks to print (the embedding and head are always shown)."),
):
    """Print a model's forward graph (one op a line, symbolic shapes and FLOPs) and its parameter count."""
    from model_zoo import load_model

    with _user_errors():
        if layers < 0:
            raise PlanError(f"layers: must be an integer >= 0, got {layers}")
        loaded = load_model(model)
        graph = loaded.graph
    last = loaded.layers + 1
    lines = str(graph).splitlines()
    for op, line in zip(graph.ops, lines):
        if op.layer <= layers or op.layer == last:
            typer.echo(line)
    import sympy

    block = sympy.Add(*(op.flops for op in graph.ops if op.layer == 1))
    typer.echo(f"# forward FLOPs of block 1: {block}")
    typer.echo(f"# {loaded.name}: {loaded.layers} blocks, {loaded.params:,} parameters")


# --- pictures (stg/view) --------------------------------------------------------------------


app.command("timeline")(_timeline)
app.command("plot")(_plot)
app.command("report")(_report)
app.command("explore")(_explore)


def main() -> None:
    """The `stg` command. It ends without tearing the interpreter down: freeing a big plan's
    objects one by one costs more than some commands (0.3-0.6 s of a llama3-405b count).
    Everything it writes is closed by then and its worker pools are gone; the output streams
    are flushed here. (mypy's command ends the same way.) `app` itself exits normally, for
    callers inside Python.

    It runs with Python's cyclic collector off: a command makes millions of objects and next
    to no cycles (a few hundred, from click and the imports, measured for generate, validate,
    summary and explore), while the collections that start-up's imports alone trigger cost
    ~0.1 s (9 % of a llama3-405b count). Each build pauses the collector anyway
    (stg.api.collector_paused)."""
    import gc
    import os

    gc.disable()
    try:
        app(prog_name="stg")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
