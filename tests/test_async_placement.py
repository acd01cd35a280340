"""Where Ray puts the async script's rollout workers on GPUs: each on the GPU Ray assigns it, named as the trainer
names it, and a local Ray offering the inference GPUs alone; in a cluster, rank 0 on a GPU of its node that Ray
holds for it. A CPU machine has no GPU, but Ray assigns GPUs it is told of all the same: these tests start Ray with
the GPUs the script would declare and read back what it assigns."""

import os
import time

import pytest
import ray
import torch
from omegaconf import OmegaConf

from conftest import ray_cluster_here
from grpo.process.allocation import DeviceAllocation
from grpo.process.devices import PlacementSettings, allocate_devices
from grpo.process.errors import DeviceAllocationError
from grpo.process.ray_placement import MEMORY_MONITOR, SAME_GPU_IDS, TRAINER_GPU, RaySettings, assigned_gpu, \
    driver_gpu, gpu_share, local_gpu, local_ray_resources, ray_session, see_only, worker_gpu
from grpo.process.setup import ray_pythonpath


@ray.remote
class GpuProbe:
    """Stands where a rollout worker stands (the same Ray request and environment) and says which GPU it got."""

    def gpu(self, pool) -> tuple[str, str | None]:
        return str(assigned_gpu(pool)), os.environ.get("CUDA_VISIBLE_DEVICES")

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def four_gpu_layout(collectors: int):
    """4 GPUs: 2 trainer ranks on GPUs 0 and 1, 2 inference GPUs (2 and 3), ``collectors`` rollout workers."""
    cfg = OmegaConf.create({"train_model": {"num_devices": 2}, "inference_model": {"num_devices": 2},
                            "ref_model": {"colocate": True}, "train": {"num_collectors": collectors}})
    return allocate_devices(PlacementSettings.from_config(cfg), inference_engines=collectors, dedicated_inference=True,
                            visible_gpus=4)


