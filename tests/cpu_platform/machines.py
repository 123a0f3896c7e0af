"""Fixture trees of /proc and /sys for machines this one is not."""

from __future__ import annotations

from pathlib import Path

XEON_FLAGS = ("fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 "
              "avx512_fp16 amx_bf16 amx_tile amx_int8")
ZEN4_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
ARM_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve sve2 bf16 i8mm"


def make_machine(root: Path, *, vendor: str, model: str, flags: str, sockets: int,
                 cores_per_socket: int, threads_per_core: int, numa: bool = True,
                 allowed: str | None = None, arm: bool = False,
                 mem_per_node_kb: int = 64 * 1024 * 1024) -> Path:
    """Write a machine whose logical CPU numbering is Linux's usual one: first thread of
    every core first (socket by socket), then the second threads."""
    num_cores = sockets * cores_per_socket
    cpus = []  # (cpu, core_id, socket)
    for thread in range(threads_per_core):
        for core in range(num_cores):
            cpus.append((thread * num_cores + core, core % cores_per_socket,
                         core // cores_per_socket))
    blocks = []
    for cpu, _, _ in cpus:
        if arm:
            blocks.append(f"processor\t: {cpu}\nBogoMIPS\t: 50.00\nFeatures\t: {flags}\n"
                          f"CPU implementer\t: 0x41\nCPU part\t: 0xd40\n")
        else:
            blocks.append(f"processor\t: {cpu}\nvendor_id\t: {vendor}\nmodel name\t: {model}\n"
                          f"flags\t\t: {flags}\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text("\n".join(blocks))
    total = len(cpus)
    (root / "proc/self/status").write_text(
        f"Name:\tpython\nCpus_allowed_list:\t{allowed or f'0-{total - 1}'}\n")
    (root / "proc/meminfo").write_text(
        f"MemTotal: {mem_per_node_kb * sockets} kB\nMemFree: {mem_per_node_kb * sockets // 2} kB\n"
        f"MemAvailable: {mem_per_node_kb * sockets * 3 // 4} kB\n")
    cpu_dir = root / "sys/devices/system/cpu"
    cpu_dir.mkdir(parents=True)
    (cpu_dir / "online").write_text(f"0-{total - 1}\n")
    for cpu, core, socket in cpus:
        topo = cpu_dir / f"cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text(f"{socket}\n")
    if numa:
        for socket in range(sockets):
            node = root / f"sys/devices/system/node/node{socket}"
            node.mkdir(parents=True)
            members = sorted(c for c, _, s in cpus if s == socket)
            node.joinpath("cpulist").write_text(",".join(map(str, members)) + "\n")
            node.joinpath("meminfo").write_text(
                f"Node {socket} MemTotal: {mem_per_node_kb} kB\n"
                f"Node {socket} MemFree: {mem_per_node_kb // 2} kB\n")
    return root


MACHINES = {
    # one socket, 8 cores with hyper-threads, AMX
    "xeon-1s-ht": dict(vendor="GenuineIntel", model="Intel(R) Xeon(R) Platinum 8480+",
                       flags=XEON_FLAGS, sockets=1, cores_per_socket=8, threads_per_core=2),
    # two sockets of 4 cores with hyper-threads, one NUMA node each
    "xeon-2s": dict(vendor="GenuineIntel", model="Intel(R) Xeon(R) Gold 6430",
                    flags=XEON_FLAGS, sockets=2, cores_per_socket=4, threads_per_core=2),
    # the same machine seen from a container limited to CPUs 2-5 and 10-11
    "container": dict(vendor="GenuineIntel", model="Intel(R) Xeon(R) Gold 6430",
                      flags=XEON_FLAGS, sockets=2, cores_per_socket=4, threads_per_core=2,
                      allowed="2-5,10-11"),
    "zen4": dict(vendor="AuthenticAMD", model="AMD EPYC 9654 96-Core Processor",
                 flags=ZEN4_FLAGS, sockets=1, cores_per_socket=8, threads_per_core=2),
    "arm": dict(vendor="ARM", model="", flags=ARM_FEATURES, sockets=1, cores_per_socket=4,
                threads_per_core=1, arm=True, numa=False),
    "avx-only": dict(vendor="GenuineIntel", model="Old Xeon", flags="fpu sse2 avx",
                     sockets=1, cores_per_socket=2, threads_per_core=1),
}
