r"""One rank of a small DistributedDataParallel conv training run (gloo, CPU), launched per rank by
tests/integration/test_ddp.py the way ``torchrun`` would: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` in the environment.

    python ddp_train.py --out DIR [--enable BACKEND] [--reference]

``--enable`` wraps training in ``aten_override.enable(BACKEND)``; without it the script changes
nothing, so ``python -m aten_override run --backend B ddp_train.py`` can enable from outside.
``--reference`` first trains the same model natively in the same process group. Each rank saves
``DIR/rank{R}.pt``: the final parameters, ``aten_override.stats()`` and the backend that was active
during training (and the same under ``"native"`` with ``--reference``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import aten_override

STEPS = 3


def train(rank: int, ctx) -> dict:
    """STEPS SGD steps of a small conv model under DDP inside ``ctx``; returns the final parameters,
    ``aten_override.stats()`` of the run and the backend that was active."""
    torch.manual_seed(0)  # same initial weights in every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=4), nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Flatten(), nn.LazyLinear(5),
    ).double()
    model(torch.zeros(1, 3, 8, 8, dtype=torch.float64))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    aten_override.reset_stats()
    with ctx:
        active = aten_override.active_backend()
        for _ in range(STEPS):
            x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=g)
            y = torch.randint(0, 5, (4,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "stats": aten_override.stats(), "active": active}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--enable", default=None, help="train under aten_override.enable(ENABLE)")
    p.add_argument("--reference", action="store_true", help="first train natively too (saved as 'native')")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # torch 2.13 aborts ~1 rank exit in 10 ("terminate called without an active exception", SIGABRT,
    # natively too, without this package): every backward stashes a Python object in its thread-local
    # state (torch.autograd.graph._engine_run_backward's contextvars "context"), DDP's allreduce work
    # captures that state, and a gloo worker thread drops the last reference to the work after it
    # completed. That destructor needs the GIL; if the interpreter is already finalizing, CPython ends
    # the thread with pthread_exit, whose unwinding through the noexcept destructor calls
    # std::terminate. Releasing the GIL once more before finalization lets a waiting worker finish
    # (0 aborts in 100 runs, against 10 in 100 without; atexit runs before finalization begins).
    atexit.register(time.sleep, 0.05)
    try:
        result = {}
        if args.reference:
            result["native"] = train(rank, contextlib.nullcontext())
        ctx = aten_override.enable(args.enable) if args.enable else contextlib.nullcontext()
        result.update(train(rank, ctx))
        torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
