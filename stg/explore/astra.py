"""ASTRA-sim's analytical backend on a written set: its configuration derived from the same
network and device files stg's estimate uses, one run, and the times it reports.

The derived network (ASTRA-sim's network YAML) has one dimension per tier that the cluster
reaches, innermost first (ASTRA-sim numbers NPUs with dimension 0 fastest, as stg's tiers join
consecutive ranks):

    topology     the tier's `topology` (switch, ring, fully_connected -> Switch, Ring, FullyConnected)
    npus_count   the tier's domain over the inner tier's domain (Network.dims)
    bandwidth    bandwidth_gbps x efficiency in ASTRA-sim's GB/s, which are 2^30 bytes:
                 x 1e9 / 2^30 (50 GB/s x 0.9 = 45e9 B/s = 41.91 ASTRA GB/s)
    latency      ns per link: latency_us x 1000, halved on a switch (a hop there crosses two
                 links, GPU-switch-GPU), so that one algorithm step costs latency_us as in stg

The system file: one chunk per collective (`preferred-dataset-splits` 1: ASTRA-sim charges
latency per ring step of every chunk, stg per step), ring reduce-scatter and all-gather, the
network's all-reduce (ring, or doubleBinaryTree for tree) and all-to-all (`direct1`, n-1
exchanges one at a time, for direct; `ring` for ring), `localBWAware` multi-dimensional
collectives (what `hierarchical: true` models), the roofline off (`roofline-enabled` 0: a
compute node takes the `duration_micros` stg wrote, its GEMM efficiency included), and the
device's memory bandwidth (`local-mem-bw` in 1e9 B/s, which ASTRA-sim charges reductions at).

The run: `BINARY --workload-configuration=SET/workload --comm-group-configuration=SET/workload.json
--system-configuration=... --network-configuration=... --remote-memory-configuration=...`.
A rank has finished when its `sys[N] finished, T cycles` line is there (cycles are ns); the
set's time is the latest rank's. ASTRA-sim exits 0 on a deadlock and may exit non-zero at
teardown after every rank finished (1-D networks with sub-groups), so the lines decide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stg.errors import PlanError
from stg.explore.network import AllToAll, Algorithm, Network, Topology

ENV = "STG_ASTRA_SIM"  # the ASTRA-sim binary, when --astra-sim is not given
GIB = 2**30
ASTRA_TOPOLOGY = {Topology.SWITCH: "Switch", Topology.RING: "Ring", Topology.FULLY_CONNECTED: "FullyConnected"}
FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles")
CRITICAL = re.compile(r"\[critical\]|\] \[C\] ")


def network_config(network: Network, world: int) -> dict:
    """ASTRA-sim's analytical network configuration for `world` ranks on `network`."""
    if world < 2:
        raise PlanError(f"simulate: ASTRA-sim's analytical network needs at least 2 NPUs, the set has {world}")
    dims = [(n, tier) for n, tier in zip(network.dims(world), network.tiers) if n > 1]
    return {
        "topology": [ASTRA_TOPOLOGY[t.topology] for _, t in dims],
        "npus_count": [n for n, _ in dims],
        "bandwidth": [t.bandwidth_gbps * t.efficiency * 1e9 / GIB for _, t in dims],
        "latency": [t.latency_us * 1e3 / (2 if t.topology is Topology.SWITCH else 1) for _, t in dims],
    }


def system_config(network: Network, dims: int, memory_gbps: float) -> dict:
    """ASTRA-sim's system configuration (see the module's docstring) for a `dims`-dimensional
    network and a device of `memory_gbps` (1e9 B/s)."""
    all_reduce = "doubleBinaryTree" if network.all_reduce is Algorithm.TREE else "ring"
    all_to_all = "ring" if network.all_to_all is AllToAll.RING else "direct1"
    return {
        "scheduling-policy": "FIFO",
        "endpoint-delay": 10,
        "active-chunks-per-dimension": 1,
        "preferred-dataset-splits": 1,
        "collective-optimization": "localBWAware",
        "all-reduce-implementation": [all_reduce] * dims,
        "reduce-scatter-implementation": ["ring"] * dims,
        "all-gather-implementation": ["ring"] * dims,
        "all-to-all-implementation": [all_to_all] * dims,
        "roofline-enabled": 0,
        "local-mem-bw": memory_gbps,
    }


