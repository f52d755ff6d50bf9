"""Build script: the package is pure Python plus an optional C++ extension, ``aten_override._C``.

The extension (aten_override/csrc) is built by the normal install
(``pip install --no-build-isolation -e .``). A failed build warns and the install continues without
it: ``aten_override.ops.convolution_backward.compiled.unavailable_reason()`` then says why.

When torch has CUDA (``torch.version.cuda``) and finds the toolkit (``CUDA_HOME``), the extension is
a CUDAExtension with the kernels of ``csrc/cuda/*.cu`` and ``-DATEN_OVERRIDE_WITH_CUDA``
(``TORCH_CUDA_ARCH_LIST`` picks the GPU architectures; by default those of the visible GPUs). If that
build fails, it warns and builds the CPU-only extension instead: a CUDA problem never costs the CPU
backend.
"""

import copy
import glob
import os
import sys

from setuptools import setup

CSRC = os.path.join("aten_override", "csrc")


def _extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except Exception as e:  # noqa: BLE001 - torch missing: install the pure-Python package
        print(f"aten_override: not building the C++ extension ({type(e).__name__}: {e})", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    # at::parallel_for is header code: it only runs in parallel when the extension itself is compiled
    # with OpenMP (ATen/ParallelOpenMP.h), else it runs serially. torch's Linux CPU build links libgomp.
    linux = sys.platform.startswith("linux")
    openmp = ["-fopenmp"] if linux else ["-fopenmp-simd"]
    cxx_flags = ["-O3", *openmp, "-fno-math-errno"]
    link_flags = openmp if linux else []
    cpu_ext = CppExtension("aten_override._C", sources, extra_compile_args=cxx_flags, extra_link_args=link_flags)
    ext = cpu_ext
    if torch.version.cuda is not None and CUDA_HOME is not None:
        ext = CUDAExtension(
            "aten_override._C",
            sources + sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu"))),
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=link_flags,
            define_macros=[("ATEN_OVERRIDE_WITH_CUDA", None)],
        )
    # Without CUDA, CUDA calls route to the original kernel ("no CUDA kernels in this build").
    return [ext], {"build_ext": _OptionalBuildExt.wrap(BuildExtension, cpu_ext)}


class _OptionalBuildExt:
    # What CUDAExtension sets beyond CppExtension; a failed CUDA build gets cpu_ext's values back.
    CPU_ONLY_ATTRIBUTES = ("sources", "include_dirs", "define_macros", "library_dirs", "libraries", "extra_compile_args")

    @staticmethod
    def wrap(base, cpu_ext):
        class OptionalBuildExt(base.with_options(use_ninja=True)):
            """Warns instead of failing the install when the extension does not build; a failed CUDA
            build is retried CPU-only (the extension gets ``cpu_ext``'s sources and flags)."""

            def run(self):
                # A failed run leaves `inplace` cleared (setuptools) and `compiler` an object (distutils).
                options = self.inplace, self.compiler
                try:
                    super().run()
                except Exception as e:  # noqa: BLE001
                    self.inplace, self.compiler = options
                    cuda = [ext for ext in self.extensions if any(src.endswith(".cu") for src in ext.sources)]
                    if not cuda:
                        self.warn(f"aten_override: C++ extension not built, compiled backend unavailable: {e}")
                        return
                    self.warn(f"aten_override: CUDA kernels not built ({e}); building the CPU-only extension")
                    for ext in cuda:
                        for name in _OptionalBuildExt.CPU_ONLY_ATTRIBUTES:
                            setattr(ext, name, copy.deepcopy(getattr(cpu_ext, name)))
                    self.run()

        return OptionalBuildExt


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
