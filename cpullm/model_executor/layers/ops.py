"""The compiled CPU kernels (cpullm/csrc/), as one table.

``load_ops()`` returns a ``KernelTable``, or None when the kernels cannot be built (no
compiler, no headers): callers then use plain torch ops, which is also what
``--enforce-eager`` selects. The table says in one place which kernels run here: those
that need AVX-512, VNNI or BF16 are None in a build without them, and the AMX ones are
None unless this CPU has the tiles and the OS grants them to the process (asked once, as
the table is made), so that callers test an entry, never the CPU.

Installing the package builds one library per instruction-set level
(``kernel_build.py``, run by setup.py) into ``cpullm/_kernels/``, each named after the
sources it was built from. ``load_ops()`` takes the highest level this CPU runs, if it was
built from the sources as they are. Otherwise (sources edited since, an install that could
not compile) it builds with ``-march=native`` on first use, cached by torch under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) under a name keyed on the sources,
on their folder and on the CPU's instruction sets: a second install of cpullm, or another
CPU sharing the same home folder, gets its own build instead of rebuilding over the other's
at every switch or loading one made for instructions this CPU lacks (SIGILL).
``python -m cpullm.model_executor.layers.ops`` rebuilds the libraries in place, after
editing the sources.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from cpullm.logger import init_logger
from cpullm.model_executor.layers import kernel_build
from cpullm.model_executor.layers.kernel_build import ISA_LEVELS, IsaLevel, prebuilt_name
from cpullm.platform.cpu import cpu_info

logger = init_logger(__name__)

_PREBUILT = os.path.join(os.path.dirname(kernel_build.CSRC), "_kernels")

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class KernelTable:
    """Every kernel of the build; None where it needs an instruction set the build lacks."""

    decode_attention: Kernel
    rotary_embedding: Kernel
    cache_kv: Kernel
    cache_kv_quant: Kernel  # the quantized KV cache (int8, fp8)
    decode_attention_quant: Kernel
    bind_threads: Kernel
    rms_norm_bf16: Kernel | None  # AVX-512 BF16
    silu_and_mul_bf16: Kernel | None
    gemm_bf16: Kernel | None
    gemm_bf16_grouped: Kernel | None
    embedding_from_panels: Kernel | None
    amx_bf16_ready: Kernel | None  # compiled with AVX-512 BF16: asks the OS for the tiles
    gemm_bf16_amx: Kernel | None  # AMX_KERNELS: where the tiles run (AMX-BF16, AMX-INT8)
    decode_attention_amx: Kernel | None
    prefill_softmax_bf16: Kernel | None
    prefill_attention_bf16: Kernel | None
    prefill_attention_quant: Kernel | None
    quant_gemm_tiled_int8: Kernel | None  # AVX-512 VNNI, or AVX2's int8 multiply-adds
    quant_gemm_tiled_grouped: Kernel | None
    quant_gemm_tiled_bf16: Kernel | None  # AVX-512 VNNI and BF16
    quant_gemm_tiled_amx: Kernel | None
    quant_gemm_int8_amx: Kernel | None
    fp8_gemm_bf16: Kernel | None  # AVX-512 BF16
    fp8_gemm_bf16_amx: Kernel | None
    sample_from_logits: Kernel | None  # AVX-512
    isa: str  # what the build was compiled for: avx2, avx512, avx512_bf16 (or generic)
    module: ModuleType = field(repr=False, compare=False)  # the extension itself

    @classmethod
    def of(cls, module: ModuleType) -> KernelTable:
        """The module's kernels, the AMX ones only where they run."""
        table = cls(**{f.name: getattr(module, f.name, None) for f in fields(cls)
                       if f.name not in ("module", "isa")},
                    isa=getattr(module, "isa", "generic"), module=module)
        flags = cpu_info().flags
        ready = table.amx_bf16_ready
        if not ("amx_bf16" in flags and ready is not None and ready()):
            return table.without_amx()
        if "amx_int8" not in flags:  # (every AMX CPU so far has both)
            return dataclasses.replace(table, quant_gemm_int8_amx=None)
        return table

    def without_amx(self) -> KernelTable:
        """This table as a CPU without AMX has it: every AMX kernel None."""
        return dataclasses.replace(self, **dict.fromkeys(AMX_KERNELS))

    @property
    def amx(self) -> bool:
        """Whether the AMX kernels run here."""
        return self.gemm_bf16_amx is not None

    @property
    def available(self) -> list[str]:
        """The kernels this build has."""
        return [f.name for f in fields(self)
                if f.name not in ("module", "isa") and getattr(self, f.name) is not None]


