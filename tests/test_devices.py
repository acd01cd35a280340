"""Table-driven tests for grpo.devices (no GPU needed: visible_gpus is passed explicitly)."""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo.devices import DeviceAllocation, DeviceAllocationError, allocate_devices, physical_id, visible_gpu_ids

BASE = {
    "allow_cpu": False,
    "train": {"use_kl_to_ref": True},
    "train_model": {"num_devices": None, "devices": None},
    "ref_model": {"num_devices": None, "devices": None, "colocate": False},
    "inference_model": {"num_devices": None, "devices": None, "colocate": False, "gpu_memory_utilization": 0.9},
}


def make_cfg(*overrides: str):
    """Base config + Hydra-style dotlist overrides (e.g. ``train_model.num_devices=2``)."""
    return OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.from_dotlist(list(overrides)))


def check_invariants(a: DeviceAllocation, n: int, mode: str, cfg) -> None:
    if a.cpu:
        assert a.train == a.ref == a.inference == []
        assert not a.colocated
        return
    visible = set(range(n))
    for role in ("train", "ref", "inference"):
        ids = getattr(a, role)
        assert len(ids) == len(set(ids)), role
        assert set(ids) <= visible, role
        key = f"{role}_model"
        if role == "ref" and not cfg.train.use_kl_to_ref:
            assert ids == []
            continue
        assert ids, role
        if cfg[key].devices is not None:
            assert ids == list(cfg[key].devices), role
        elif cfg[key].num_devices is not None:
            assert len(ids) == cfg[key].num_devices, role
    shared = set(a.train) & set(a.inference)
    assert a.colocated == bool(shared)
    if mode == "async":
        assert not shared
    assert a.torch_device("train") == torch.device("cuda", a.train[0])
    assert a.torch_device("inference") == torch.device("cuda", a.inference[0])


