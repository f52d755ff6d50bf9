r"""Backward in worker threads while another thread enters and leaves ``enable(backend)``.

    python thread_stress.py --backend B --mode pinned|unpinned [--toggles N] [--workers W] [--togglers T]

Run as a child interpreter by tests/robustness/test_threads.py, so that a crash in the dispatcher
is an exit status, not a dead test session. ``pinned`` holds ``aten_override.install()`` for the
whole run (the documented mode for toggling while other threads run backward: entering and leaving
only flips the active backend); ``unpinned`` registers and deregisters at every toggle.

Every worker call is one ``aten::convolution_backward`` (autograd of one ``conv2d``) whose three
gradients are compared bitwise with the native result and the backend's result, computed before the
threads start (they differ in every component, so a call served half by each would show). Prints one
JSON line: counts of all calls (workers' and togglers') classified ``native`` / ``backend`` /
``mixed`` / ``other``, the togglers' own calls inside and outside their blocks, the stats, and the
final dispatcher state.
"""

from __future__ import annotations

import argparse
import json
import threading

import torch

import aten_override


def _problem():
    g = torch.Generator().manual_seed(0)
    # Grouped with a channel multiplier and 12x12 output planes: a layer every backend serves itself
    # (the compiled backend hands planes under 64 elements to native, which would hide it here).
    x = torch.randn(4, 8, 26, 26, generator=g)
    w = torch.randn(16, 4, 3, 3, generator=g)
    b = torch.randn(16, generator=g)
    go = torch.randn(4, 16, 12, 12, generator=g)
    return x, w, b, go


def _backward(x, w, b, go):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.conv2d(x, w, b, stride=2, padding=0, groups=2)
    return torch.autograd.grad(y, (x, w, b), go)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--mode", choices=("pinned", "unpinned"), required=True)
    p.add_argument("--toggles", type=int, default=2000)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--togglers", type=int, default=1, help="threads entering and leaving enable()")
    args = p.parse_args()
    torch.set_num_threads(1)
    problem = _problem()
    native = _backward(*problem)
    with aten_override.enable(args.backend):
        ours = _backward(*problem)
    differs = [not torch.equal(a, b) for a, b in zip(native, ours)]

    counts = {"native": 0, "backend": 0, "mixed": 0, "other": 0}
    counts_lock = threading.Lock()
    done = threading.Event()
    errors: list[str] = []

    def classified_call() -> str:
        got = _backward(*problem)
        is_native = [torch.equal(g, n) for g, n in zip(got, native)]
        is_ours = [torch.equal(g, o) for g, o in zip(got, ours)]
        if all(is_native):
            kind = "native"
        elif all(is_ours):
            kind = "backend"
        elif all(n or o for n, o in zip(is_native, is_ours)):
            kind = "mixed"
        else:
            kind = "other"
        with counts_lock:
            counts[kind] += 1
        return kind

    def worker():
        try:
            while not done.is_set():
                classified_call()
        except BaseException as e:  # reported, not swallowed
            errors.append(f"{type(e).__name__}: {e}")

    # One enable object shared by every toggling thread (its tokens are per thread).
    ctx = aten_override.enable(args.backend)
    toggler = {"inside": {}, "outside": {}}  # kinds of the toggling threads' own calls

    def toggle():
        try:
            for i in range(args.toggles):
                with ctx:
                    if i % 4 == 0:  # sometimes let calls land inside the block,
                        kind = classified_call()
                        with counts_lock:
                            toggler["inside"][kind] = toggler["inside"].get(kind, 0) + 1
                if i % 4 == 2:  # and sometimes stay out a while, so workers see both states
                    kind = classified_call()
                    with counts_lock:
                        toggler["outside"][kind] = toggler["outside"].get(kind, 0) + 1
        except BaseException as e:
            errors.append(f"toggler: {type(e).__name__}: {e}")

    if args.mode == "pinned":
        aten_override.install()
    aten_override.reset_stats()
    threads = [threading.Thread(target=worker) for _ in range(args.workers)]
    togglers = [threading.Thread(target=toggle) for _ in range(args.togglers)]
    for t in threads + togglers:
        t.start()
    for t in togglers:
        t.join()
    done.set()
    for t in threads:
        t.join()
    stats = aten_override.stats()
    if args.mode == "pinned":
        aten_override.uninstall()
    # Fast toggling leaves the registration lingering idle (calls run the original kernel: "after"
    # below checks that); release() destroys it, so the dispatcher table can be compared too.
    after = "native" if all(torch.equal(a, b) for a, b in zip(_backward(*problem), native)) else "changed"
    lingered = aten_override.release()
    print(json.dumps({
        "lingered": lingered,
        "differs": differs,
        "counts": counts,
        "toggler": toggler,
        "stats": {k: v for k, v in stats.items() if k != "fallback_reasons"},
        "errors": errors,
        "registered": aten_override.is_registered(),
        "active": aten_override.active_backend(),
        "dump_mentions_us": aten_override._registration.__file__ in torch._C._dispatch_dump("aten::convolution_backward"),
        "after": after,
    }))


if __name__ == "__main__":
    main()
