"""Building the CPU kernels (cpullm/csrc/) into one library per instruction-set level.

Installing the package runs this (setup.py's build step): AVX2, AVX-512 with VNNI, and
AVX-512 with VNNI and BF16, as vLLM ships ``_C_AVX2`` / ``_C_AVX512`` / ``_C``, into
``cpullm/_kernels/``, each named after the sources it was built from, so that a library
built from other sources is never loaded. ``ops.load_ops()`` takes the highest level the CPU
runs. This module imports nothing of cpullm (setup.py loads it before cpullm is installed)
and torch only to compile.
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass

CSRC = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc"))
# -ffp-contract=off: no fused multiply-adds, so that float32 results round like the unfused
# torch ops they replace.
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
SOURCES = ("attention/decode.cpp", "attention/prefill.cpp", "attention/kv_quant.cpp",
           "gemm.cpp", "gemm_amx.cpp",
           "quant/int8_amx.cpp", "quant/tiled_dots.cpp", "quant/tiled_panels.cpp",
           "fp8_gemm.cpp", "pointwise.cpp", "sampling.cpp", "threads.cpp", "bindings.cpp")
HEADERS = ("amx.h", "gemm_tiles.h", "ops.h", "vec.h", "attention/common.h",
           "attention/decode_bf16.h", "attention/decode_amx.h", "attention/kv_quant.h",
           "quant/kept.h", "quant/tiled.h", "quant/tiled_dots_avx512.h",
           "quant/tiled_dots_avx2.h")

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


def sources() -> list[str]:
    return [os.path.join(CSRC, name) for name in SOURCES]


def sources_digest(*extra: str) -> hashlib._Hash:
    """A hash of the sources and headers, and of ``extra``."""
    digest = hashlib.sha256()
    for part in extra:
        digest.update(part.encode() + b"\0")
    for name in SOURCES + HEADERS:
        with open(os.path.join(CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest


def prebuilt_name(level: IsaLevel) -> str:
    """A prebuilt library's name: its level and a hash of the sources it is built from."""
    return f"cpullm_ops_{level.name}_{sources_digest(level.name).hexdigest()[:16]}"


def put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installed sits in the environment's bin
    folder, which is not on PATH unless the environment was activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_prebuilt(level: IsaLevel, into: str) -> str:
    """Compile ``level``'s library into the folder ``into``; returns its path. Libraries of
    the same level built from other sources are removed from there."""
    from torch.utils import cpp_extension

    put_ninja_on_path()
    name = prebuilt_name(level)
    build_dir = os.path.join(into, f"build-{level.name}")
    os.makedirs(build_dir, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=sources(), extra_cflags=[*CFLAGS, *level.cflags],
                           extra_ldflags=["-fopenmp"], build_directory=build_dir,
                           verbose=False)
        target = os.path.join(into, f"{name}.so")
        os.replace(os.path.join(build_dir, f"{name}.so"), target)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    # (the hash's 16 hex digits: avx512_* alone would match the avx512_bf16 libraries)
    for old in glob.glob(os.path.join(into, f"cpullm_ops_{level.name}_{'[0-9a-f]' * 16}.so")):
        if old != target:
            os.remove(old)
    return target


def build_all(into: str) -> list[str]:
    """Build every level's library this compiler can target into ``into``; returns their
    paths. Nothing is built off x86 or without torch (cpullm then builds for the CPU on first
    use, or runs plain torch ops); a level the compiler refuses is left out, with its
    reason on stderr."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"cpullm kernels: none prebuilt for {platform.machine()}", file=sys.stderr)
        return []
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        print(f"cpullm kernels: not built, torch is missing ({e})", file=sys.stderr)
        return []
    built = []
    for level in ISA_LEVELS:
        start = time.perf_counter()
        try:
            path = build_prebuilt(level, into)
        except Exception as e:  # noqa: BLE001 - a compiler without the level's flags, or none
            print(f"cpullm kernels: {level.name} not built ({e})", file=sys.stderr)
            continue
        print(f"cpullm kernels: {level.name} built in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        built.append(path)
    return built
