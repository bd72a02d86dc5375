"""`stg explore`: plan search on the command line (registered in stg/cli.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from stg.errors import PlanError

def _list(name: str, text: str | None, parse=int) -> tuple | None:
    """A comma-separated option (`--tp 4,8`) as a tuple; PlanError naming the option and
    what its items must be."""
    if text is None:
        return None
    try:
        return tuple(parse(part.strip()) for part in text.split(","))
    except ValueError:
        items = {int: "integers", _flag: "true or false"}.get(parse, "values")
        raise PlanError(f"{name}: expected a comma-separated list of {items}, got {text!r}") from None


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "on", "off", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "on", "1")


def explore(
    model: str = typer.Argument(..., help="A zoo name (llama3-70b, ...), a model YAML, or a HuggingFace config.json."),
    gpus: Optional[int] = typer.Option(None, help="GPUs in the cluster (or give --nodes)."),
    nodes: Optional[int] = typer.Option(None, help="Nodes in the cluster, of --gpus-per-node GPUs each (instead of --gpus)."),
    global_batch: Optional[int] = typer.Option(None, help="Sequences per optimizer step."),
    global_batch_tokens: Optional[int] = typer.Option(None, help="Tokens per optimizer step (instead of --global-batch; a multiple of --seq)."),
    seq: int = typer.Option(..., help="Sequence length (ignored for recommendation models)."),
    device: str = typer.Option("h100", help="A device name (stg/data/devices: h100, h200, a100, b200, mi300x) or a device YAML path: peaks per dtype, HBM size and bandwidth, and optionally matmul_efficiency, the measured fraction of peak by GEMM size (h100 and h200 carry OpenXLA's measurements)."),
    network: str = typer.Option("dgx-h100-superpod", help="A network name (stg/data/networks) or a network YAML path."),
    gpus_per_node: int = typer.Option(8, help="GPUs per node: the default largest tp."),
    tp: Optional[str] = typer.Option(None, help="Tensor-parallel degrees to try, e.g. 4,8. [default: powers of 2 up to --max-tp]"),
    max_tp: Optional[int] = typer.Option(None, help="Largest default tp. [default: --gpus-per-node]"),
    pp: Optional[str] = typer.Option(None, help="Pipeline degrees. [default: powers of 2 up to the layer count]"),
    cp: str = typer.Option("1", help="Context-parallel degrees."),
    ep: Optional[str] = typer.Option(None, help="Expert-parallel degrees (MoE models). [default: powers of 2 up to the experts]"),
    sp: str = typer.Option("true", help="Sequence parallelism with tp > 1: true, false or both (true,false)."),
    zero: str = typer.Option("1", help="ZeRO stages, e.g. 0,1,3 (with pp > 1, 2 and 3 act as 1: see stg generate --help)."),
    recompute: str = typer.Option("none,selective,full", help="Activation recomputation: none, selective, full."),
    micro_batch: str = typer.Option("1,2", help="Micro-batch sizes."),
    schedule: str = typer.Option("1f1b,interleaved", help="Pipeline schedules (with pp > 1): gpipe, 1f1b, interleaved, zb-h1."),
    vpp: str = typer.Option("2", help="Virtual stages per pipeline stage for the interleaved schedule."),
    embedding_sharding: str = typer.Option("auto,data_parallel,table_wise,column_wise,row_wise,table_row_wise", help="Recommendation models (family dlrm): the tables' shardings to try (TorchRec's types; auto: stg's planner; table_row_wise with a host of --gpus-per-node ranks). Their dense part is data parallel; --micro-batch defaults to one micro-batch per step; --seq is ignored and tokens/s counts samples."),
    headroom: float = typer.Option(0.0, help="Fraction of device memory kept free (a plan whose peak exceeds the rest is dropped)."),
    top: int = typer.Option(10, help="Rows in the table, and trace sets written with --write."),
    write: Optional[Path] = typer.Option(None, help="Write the trace sets of the --top fastest plans under this folder, each with its plan.yaml."),
    as_json: bool = typer.Option(False, "--json", help="Print every valid plan as JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print every valid plan as CSV."),
    plot: Optional[Path] = typer.Option(None, help="Draw peak memory against step time with the Pareto front, FILE.png or FILE.svg (needs matplotlib: pip install 'stg[plot]')."),
    workers: Optional[int] = typer.Option(None, help="Processes evaluating plans (forked; the ranking does not depend on it). [default: all cores]"),
    simulate: Optional[str] = typer.Option(None, help="Also run the --top trace sets (written under --write, or a temporary folder) through a simulator and print its step time next to stg's estimate: astra-sim (ASTRA-sim's analytical congestion-unaware backend, its network and system files derived from --network and --device; see README, ASTRA-sim)."),
    astra_sim: Optional[str] = typer.Option(None, help="The ASTRA-sim binary for --simulate astra-sim (build/astra_analytical/build/bin/AstraSim_Analytical_Congestion_Unaware). [default: $STG_ASTRA_SIM]"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
):
    """Search parallelism plans: build each plan's rank programs, drop those that do not divide or do not fit in memory, time the rest by replaying one pipeline slice on the device and network models, and rank them by step time."""
    from stg.cli import _progress, _stdout, _user_errors, err
    from stg.explore import Cluster, Job, Space, explore as search, write_top
    from stg.explore.report import footer, table, to_csv, to_json

    with _user_errors():
        if (gpus is None) == (nodes is None):
            raise PlanError("gpus: give exactly one of --gpus and --nodes")
        if nodes is not None:
            if nodes < 1:
                raise PlanError(f"nodes: must be a positive integer, got {nodes}")
            gpus = nodes * gpus_per_node
        if (global_batch is None) == (global_batch_tokens is None):
            raise PlanError("global_batch: give exactly one of --global-batch and --global-batch-tokens")
        if global_batch_tokens is not None:
            if global_batch_tokens % seq:
                raise PlanError(f"global_batch_tokens: {global_batch_tokens} is not a multiple of seq={seq}")
            global_batch = global_batch_tokens // seq
        if as_json and as_csv:
            raise PlanError("json: --json and --csv exclude each other")
        if top < 1:
            raise PlanError(f"top: must be at least 1, got {top}")
        binary = None
        if simulate is not None:
            from stg.explore.astra import find_binary

            if simulate != "astra-sim":
                raise PlanError(f"simulate: must be astra-sim, got {simulate!r}")
            binary = find_binary(astra_sim)
        space = Space(tp=_list("tp", tp), pp=_list("pp", pp), cp=_list("cp", cp), ep=_list("ep", ep),
                      sp=_list("sp", sp, _flag), zero=_list("zero", zero), recompute=_list("recompute", recompute, str),
                      micro_batch=_list("micro_batch", micro_batch), schedule=_list("schedule", schedule, str),
                      vpp=_list("vpp", vpp), max_tp=max_tp,
                      embedding_sharding=_list("embedding_sharding", embedding_sharding, str))
        cluster, job = Cluster(gpus, device, network, gpus_per_node), Job(global_batch, seq)
        with _progress("evaluating plans", quiet or as_json or as_csv) as progress:
            result = search(model, cluster, job, space, headroom=headroom, progress=progress,
                            workers=(os.cpu_count() or 1) if workers is None else workers)
        if as_json or as_csv:
            typer.echo(to_json(result) if as_json else to_csv(result), nl=False)
        else:
            _stdout().print(table(result, top, f"{model} on {gpus} x {device}, {network}: fastest plans"))
            typer.echo(footer(result))
        if plot is not None:
            from stg.explore.plot import save_pareto

            save_pareto(result, plot, f"{model} on {gpus} x {device}, {network}")
        if write is not None:
            for folder in write_top(model, result, top, write):
                err.print(f"wrote {folder}", highlight=False)
        if binary is not None:
            from stg.explore.astra import simulate_rows

            lines = simulate_rows(model, result, top, write, binary, network)
            for line in lines:
                (err.print(line, highlight=False) if as_json or as_csv else typer.echo(line))