def network_yaml(config: dict) -> str:
    """The network configuration as ASTRA-sim's YAML (flow lists, one key a line)."""
    def value(v):
        return "[ " + ", ".join(str(x) if not isinstance(x, float) else repr(x) for x in v) + " ]"
    return "".join(f"{key}: {value(v)}\n" for key, v in config.items())


@dataclass(frozen=True)
class AstraRun:
    """What one ASTRA-sim run reported: per rank its finish time in ns (None: no finished line)."""

    finished_ns: tuple[int | None, ...]
    critical: tuple[str, ...]  # the `[critical]` lines
    returncode: int

    @property
    def complete(self) -> bool:
        return all(t is not None for t in self.finished_ns) and not self.critical

    @property
    def time_us(self) -> float:
        """The set's simulated time: the latest rank's finish (µs)."""
        return max(t for t in self.finished_ns if t is not None) / 1e3 if any(
            t is not None for t in self.finished_ns) else float("nan")

    def problem(self) -> str | None:
        """Why the run does not count, in one line; None when every rank finished cleanly."""
        missing = [r for r, t in enumerate(self.finished_ns) if t is None]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            return f"{len(missing)} of {len(self.finished_ns)} ranks did not finish (ranks {shown}; exit {self.returncode})"
        if self.critical:
            return f"ASTRA-sim logged an error: {self.critical[0].strip()}"
        return None


def parse_output(text: str, ranks: int, returncode: int = 0) -> AstraRun:
    """The finish times and errors in ASTRA-sim's log text for a set of `ranks` ranks."""
    finished: list[int | None] = [None] * ranks
    for rank, cycles in FINISHED.findall(text):
        if int(rank) < ranks:
            finished[int(rank)] = int(cycles)
    critical = tuple(line for line in text.splitlines() if CRITICAL.search(line))
    return AstraRun(tuple(finished), critical, returncode)


def find_binary(given: str | os.PathLike | None) -> Path:
    """The ASTRA-sim binary: `given` (--astra-sim), else $STG_ASTRA_SIM; PlanError naming the
    field when neither names an executable file."""
    text = str(given) if given is not None else os.environ.get(ENV)
    if not text:
        raise PlanError(f"astra_sim: no ASTRA-sim binary; give --astra-sim PATH or set {ENV} "
                        "(build: see README, ASTRA-sim)")
    path = Path(text).expanduser()
    found = path if path.is_file() else (Path(shutil.which(text)) if shutil.which(text) else None)
    if found is None or not os.access(found, os.X_OK):
        raise PlanError(f"astra_sim: {text} is not an executable file")
    return found


def set_ranks(set_dir: Path) -> int:
    """The number of rank files `workload.<r>.et` in a written set."""
    return len(list(Path(set_dir).glob("workload.*.et")))


