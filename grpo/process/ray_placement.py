"""Where Ray puts the async script's processes: its trainer ranks 1..N-1, as Ray actors beside the rollout workers,
and each rollout worker on the GPU Ray assigns it.

The async script already needs Ray for its rollout workers; with its trainer ranks as Ray actors too, Ray places
every process of a run, the way to ranks on other nodes without another launcher (torchrun, ssh). Rank 0 stays the
process Hydra started (its config, run dir and terminal), as with ``grpo.process.launch``'s processes, and each
actor runs the follower loop a torchrun rank runs (``follow_run``), joining rank 0's process group at the address rank 0
publishes (its node's IP as Ray knows it, a free port).
Ray ends an actor when the driver that owns it dies, however it dies, so no rank outlives rank 0.

A rollout worker on GPUs asks Ray for one (a share of one where workers outnumber the inference GPUs) and
generates on the GPU Ray assigns it, under the id the allocation gives that GPU (``worker_gpu``). A local Ray the
script starts holds the inference GPUs alone as its GPUs (``local_ray_resources``): Ray cannot assign a worker a
GPU that trains. Its trainer ranks then take a resource of their own per train GPU, not one of Ray's GPUs, whose
ids Ray hands out in no documented order (a rank given an inference GPU's slot would leave a worker the train
GPU's). Joining a cluster (``ray.address``), Ray places every GPU process of the run on the GPUs its nodes declare
(``DeviceAllocation.placed_by_ray``): each rank trains on the GPU Ray assigns its actor, and rank 0, which is no
actor, on a GPU of its own node that an actor holds for it (``driver_gpu``), so no actor is given that GPU too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import traceback
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from grpo.process.allocation import DeviceAllocation
from grpo.process.errors import ConfigError, DeviceAllocationError
from grpo.process.launch import REAP_GRACE_S, ended_if_one_ends_first
from grpo.process.setup import ray_pythonpath
from grpo.process.world import World, join_group

# actors address GPUs by the allocation's logical ids, as rank 0 does: Ray would otherwise narrow
# CUDA_VISIBLE_DEVICES to the GPU it assigned, and the rank's allocated train GPU would not be cuda:<id> there
SAME_GPU_IDS = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
MEMORY_MONITOR = "RAY_memory_monitor_refresh_ms"  # 0: a local Ray kills no actor for the node's memory use
# 0: a local Ray starts no idle Python workers for the first driver: the run's actors each get a process of their own,
# so those only imported Ray and waited (2 of them, ~0.6 CPU-s each, beside a 2-CPU Ray)
PRESTART = "RAY_prestart_worker_first_driver"
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TRAINER_GPU = "grpo_trainer_gpu"  # a local Ray's resource for each train GPU of ranks 1..N-1 (its GPUs: inference's)
LEASE_WAIT_S = 120  # how long rank 0 waits for a GPU of its node to come free in a cluster's Ray
_driver_lease = None  # in a cluster: (the actor holding rank 0's GPU, its id here), for the Ray session's life


@dataclass(frozen=True)
class RaySettings:
    """What the async script's Ray reads of the config: ``ray_session`` and the placement of its actors take it."""
    address: str | None             # ray.address: a cluster to join; None: a local Ray of the run's own
    num_cpus: int | None            # ray.num_cpus: ray.init's; None: all
    kill_on_low_memory: bool        # ray.kill_on_low_memory: a local Ray's memory monitor left on
    num_collectors: int             # train.num_collectors: rollout workers, one CPU each

    @classmethod
    def from_config(cls, cfg) -> RaySettings:
        return cls(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, kill_on_low_memory=cfg.ray.kill_on_low_memory,
                   num_collectors=cfg.train.num_collectors)