# id, visible, mode, overrides, expected (train, ref, inference), colocated
OK_CASES = [
    # -- 0 GPUs ----------------------------------------------------------------
    ("0gpu-sync-cpu", 0, "sync", ["allow_cpu=true"], ([], [], []), False),
    ("0gpu-async-cpu", 0, "async", ["allow_cpu=true"], ([], [], []), False),
    ("0gpu-cpu-ignores-num", 0, "sync", ["allow_cpu=true", "train_model.num_devices=2"], ([], [], []), False),
    ("0gpu-cpu-ignores-devices", 0, "async", ["allow_cpu=true", "inference_model.devices=[3]"], ([], [], []), False),
    # -- 1 GPU -----------------------------------------------------------------
    ("1gpu-sync-defaults", 1, "sync", [], ([0], [0], [0]), True),
    ("1gpu-sync-ref-colocate", 1, "sync", ["ref_model.colocate=true"], ([0], [0], [0]), True),
    ("1gpu-sync-no-kl", 1, "sync", ["train.use_kl_to_ref=false"], ([0], [], [0]), True),
    ("1gpu-sync-num1-all", 1, "sync",
     ["train_model.num_devices=1", "inference_model.num_devices=1", "ref_model.num_devices=1"], ([0], [0], [0]), True),
    ("1gpu-sync-explicit-all", 1, "sync",
     ["train_model.devices=[0]", "inference_model.devices=[0]", "ref_model.devices=[0]"], ([0], [0], [0]), True),
    ("1gpu-sync-allow-cpu-ignored", 1, "sync", ["allow_cpu=true"], ([0], [0], [0]), True),
    # -- 2 GPUs ----------------------------------------------------------------
    ("2gpu-sync-defaults", 2, "sync", [], ([0], [0], [1]), False),
    ("2gpu-async-defaults", 2, "async", [], ([0], [0], [1]), False),
    ("2gpu-sync-ref-colocate", 2, "sync", ["ref_model.colocate=true"], ([0], [0], [1]), False),
    ("2gpu-sync-inf-colocate", 2, "sync", ["inference_model.colocate=true"], ([0], [1], [0]), True),
    ("2gpu-sync-explicit-share", 2, "sync",
     ["train_model.devices=[0]", "inference_model.devices=[0]", "inference_model.colocate=true"],
     ([0], [1], [0]), True),
    ("2gpu-sync-explicit-swap", 2, "sync", ["train_model.devices=[1]", "inference_model.devices=[0]"],
     ([1], [1], [0]), False),
    ("2gpu-async-explicit-swap", 2, "async", ["train_model.devices=[1]", "inference_model.devices=[0]"],
     ([1], [1], [0]), False),
    ("2gpu-async-no-kl", 2, "async", ["train.use_kl_to_ref=false"], ([0], [], [1]), False),
    ("2gpu-async-inference-first", 2, "async", ["inference_model.devices=[0]"], ([1], [1], [0]), False),
    # -- 3 GPUs ----------------------------------------------------------------
    ("3gpu-sync-defaults", 3, "sync", [], ([0], [2], [1]), False),
    ("3gpu-async-defaults", 3, "async", [], ([0], [2], [1]), False),
    ("3gpu-async-ref-colocate", 3, "async", ["ref_model.colocate=true"], ([0], [0], [1]), False),
    ("3gpu-sync-train2", 3, "sync", ["train_model.num_devices=2"], ([0, 1], [0, 1], [2]), False),
    ("3gpu-async-inf2", 3, "async", ["inference_model.num_devices=2"], ([0], [0], [1, 2]), False),
    ("3gpu-sync-ref-explicit", 3, "sync", ["ref_model.devices=[0]"], ([1], [0], [2]), False),
    ("3gpu-async-no-kl-train2", 3, "async", ["train.use_kl_to_ref=false", "train_model.num_devices=2"],
     ([0, 1], [], [2]), False),
    # -- 4 GPUs ----------------------------------------------------------------
    ("4gpu-sync-2-1-1", 4, "sync",
     ["train_model.num_devices=2", "ref_model.num_devices=1", "inference_model.num_devices=1"],
     ([0, 1], [3], [2]), False),
    ("4gpu-async-2-1-1", 4, "async",
     ["train_model.num_devices=2", "ref_model.num_devices=1", "inference_model.num_devices=1"],
     ([0, 1], [3], [2]), False),
    ("4gpu-sync-2-1-1-explicit", 4, "sync",
     ["train_model.devices=[0,1]", "ref_model.devices=[2]", "inference_model.devices=[3]"], ([0, 1], [2], [3]), False),
    ("4gpu-async-2-1-1-explicit", 4, "async",
     ["train_model.devices=[0,1]", "ref_model.devices=[2]", "inference_model.devices=[3]"], ([0, 1], [2], [3]), False),
    ("4gpu-async-2-coloc-2", 4, "async",
     ["train_model.num_devices=2", "ref_model.colocate=true", "inference_model.num_devices=2"],
     ([0, 1], [0, 1], [2, 3]), False),
    ("4gpu-sync-ref-colocate-num1", 4, "sync", ["train_model.num_devices=2", "ref_model.colocate=true",
                                                 "ref_model.num_devices=1"], ([0, 1], [0], [2]), False),
    ("4gpu-sync-train3-inf-colocate", 4, "sync", ["train_model.num_devices=3", "inference_model.colocate=true"],
     ([0, 1, 2], [3], [0]), True),
    ("4gpu-async-mixed", 4, "async", ["train_model.num_devices=2", "inference_model.devices=[0]"],
     ([1, 2], [3], [0]), False),
    ("4gpu-sync-no-kl-ref-ignored", 4, "sync",
     ["train.use_kl_to_ref=false", "ref_model.num_devices=1", "ref_model.devices=[0]"], ([0], [], [1]), False),
    # -- 8 GPUs ----------------------------------------------------------------
    ("8gpu-async-4-2-2", 8, "async",
     ["train_model.num_devices=4", "ref_model.num_devices=2", "inference_model.num_devices=2"],
     ([0, 1, 2, 3], [6, 7], [4, 5]), False),
    ("8gpu-sync-4-2-2", 8, "sync",
     ["train_model.num_devices=4", "ref_model.num_devices=2", "inference_model.num_devices=2"],
     ([0, 1, 2, 3], [6, 7], [4, 5]), False),
    ("8gpu-sync-6-coloc-2", 8, "sync",
     ["train_model.num_devices=6", "ref_model.colocate=true", "inference_model.num_devices=2"],
     (list(range(6)), list(range(6)), [6, 7]), False),
    ("8gpu-async-explicit-inf", 8, "async",
     ["train_model.num_devices=4", "ref_model.num_devices=2", "inference_model.devices=[6,7]"],
     ([0, 1, 2, 3], [4, 5], [6, 7]), False),
    ("8gpu-async-explicit-train-high", 8, "async", ["train_model.devices=[4,5,6,7]", "inference_model.num_devices=2"],
     ([4, 5, 6, 7], [2], [0, 1]), False),
    ("8gpu-async-no-kl-7-1", 8, "async", ["train.use_kl_to_ref=false", "train_model.num_devices=7"],
     (list(range(7)), [], [7]), False),
    ("8gpu-sync-all-train-inf-colocate", 8, "sync", ["train_model.num_devices=8", "inference_model.colocate=true"],
     (list(range(8)), list(range(8)), [0]), True),
    ("8gpu-async-defaults", 8, "async", [], ([0], [2], [1]), False),
]


