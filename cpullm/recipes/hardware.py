"""Hardware classes for recipes: a named class's typical server as a CpuTopology, or this
machine's own topology with the class its CPU belongs to (``auto``)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cpullm.platform.cpu import CpuInfo
from cpullm.platform.topology import CpuTopology, LogicalCpu, NumaNode

DATA = Path(__file__).parent / "data"
GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """A hardware class (``name``) and the topology a recipe is planned on."""

    name: str
    description: str
    topology: CpuTopology
    detected: bool  # the topology is this machine's, not the class's typical server

    @property
    def usable_nodes(self) -> list[NumaNode]:
        """The NUMA nodes with CPUs this process may use."""
        return [n for n in self.topology.nodes if set(n.cpus) & self.topology.allowed]

    @property
    def node_bytes(self) -> int:
        """The memory of the smallest usable node: what a node-sized plan may count on."""
        return min(n.mem_total for n in self.usable_nodes)


@functools.cache
def hardware_classes() -> dict[str, dict[str, Any]]:
    with open(DATA / "hardware.yaml") as f:
        return yaml.safe_load(f)


def class_topology(spec: dict[str, Any]) -> CpuTopology:
    """The typical server of a class, numbered as Linux numbers CPUs: the first thread of
    every core, socket by socket, then the second threads."""
    info = CpuInfo(spec["vendor"], spec["model_name"], frozenset(spec["flags"].split()))
    sockets, cores, threads = spec["sockets"], spec["cores_per_socket"], spec["threads_per_core"]
    per_socket = spec["numa_nodes_per_socket"]
    cores_per_node = cores // per_socket
    total_cores = sockets * cores
    cpus = [LogicalCpu(thread * total_cores + core, core % cores, core // cores,
                       core // cores_per_node)
            for thread in range(threads) for core in range(total_cores)]
    memory = int(spec["memory_gib_per_node"] * GiB)
    nodes = tuple(NumaNode(n, tuple(c.cpu for c in cpus if c.node == n), memory, memory)
                  for n in range(sockets * per_socket))
    return CpuTopology(info, tuple(cpus), nodes, frozenset(c.cpu for c in cpus))


def class_of(info: CpuInfo) -> str:
    """The class whose recipes fit this CPU: its ISA decides (AMX, AVX-512 BF16, SVE2)."""
    if info.is_arm:
        return "graviton4"
    if "amx_bf16" in info.flags:
        # Xeon 6 P-cores are named "Xeon(R) 6xxxP"; 4th and 5th gen "Xeon(R) Platinum 8xxx"
        return "xeon6" if re.search(r"Xeon\(R\) 6\d{3}", info.model_name) else "xeon5"
    if info.vendor == "AuthenticAMD" and "avx512_bf16" in info.flags:
        return "epyc-zen5"
    return "generic"


def resolve_hardware(name: str, root: str = "/") -> Hardware:
    """``auto``: this machine (read below ``root``); else a class's typical server."""
    classes = hardware_classes()
    if name == "auto":
        topology = CpuTopology.detect(root)
        found = class_of(topology.info)
        return Hardware(found, f"this machine ({topology.info.model_name}, "
                        f"{topology.num_physical_cores} cores, {len(topology.nodes)} NUMA "
                        f"node(s)), recipes of class {found}", topology, True)
    if name not in classes:
        raise ValueError(f"hardware: unknown class {name!r}; choose auto or one of "
                         f"{', '.join(classes)}")
    spec = classes[name]
    return Hardware(name, spec["description"], class_topology(spec), False)
