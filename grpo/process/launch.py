"""The trainer's data-parallel ranks on one node without torchrun: ``train_model.num_devices=N`` (or N ids in
``train_model.devices``) makes the process the user started rank 0, and it starts the other N-1 itself. Under
torchrun (or any launcher that sets WORLD_SIZE) the ranks are the launcher's, and the config must agree.

Rank 0 starts its followers itself rather than through torchrun's in-process API or ``torch.multiprocessing``:
both make the user's process a supervisor that idles while N fresh workers run, so rank 0 would be a child that
composes Hydra's config again, apart from the run dir, the multirun sweep and the terminal that the user's
process owns. Here the process Hydra started stays rank 0 and runs the run as it does alone; each follower is
the script itself with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so it runs
the very code a torchrun rank runs (``follow_run``), and a test of one path tests the other.

A follower never outlives rank 0. It exits when rank 0 leads the stop, however rank 0's run ends; if rank 0 dies
without a word (kill -9, the OOM killer), a thread that watches its parent ends it within a second: a follower
waiting on NCCL, or on a TCP store that died with rank 0, would otherwise wait out a 30-minute timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from grpo.process.devices import PlacementSettings, trainer_ranks
from grpo.process.errors import DeviceAllocationError
from grpo.process.world import World, join_group

LEADER_PID = "GRPO_LEADER_PID"  # set in each follower rank 0 starts: the process whose end ends it
REAP_GRACE_S = 30  # what a follower has to exit once rank 0 led the stop; it takes about a second


@contextlib.contextmanager
def trainer_world(placement: PlacementSettings, script: str, check, followers=None):
    """Rank 0's world for its whole run: the other ranks started by ``followers(devices, script, size)`` (a context
    that yields the joined world: ``process_followers``, the default, runs ``script`` as each; the async script's are
    Ray actors, ``grpo.process.ray_placement``) or, under torchrun, joined; however the run ends, they are told to
    stop with its exit status (``World.leading``). ``check()``: the checks that need no other rank, run before any
    is started, returning the run's ``DeviceAllocation``; under torchrun, whose ranks run already, the run makes
    them inside the world (``agree_with_launcher`` first), which tells those ranks to stop."""
    if "WORLD_SIZE" in os.environ:  # torchrun's ranks
        world = World.from_env()
        with world.leading():
            yield world
        return
    ranks = trainer_ranks(placement) or 1
    devices = check()
    followers = followers or process_followers
    started = followers(devices, script, ranks) if ranks > 1 else contextlib.nullcontext(World())
    with started as world, world.leading():
        yield world


def agree_with_launcher(placement: PlacementSettings, world: World) -> int | None:
    """Under torchrun, ``train_model.num_devices`` left null becomes the number of ranks it started: returned, for
    the run's config (its record and device allocation then say it); set, it must be that number. None: the config's
    count stands (always, for the ranks ``trainer_world`` started itself)."""
    asked = trainer_ranks(placement)
    if asked is None:
        return world.size if world.size > 1 else None
    if asked == world.size:
        return None
    if placement.train.devices is not None:
        setting = f"train_model.devices={list(placement.train.devices)}"
        fix = "train_model.devices=null (torchrun's count)"
    else:
        setting = f"train_model.num_devices={asked}"
        fix = f"train_model.num_devices={world.size} (or null: torchrun's count)"
    raise DeviceAllocationError(
        f"torchrun started {world.size} trainer rank(s) (WORLD_SIZE={world.size}) but {setting} asks for {asked}: "
        f"each rank trains on one of them. Fix: {fix} or --nproc_per_node={asked}, "
        f"or leave out torchrun: on one node {setting} starts its ranks itself")


def process_followers(devices, script: str, size: int):
    """Ranks 1..size-1 as processes of this node: ``script`` run with torchrun's variables (``_followers``)."""
    return _followers(script, size)


@contextlib.contextmanager
def _followers(script: str, size: int):
    """Ranks 1..size-1 of a world this process hosts as rank 0: ``script`` run with torchrun's variables, then the
    group joined. At the end the group is left (a multirun's next job joins its own) and the followers get
    ``REAP_GRACE_S`` to exit, then are killed; at once if the group was never joined (no stop reached them)."""
    # a port free now; were it taken before rank 0 binds it below, that is an error at once, not a hang
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), LEADER_PID: str(os.getpid())}
    followers = [subprocess.Popen([sys.executable, script], env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(1, size)]
    joined = False
    try:
        # the followers join through torchrun's env:// rendezvous; tcp:// is the same store at that port
        def first_exited() -> str | None:
            for rank, follower in enumerate(followers, start=1):
                if follower.poll() is not None:
                    return (f"error: rank {rank} exited (status {follower.returncode}) before joining rank 0; its "
                            "output above says why")
            return None

        with ended_if_one_ends_first(first_exited, lambda: [follower.kill() for follower in followers], poll_s=0.2):
            join_group(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=size)
        joined = True
        yield World.from_env()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + (REAP_GRACE_S if joined else 0)
        for follower in followers:
            try:
                follower.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait()


@contextlib.contextmanager
def ended_if_one_ends_first(first_ended, stop_all, poll_s: float):
    """While rank 0 waits for its followers to join: a follower that ends first (a crash on import or on its GPU)
    never will, and rank 0, blocked in C++, would wait out the 30-minute timeout; so a thread ends the run.
    ``first_ended()``: the error line naming a follower that ended, else None; ``stop_all()`` ends the others."""
    joining = threading.Event()
    joining.set()

    def watch() -> None:
        while joining.is_set():
            error = first_ended()
            if error and joining.is_set():
                print(error, file=sys.stderr, flush=True)
                stop_all()
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="followers-joining", daemon=True).start()
    try:
        yield
    finally:
        joining.clear()


def exit_with_leader() -> None:
    """In a follower that rank 0 started (not torchrun's): end this process once rank 0, its parent, is gone."""
    leader = os.environ.get(LEADER_PID)
    if leader is None:
        return

    def watch() -> None:
        while os.getppid() == int(leader):
            time.sleep(0.5)
        print(f"rank {os.environ.get('RANK')}: rank 0 (pid {leader}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-rank-0", daemon=True).start()
