"""What the machine is: logical CPUs, physical cores, sockets, NUMA nodes, allowed CPUs.

Everything is read below a root folder (``/`` on a real machine, a fixture tree in tests):
``proc/cpuinfo``, ``proc/self/status`` (Cpus_allowed_list, which reflects cgroups and
taskset), ``sys/devices/system/cpu/cpuN/topology`` and ``sys/devices/system/node``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cpullm.platform.cpu import CpuInfo


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]; raises ValueError on bad syntax."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M")
        start, end = int(first), int(last) if sep else int(first)
        if end < start:
            raise ValueError(f"bad CPU list {text!r}: range {part!r} runs backwards")
        cpus.extend(range(start, end + 1))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


@dataclass(frozen=True)
class LogicalCpu:
    cpu: int
    core: int  # physical core id, unique within its socket
    socket: int
    node: int


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]
    mem_total: int  # bytes
    mem_available: int  # bytes: free (single node: MemAvailable, counting reclaimable cache)


@dataclass(frozen=True)
class CpuTopology:
    info: CpuInfo
    cpus: tuple[LogicalCpu, ...]
    nodes: tuple[NumaNode, ...]
    allowed: frozenset[int] = field(default_factory=frozenset)

    @property
    def num_sockets(self) -> int:
        return len({c.socket for c in self.cpus})

    @property
    def num_physical_cores(self) -> int:
        return len({(c.socket, c.core) for c in self.cpus})

    @property
    def threads_per_core(self) -> int:
        return max(1, len(self.cpus) // max(1, self.num_physical_cores))

    def node_of(self, cpu: int) -> int:
        return next(c.node for c in self.cpus if c.cpu == cpu)

    def one_cpu_per_core(self, cpus: list[int]) -> list[int]:
        """The first allowed hyper-thread of every physical core among ``cpus``."""
        by_id = {c.cpu: c for c in self.cpus}
        seen: set[tuple[int, int]] = set()
        chosen = []
        for cpu in sorted(cpus):
            key = (by_id[cpu].socket, by_id[cpu].core)
            if key not in seen:
                seen.add(key)
                chosen.append(cpu)
        return chosen

    @classmethod
    def detect(cls, root: str | os.PathLike[str] = "/") -> CpuTopology:
        base = Path(root)
        info = CpuInfo.parse(_read(base / "proc/cpuinfo"))
        cpu_dir = base / "sys/devices/system/cpu"
        online_text = _read(cpu_dir / "online").strip()
        online = parse_cpu_list(online_text) if online_text else sorted(
            int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*"))
        node_dir = base / "sys/devices/system/node"
        nodes = []
        for path in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            mem = _meminfo(path / "meminfo")
            nodes.append(NumaNode(int(path.name[4:]),
                                  tuple(parse_cpu_list(_read(path / "cpulist").strip())),
                                  mem.get("MemTotal", 0), mem.get("MemFree", 0)))
        if len(nodes) <= 1:  # one node: /proc/meminfo knows better what can be had
            mem = _meminfo(base / "proc/meminfo")
            nodes = [NumaNode(0, nodes[0].cpus if nodes else tuple(online),
                              mem.get("MemTotal", 0),
                              mem.get("MemAvailable", mem.get("MemFree", 0)))]
        node_of = {cpu: n.node for n in nodes for cpu in n.cpus}
        cpus = []
        for cpu in online:
            topo = cpu_dir / f"cpu{cpu}/topology"
            core = _read_int(topo / "core_id", cpu)
            socket = _read_int(topo / "physical_package_id", 0)
            cpus.append(LogicalCpu(cpu, core, socket, node_of.get(cpu, 0)))
        allowed = _allowed_cpus(base) or set(online)
        return cls(info, tuple(cpus), tuple(nodes), frozenset(allowed & set(online)))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_int(path: Path, default: int) -> int:
    text = _read(path).strip()
    return int(text) if text.lstrip("-").isdigit() else default


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in _read(path).splitlines():
        # "Node 0 MemTotal:  123 kB" (per node) or "MemTotal:  123 kB" (/proc/meminfo)
        key, sep, rest = line.partition(":")
        if sep and rest.split():
            values[key.split()[-1]] = int(rest.split()[0]) * 1024
    return values


def _allowed_cpus(base: Path) -> set[int]:
    for line in _read(base / "proc/self/status").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return set(parse_cpu_list(line.split(":", 1)[1].strip()))
    if str(base) == "/" and hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set()
