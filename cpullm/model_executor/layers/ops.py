"""The compiled CPU kernels (cpullm/csrc/), as one table.

``load_ops()`` returns a ``KernelTable``, or None when the kernels cannot be built (no
compiler, no headers): callers then use plain torch ops, which is also what
``--enforce-eager`` selects. The table says in one place which kernels this build has
(those that need AVX-512, VNNI or BF16 are None without them).

Setup builds one library per instruction-set level (``main()``, run by ``make setup``:
AVX2, AVX-512 with VNNI, AVX-512 with VNNI and BF16), as vLLM ships ``_C_AVX2`` /
``_C_AVX512`` / ``_C``, into ``cpullm/_kernels/``, each named after the sources it was
built from. ``load_ops()`` takes
the highest level this CPU runs, if it was built from the sources as they are. Otherwise
(an install without that step, sources edited since) it builds with ``-march=native`` on
first use, cached by torch under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)
under a name keyed on the sources, on their folder and on the CPU's instruction sets: a
second install of cpullm, or another CPU sharing the same home folder, gets its own build
instead of rebuilding over the other's at every switch or loading one made for
instructions this CPU lacks (SIGILL).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from cpullm.logger import init_logger
from cpullm.platform.cpu import cpu_info

logger = init_logger(__name__)

_PACKAGE = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
_CSRC = os.path.join(_PACKAGE, "csrc")
_PREBUILT = os.path.join(_PACKAGE, "_kernels")
# -ffp-contract=off: no fused multiply-adds, so that float32 results round like the unfused
# torch ops they replace.
_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


@dataclass(frozen=True)
class IsaLevel:
    """One prebuilt library: the compiler flags it is built with, and the CPU flags
    (/proc/cpuinfo's names) it needs."""

    name: str
    cflags: tuple[str, ...]
    needs: frozenset[str]


_AVX2 = IsaLevel("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"}))
_AVX512 = IsaLevel(
    "avx512", _AVX2.cflags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                              "-mavx512vnni"),
    _AVX2.needs | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})
_AVX512_BF16 = IsaLevel("avx512_bf16", _AVX512.cflags + ("-mavx512bf16",),
                        _AVX512.needs | {"avx512_bf16"})
ISA_LEVELS = (_AVX2, _AVX512, _AVX512_BF16)  # lowest first
_SOURCES = ("attention.cpp", "gemm.cpp", "quant_gemm.cpp", "fp8_gemm.cpp", "pointwise.cpp",
            "sampling.cpp", "threads.cpp", "bindings.cpp")
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
    gemm_bf16_grouped: Kernel | None
    prefill_softmax_bf16: Kernel | None
    quant_gemm: Kernel | None  # AVX-512 VNNI
    quant_gemm_grouped: Kernel | None
    quant_gemm_bf16: Kernel | None  # AVX-512 VNNI and BF16
    fp8_gemm_bf16: Kernel | None  # AVX-512 BF16
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


def _sources_digest(*extra: str) -> hashlib._Hash:
    digest = hashlib.sha256()
    for part in extra:
        digest.update(part.encode() + b"\0")
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest


def build_name() -> str:
    """The JIT build's name: a hash of the sources, of where they are (torch's build writes
    their paths into its ninja file, so another install's build would be redone) and of
    the CPU's instruction sets (-march=native compiles for every flag the CPU has)."""
    digest = _sources_digest(_CSRC, " ".join(sorted(cpu_info().flags)))
    return f"cpullm_ops_{digest.hexdigest()[:16]}"


def prebuilt_name(level: IsaLevel) -> str:
    """A prebuilt library's name: its level and a hash of the sources it is built from."""
    return f"cpullm_ops_{level.name}_{_sources_digest(level.name).hexdigest()[:16]}"


def best_level(flags: frozenset[str] | set[str]) -> IsaLevel | None:
    """The highest level a CPU with these flags runs, or None (no AVX2: another ISA)."""
    runnable = [level for level in ISA_LEVELS if level.needs <= flags]
    return runnable[-1] if runnable else None


def build_prebuilt(level: IsaLevel) -> str:
    """Compile ``level``'s library into cpullm/_kernels/; returns its path."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    name = prebuilt_name(level)
    build_dir = os.path.join(_PREBUILT, f"build-{level.name}")
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(name=name, sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                       extra_cflags=[*_CFLAGS, *level.cflags], extra_ldflags=["-fopenmp"],
                       build_directory=build_dir, verbose=False)
    target = os.path.join(_PREBUILT, f"{name}.so")
    os.replace(os.path.join(build_dir, f"{name}.so"), target)
    shutil.rmtree(build_dir)
    for old in glob.glob(os.path.join(_PREBUILT, f"cpullm_ops_{level.name}_*.so")):
        if old != target:  # built from other sources
            os.remove(old)
    return target


def load_prebuilt(level: IsaLevel) -> ModuleType | None:
    """``level``'s library if setup built it from the sources as they are now."""
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


@functools.cache
def load_ops() -> KernelTable | None:
    start = time.perf_counter()
    level = best_level(cpu_info().flags)
    module = load_prebuilt(level) if level is not None else None
    if module is not None:
        origin = f"the {level.name} build"  # type: ignore[union-attr]
    else:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        try:
            module = cpp_extension.load(
                name=build_name(), sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                extra_cflags=[*_CFLAGS, "-march=native"], extra_ldflags=["-fopenmp"],
                verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: use torch ops
            logger.warning("CPU kernels could not be built (%s); using plain torch ops", e)
            return None
        origin = "built for this CPU"
    table = KernelTable.of(module)
    logger.info("CPU kernels ready in %.1f s, %s (%s)", time.perf_counter() - start, origin,
                ", ".join(table.available))
    return table


def main() -> None:
    """Build every level's library this compiler can target (setup runs this)."""
    for level in ISA_LEVELS:
        start = time.perf_counter()
        try:
            path = build_prebuilt(level)
        except Exception as e:  # noqa: BLE001 - a compiler without the level's flags
            print(f"{level.name}: not built ({e})", file=sys.stderr)
            continue
        print(f"{level.name}: {os.path.relpath(path)} in {time.perf_counter() - start:.0f} s")


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installed sits in the environment's bin
    folder, which is not on PATH unless the environment was activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