@pytest.mark.parametrize(
    "n,mode,overrides,expected,colocated",
    [c[1:] for c in OK_CASES],
    ids=[c[0] for c in OK_CASES],
)
def test_allocation(n, mode, overrides, expected, colocated):
    cfg = make_cfg(*overrides)
    a = allocate_devices(cfg, visible_gpus=n, mode=mode)
    assert (a.train, a.ref, a.inference) == expected
    assert a.colocated is colocated
    assert a.cpu is (n == 0)
    assert a.mode == mode and a.num_visible == n
    assert a.ref_enabled is bool(cfg.train.use_kl_to_ref)
    check_invariants(a, n, mode, cfg)
    # same result with an explicit id list
    b = allocate_devices(cfg, visible_gpus=list(range(n)), mode=mode)
    assert (b.train, b.ref, b.inference) == expected
    # logging helpers work everywhere
    json.dumps(a.as_dict())
    text = a.describe()
    assert f"mode={mode}" in text
    if not a.cpu:
        for role in ("train", "ref", "inference"):
            assert role in text


# id, visible, mode, overrides, substrings the message must contain, fix (dotlist override; "mode=sync" switches mode)
ERR_CASES = [
    ("0gpu-sync-no-cpu", 0, "sync", [], ["train_model", "0 GPUs"], "allow_cpu=true"),
    ("0gpu-async-no-cpu", 0, "async", [], ["inference_model", "0 GPUs"], "allow_cpu=true"),
    ("1gpu-async", 1, "async", [], ["train_model", "inference_model", ">= 2 GPUs", "sync script"], "mode=sync"),
    ("1gpu-sync-train2", 1, "sync", ["train_model.num_devices=2"], ["train_model"], "train_model.num_devices=1"),
    ("1gpu-sync-inf2", 1, "sync", ["inference_model.num_devices=2"], ["inference_model"],
     "inference_model.num_devices=1"),
    ("1gpu-sync-devices-out-of-range", 1, "sync", ["train_model.devices=[1]"], ["train_model", "[1]", "out of range"],
     "train_model.devices=[0]"),
    ("2gpu-async-inf-colocate", 2, "async", ["inference_model.colocate=true"], ["inference_model", "async"],
     "inference_model.colocate=false"),
    ("2gpu-sync-share-without-colocate", 2, "sync", ["train_model.devices=[0]", "inference_model.devices=[0]"],
     ["train_model", "inference_model", "[0]"], "inference_model.colocate=true"),
    ("2gpu-async-share", 2, "async", ["train_model.devices=[0]", "inference_model.devices=[0]"],
     ["train_model", "inference_model", "[0]", "never share"], "inference_model.devices=[1]"),
    ("2gpu-async-share-even-with-both-lists", 2, "async", ["train_model.devices=[0,1]", "inference_model.devices=[1]"],
     ["train_model", "inference_model", "[1]"], "train_model.devices=[0]"),
    ("2gpu-sync-train-takes-all", 2, "sync", ["train_model.num_devices=2"], ["inference_model", "train_model=[0,1]"],
     "inference_model.colocate=true"),
    ("2gpu-sync-train-takes-all-shrink", 2, "sync", ["train_model.num_devices=2"], ["inference_model"],
     "train_model.num_devices=1"),
    ("2gpu-async-train-takes-all", 2, "async", ["train_model.num_devices=2"], ["inference_model", "async"],
     "train_model.num_devices=1"),
    ("2gpu-sync-ref-on-train", 2, "sync", ["train_model.devices=[0]", "ref_model.devices=[0]"],
     ["ref_model", "train_model", "[0]"], "ref_model.colocate=true"),
    ("2gpu-sync-ref-claims-first", 2, "sync", ["ref_model.devices=[0]"], ["inference_model", "ref_model=[0]"],
     "ref_model.devices=null"),
    ("2gpu-async-ref-claims-inference-gpu", 2, "async", ["ref_model.devices=[1]"], ["inference_model", "ref_model=[1]"],
     "ref_model.devices=null"),
    ("2gpu-sync-ref-on-inference", 2, "sync",
     ["train_model.devices=[0]", "ref_model.devices=[1]", "inference_model.devices=[1]"],
     ["ref_model", "inference_model", "[1]"], "ref_model.devices=null"),
    ("2gpu-sync-ref-num-short", 2, "sync", ["ref_model.num_devices=1"], ["ref_model"], "ref_model.colocate=true"),
    ("3gpu-both-keys-train", 3, "sync", ["train_model.num_devices=1", "train_model.devices=[0]"],
     ["train_model", "exclusive"], "train_model.num_devices=null"),
    ("3gpu-both-keys-inference", 3, "async", ["inference_model.num_devices=1", "inference_model.devices=[2]"],
     ["inference_model", "exclusive"], "inference_model.devices=null"),
    ("3gpu-both-keys-ref", 3, "sync", ["ref_model.num_devices=1", "ref_model.devices=[2]"],
     ["ref_model", "exclusive"], "ref_model.num_devices=null"),
    ("3gpu-num0-train", 3, "sync", ["train_model.num_devices=0"], ["train_model", ">= 1"], "train_model.num_devices=1"),
    ("3gpu-neg-inference", 3, "async", ["inference_model.num_devices=-1"], ["inference_model", ">= 1"],
     "inference_model.num_devices=1"),
    ("3gpu-num0-ref", 3, "sync", ["ref_model.num_devices=0"], ["ref_model", ">= 1"], "ref_model.num_devices=1"),
    ("3gpu-dup-devices", 3, "sync", ["train_model.devices=[0,0]"], ["train_model", "more than once"],
     "train_model.devices=[0]"),
    ("3gpu-empty-devices", 3, "sync", ["inference_model.devices=[]"], ["inference_model"],
     "inference_model.devices=null"),
    ("3gpu-ref-colocate-too-many", 3, "sync",
     ["ref_model.colocate=true", "ref_model.num_devices=2"], ["ref_model", "train_model"], "ref_model.num_devices=1"),
    ("4gpu-out-of-range-inference", 4, "async", ["inference_model.devices=[4]"], ["inference_model", "[4]"],
     "inference_model.devices=[0]"),
    ("4gpu-sync-train5", 4, "sync", ["train_model.num_devices=5"], ["train_model", "requests 5"],
     "train_model.num_devices=3"),
    ("4gpu-async-train4", 4, "async", ["train_model.num_devices=4"], ["inference_model", "train_model=[0,1,2,3]"],
     "train_model.num_devices=3"),
    ("4gpu-sync-2-2-ref1", 4, "sync",
     ["train_model.num_devices=2", "inference_model.num_devices=2", "ref_model.num_devices=1"],
     ["ref_model", "train_model=[0,1]", "inference_model=[2,3]"], "ref_model.colocate=true"),
    ("4gpu-inf-colocate-too-many", 4, "sync", ["inference_model.colocate=true", "inference_model.num_devices=2"],
     ["inference_model", "train_model"], "train_model.num_devices=2"),
    ("4gpu-gpu-mem-util", 4, "sync", ["inference_model.gpu_memory_utilization=1.5"], ["inference_model"],
     "inference_model.gpu_memory_utilization=0.5"),
    ("8gpu-async-overlap", 8, "async", ["train_model.devices=[0,1,2,3]", "inference_model.devices=[3,4,5,6,7]"],
     ["train_model", "inference_model", "[3]"], "inference_model.devices=[4,5,6,7]"),
    ("8gpu-async-overlap-shrink-train", 8, "async",
     ["train_model.devices=[0,1,2,3]", "inference_model.devices=[3,4,5,6,7]"], ["train_model"],
     "train_model.devices=[0,1,2]"),
    ("3gpu-async-overlap-swap", 3, "async", ["train_model.devices=[0,1]", "inference_model.devices=[1]"],
     ["train_model", "inference_model", "[1]"], "inference_model.devices=[2]"),
    ("8gpu-async-inference9", 8, "async", ["inference_model.num_devices=9"], ["inference_model", "requests 9"],
     "inference_model.num_devices=7"),
    ("8gpu-sync-ref-explicit-overlap", 8, "sync", ["train_model.devices=[0,1,2,3]", "ref_model.devices=[3,4]"],
     ["ref_model", "train_model", "[3]"], "ref_model.colocate=true"),
    ("8gpu-async-train-all-explicit", 8, "async", ["train_model.devices=[0,1,2,3,4,5,6,7]"],
     ["inference_model", "train_model=[0,1,2,3,4,5,6,7]"], "train_model.devices=[0,1,2,3,4,5,6]"),
]