@pytest.fixture
def local_ray(monkeypatch):
    """A local Ray started as the script starts it for ``four_gpu_layout``, under CUDA_VISIBLE_DEVICES=4,5,6,7 (so
    Ray's GPU names and the logical ids differ); yields the allocation."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the raylet, and through it every worker, inherits it
    devices = four_gpu_layout(collectors=3)
    ray.init(address="local", num_cpus=3, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath()}}, **local_ray_resources(devices, trainer_actors=1))
    try:
        yield devices
    finally:
        ray.shutdown()


def probes(workers: int, share: float, pool):
    options = {"num_cpus": 1, "num_gpus": share, "runtime_env": {"env_vars": SAME_GPU_IDS}}
    actors = [GpuProbe.options(**options).remote() for _ in range(workers)]
    return ray.get([actor.gpu.remote(pool) for actor in actors], timeout=120)  # a hang guard: all must fit


def test_a_local_ray_offers_the_inference_gpus_alone_and_each_worker_gets_its_own(local_ray):
    """Ray knows 2 GPUs (the inference GPUs; the train GPUs are not Ray's to give) and one train GPU for rank 1;
    two workers asking for a GPU each get distinct ones, which they name cuda:2 and cuda:3, as the trainer does
    (CUDA_VISIBLE_DEVICES left as the trainer's, so CUDA IPC handles name the same devices)."""
    assert local_ray.train == [0, 1] and local_ray.inference == [2, 3]
    resources = ray.cluster_resources()
    assert resources["GPU"] == 2 and resources[TRAINER_GPU] == 1
    got = probes(2, gpu_share(2, 2), local_ray.inference)
    assert sorted(device for device, _ in got) == ["cuda:2", "cuda:3"]
    assert {visible for _, visible in got} == {"4,5,6,7"}


def test_workers_that_outnumber_the_inference_gpus_share_them_evenly(local_ray):
    """3 workers on 2 inference GPUs: all are placed (half a GPU each), at most 2 on one, none on a train GPU."""
    got = [device for device, _ in probes(3, gpu_share(3, 2), local_ray.inference)]
    assert set(got) <= {"cuda:2", "cuda:3"} and max(got.count("cuda:2"), got.count("cuda:3")) == 2


@pytest.mark.parametrize("workers,gpus,share", [(1, 1, 1.0), (2, 2, 1.0), (3, 2, 0.5), (4, 2, 0.5), (5, 2, 1 / 3)])
def test_gpu_share_packs_whole_workers(workers, gpus, share):
    assert gpu_share(workers, gpus) == pytest.approx(share)


@pytest.mark.parametrize("ray_ids,visible,pool,logical", [
    (["5"], "4,5,6,7", [2, 3], 3),   # a local Ray: its GPU slot 1 (named "5") is the second inference GPU
    ([1], None, [2, 3], 3),          # the same with CUDA_VISIBLE_DEVICES unset: Ray names the slot by its number
    (["6"], "4,5,6,7", None, 2),     # a cluster node's GPUs are its visible GPUs: "6" is cuda:2
    ([0], None, None, 0),
])
def test_worker_gpu_names_ray_s_gpu_as_the_allocation_does(ray_ids, visible, pool, logical):
    assert worker_gpu(ray_ids, visible, pool) == logical


def test_a_worker_given_two_gpus_is_a_bug_said_so():
    with pytest.raises(RuntimeError, match=r"assigned GPUs \['4', '5'\]: it asks for one"):
        worker_gpu(["4", "5"], "4,5,6,7", None)


@pytest.mark.parametrize("visible,device,seen", [("4,5,6,7", 3, "7"), (None, 1, "1"), ("2", 0, "2")])
def test_a_vllm_worker_sees_only_its_own_gpu_as_cuda_0(monkeypatch, visible, device, seen):
    """In-process vLLM runs on cuda:0 of what its process sees, so its worker's logical cuda:<device> becomes that."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert str(see_only(torch.device("cuda", device))) == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == seen


@ray.remote
class Sleeper:
    def sleep(self, seconds: float) -> bool:
        time.sleep(seconds)
        return True


@pytest.mark.parametrize("kill_on_low_memory", [False, True])
def test_a_local_ray_kills_no_actor_for_the_node_s_memory_unless_asked(kill_on_low_memory, monkeypatch):
    """Ray's memory monitor, with its threshold at 1% of the node's memory (always passed), kills a busy actor; the
    local Ray the script starts runs without it unless ``ray.kill_on_low_memory`` (in CI another test's memory got
    a trainer rank killed, and the run ended)."""
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.01")
    monkeypatch.setenv(MEMORY_MONITOR, "100")  # Ray's default is 250 ms; restored (unset) after the test
    cfg = OmegaConf.create({"ray": {"address": None, "num_cpus": 1, "kill_on_low_memory": kill_on_low_memory},
                            "train": {"num_collectors": 1}})
    with ray_session(RaySettings.from_config(cfg), DeviceAllocation([], [], [], cpu=True)):
        busy = Sleeper.remote().sleep.remote(3)
        if kill_on_low_memory:
            with pytest.raises(ray.exceptions.RayError, match="low on memory"):
                ray.get(busy, timeout=120)  # a hang guard
        else:
            assert ray.get(busy, timeout=120)


def in_a_cluster(address: str, trainer_ranks: int = 1):
    """The async script's Ray session in a cluster (``ray.address``), one inference GPU, as rank 0 enters it."""
    cfg = OmegaConf.create({"ray": {"address": address, "num_cpus": None, "kill_on_low_memory": False},
                            "train": {"num_collectors": 1}, "train_model": {"num_devices": trainer_ranks},
                            "ref_model": {"colocate": True}})
    devices = allocate_devices(PlacementSettings.from_config(cfg), inference_engines=1, dedicated_inference=True,
                               placed_by_ray=True, visible_gpus=2)
    return ray_session(RaySettings.from_config(cfg), devices, trainer_actors=trainer_ranks - 1)


def test_in_a_cluster_rank_0_s_node_without_a_gpu_in_ray_is_one_line(monkeypatch):
    with ray_cluster_here(monkeypatch, node_gpus="7,8") as address:
        with pytest.raises(DeviceAllocationError, match=r"^Rank 0 trains in this process, on a GPU of its node that "
                           r"Ray holds for it, but this node's Ray declares no GPU. Fix: run the script on a GPU node"):
            with in_a_cluster(address):
                pass


class TestOneClusterOfTwoNodes:
    """A Ray cluster (``ray_cluster_here``): a head declaring GPU "5", where this process attaches, and a node of 2
    CPUs declaring GPU "7". One for the tests of this class (a start is ~10 s a node); the Ray sessions they open
    end with them."""

    @pytest.fixture(scope="class")
    def cluster(self):
        with pytest.MonkeyPatch.context() as monkeypatch, \
                ray_cluster_here(monkeypatch, head_gpus="5", node_gpus="7") as address:
            yield address

    def test_a_local_ray_is_the_run_s_own_even_beside_a_running_cluster(self, cluster):
        """``ray.address=null`` starts a Ray of the run's own, not the cluster this machine started last (what Ray's
        ``ray.init()`` without an address joins, even a dead one: a test run hung on one that way)."""
        cfg = OmegaConf.create({"ray": {"address": None, "num_cpus": 1, "kill_on_low_memory": False},
                                "train": {"num_collectors": 1}})
        with ray_session(RaySettings.from_config(cfg), DeviceAllocation([], [], [], cpu=True)):
            assert len(ray.nodes()) == 1 and ray.cluster_resources()["CPU"] == 1  # the cluster: 2 nodes, 2 CPUs

    def test_in_a_cluster_rank_0_trains_on_a_gpu_of_its_node_that_ray_holds_and_no_actor_gets(self, cluster,
                                                                                              monkeypatch):
        """Rank 0's node (the head, where this process runs) declares one GPU, its "5"; another node GPU "7". Rank 0
        (no actor: Ray gives it no GPU) trains on the one Ray holds for it here from the session's start, which this
        process, seeing GPUs 4,5, names cuda:1; an actor asking for a GPU, even one started before rank 0 asks which
        GPU it has (as the other ranks are), gets the other node's, which it names cuda:0 (it sees GPU 7 alone). On
        4 H200s, the lease taken at that later point found the head's one GPU taken by rank 1's actor."""
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
        with in_a_cluster(cluster):
            assert ray.available_resources().get("GPU") == 1  # one held for rank 0 from the start
            probe = GpuProbe.options(num_cpus=0, num_gpus=1,  # it could run on the head
                                     runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath(), **SAME_GPU_IDS}}).remote()
            assert ray.get(probe.gpu.remote(None), timeout=120) == ("cuda:0", "7")
            assert ray.get(probe.node.remote()) != ray.get_runtime_context().get_node_id()
            assert driver_gpu() == 1

    def test_a_cluster_with_fewer_gpus_than_the_run_needs_is_one_line(self, cluster):
        """2 trainer ranks and 1 inference GPU need 3 GPUs; the cluster declares 2 (an actor would wait forever)."""
        with pytest.raises(DeviceAllocationError, match=r"The Ray cluster at ray.address=\S+ declares 2 GPU\(s\) but "
                           r"the run needs 3: 2 trainer rank\(s\) \(train_model.num_devices\) and 1 inference GPU"):
            with in_a_cluster(cluster, trainer_ranks=2):
                pass


@pytest.mark.parametrize("ray_ids,own_visible,logical", [
    (["5"], "4,5", 1),     # the node's raylet saw GPUs 5,6 (Ray names it "5"); this process sees 4,5
    ([2], None, 2),        # nothing narrowed anywhere: Ray's index is torch's
    (["GPU-a1"], "GPU-b2,GPU-a1", 1),
])
def test_local_gpu_names_the_gpu_ray_holds_as_this_process_does(ray_ids, own_visible, logical):
    assert local_gpu(ray_ids, own_visible) == logical


def test_a_gpu_ray_holds_that_this_process_cannot_see_is_one_line():
    with pytest.raises(DeviceAllocationError, match=r"Ray holds GPU 6 of this node for rank 0, but this process does "
                       r"not see it \(CUDA_VISIBLE_DEVICES=4,5\)"):
        local_gpu(["6"], "4,5")
