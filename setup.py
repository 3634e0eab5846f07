"""Builds compile_cache with its private native extension, compile_cache._C.

The extension is compiled against the torch already installed in the environment (its headers
and ABI), which is why the package is installed with ``pip install --no-build-isolation``.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))

setup(
    ext_modules=[
        CppExtension(
            name="compile_cache._C",
            sources=sources,
            extra_compile_args={"cxx": ["-O3", "-std=c++17"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
