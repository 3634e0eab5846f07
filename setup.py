"""Builds compile_cache with its private native extension, compile_cache._C.

The extension is compiled against the torch already installed in the environment (its headers
and ABI), which is why the package is installed with ``pip install --no-build-isolation``.
torch's ``BuildExtension`` chooses the C++ standard its headers need (C++20 since torch 2.13;
torch >= 2.14's headers do not compile as C++17).

The extension is optional: when it cannot be built (no compiler, a torch whose headers this
compiler cannot take), the install goes on without it and says so, and compile_cache uses its
pure-Python fingerprint backend (the same digests, slower), warning once when it first needs one.
"""

import glob
import os
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))


class OptionalBuildExtension(BuildExtension):
    """torch's ``BuildExtension``, whose failure to build an extension leaves it out instead of
    failing the install (setuptools' ``optional=True`` does not catch the errors torch's ninja
    build raises)."""

    def build_extensions(self) -> None:
        # torch's checks of the compiler (_check_abi) run here, before any extension builds.
        try:
            super().build_extensions()
        except Exception as exc:  # noqa: BLE001 - any build failure: the Python fallback
            names = ", ".join(ext.name for ext in self.extensions)
            sys.stderr.write(
                f"WARNING: compile_cache: the native extension {names} could not be built "
                f"({type(exc).__name__}: {exc}); installing without it. compile_cache will use "
                "its pure-Python fingerprint backend (same digests, slower).\n"
            )
            self.extensions = []  # nothing of it to copy or install


setup(
    ext_modules=[
        CppExtension(
            name="compile_cache._C",
            sources=sources,
            extra_compile_args={"cxx": ["-O3"]},
        )
    ],
    cmdclass={"build_ext": OptionalBuildExtension.with_options(use_ninja=True)},
)
