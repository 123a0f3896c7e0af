"""The AMD Zen platform: where zentorch (AMD's ZenDNN kernels for PyTorch) is installed on
an AMD CPU with AVX-512, linear layers may run through it, each only where it is measured
faster than cpullm's own GEMM on that machine (``layers/platform_gemm.py``).

Selected, as vLLM selects its Zen platform, when /proc/cpuinfo says ``AuthenticAMD`` with
AVX-512 and ``import zentorch`` succeeds (``pip install 'cpullm[zen]'``). float16 then
follows zentorch's own word on AVX512-FP16 (else bfloat16, with vLLM's warning);
``VLLM_ZENTORCH_WEIGHT_PREPACK=0`` keeps the weights in their plain layout for it.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from cpullm import envs
from cpullm.logger import init_logger
from cpullm.platform.cpu import CpuInfo, cpu_info

logger = init_logger(__name__)


def is_zen_cpu(info: CpuInfo) -> bool:
    """An AMD CPU with AVX-512 (Zen 4 and Zen 5)."""
    return info.vendor == "AuthenticAMD" and any(f.startswith("avx512") for f in info.flags)


def zen_platform_selected(info: CpuInfo, zentorch: ModuleType | None) -> bool:
    return zentorch is not None and is_zen_cpu(info)


@functools.cache
def import_zentorch() -> ModuleType | None:
    """zentorch, or None where it is not installed or does not load (a build for another
    torch fails at import)."""
    try:
        return importlib.import_module("zentorch")
    except Exception as e:  # ImportError, or an undefined symbol of a mismatched torch
        if not isinstance(e, ModuleNotFoundError):
            logger.warning("zentorch is installed but does not load (%s); the Zen platform "
                           "is off", e)
        return None


@functools.cache
def zen_platform() -> ModuleType | None:
    """zentorch where the Zen platform is selected on this machine, else None."""
    zentorch = import_zentorch() if is_zen_cpu(cpu_info()) else None
    if not zen_platform_selected(cpu_info(), zentorch):
        return None
    assert zentorch is not None
    logger.info("Platform: AMD Zen with zentorch %s; each linear layer's GEMM runs where it "
                "is measured faster, zentorch's or cpullm's (weights prepacked for zentorch: "
                "%s)", getattr(zentorch, "__version__", "?"), weight_prepack())
    return zentorch


def weight_prepack() -> bool:
    return envs.VLLM_ZENTORCH_WEIGHT_PREPACK


def fast_fp16(zentorch: ModuleType | None) -> bool | None:
    """On the Zen platform, float16 only where zentorch reports AVX512-FP16 (else bfloat16,
    with vLLM's warning: ``resolve_dtype``); None elsewhere (the CPU's flags decide)."""
    return None if zentorch is None else bool(zentorch._C.is_fp16_supported())
