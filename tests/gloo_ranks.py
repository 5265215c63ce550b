"""Spawned gloo ranks for the tests that compare a parallel layout with one process.

`run_ranks(fn, world, *args)` runs `fn(rank, world, *args)` in `world` spawned processes joined
by a gloo process group and raises the first rank's traceback as an AssertionError. `fn` must be
a module-level function of a test module (the rank imports it by name).

Ranks are forked from a forkserver that imported torch and trillora once: a spawned rank spends
about 2 s of one core importing them, so 8 spawned ranks on 2 cores took 15 s before running a
line of the test, forked ones under 1 s. The server is started clean (no threads, no process
group), so forking it is as safe as spawning.
"""

from __future__ import annotations

import gc
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_helpers import free_port

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "trillora.models",
    "trillora.lora",
    "trillora.parallel",
]
"""What the forkserver imports before any rank forks from it (importing `fn`'s module then costs
only what that module adds)."""


def run_ranks(fn, world: int, *args, attempts: int = 3) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    for attempt in range(attempts):  # free_port() reserves nothing: another process may take it first
        errors = ctx.SimpleQueue()
        try:
            mp.start_processes(
                _rank, args=(fn, world, free_port(), errors, args), nprocs=world, start_method="forkserver"
            )
            return
        except Exception as e:
            message = errors.get() if not errors.empty() else str(e)
            # the port taken by another process first, or the rendezvous's connection dropped while the
            # ranks set up their groups: both before any of `fn` ran; anything else is the test's failure
            if not any(e in message for e in ("EADDRINUSE", "DistNetworkError")) or attempt == attempts - 1:
                raise AssertionError(message) from None


def _rank(rank: int, fn, world: int, port: int, errors, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        # what `fn` built (meshes, FSDP states) holds process groups in reference cycles: freed before the
        # groups are destroyed (a forkserver child then ends with os._exit, without the interpreter's teardown)
        gc.collect()
        dist.destroy_process_group()