# The kernels on AMX tiles: None in a KernelTable where the tiles do not run.
AMX_KERNELS = ("gemm_bf16_amx", "decode_attention_amx", "quant_gemm_int8_amx",
               "quant_gemm_tiled_amx", "fp8_gemm_bf16_amx")


def build_name() -> str:
    """The JIT build's name: a hash of the sources, of where they are (torch's build writes
    their paths into its ninja file, so another install's build would be redone) and of
    the CPU's instruction sets (-march=native compiles for every flag the CPU has)."""
    digest = kernel_build.sources_digest(kernel_build.CSRC, " ".join(sorted(cpu_info().flags)))
    return f"cpullm_ops_{digest.hexdigest()[:16]}"


def best_level(flags: frozenset[str] | set[str]) -> IsaLevel | None:
    """The highest level a CPU with these flags runs, or None (no AVX2: another ISA)."""
    runnable = [level for level in ISA_LEVELS if level.needs <= flags]
    return runnable[-1] if runnable else None


def load_prebuilt(level: IsaLevel) -> ModuleType | None:
    """``level``'s library if the install built it from the sources as they are now."""
    name = prebuilt_name(level)
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(_PREBUILT, f"{name}.so")
    if not os.path.exists(path):
        return None
    import torch  # noqa: F401 - the library links against torch's, which must be loaded

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def chosen_level() -> IsaLevel | None:
    """The level whose library runs: the highest this CPU runs, or CPULLM_KERNEL_ISA's."""
    from cpullm import envs

    flags = cpu_info().flags
    name = envs.CPULLM_KERNEL_ISA
    if name is None:
        return best_level(flags)
    level = next((level for level in ISA_LEVELS if level.name == name), None)
    if level is None:
        raise ValueError(f"CPULLM_KERNEL_ISA={name!r}: choose from "
                         f"{', '.join(level.name for level in ISA_LEVELS)}")
    if not level.needs <= flags:
        raise ValueError(f"CPULLM_KERNEL_ISA={name!r}: this CPU lacks "
                         f"{', '.join(sorted(level.needs - flags))}")
    return level


@functools.cache
def load_ops() -> KernelTable | None:
    from cpullm import envs

    start = time.perf_counter()
    level = chosen_level()
    module = load_prebuilt(level) if level is not None else None
    if module is not None:
        origin = f"the {level.name} build"  # type: ignore[union-attr]
    else:
        from torch.utils import cpp_extension

        kernel_build.put_ninja_on_path()
        # a level asked for by name: its own flags, not all of this CPU's
        forced = level if envs.CPULLM_KERNEL_ISA is not None else None
        try:
            module = cpp_extension.load(
                name=build_name() + (f"_{forced.name}" if forced else ""),
                sources=kernel_build.sources(),
                extra_cflags=[*kernel_build.CFLAGS,
                              *(forced.cflags if forced else ("-march=native",))],
                extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: use torch ops
            logger.warning("CPU kernels could not be built (%s); using plain torch ops", e)
            return None
        origin = "built for this CPU"
    table = KernelTable.of(module)
    logger.info("CPU kernels ready in %.1f s, %s (%s)", time.perf_counter() - start, origin,
                ", ".join(table.available))
    return table


def main() -> None:
    """Rebuild every level's library in the package (after editing the sources)."""
    kernel_build.build_all(_PREBUILT)


if __name__ == "__main__":
    main()