@contextlib.contextmanager
def ray_session(settings: RaySettings, devices: DeviceAllocation, trainer_actors: int = 0):
    """Ray for this run: the one this process joined already (the trainer ranks' launcher started it, and ends it),
    else started (with ``devices``' GPUs: ``local_ray_resources``), or ``ray.address``'s cluster joined, here and
    left at the end. A local Ray is checked to hold the run's actors: ``trainer_actors`` trainer ranks and
    ``train.num_collectors`` rollout workers; its memory monitor is off unless ``ray.kill_on_low_memory``: it
    judges by the whole node's memory, so any process's use got the newest actor killed (a trainer rank: the run
    ended with a closed connection; a rollout worker: a restart)."""
    if ray.is_initialized():
        yield
        return
    local = local_ray_resources(devices, trainer_actors) if settings.address is None else {}
    if settings.address is None and not settings.kill_on_low_memory:
        os.environ[MEMORY_MONITOR] = "0"  # read by the raylet ray.init starts: its memory monitor never runs
    if settings.address is None:
        os.environ.setdefault(PRESTART, "0")  # read by the raylet too
        # a Ray of the run's own says nothing a user acts on: its INFO lines (started, a token written), nor Ray
        # 2.60's warning at every start that its default, token authentication, is on (RAY_AUTH_MODE=token said
        # beforehand made its server time out at start). A joined cluster's INFO lines stay: they say where it is
        logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
    # "local", not None: None joins whichever cluster this machine ran last (/tmp/ray/ray_current_cluster), even a
    # dead one, where the config asked for a Ray of the run's own
    ray.init(address=settings.address or "local", num_cpus=settings.num_cpus, include_dashboard=False,
             logging_level=logging.INFO if settings.address else logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath()}}, **local)
    try:
        if settings.address is None:
            check_room(ray.cluster_resources(), trainer_actors, settings.num_collectors, not devices.cpu)
        elif devices.placed_by_ray:
            check_cluster_gpus(ray.cluster_resources(), trainer_actors + 1, len(devices.inference), settings.address)
            hold_driver_gpu()  # before any actor starts: one could take this node's last GPU
        yield
    finally:
        global _driver_lease
        _driver_lease = None
        ray.shutdown()


def local_ray_resources(devices: DeviceAllocation, trainer_actors: int) -> dict:
    """``ray.init``'s GPUs for a local Ray: the inference GPUs alone, Ray's GPU ``j`` being ``devices.inference[j]``
    (``worker_gpu``), and one ``TRAINER_GPU`` per trainer rank it places. On the CPU: none."""
    if devices.cpu:
        return {}
    return {"num_gpus": len(devices.inference), "resources": {TRAINER_GPU: trainer_actors} if trainer_actors else None}


def trainer_rank_resources(settings: RaySettings, devices: DeviceAllocation) -> dict:
    """What one trainer rank asks Ray for: a GPU (a local Ray's ``TRAINER_GPU``: its GPUs are the workers'), or a
    CPU where there is no GPU."""
    if devices.cpu:
        return {"num_cpus": 1}
    return {"resources": {TRAINER_GPU: 1}} if settings.address is None else {"num_gpus": 1}


def gpu_share(workers: int, gpus: int) -> float:
    """The share of a GPU each of ``workers`` rollout workers asks for: 1 each, or where they outnumber the ``gpus``
    (the allocation lets them share), the share that packs them evenly: at most ``ceil(workers / gpus)`` a GPU.
    An even split (2/3 each for 3 workers on 2 GPUs) would leave the third waiting: 1/3 free on each GPU."""
    return 1 / -(-workers // gpus)


def worker_gpu(ray_gpu_ids: list, visible: str | None, pool: list[int] | None) -> int:
    """The logical id (``cuda:<id>`` here and on the trainer) of the GPU Ray assigned a worker: ``ray_gpu_ids`` from
    ``ray.get_gpu_ids()``, which names Ray's GPU slot ``j`` by the ``j``-th entry of ``CUDA_VISIBLE_DEVICES``
    (``visible``; unset: ``j``); ``pool``: the logical ids Ray's slots stand for, in slot order (a local Ray's:
    ``local_ray_resources``), or None where they are the node's visible GPUs (a cluster's)."""
    if len(ray_gpu_ids) != 1:
        raise RuntimeError(f"a rollout worker was assigned GPUs {ray_gpu_ids}: it asks for one (or a share of one)")
    slot = visible.split(",").index(str(ray_gpu_ids[0])) if visible else int(ray_gpu_ids[0])
    return slot if pool is None else pool[slot]


def assigned_gpu(pool: list[int] | None) -> torch.device:
    """In a rollout worker: the GPU Ray assigned it, as ``worker_gpu`` names it."""
    return torch.device("cuda", worker_gpu(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), pool))


def see_only(device: torch.device) -> torch.device:
    """In a rollout worker, before its first CUDA call: ``device`` made the only GPU the process sees, as cuda:0.
    In-process vLLM always runs on cuda:0 of what its process sees (its one worker takes local rank 0), and the
    workers otherwise see every GPU (``SAME_GPU_IDS``): on 2xH200 a worker on cuda:1 could not start its engine."""
    if torch.cuda.is_initialized():
        raise RuntimeError("see_only must run before the process's first CUDA call")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device.index] if visible else str(device.index)
    return torch.device("cuda", 0)