@pytest.mark.parametrize(
    "n,mode,overrides,needles,fix",
    [c[1:] for c in ERR_CASES],
    ids=[c[0] for c in ERR_CASES],
)
def test_allocation_errors(n, mode, overrides, needles, fix):
    cfg = make_cfg(*overrides)
    with pytest.raises(DeviceAllocationError) as info:
        allocate_devices(cfg, visible_gpus=n, mode=mode)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert f"{n} GPU" in msg, msg  # says how many GPUs are visible
    assert "Fix:" in msg and fix in msg, (fix, msg)
    # the suggested override really fixes it (an exact Hydra override, not prose)
    if fix == "mode=sync":
        mode = "sync"
    else:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([fix]))
    a = allocate_devices(cfg, visible_gpus=n, mode=mode)
    check_invariants(a, n, mode, cfg)


def test_bad_mode():
    with pytest.raises(DeviceAllocationError, match="mode"):
        allocate_devices(make_cfg(), visible_gpus=2, mode="pipelined")


def test_allow_cpu_under_device_section():
    cfg = make_cfg("device.allow_cpu=true")
    del cfg["allow_cpu"]
    a = allocate_devices(cfg, visible_gpus=0)
    assert a.cpu and a.torch_device("train") == torch.device("cpu")
    assert "CPU" in a.describe()


