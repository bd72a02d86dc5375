"""Writing a trace set on a Dask cluster, for sets beyond one machine's disk or cores.

The client builds the workload once (to check the inputs and write workload.json and
summary.json); each task rebuilds it from the model description and plan -- deterministic,
and seconds of work, instead of shipping the rank-class programs -- and writes its range of
rank files into the output folder, which must be storage the workers share. A full set is
written into a temporary folder beside OUT and renamed into place when every task is done.
Install with `pip install stg[dask]`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from model_zoo import Model
from stg.api import check_ranks, build
from stg.emit import Progress, Stamper, split_ranks, commit_output, prepare_output, prepare_range, write_groups, write_json
from stg.errors import StgError
from stg.slice_check import check_slice
from stg.plan import Plan


def _write_range(config, source: str, plan: Plan, folder: str, start: int, stop: int) -> int:
    workload = build(Model(config, source), plan)
    return Stamper(workload).write(Path(folder), range(start, stop))


def _connect(client_type, address, scheduler: str | None):
    """A Dask client, or one line saying why there is none (a bad address, nobody listening)."""
    try:
        return client_type(address, timeout="10s")
    except (OSError, ValueError, TypeError) as error:  # TimeoutError is an OSError
        reason = " ".join(str(error).split()) or type(error).__name__
        raise StgError(f"scheduler: cannot connect to {scheduler!r} ({reason[:200]})") from None


def generate_on_dask(model: Model, plan: Plan, out: Path, *, scheduler: str | None = None,
                     ranks: range | None = None, tasks: int | None = None,
                     progress: Progress | None = None) -> dict:
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise StgError("executor dask: dask.distributed is not installed (pip install 'stg[dask]')") from None
    workload = build(model, plan)
    check_slice(workload)
    summary = workload.summary()
    world = workload.mesh.size
    ranks = check_ranks(ranks, workload) or range(world)
    whole = ranks == range(world)
    out = Path(out)
    folder = prepare_output(out) if whole else prepare_range(out)
    try:
        write_groups(folder / "workload.json", workload.group_ids)
        write_json(folder / "summary.json", summary)
        cluster = None if scheduler else LocalCluster(n_workers=2, threads_per_worker=1, processes=True)
        with _connect(Client, scheduler or cluster, scheduler) as client:
            pieces = tasks or max(1, 4 * len(client.scheduler_info()["workers"]))
            futures = [client.submit(_write_range, model.config, model.source, plan, str(folder), r.start, r.stop,
                                     pure=False) for r in split_ranks(ranks, pieces)]
            done = 0
            for future in as_completed(futures):
                done += future.result()
                if progress:
                    progress(done, len(ranks))
        if cluster is not None:
            cluster.close()
        if whole:
            commit_output(folder, out)
    except BaseException:
        if whole:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return summary