def check_cluster_gpus(resources: dict, ranks: int, inference_gpus: int, address: str) -> None:
    """A cluster with fewer GPUs than the run's ranks and inference GPUs would leave an actor waiting for one forever
    (another job's GPUs it waits for, as Ray does)."""
    declared = resources.get("GPU", 0)
    if declared < ranks + inference_gpus:
        raise DeviceAllocationError(f"The Ray cluster at ray.address={address} declares {declared:g} GPU(s) but the "
                                    f"run needs {ranks + inference_gpus}: {ranks} trainer rank(s) "
                                    f"(train_model.num_devices) and {inference_gpus} inference GPU(s) "
                                    f"(inference_model.num_devices), one GPU each. Fix: fewer of either, or add GPU "
                                    f"nodes to the cluster (ray start --address=... on each)")


@ray.remote(num_cpus=0)
class GpuLease:
    """Holds a GPU of rank 0's node for rank 0 while its Ray session lasts: rank 0 trains in the driver process, which
    Ray gives no GPU, so without it Ray would hand that GPU to a rank or worker too."""

    def gpu(self) -> list:
        """Ray's name for the GPU held (``local_gpu``)."""
        return ray.get_gpu_ids()


def driver_gpu() -> int:
    """In a cluster, the GPU of its node that rank 0 trains on (``placed_by_ray``), as this process numbers it."""
    return _driver_lease[1]


def hold_driver_gpu() -> None:
    """One of the GPUs Ray knows on this node, held for the session by a ``GpuLease`` actor placed here, for rank 0
    (``driver_gpu``)."""
    global _driver_lease
    node = ray.get_runtime_context().get_node_id()
    declared = next(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node)
    if declared < 1:
        raise DeviceAllocationError("Rank 0 trains in this process, on a GPU of its node that Ray holds for it, but "
                                    "this node's Ray declares no GPU. Fix: run the script on a GPU node of the "
                                    "cluster, whose Ray was started with its GPUs (ray start --num-gpus=N)")
    lease = GpuLease.options(num_gpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                             runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath(), **SAME_GPU_IDS}}).remote()
    held = lease.gpu.remote()
    if not ray.wait([held], timeout=LEASE_WAIT_S)[0]:
        ray.kill(lease)
        raise DeviceAllocationError(f"Rank 0 trains on a GPU of its node, but none of this node's {declared:g} GPU(s) "
                                    f"in Ray came free within {LEASE_WAIT_S} s (other jobs hold them). Fix: free "
                                    "one, or run the script on another GPU node of the cluster")
    _driver_lease = lease, local_gpu(ray.get(held), os.environ.get("CUDA_VISIBLE_DEVICES"))  # ends with the session


def local_gpu(ray_gpu_ids: list, own_visible: str | None) -> int:
    """The logical id, in a process whose ``CUDA_VISIBLE_DEVICES`` is ``own_visible``, of the one GPU Ray names
    ``ray_gpu_ids`` on this node: Ray names a GPU by its entry in the raylet's ``CUDA_VISIBLE_DEVICES``, or by its
    index where that is unset, so the same device whoever narrows their view."""
    if len(ray_gpu_ids) != 1:
        raise RuntimeError(f"rank 0's GPU lease was given GPUs {ray_gpu_ids}: it asks for one")
    name = str(ray_gpu_ids[0])
    if own_visible is None and name.isdigit():
        return int(name)
    ids = (own_visible or "").split(",")
    if name not in ids:
        raise DeviceAllocationError(f"Ray holds GPU {name} of this node for rank 0, but this process does not see it "
                                    f"(CUDA_VISIBLE_DEVICES={own_visible}). Fix: run the script with the "
                                    "CUDA_VISIBLE_DEVICES this node's Ray was started with (or none)")
    return ids.index(name)


def check_room(resources: dict, trainer_actors: int, workers: int, gpus: bool) -> None:
    """A local Ray too small for the run's actors would leave one waiting for a CPU forever, and the run with it."""
    cpus = workers + (0 if gpus else trainer_actors)  # each worker takes a CPU; a trainer rank its GPU, or a CPU
    if resources.get("CPU", 0) < cpus:
        ranks = f"{trainer_actors} trainer rank(s) and " if not gpus and trainer_actors else ""
        raise ConfigError(f"ray.num_cpus={resources.get('CPU', 0):g} is too few for the run's Ray actors: {ranks}"
                          f"{workers} rollout worker(s) (train.num_collectors), one CPU each. Fix: ray.num_cpus={cpus} "
                          "or ray.num_cpus=null (all)")