def test_minimal_and_duck_typed_configs():
    # missing sections/keys behave as null; struct mode is fine; plain namespaces work
    cfg = OmegaConf.create({"train_model": {}, "inference_model": {}})
    OmegaConf.set_struct(cfg, True)
    a = allocate_devices(cfg, visible_gpus=2, mode="async")
    assert (a.train, a.ref, a.inference) == ([0], [0], [1])
    ns = SimpleNamespace(
        train_model=SimpleNamespace(num_devices=2, devices=None),
        ref_model=SimpleNamespace(num_devices=None, devices=None, colocate=True),
        inference_model=SimpleNamespace(num_devices=None, devices=[3], colocate=False, gpu_memory_utilization=0.5),
        train=SimpleNamespace(use_kl_to_ref=True),
    )
    a = allocate_devices(ns, visible_gpus=4, mode="async")
    assert (a.train, a.ref, a.inference) == ([0, 1], [0, 1], [3])
    assert a.gpu_memory_utilization == 0.5
    d = allocate_devices({"train_model": {"devices": [1]}}, visible_gpus=2)
    assert (d.train, d.inference) == ([1], [0])


def test_missing_value_is_null():
    cfg = OmegaConf.create({"train_model": {"num_devices": "???", "devices": None}})
    assert allocate_devices(cfg, visible_gpus=1).train == [0]


def test_single_gpu_sync_records_memory_cap():
    a = allocate_devices(make_cfg("inference_model.gpu_memory_utilization=0.35"), visible_gpus=1)
    assert a.colocated and a.gpu_memory_utilization == 0.35
    assert "0.35" in a.describe() and a.as_dict()["gpu_memory_utilization"] == 0.35
    assert a.shared_with("inference") == ["train", "ref"]


