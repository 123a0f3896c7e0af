"""The compiled CPU kernels (cpullm/csrc/cpu_ops.cpp), built on first use and cached.

``load_ops()`` returns the extension module, or None when it cannot be built (no compiler,
no headers): callers then use plain torch ops, which is also what ``--enforce-eager``
selects. The build is cached by torch under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), keyed by the source, so later starts only load it.
"""

from __future__ import annotations

import functools
import os
import time
from types import ModuleType

from cpullm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc", "cpu_ops.cpp")


@functools.cache
def load_ops() -> ModuleType | None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name="cpullm_cpu_ops", sources=[os.path.normpath(_SOURCE)],
            # -ffp-contract=off: no fused multiply-adds, so that float32 results round like
            # the unfused torch ops they replace.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch ops
        logger.warning("CPU kernels could not be built (%s); using plain torch ops", e)
        return None
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    return module


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installed sits in the environment's bin
    folder, which is not on PATH unless the environment was activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