def simulate(binary: Path, set_dir: Path, network: Network, memory_gbps: float,
             timeout_s: float | None = None) -> AstraRun:
    """Run ASTRA-sim's analytical backend on the written set in `set_dir`."""
    set_dir = Path(set_dir).resolve()
    ranks = set_ranks(set_dir)
    net = network_config(network, ranks)
    with tempfile.TemporaryDirectory(prefix="stg-astra-") as work:
        work_dir = Path(work)
        (work_dir / "network.yml").write_text(network_yaml(net))
        system = system_config(network, len(net["npus_count"]), memory_gbps)
        (work_dir / "system.json").write_text(json.dumps(system, indent=1))
        (work_dir / "memory.json").write_text(json.dumps({"memory-type": "NO_MEMORY_EXPANSION"}))
        command = [str(binary), f"--workload-configuration={set_dir / 'workload'}",
                   f"--comm-group-configuration={set_dir / 'workload.json'}",
                   f"--system-configuration={work_dir / 'system.json'}",
                   f"--network-configuration={work_dir / 'network.yml'}",
                   f"--remote-memory-configuration={work_dir / 'memory.json'}"]
        try:
            done = subprocess.run(command, cwd=work_dir, capture_output=True, text=True, errors="replace",
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return AstraRun((None,) * ranks, (f"[critical] timed out after {timeout_s} s",), 124)
        logs = "".join(p.read_text(errors="replace") for p in sorted((work_dir / "log").glob("*.log")))
    return parse_output(done.stdout + done.stderr + logs, ranks, done.returncode)


def misaligned(network: Network, groups: dict[int, list[int]], world: int) -> list[int]:
    """Groups that ASTRA-sim costs differently from stg. ASTRA-sim charges each hop of a
    sub-group's ring (members in the JSON's order) on the lowest dimension in which the two
    ranks' coordinates differ, stg the whole ring on the outermost tier the group spans: they
    agree when every hop's lowest differing dimension is that tier (groups along mesh axes whose
    tier sizes are products of the innermost axes). A group of every rank runs dimension by
    dimension in ASTRA-sim: stg agrees with `hierarchical: true` (on one tier, trivially)."""
    dims = network.dims(world)
    strides = [1]
    for n in dims[:-1]:
        strides.append(strides[-1] * n)

    def lowest(a: int, b: int) -> int:
        return next(d for d in range(len(dims)) if (a // strides[d]) % dims[d] != (b // strides[d]) % dims[d])

    bad = []
    for g, members in sorted(groups.items()):
        members = list(members)
        if len(members) < 2:
            continue
        if len(members) == world and set(members) == set(range(world)):
            if len([n for n in dims if n > 1]) > 1 and not network.hierarchical:
                bad.append(g)
            continue
        tier = min(network.tiers.index(network.tier(min(members), max(members))), len(dims) - 1)
        if {lowest(a, b) for a, b in zip(members, members[1:] + members[:1])} != {tier}:
            bad.append(g)
    return bad


def simulate_rows(model, result, top: int, out: Path | None, binary: Path, network_name: str,
                  timeout_s: float | None = None) -> list[str]:
    """`stg explore --simulate astra-sim`: the `top` fastest plans' sets (already written under
    `out`, or written to a temporary folder) run in ASTRA-sim, one line each with stg's estimate,
    ASTRA-sim's time and their ratio, then the warnings."""
    from model_zoo import Model, load_model
    from stg.api import generate
    from stg.device import device_spec
    from stg.explore.network import load_network
    from stg.explore.search import label

    model = model if isinstance(model, Model) else load_model(model)
    network = load_network(network_name)
    lines = [f"{'plan':<44} {'stg ms':>10} {'ASTRA-sim ms':>13} {'ratio':>6}"]
    with tempfile.TemporaryDirectory(prefix="stg-sets-") as scratch:
        for i, row in enumerate(result.rows[:top], 1):
            folder = (out if out is not None else Path(scratch)) / f"{i:02d}-{label(row.plan)}"
            if out is None:
                generate(model, row.plan, folder)
            device = device_spec(row.plan.device)
            run = simulate(binary, folder, network, device.memory_tbps * 1e3, timeout_s)
            stg_ms = row.estimate.step_us / 1e3
            problem = run.problem()
            astra = f"{run.time_us / 1e3:13.3f} {stg_ms / (run.time_us / 1e3):6.3f}" if problem is None else \
                f"{'-':>13} {'-':>6}  ({problem})"
            groups = json.loads((folder / "workload.json").read_text())
            odd = misaligned(network, {int(k): v for k, v in groups.items()}, set_ranks(folder))
            note = f"  (ASTRA-sim routes {len(odd)} group(s) on other tiers than stg)" if odd else ""
            if uses_all_to_all(folder) and network.all_to_all is AllToAll.DIRECT and \
                    len([n for n in network.dims(set_ranks(folder)) if n > 1]) > 1:
                note += "  (ASTRA-sim runs a sub-group's all-to-all as a ring here: use all_to_all: ring)"
            lines.append(f"{label(row.plan):<44} {stg_ms:10.3f} {astra}{note}")
    return lines


def uses_all_to_all(set_dir: Path) -> bool:
    """Whether a written set's summary counts any ALL_TO_ALL."""
    try:
        summary = json.loads((Path(set_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return any(c.get("comm_count", {}).get("ALL_TO_ALL") for c in summary.get("rank_classes", []))