def test_torch_device_roles():
    a = allocate_devices(make_cfg("train_model.num_devices=2", "train.use_kl_to_ref=false"), visible_gpus=4)
    assert a.torch_device("train") == torch.device("cuda:0")
    assert a.torch_device("train_model") == torch.device("cuda:0")
    assert a.torch_device("inference") == torch.device("cuda:2")
    assert a.torch_device("ref") == torch.device("cpu")  # no reference model
    with pytest.raises(ValueError):
        a.torch_device("critic")


def test_describe_shows_physical_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    a = allocate_devices(make_cfg("train_model.num_devices=2"), visible_gpus=4, mode="async")
    text = a.describe()
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in text
    assert re.search(r"train\s+0,1\s+4,5\s+cuda:0", text), text
    assert re.search(r"inference\s+2\s+6\s+cuda:2", text), text
    assert a.as_dict()["physical"] == {"0": 4, "1": 5, "2": 6, "3": 7}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "physical" not in allocate_devices(make_cfg(), visible_gpus=2).describe()


@pytest.mark.parametrize(
    "env,logical,expected",
    [
        (None, 3, 3),
        ("4,5,6", 0, 4),
        ("4,5,6", 2, 6),
        (" 2 , 0 ", 1, 0),
        ("GPU-1a2b,GPU-3c4d", 1, "GPU-3c4d"),
        ("MIG-abc", 0, "MIG-abc"),
    ],
)
def test_physical_id(monkeypatch, env, logical, expected):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert physical_id(logical) == expected
    if env is not None:
        assert physical_id(logical, env=env) == expected


@pytest.mark.parametrize("env,logical", [("4,5", 2), ("0,-1,2", 1), ("", 0)])
def test_physical_id_out_of_range(env, logical):
    with pytest.raises(DeviceAllocationError):
        physical_id(logical, env=env)


def test_visible_gpu_ids_uses_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpu_ids() == [0, 1, 2]
    a = allocate_devices(make_cfg(), mode="async")  # visible_gpus=None -> detect
    assert (a.train, a.ref, a.inference) == ([0], [2], [1])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert visible_gpu_ids() == []
    with pytest.raises(DeviceAllocationError, match="allow_cpu=true"):
        allocate_devices(make_cfg())


@pytest.mark.parametrize("bad", [-1, True, [0, 0], [0, -2]])
def test_bad_visible_gpus(bad):
    with pytest.raises(DeviceAllocationError):
        allocate_devices(make_cfg(), visible_gpus=bad)


def test_visible_gpus_subset_list():
    # logical ids need not start at 0 when the caller passes a subset
    a = allocate_devices(make_cfg(), visible_gpus=[2, 3], mode="async")
    assert (a.train, a.ref, a.inference) == ([2], [2], [3])
    with pytest.raises(DeviceAllocationError, match=r"train_model\.devices=\[2\]"):
        allocate_devices(make_cfg("train_model.devices=[0]"), visible_gpus=[2, 3])


def test_sweep_invariants():
    """Every small combination either satisfies the invariants or fails with a Fix: override."""
    nums = [None, 1, 2]
    count = 0
    for tn, rn, inn, rc, ic, kl in itertools.product(nums, nums, nums, [False, True], [False, True], [True, False]):
        cfg = OmegaConf.create(BASE)
        cfg.train_model.num_devices = tn
        cfg.ref_model.num_devices = rn
        cfg.inference_model.num_devices = inn
        cfg.ref_model.colocate = rc
        cfg.inference_model.colocate = ic
        cfg.train.use_kl_to_ref = kl
        for n, mode in itertools.product([0, 1, 2, 3, 4], ["sync", "async"]):
            count += _sweep_one(cfg, n, mode, rc)
    assert count > 100


def _sweep_one(cfg, n, mode, rc) -> int:
    try:
        a = allocate_devices(cfg, visible_gpus=n, mode=mode)
    except DeviceAllocationError as e:
        msg = str(e)
        assert "Fix:" in msg and re.search(r"(train|ref|inference)_model|allow_cpu", msg), msg
        assert f"{n} GPU" in msg, msg
        return 0
    check_invariants(a, n, mode, cfg)
    if a.ref and not a.cpu and mode == "async":
        assert not set(a.ref) & set(a.inference)  # ref never on an async inference GPU
    if not rc and a.ref and not a.cpu and set(a.ref) & set(a.train):
        assert cfg.ref_model.num_devices is None or n == 1  # only the "GPUs short" fallback shares
    return 1
