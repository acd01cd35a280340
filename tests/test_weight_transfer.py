"""Weights from the trainer to rollout workers (grpo/inference/weight_transfer.py). Its CUDA IPC path needs
GPUs: on 2xH200 the async runs of benchmarks/gpu_suite.sh (job_05b, job_15b) had every push read back
from the engine with the checksum sent (2 verified, 0 mismatched). Here: the host path every CPU run and
every multi-host cluster takes, and what an IPC message holds."""

import pytest
import ray
import torch

from grpo.inference.generation import weights_checksum
from grpo.inference.weight_transfer import CudaIpcWeights, PublishedWeights, one_host, receive


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


def tied_weights() -> dict:
    """HF-named weights where the LM head is the embedding, as Qwen2.5-0.5B ties them."""
    embedding = torch.randn(16, 4)
    return {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding,
            "model.norm.weight": torch.randn(4)}


def test_a_cpu_snapshot_goes_through_the_object_store_and_arrives_whole(local_ray):
    weights = tied_weights()
    published = PublishedWeights(weights, version=7, cuda_ipc=False)
    assert one_host()  # a local Ray instance is one machine
    message = published.message()
    assert isinstance(message, ray.ObjectRef)
    received = receive(ray.get(message), torch.device("cpu"))  # Ray hands a worker the value of a top-level ref
    assert received.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(received[name], tensor), name
    # the checksum counts the tied weight once, as an engine holding it once reads it back
    assert published.version == 7 and published.checksum == weights_checksum(received) == weights_checksum(
        [weights["model.embed_tokens.weight"], weights["model.norm.weight"]])


def test_an_ipc_message_holds_one_handle_per_tensor_and_maps_tied_names_to_it():
    weights = tied_weights()
    message = CudaIpcWeights.of(weights)
    assert len(message.handles) == 2
    assert message.names == {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "model.norm.weight": 1}
