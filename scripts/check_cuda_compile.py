r"""Compile-check the CUDA part of ``aten_override._C`` on a machine without a GPU or a CUDA build of torch.

Runs the two compilations whose code only a CUDA build sees, with the flags ``setup.py``'s
CUDAExtension build passes (torch.utils.cpp_extension's ``COMMON_NVCC_FLAGS``, ``-std=c++20``,
``-fPIC``, the ``-gencode`` flags of ``TORCH_CUDA_ARCH_LIST``, ``-DTORCH_EXTENSION_NAME=_C``,
``-DTORCH_API_INCLUDE_EXTENSION_H``, and the extension's own ``-O3 -DATEN_OVERRIDE_WITH_CUDA``),
plus ``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE`` (see ``CHECK_ONLY_FLAGS``):

1. ``nvcc -c aten_override/csrc/cuda/direct.cu`` (host and device code, to a temporary object);
2. ``c++ -fsyntax-only aten_override/csrc/convolution_backward.cpp -DATEN_OVERRIDE_WITH_CUDA``
   (the CUDA dispatch and gating of the C++ kernel).

Nothing is linked: a CPU wheel of torch has no libtorch_cuda / libc10_cuda. Include paths are
``torch.utils.cpp_extension.include_paths(device_type="cuda")`` (torch's headers, ATen/cuda and
c10/cuda included, plus ``$CUDA_HOME/include``) and Python's. Any compiler warning fails the check.

Usage::

    python scripts/check_cuda_compile.py                      # TORCH_CUDA_ARCH_LIST defaults to 9.0
    CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST="8.0;9.0" python scripts/check_cuda_compile.py --resource-usage

Exit status 0 when both compile without a warning.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "aten_override" / "csrc"
# The flags setup.py gives the CUDAExtension, and those BuildExtension adds to every source.
EXTENSION_FLAGS = ["-O3", "-DATEN_OVERRIDE_WITH_CUDA", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]
# Only for this check, never in the build: a CPU wheel lacks c10/cuda/impl/cuda_cmake_macros.h, which
# CMake generates for CUDA builds of torch and which only defines C10_CUDA_BUILD_SHARED_LIBS (used by
# C10_CUDA_API on Windows alone); c10/cuda/CUDAMacros.h skips it under this macro.
CHECK_ONLY_FLAGS = ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
WARNING = re.compile(r"\bwarning\b", re.IGNORECASE)


def cuda_home() -> Path:
    """$CUDA_HOME, torch's own guess (None on a CPU wheel), or the toolkit of the ``nvcc`` on PATH."""
    for candidate in (os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME):
        if candidate:
            return Path(candidate)
    nvcc = shutil.which("nvcc")
    for home in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (home / "include" / "cuda_runtime.h").exists():
            return home
    raise SystemExit("check_cuda_compile: no CUDA toolkit found (set CUDA_HOME)")


def include_flags(home: Path) -> list[str]:
    cpp_extension.CUDA_HOME = str(home)  # include_paths(device_type="cuda") reads it
    paths = cpp_extension.include_paths(device_type="cuda") + [sysconfig.get_paths()["include"]]
    return [f"-I{p}" for p in paths]


def run(cmd: list[str]) -> tuple[int, str]:
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="", flush=True)
    return proc.returncode, proc.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resource-usage", action="store_true", help="print registers / shared memory per kernel (ptxas)")
    args = parser.parse_args(argv)

    home = cuda_home()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    includes = include_flags(home)
    cxx = os.environ.get("CXX", "c++")
    nvcc_extra = ["--resource-usage"] if args.resource_usage else []
    with tempfile.TemporaryDirectory() as tmp:
        nvcc = [
            str(home / "bin" / "nvcc"), *includes, "-c", str(CSRC / "cuda" / "direct.cu"), "-o", f"{tmp}/direct.o",
            *cpp_extension.COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *EXTENSION_FLAGS,
            *cpp_extension._get_cuda_arch_flags(), "-std=c++20", *CHECK_ONLY_FLAGS, *nvcc_extra,
        ]
        host = [
            cxx, *includes, "-fsyntax-only", str(CSRC / "convolution_backward.cpp"), "-fPIC", "-std=c++20", "-Wall",
            *EXTENSION_FLAGS, *CHECK_ONLY_FLAGS,
        ]
        failed = []
        for name, cmd in (("nvcc direct.cu", nvcc), ("c++ convolution_backward.cpp", host)):
            rc, output = run(cmd)
            warnings = [line for line in output.splitlines() if WARNING.search(line)]
            if rc != 0 or warnings:
                failed.append(f"{name}: exit status {rc}, {len(warnings)} warning line(s)")
            else:
                print(f"ok: {name}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