@ray.remote
class TrainerRank:
    """A trainer rank other than 0, as a Ray actor: ``follow`` runs the follower loop until rank 0 leads the stop."""

    def follow(self, follow_run, env: dict, placed_by_ray: bool) -> int:
        """``follow_run`` (``grpo.loop.run``'s, which Ray sends by name: this process imports it) under torchrun's
        variables (``env``), in a cluster (``placed_by_ray``) on the GPU Ray assigned this actor; returns rank 0's
        exit status. A crash ends this process, as it ends a follower process: its connections close, and rank 0's
        next collective fails at once (a Ray actor would otherwise live on, holding them open, and rank 0 would wait
        out gloo's timeout)."""
        os.environ.update(env)
        try:
            status = follow_run(own_gpu=assigned_gpu(None).index if placed_by_ray else None)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        # this process outlives its loop (until rank 0 kills the actor), and NCCL's teardown on rank 0 waits for
        # every peer's (2×H200: rank 0 hung in destroy_process_group until killed), so leave the group now
        if dist.is_initialized():
            dist.destroy_process_group()
        return status


@contextlib.contextmanager
def ray_followers(settings: RaySettings, devices: DeviceAllocation, script: str, size: int, *, follow_run):
    """Ranks 1..size-1 of a world this process hosts as rank 0, as ``TrainerRank`` actors, each running
    ``follow_run`` (the script's: ``script`` is the process launcher's). On GPUs each asks Ray for one
    (``trainer_rank_resources``) and trains on the allocation's GPU for its rank (``DeviceAllocation.for_rank``), or
    in a cluster on the one Ray assigned it (``DeviceAllocation.on_gpu``); on
    the CPU it asks for one CPU. At the end the actors get ``REAP_GRACE_S`` to end their loop (and leave the group),
    at once if the group was never joined, then are killed, and rank 0 leaves the group last."""
    with ray_session(settings, devices, trainer_actors=size - 1):
        address = ray.util.get_node_ip_address()  # where rank 0 runs, reachable from every node of the cluster
        with socket.socket() as probe:  # free now; taken before rank 0 binds it, an error at once, not a hang
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        env = {"WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": address, "MASTER_PORT": str(port)}
        options = {"env_vars": {"PYTHONPATH": ray_pythonpath(), **SAME_GPU_IDS}}
        resources = trainer_rank_resources(settings, devices)
        ranks = [TrainerRank.options(**resources, runtime_env=options).remote() for _ in range(1, size)]
        loops = [rank.follow.remote(follow_run, env | {"RANK": str(r), "LOCAL_RANK": str(r)}, devices.placed_by_ray)
                 for r, rank in enumerate(ranks, 1)]
        joined = failed = False
        try:
            def first_ended() -> str | None:  # waits up to 0.2 s for one
                ended, _ = ray.wait(loops, num_returns=1, timeout=0.2)
                return (f"error: rank {loops.index(ended[0]) + 1} (a Ray actor) ended before joining rank 0; its "
                        "output above says why") if ended else None

            with ended_if_one_ends_first(first_ended, lambda: [ray.kill(rank) for rank in ranks], poll_s=0.05):
                join_group(init_method=f"tcp://{address}:{port}", rank=0, world_size=size)
            joined = True
            yield World.from_env()
        except BaseException:
            failed = True
            raise
        finally:
            with contextlib.suppress(ray.exceptions.RayError):  # the stop was led: their loops end, and leave the group
                ray.wait(loops, num_returns=len(loops), timeout=REAP_GRACE_S if joined else 0)
            if failed:
                report_dead_ranks(loops)
            for rank in ranks:
                ray.kill(rank)
            if dist.is_initialized():  # after the followers left it or were killed: NCCL's teardown waits for them
                dist.destroy_process_group()


def report_dead_ranks(loops: list) -> None:
    """After rank 0 failed: each rank whose actor died, with how Ray says it died (its exit code, or a kill by Ray's
    memory monitor). A rank's connection closing is all rank 0's error shows, and the rank's own traceback, which Ray
    forwards from its log a moment later, may never reach this terminal before Ray shuts down."""
    ended, _ = ray.wait(loops, num_returns=len(loops), timeout=0)
    for loop in ended:
        try:
            ray.get(loop)
        except ray.exceptions.RayError as err:
            print(f"rank {loops.index(loop) + 1} (a Ray actor) died: {err}", file=sys.stderr, flush=True)
