r"""Upstream reproduction, torch.library only (no aten_override): deregistering a Python kernel of
``aten::convolution_backward`` while other threads dispatch the op.

    python repro_register_race.py

Three threads call the op in a loop while the main thread 3000 times registers a Python CPU kernel
(``Library("aten", "IMPL").impl(..., with_keyset=True)``), calls the op once in four, and destroys
the library. On torch 2.13.0+cpu the worker threads die with ``RuntimeError: interpreter ==
pyinterpreter_ INTERNAL ASSERT FAILED at c10/core/SafePyObject.cpp:6`` in about two runs of three
on a loaded 2-core machine (without the main thread's own calls: none in 6 runs): the dispatcher reads its kernel table without a lock
(pytorch#8713), so a reader can use a kernel that is being destroyed. This is why
``aten_override.install()`` exists. Prints the workers' errors; exits 0 whatever happens.
"""

import threading

import torch
from torch.library import Library, get_kernel

torch.set_num_threads(1)
original = get_kernel("aten::convolution_backward", "CPU")


def kernel(keyset, *args):
    return original.call_boxed(keyset, *args)


x, w, go = torch.randn(4, 8, 14, 14), torch.randn(16, 4, 3, 3), torch.randn(4, 16, 12, 12)
args = (go, x, w, [16], [1, 1], [0, 0], [1, 1], False, [0, 0], 2, [True, True, True])
done, errors = threading.Event(), []


def worker():
    try:
        while not done.is_set():
            torch.ops.aten.convolution_backward.default(*args)
    except BaseException as e:  # noqa: BLE001 - reported below
        errors.append(f"{type(e).__name__}: {e}".splitlines()[0])


threads = [threading.Thread(target=worker) for _ in range(3)]
for t in threads:
    t.start()
for i in range(3000):
    lib = Library("aten", "IMPL")
    lib.impl("convolution_backward", kernel, "CPU", with_keyset=True)
    if i % 4 == 0:
        torch.ops.aten.convolution_backward.default(*args)
    lib._destroy()
done.set()
for t in threads:
    t.join()
print("worker errors:", errors or "none")
