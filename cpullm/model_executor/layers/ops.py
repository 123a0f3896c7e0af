"""The compiled CPU kernels (cpullm/csrc/), built on first use and cached, as one table.

``load_ops()`` returns a ``KernelTable``, or None when the kernels cannot be built (no
compiler, no headers): callers then use plain torch ops, which is also what
``--enforce-eager`` selects. The table says in one place which kernels this build has
(those that need AVX-512 or AVX-512 BF16 are None without them).

The build is compiled with ``-march=native`` and cached by torch under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), under a name keyed on the
sources, on their folder and on the instruction sets of the CPU: a second install of
cpullm, or another CPU sharing the same home folder, gets its own build instead of
rebuilding over the other's at every switch or loading one made for instructions this CPU
lacks (SIGILL).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from cpullm.logger import init_logger
from cpullm.platform.cpu import cpu_info

logger = init_logger(__name__)

_CSRC = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc"))
_SOURCES = ("attention.cpp", "gemm.cpp", "quant_gemm.cpp", "pointwise.cpp", "sampling.cpp",
            "threads.cpp", "bindings.cpp")
_HEADERS = ("gemm_tiles.h", "ops.h", "vec.h")

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class KernelTable:
    """Every kernel of the build; None where it needs an instruction set the build lacks."""

    decode_attention: Kernel
    rotary_embedding: Kernel
    bind_threads: Kernel
    rms_norm_bf16: Kernel | None  # AVX-512 BF16
    silu_and_mul_bf16: Kernel | None
    gemm_bf16: Kernel | None
    prefill_softmax_bf16: Kernel | None
    quant_gemm: Kernel | None  # AVX-512 VNNI
    quant_gemm_bf16: Kernel | None  # AVX-512 VNNI and BF16
    sample_from_logits: Kernel | None  # AVX-512
    module: ModuleType = field(repr=False, compare=False)  # the extension itself

    @classmethod
    def of(cls, module: ModuleType) -> KernelTable:
        return cls(**{f.name: getattr(module, f.name, None) for f in fields(cls)
                      if f.name != "module"}, module=module)

    @property
    def available(self) -> list[str]:
        """The kernels this build has."""
        return [f.name for f in fields(self)
                if f.name != "module" and getattr(self, f.name) is not None]


def build_name() -> str:
    """The extension's name: a hash of the sources, of where they are (torch's build writes
    their paths into its ninja file, so another install's build would be redone) and of
    the CPU's instruction sets."""
    digest = hashlib.sha256(_CSRC.encode())
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    # -march=native compiles for every flag the CPU has, so every flag keys the build.
    digest.update(" ".join(sorted(cpu_info().flags)).encode())
    return f"cpullm_ops_{digest.hexdigest()[:16]}"


@functools.cache
def load_ops() -> KernelTable | None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=build_name(), sources=[os.path.join(_CSRC, s) for s in _SOURCES],
            # -ffp-contract=off: no fused multiply-adds, so that float32 results round like
            # the unfused torch ops they replace.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch ops
        logger.warning("CPU kernels could not be built (%s); using plain torch ops", e)
        return None
    table = KernelTable.of(module)
    logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - start,
                ", ".join(table.available))
    return table


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installed sits in the environment's bin
    folder, which is not on PATH unless the environment was activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
