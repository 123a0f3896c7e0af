"""Platform facts and binding plans on fixture machines; binding on this machine."""

from __future__ import annotations

import pytest
import torch

from cpullm.platform import CpuTopology, parse_cpu_list, plan_binding, resolve_dtype

from .machines import MACHINES, make_machine


@pytest.fixture(params=list(MACHINES))
def any_machine(request, tmp_path):
    return request.param, CpuTopology.detect(make_machine(tmp_path, **MACHINES[request.param]))


def machine(tmp_path, name: str) -> CpuTopology:
    return CpuTopology.detect(make_machine(tmp_path, **MACHINES[name]))


EXPECTED_FACTS = {
    # name: (vendor, sockets, physical cores, logical cpus, nodes, allowed, features)
    "xeon-1s-ht": ("GenuineIntel", 1, 8, 16, 1, "0-15",
                   ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                    "amx_int8"]),
    "xeon-2s": ("GenuineIntel", 2, 8, 16, 2, "0-15",
                ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                 "amx_int8"]),
    "container": ("GenuineIntel", 2, 8, 16, 2, "2-5,10-11",
                  ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                   "amx_int8"]),
    "zen4": ("AuthenticAMD", 1, 8, 16, 1, "0-15",
             ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]),
    "arm": ("ARM", 1, 4, 4, 1, "0-3", ["asimd", "sve", "sve2", "bf16", "fphp", "i8mm"]),
    "avx-only": ("GenuineIntel", 1, 2, 2, 1, "0-1", []),
}


def test_facts(any_machine):
    name, topo = any_machine
    vendor, sockets, cores, cpus, nodes, allowed, features = EXPECTED_FACTS[name]
    assert topo.info.vendor == vendor
    assert (topo.num_sockets, topo.num_physical_cores, len(topo.cpus), len(topo.nodes)) == (
        sockets, cores, cpus, nodes)
    assert sorted(topo.allowed) == parse_cpu_list(allowed)
    assert topo.info.features == features


def test_two_socket_nodes_and_memory(tmp_path):
    topo = machine(tmp_path, "xeon-2s")
    assert [n.cpus for n in topo.nodes] == [(0, 1, 2, 3, 8, 9, 10, 11),
                                            (4, 5, 6, 7, 12, 13, 14, 15)]
    assert all(n.mem_available == 32 * 2**30 for n in topo.nodes)
    assert topo.node_of(13) == 1


def test_isa_policy(tmp_path):
    old = machine(tmp_path / "a", "avx-only")
    with pytest.raises(RuntimeError, match="AVX2"):
        old.info.check_supported()
    machine(tmp_path / "b", "zen4").info.check_supported()
    machine(tmp_path / "c", "arm").info.check_supported()


def test_dtype_policy(tmp_path, caplog):
    xeon = machine(tmp_path / "a", "xeon-1s-ht").info
    zen4 = machine(tmp_path / "b", "zen4").info
    assert resolve_dtype("float16", None, xeon) == torch.float16
    assert resolve_dtype("float16", None, zen4) == torch.bfloat16
    assert "doesn't support torch.float16. Falling back to torch.bfloat16" in caplog.text
    assert resolve_dtype("auto", torch.float32, zen4) == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, xeon) == torch.float16
    assert resolve_dtype("float32", None, zen4) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3", None, zen4)


@pytest.mark.parametrize("name,kwargs,ranks,reserved", [
    ("xeon-1s-ht", dict(), ["0-6"], "7"),  # one core per rank kept for the front-end
    ("xeon-1s-ht", dict(num_reserved=0), ["0-7"], ""),
    ("xeon-1s-ht", dict(num_reserved=2), ["0-5"], "6,7"),
    ("xeon-2s", dict(), ["0-2"], "3"),
    ("xeon-2s", dict(num_ranks=2), ["0-2", "4-6"], "3,7"),
    ("xeon-2s", dict(num_ranks=2, num_reserved=0), ["0-3", "4-7"], ""),
    ("xeon-2s", dict(num_ranks=2, visible_nodes="1,0"), ["4-6", "0-2"], "7,3"),
    ("xeon-2s", dict(visible_nodes="1", num_reserved=0), ["4-7"], ""),
    ("xeon-2s", dict(num_ranks=4, num_reserved=0), ["0-1", "2-3", "4-5", "6-7"], ""),
    ("xeon-2s", dict(num_ranks=4), ["0-1", "2-3", "4-5", "6-7"], ""),  # 2 cores: none kept
    ("container", dict(), ["2-3"], ""),
    ("container", dict(num_ranks=2, num_reserved=0), ["2-3", "4-5"], ""),
    ("zen4", dict(), ["0-6"], "7"),
    ("arm", dict(), ["0-2"], "3"),
])
def test_auto_plans(tmp_path, name, kwargs, ranks, reserved):
    plan = plan_binding(machine(tmp_path, name), "auto", **kwargs)
    assert [list(r) for r in plan.rank_cpus] == [parse_cpu_list(r) for r in ranks]
    assert list(plan.reserved_cpus) == [int(c) for c in reserved.split(",") if c]


def test_explicit_and_nobind_plans(tmp_path):
    topo = machine(tmp_path, "xeon-2s")
    plan = plan_binding(topo, "0-3,8|4-7", num_ranks=2)
    assert [list(r) for r in plan.rank_cpus] == [[0, 1, 2, 3, 8], [4, 5, 6, 7]]
    assert plan.reserved_cpus == (9, 10, 11, 12, 13, 14, 15)
    assert plan_binding(topo, "nobind").rank_cpus == ()


@pytest.mark.parametrize("name,spec,kwargs,message", [
    ("xeon-2s", "0-3", dict(num_ranks=2), "1 CPU lists for 2 rank"),
    ("xeon-2s", "0-3|2-5", dict(num_ranks=2), "CPUs 2-3 are given to rank 0 and rank 1"),
    ("xeon-2s", "0-99", dict(), "CPUs 16-99 do not exist"),
    ("xeon-2s", "3-1", dict(), "runs backwards"),
    ("xeon-2s", "a-b", dict(), "not N or N-M"),
    ("container", "0-1", dict(), "outside this process's affinity mask"),
    ("xeon-2s", "auto", dict(visible_nodes="5"), "nodes \\[5\\] do not exist"),
    ("xeon-2s", "auto", dict(num_ranks=3), "cannot be spread evenly"),
    ("arm", "auto", dict(num_reserved=4), "leaves none to compute"),
])
def test_invalid_specs(tmp_path, name, spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_binding(machine(tmp_path, name), spec, **kwargs)


def test_real_machine_threads_pinned_to_plan(tiny_model, monkeypatch):
    from cpullm import LLM, SamplingParams
    from cpullm.platform.affinity import thread_affinities

    monkeypatch.setenv("CPULLM_COMPUTE_LANES", "1")  # no lane threads pinned beside the pool
    llm = LLM(str(tiny_model("llama")), dtype="float32", block_size=32)
    plan = llm.llm_engine.config.parallel.binding
    assert plan.mode == "auto"
    llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.llm_engine.model_runner
    runner.bind_threads()  # as generate does before its steps (it releases the caller after)
    try:
        pinned = [cpus for cpus in thread_affinities().values() if len(cpus) == 1]
        # one compute thread on each planned CPU, read back from the kernel
        assert sorted(c[0] for c in pinned if c[0] in plan.rank_cpus[0]) == \
            sorted(plan.rank_cpus[0])
    finally:  # this thread's CPUs back, or every later test sees one CPU
        runner.release_calling_thread()
