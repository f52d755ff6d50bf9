"""Build script: the package is pure Python plus an optional C++ extension, ``aten_override._C``.

The extension (aten_override/csrc) is built by the normal install
(``pip install --no-build-isolation -e .``). A failed build warns and the install continues without
it: ``aten_override.ops.convolution_backward.compiled.unavailable_reason()`` then says why.
"""

import glob
import os
import sys

from setuptools import setup

CSRC = os.path.join("aten_override", "csrc")


def _extensions():
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:  # noqa: BLE001 - torch missing: install the pure-Python package
        print(f"aten_override: not building the C++ extension ({type(e).__name__}: {e})", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    # CUDA keys route to the original kernel ("no CUDA kernels in this build"): there is no .cu source
    # yet, so the extension is a CppExtension even when torch has CUDA.
    del torch
    # at::parallel_for is header code: it only runs in parallel when the extension itself is compiled
    # with OpenMP (ATen/ParallelOpenMP.h), else it runs serially. torch's Linux CPU build links libgomp.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else ["-fopenmp-simd"]
    ext = CppExtension(
        "aten_override._C",
        sources,
        extra_compile_args=["-O3", *openmp, "-fno-math-errno"],
        extra_link_args=openmp if sys.platform.startswith("linux") else [],
    )
    return [ext], {"build_ext": _OptionalBuildExt.wrap(BuildExtension)}


class _OptionalBuildExt:
    @staticmethod
    def wrap(base):
        class OptionalBuildExt(base.with_options(use_ninja=True)):
            """Warns instead of failing the install when the extension does not build."""

            def run(self):
                try:
                    super().run()
                except Exception as e:  # noqa: BLE001
                    self.warn(f"aten_override: C++ extension not built, compiled backend unavailable: {e}")

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as e:  # noqa: BLE001
                    self.warn(f"aten_override: C++ extension {ext.name} not built: {e}")

        return OptionalBuildExt


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
