"""Installing cpullm compiles its CPU kernels: one library per instruction-set level, built
against the torch of the build environment (the pinned one, as pyproject.toml's
build-system names it) into cpullm/_kernels/. Everything else is in pyproject.toml."""

import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

_HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_build():
    """cpullm/model_executor/layers/kernel_build.py, loaded on its own: cpullm itself is
    not importable before it is installed."""
    path = os.path.join(_HERE, "cpullm", "model_executor", "layers", "kernel_build.py")
    spec = importlib.util.spec_from_file_location("cpullm_kernel_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(build_py):
    """The package's files, then the kernels beside them: into the build folder for a
    wheel, into the source tree for an editable install (where the package is imported)."""

    def run(self):
        super().run()
        if self.editable_mode:
            into = os.path.join(_HERE, "cpullm", "_kernels")
        else:
            into = os.path.join(self.build_lib, "cpullm", "_kernels")
        os.makedirs(into, exist_ok=True)
        _kernel_build().build_all(into)


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries: tagged for this platform and Python, not pure."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithKernels}, distclass=BinaryDistribution)
