"""grpo.process.devices without a GPU: ``visible_gpus`` stands in for the machine."""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from grpo.process import errors
from grpo.process.allocation import DeviceAllocation
from grpo.process import devices
from grpo.process.devices import PlacementSettings
from grpo.process.errors import DeviceAllocationError
from grpo.process.launch import agree_with_launcher
from grpo.process.world import World

BASE = {
    "allow_cpu": False,
    "train": {"use_kl_to_ref": True, "num_collectors": 1},
    "train_model": {"num_devices": None, "devices": None},
    "ref_model": {"num_devices": None, "devices": None, "colocate": False},
    "inference_model": {"num_devices": None, "devices": None, "colocate": False, "gpu_memory_utilization": 0.9},
}
SYNC, ASYNC = False, True  # dedicated_inference


def allocate_devices(cfg, **kwargs) -> DeviceAllocation:
    """As ``check_start`` calls it: on the config's placement settings."""
    return devices.allocate_devices(PlacementSettings.from_config(cfg), **kwargs)


def trainer_ranks(cfg) -> int | None:
    return devices.trainer_ranks(PlacementSettings.from_config(cfg))


def make_cfg(*overrides: str, base: dict = BASE) -> dict:
    """A plain-dict config: ``base`` plus Hydra-style overrides such as ``train_model.devices=[0,1]``."""
    cfg = copy.deepcopy(base)
    for override in overrides:
        key, value = override.split("=", 1)
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)  # the value as Hydra reads it: null, true, 2, [0,1], 0.5
    return cfg


def allocate(cfg, n, dedicated: bool) -> DeviceAllocation:
    """As the scripts call it: sync starts one engine, async one per collector."""
    engines = cfg["train"]["num_collectors"] if dedicated else 1
    return allocate_devices(cfg, inference_engines=engines, dedicated_inference=dedicated, visible_gpus=n)


def check_invariants(a: DeviceAllocation, n: int, dedicated: bool, cfg) -> None:
    if a.cpu:
        assert a.train == a.ref == a.inference == [] and not a.colocated
        return
    t, r, i = set(a.train), set(a.ref), set(a.inference)
    for role in ("train", "ref", "inference"):
        ids, section = getattr(a, role), cfg[f"{role}_model"]
        assert len(ids) == len(set(ids)) and set(ids) <= set(range(n)), role
        if role == "ref" and not cfg["train"]["use_kl_to_ref"]:
            assert ids == []
            continue
        assert ids, role
        if section["devices"] is not None:
            assert ids == list(section["devices"]), role
        elif section["num_devices"] is not None:
            assert len(ids) == section["num_devices"], role
    assert a.colocated == bool(t & i)
    if dedicated:
        assert not t & i
    elif n >= 2 and not cfg["inference_model"]["colocate"]:
        assert not t & i
    assert len(i) <= (cfg["train"]["num_collectors"] if dedicated else 1)  # no idle inference GPU
    assert r & i <= t  # ref never on an inference-only GPU
    if r & t and n >= 2 and not cfg["ref_model"]["colocate"]:  # only the "no free GPU left" fallback
        assert cfg["ref_model"]["num_devices"] is None and cfg["ref_model"]["devices"] is None
        assert set(range(n)) <= t | i
    assert a.torch_device("train") == torch.device("cuda", a.train[0])
    assert a.torch_device("inference") == torch.device("cuda", a.inference[0])


# id, visible GPUs, dedicated_inference, overrides, expected (train, ref, inference), colocated
OK_CASES = [
    ("0gpu-sync-cpu", 0, SYNC, ["allow_cpu=true"], ([], [], []), False),
    ("0gpu-async-cpu-ignores-placement", 0, ASYNC, ["allow_cpu=true", "inference_model.devices=[3]"],
     ([], [], []), False),
    ("1gpu-sync-all-share", 1, SYNC, [], ([0], [0], [0]), True),
    ("1gpu-sync-no-kl", 1, SYNC, ["train.use_kl_to_ref=false"], ([0], [], [0]), True),
    ("1gpu-sync-explicit", 1, SYNC, ["train_model.devices=[0]", "inference_model.devices=[0]", "ref_model.devices=[0]"],
     ([0], [0], [0]), True),
    ("1gpu-sync-ref-num1", 1, SYNC, ["ref_model.num_devices=1"], ([0], [0], [0]), True),
    ("2gpu-sync-defaults", 2, SYNC, [], ([0], [0], [1]), False),
    ("2gpu-async-defaults", 2, ASYNC, [], ([0], [0], [1]), False),
    ("2gpu-sync-inf-colocate", 2, SYNC, ["inference_model.colocate=true"], ([0], [1], [0]), True),
    ("2gpu-sync-explicit-share", 2, SYNC,
     ["train_model.devices=[0]", "inference_model.devices=[0]", "inference_model.colocate=true"],
     ([0], [1], [0]), True),
    ("2gpu-async-explicit-swap", 2, ASYNC, ["train_model.devices=[1]", "inference_model.devices=[0]"],
     ([1], [1], [0]), False),
    ("2gpu-async-inference-claims-first", 2, ASYNC, ["inference_model.devices=[0]"], ([1], [1], [0]), False),
    ("2gpu-async-no-kl", 2, ASYNC, ["train.use_kl_to_ref=false"], ([0], [], [1]), False),
    ("3gpu-sync-ref-free-gpu", 3, SYNC, [], ([0], [2], [1]), False),
    ("3gpu-async-ref-colocate", 3, ASYNC, ["ref_model.colocate=true"], ([0], [0], [1]), False),
    ("3gpu-sync-train2-ref-falls-back", 3, SYNC, ["train_model.num_devices=2"], ([0, 1], [0, 1], [2]), False),
    ("3gpu-sync-ref-explicit", 3, SYNC, ["ref_model.devices=[0]"], ([1], [0], [2]), False),
    ("3gpu-async-2-engines", 3, ASYNC, ["inference_model.num_devices=2", "train.num_collectors=2"],
     ([0], [0], [1, 2]), False),
    ("3gpu-async-engines-share-a-gpu", 3, ASYNC, ["inference_model.num_devices=2", "train.num_collectors=5"],
     ([0], [0], [1, 2]), False),
    ("4gpu-sync-2-1-1", 4, SYNC, ["train_model.num_devices=2", "ref_model.num_devices=1"], ([0, 1], [3], [2]), False),
    ("4gpu-async-explicit", 4, ASYNC,
     ["train_model.devices=[0,1]", "ref_model.devices=[2]", "inference_model.devices=[3]"], ([0, 1], [2], [3]), False),
    ("4gpu-sync-ref-colocate-num1", 4, SYNC,
     ["train_model.num_devices=2", "ref_model.colocate=true", "ref_model.num_devices=1"], ([0, 1], [0], [2]), False),
    ("4gpu-sync-train3-inf-colocate", 4, SYNC, ["train_model.num_devices=3", "inference_model.colocate=true"],
     ([0, 1, 2], [3], [0]), True),
    ("4gpu-sync-no-kl-ref-keys-ignored", 4, SYNC,
     ["train.use_kl_to_ref=false", "ref_model.num_devices=1", "ref_model.devices=[0]"], ([0], [], [1]), False),
    ("8gpu-async-4-2-2", 8, ASYNC,
     ["train_model.num_devices=4", "ref_model.num_devices=2", "inference_model.num_devices=2",
      "train.num_collectors=2"],
     ([0, 1, 2, 3], [6, 7], [4, 5]), False),
    ("8gpu-async-explicit-train-high", 8, ASYNC, ["train_model.devices=[4,5,6,7]", "inference_model.num_devices=2",
                                                  "train.num_collectors=2"], ([4, 5, 6, 7], [2], [0, 1]), False),
    ("8gpu-sync-all-train-inf-colocate", 8, SYNC, ["train_model.num_devices=8", "inference_model.colocate=true"],
     (list(range(8)), list(range(8)), [0]), True),
]


@pytest.mark.parametrize("n,dedicated,overrides,expected,colocated", [c[1:] for c in OK_CASES],
                         ids=[c[0] for c in OK_CASES])
def test_allocation(n, dedicated, overrides, expected, colocated):
    cfg = make_cfg(*overrides)
    a = allocate(cfg, n, dedicated)
    assert (a.train, a.ref, a.inference) == expected
    assert a.colocated is colocated and a.cpu is (n == 0) and a.num_visible == n
    check_invariants(a, n, dedicated, cfg)
    b = allocate_devices(cfg, inference_engines=8, dedicated_inference=dedicated, visible_gpus=list(range(n)))
    assert (b.train, b.ref, b.inference) == expected  # an id list is the same machine; spare engines change nothing
    dict_config = OmegaConf.create(cfg)
    OmegaConf.set_struct(dict_config, True)  # as Hydra hands it over
    assert allocate(dict_config, n, dedicated) == a


def fix_options(msg: str, dedicated: bool) -> list[list[str]]:
    """The Hydra overrides of each alternative after ``Fix:`` (prose-only alternatives dropped)."""
    options = []
    for option in msg.split("Fix: ", 1)[1].split(" or "):
        if "async script" in option and not dedicated:
            continue  # a switch of script, not an override of this one
        overrides = [o.rstrip(",") for o in re.findall(r"[\w.]+=\S+", option)]
        if overrides:
            options.append(overrides)
    return options


# id, visible GPUs, dedicated_inference, overrides, text the message must hold, the fix the test applies
# ("sync" = run the sync script)
ERR_CASES = [
    ("0gpu-no-cpu", 0, SYNC, [], ["No GPU visible"], "allow_cpu=true"),
    ("1gpu-async", 1, ASYNC, [], ["async script", "1 GPU(s) visible", "sync script"], "sync"),
    ("2gpu-async-inf-colocate", 2, ASYNC, ["inference_model.colocate=true"], ["never"],
     "inference_model.colocate=false"),
    ("both-keys", 3, SYNC, ["train_model.num_devices=1", "train_model.devices=[0]"], ["exclusive"],
     "train_model.devices=null"),
    ("num0", 3, SYNC, ["ref_model.num_devices=0"], ["ref_model.num_devices=0", ">= 1"], "ref_model.num_devices=1"),
    ("num-not-int", 3, ASYNC, ["inference_model.num_devices=two"], ["'two'"], "inference_model.num_devices=1"),
    ("devices-not-list", 3, SYNC, ["train_model.devices=0"], ["list of GPU ids"], "train_model.devices=null"),
    ("devices-empty", 3, SYNC, ["inference_model.devices=[]"], ["non-empty"], "inference_model.devices=null"),
    ("devices-dup", 3, SYNC, ["train_model.devices=[0,0]"], ["twice"], "train_model.devices=[0]"),
    ("colocate-not-bool", 3, SYNC, ["ref_model.colocate=maybe"], ["true or false"], "ref_model.colocate=false"),
    ("kl-not-bool", 3, SYNC, ["train.use_kl_to_ref=1"], ["train.use_kl_to_ref"], "train.use_kl_to_ref=true"),
    ("gpu-mem-util", 2, SYNC, ["inference_model.gpu_memory_utilization=1.5"], ["(0, 1]"],
     "inference_model.gpu_memory_utilization=0.5"),
    ("out-of-range", 2, SYNC, ["train_model.devices=[1,2]"], ["[2]", "2 GPU(s) visible"], "train_model.devices=[1]"),
    ("out-of-range-null", 4, ASYNC, ["inference_model.devices=[4]"], ["[4]"], "inference_model.devices=null"),
    # one engine per inference GPU
    ("sync-inference2", 2, SYNC, ["inference_model.num_devices=2"], ["one engine on one GPU", "1 would idle",
                                                                    "async script with train.num_collectors=2"],
     "inference_model.num_devices=1"),
    ("sync-inference-devices2", 3, SYNC, ["inference_model.devices=[1,2]"], ["one engine"],
     "inference_model.devices=[1]"),
    ("async-inference2-1-collector", 3, ASYNC, ["inference_model.num_devices=2"], ["train.num_collectors=1", "idle"],
     "inference_model.num_devices=1"),
    ("async-inference2-more-collectors", 3, ASYNC, ["inference_model.num_devices=2"], ["idle"],
     "train.num_collectors=2"),
    # explicit lists that overlap
    ("sync-share-without-colocate", 2, SYNC, ["train_model.devices=[0]", "inference_model.devices=[0]"],
     ["share GPU(s) [0]"], "inference_model.colocate=true"),
    ("async-share", 2, ASYNC, ["train_model.devices=[0]", "inference_model.devices=[0]"], ["never shares"],
     "inference_model.devices=null"),
    ("async-share-shrink-train", 2, ASYNC, ["train_model.devices=[0,1]", "inference_model.devices=[1]"], ["[1]"],
     "train_model.devices=[0]"),
    ("async-share-swap", 8, ASYNC, ["train_model.devices=[0,1,2,3]", "inference_model.devices=[3,4]",
                                    "train.num_collectors=2"], ["[3]"], "inference_model.devices=[4]"),
    ("ref-on-train", 2, SYNC, ["train_model.devices=[0]", "ref_model.devices=[0]"], ["ref_model.colocate=true"],
     "ref_model.colocate=true"),
    ("ref-on-train-null", 3, ASYNC, ["train_model.devices=[0,1]", "ref_model.devices=[1]"], ["[1]"],
     "ref_model.devices=null"),
    ("ref-on-inference", 2, SYNC, ["train_model.devices=[0]", "ref_model.devices=[1]", "inference_model.devices=[1]"],
     ["only share the train GPUs"], "ref_model.devices=null"),
    # not enough GPUs for the num_devices requests
    ("train-more-than-visible", 4, SYNC, ["train_model.num_devices=5"], ["train_model needs 5", "4 are unclaimed"],
     "train_model.num_devices=3"),
    ("sync-train-takes-all", 2, SYNC, ["train_model.num_devices=2"], ["inference_model needs 1"],
     "inference_model.colocate=true"),
    ("async-train-takes-all", 4, ASYNC, ["train_model.num_devices=4"], ["train_model needs 4"],
     "train_model.num_devices=3"),
    ("ref-claims-the-inference-gpu", 2, ASYNC, ["ref_model.devices=[1]"], ["claimed: ref_model.devices=[1]"],
     "ref_model.devices=null"),
    ("ref-num-short", 4, SYNC, ["train_model.num_devices=2", "ref_model.num_devices=2"], ["ref_model needs 2"],
     "ref_model.num_devices=1"),
    ("ref-num-short-colocate", 4, SYNC, ["train_model.num_devices=2", "ref_model.num_devices=2"], ["ref_model"],
     "ref_model.colocate=true"),
    ("ref-num-short-default", 2, ASYNC, ["ref_model.num_devices=1"], ["ref_model"], "ref_model.num_devices=null"),
    ("several-must-shrink", 2, ASYNC, ["train_model.num_devices=2", "inference_model.num_devices=2",
                                       "train.num_collectors=2"], ["train_model needs 2", "inference_model needs 2"],
     "train_model.num_devices=null inference_model.num_devices=null"),
    # ref on the train GPUs asks for more than train has
    ("ref-colocate-too-many", 3, SYNC, ["ref_model.colocate=true", "ref_model.num_devices=2"], ["train_model has 1"],
     "ref_model.num_devices=1"),
    ("ref-colocate-grow-train", 3, SYNC, ["ref_model.colocate=true", "ref_model.num_devices=2"], ["ref_model"],
     "train_model.num_devices=2"),
]


@pytest.mark.parametrize("n,dedicated,overrides,needles,fix", [c[1:] for c in ERR_CASES], ids=[c[0] for c in ERR_CASES])
def test_errors_name_a_fix_that_works(n, dedicated, overrides, needles, fix):
    cfg = make_cfg(*overrides)
    with pytest.raises(DeviceAllocationError) as info:
        allocate(cfg, n, dedicated)
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    if fix == "sync":
        assert "sync script" in msg
        dedicated = False
    else:
        assert fix.split() in fix_options(msg, dedicated), (fix, msg)
        cfg = make_cfg(*fix.split(), base=cfg)
    check_invariants(allocate(cfg, n, dedicated), n, dedicated, cfg)


def follow_fixes(cfg, n, dedicated, msg: str) -> None:
    """Apply each fix ``msg`` names, then the first fix of any error left (a config may hold several
    mistakes): every path must end in a valid allocation without meeting the same error twice."""
    for fix in fix_options(msg, dedicated):
        fixed, seen = make_cfg(*fix, base=cfg), [msg]
        while True:
            try:
                check_invariants(allocate(fixed, n, dedicated), n, dedicated, fixed)
                break
            except DeviceAllocationError as err:
                assert str(err) not in seen and len(seen) < 6, (fix, seen, str(err))
                seen.append(str(err))
                assert fix_options(str(err), dedicated), str(err)
                fixed = make_cfg(*fix_options(str(err), dedicated)[0], base=fixed)


def sweep(keys: dict[str, list], visible: list[int]) -> tuple[int, int]:
    """Every combination allocates within the rules, or fails in one line whose fixes lead there."""
    allocated = failed = 0
    for values in itertools.product(*keys.values()):
        cfg = make_cfg(*(f"{key}={value}" for key, value in zip(keys, values)))
        for n, dedicated in itertools.product(visible, [SYNC, ASYNC]):
            try:
                check_invariants(allocate(cfg, n, dedicated), n, dedicated, cfg)
                allocated += 1
                continue
            except DeviceAllocationError as err:
                msg = str(err)
            failed += 1
            assert "\n" not in msg and "Fix: " in msg, msg
            assert fix_options(msg, dedicated) or "run the sync script" in msg, msg
            follow_fixes(cfg, n, dedicated, msg)
    return allocated, failed


def test_sweep_num_devices():
    nums, flags = ["null", 1, 2], ["false", "true"]
    allocated, failed = sweep({"train_model.num_devices": nums, "ref_model.num_devices": nums,
                               "inference_model.num_devices": nums, "ref_model.colocate": flags,
                               "inference_model.colocate": flags, "train.use_kl_to_ref": flags,
                               "train.num_collectors": [1, 2]}, visible=[0, 1, 2, 3, 4])
    assert allocated > 500 and failed > 500, (allocated, failed)


def test_sweep_explicit_devices():
    ids, flags = ["null", "[0]", "[1]", "[0,1]", "[2]", "[1,2]"], ["false", "true"]
    allocated, failed = sweep({"train_model.devices": ids, "ref_model.devices": ids, "inference_model.devices": ids,
                               "ref_model.colocate": flags, "inference_model.colocate": flags,
                               "train.num_collectors": [1, 2]}, visible=[1, 2, 3])
    assert allocated > 300 and failed > 300, (allocated, failed)


@pytest.mark.parametrize("n,dedicated,expected", [(1, SYNC, ([0], [0], [0])), (2, SYNC, ([0], [0], [1])),
                                                  (2, ASYNC, ([0], [0], [1])), (4, ASYNC, ([0], [0], [1]))])
def test_shipped_config(n, dedicated, expected):
    cfg = OmegaConf.load(Path(__file__).parents[1] / "config" / "grpo_gsm8k.yaml")
    a = allocate(cfg, n, dedicated)
    assert (a.train, a.ref, a.inference) == expected and a.gpu_memory_utilization == 0.5
    with pytest.raises(DeviceAllocationError, match="allow_cpu=true"):
        allocate(cfg, 0, dedicated)


def test_no_gpu_and_no_allow_cpu_is_an_error_even_for_async():
    with pytest.raises(DeviceAllocationError, match="allow_cpu=true"):
        allocate(make_cfg(), 0, ASYNC)
    a = allocate(make_cfg("allow_cpu=true"), 0, ASYNC)
    assert a.cpu and all(a.torch_device(r) == torch.device("cpu") for r in ("train", "ref", "inference"))


def test_error_is_the_one_of_grpo_errors():
    assert issubclass(DeviceAllocationError, errors.UserError)
    with pytest.raises(errors.UserError):
        allocate(make_cfg("train_model.devices=[5]"), 2, SYNC)


def test_plain_dict_with_missing_sections():
    a = allocate_devices({"train_model": {"devices": [1]}}, inference_engines=1, dedicated_inference=False,
                         visible_gpus=2)
    assert (a.train, a.ref, a.inference) == ([1], [1], [0])  # use_kl_to_ref defaults to true
    a = allocate_devices({}, inference_engines=1, dedicated_inference=True, visible_gpus=3)
    assert (a.train, a.ref, a.inference) == ([0], [2], [1])


def test_visible_gpus_detects_with_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    a = allocate_devices(make_cfg(), inference_engines=1, dedicated_inference=True)
    assert (a.train, a.ref, a.inference, a.num_visible) == ([0], [2], [1], 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceAllocationError, match="No GPU visible"):
        allocate_devices(make_cfg(), inference_engines=1, dedicated_inference=False)


def test_visible_gpus_subset_list():
    a = allocate_devices(make_cfg(), inference_engines=1, dedicated_inference=True, visible_gpus=[2, 3])
    assert (a.train, a.ref, a.inference) == ([2], [2], [3])
    with pytest.raises(DeviceAllocationError, match=r"Fix: train_model\.devices=null"):
        allocate_devices(make_cfg("train_model.devices=[0]"), inference_engines=1, dedicated_inference=False,
                         visible_gpus=[2, 3])


@pytest.mark.parametrize("visible,engines", [(-1, 1), (True, 1), ([0, 0], 1), ([0, -2], 1), (2, 0), (2, True)])
def test_bad_arguments_are_programming_errors(visible, engines):
    with pytest.raises(ValueError) as info:
        allocate_devices(make_cfg(), inference_engines=engines, dedicated_inference=False, visible_gpus=visible)
    assert not isinstance(info.value, DeviceAllocationError)


def test_torch_device_roles():
    a = allocate(make_cfg("train_model.num_devices=2", "train.use_kl_to_ref=false"), 4, SYNC)
    assert a.torch_device("train") == torch.device("cuda:0")
    assert a.torch_device("inference") == torch.device("cuda:2")
    assert a.torch_device("ref") == torch.device("cpu")  # no reference model
    with pytest.raises(ValueError, match="critic"):
        a.torch_device("critic")


def test_describe_and_as_dict(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    a = allocate(make_cfg("train_model.num_devices=2", "inference_model.colocate=true",
                          "inference_model.gpu_memory_utilization=0.35"), 3, SYNC)
    text = a.describe()
    assert text.startswith("Devices (3 GPU(s) visible, CUDA_VISIBLE_DEVICES=4,5,6)")
    assert re.search(r"^  train +gpu 0,1\b", text, re.M), text
    assert re.search(r"^  ref +gpu 2\b", text, re.M), text
    assert re.search(r"^  inference +gpu 0 .*0\.35", text, re.M), text
    d = a.as_dict()
    assert d == json.loads(json.dumps(d))
    assert (d["train"], d["ref"], d["inference"], d["colocated"], d["gpu_memory_utilization"]) == (
        [0, 1], [2], [0], True, 0.35)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cpu = allocate(make_cfg("allow_cpu=true"), 0, SYNC).describe()
    assert "CUDA_VISIBLE_DEVICES" not in cpu and "CPU" in cpu


def test_ref_fallback_is_noted():
    a = allocate(make_cfg("train_model.num_devices=2"), 3, SYNC)
    assert a.ref == a.train and "no free GPU" in a.notes["ref"] and "no free GPU" in a.describe()
    assert "colocate" in allocate(make_cfg("ref_model.colocate=true"), 3, SYNC).notes["ref"]


@pytest.mark.parametrize("overrides,ranks,expected", [
    # 2 ranks on 2 train GPUs, the reference beside each, generation on GPU 0 (rank 0's engine)
    (["train_model.num_devices=2", "ref_model.colocate=true", "inference_model.colocate=true"], 2,
     [([0], [0], [0]), ([1], [1], [0])]),
    # the reference on a GPU of its own stays there for every rank
    (["train_model.num_devices=2", "ref_model.num_devices=1", "ref_model.colocate=false"], 2,
     [([0], [3], [2]), ([1], [3], [2])]),
])
def test_each_rank_trains_on_its_own_gpu(overrides, ranks, expected):
    alloc = allocate(make_cfg(*overrides), 4, SYNC)
    for rank, (train, ref, inference) in enumerate(expected):
        own = alloc.for_rank(rank, ranks)
        assert (own.train, own.ref, own.inference) == (train, ref, inference)


def test_a_rank_with_a_reference_of_its_own_gpus_takes_one_of_them():
    """2 ranks, 2 reference GPUs apart from training: each rank's whole reference on its own one."""
    alloc = allocate(make_cfg("train_model.num_devices=2", "ref_model.num_devices=2", "inference_model.colocate=true"),
                     4, SYNC)
    assert [(own.train, own.ref) for own in (alloc.for_rank(0, 2), alloc.for_rank(1, 2))] == [([0], [2]), ([1], [3])]


def test_the_cpu_keeps_the_allocation_on_every_rank():
    cpu = allocate(make_cfg("allow_cpu=true", "train_model.num_devices=2"), 0, SYNC)
    assert cpu.for_rank(1, 2) is cpu


@pytest.mark.parametrize("overrides,visible,current", [
    ([], 1, [0]),                                                              # one rank
    (["train_model.num_devices=2", "inference_model.colocate=true"], 2, [0, 1]),
    (["train_model.devices=[2,3]", "inference_model.devices=[0]"], 4, [2, 3]),  # not GPUs 0 and 1: rank r's own
    (["train_model.devices=[3,1]", "inference_model.devices=[0]"], 4, [3, 1]),
    (["allow_cpu=true", "train_model.num_devices=2"], 0, [None, None]),         # gloo ranks: no GPU to select
])
def test_each_rank_makes_its_own_train_gpu_current(overrides, visible, current):
    """The GPU each rank the script starts makes current (``make_trainer`` selects it before any GPU work)."""
    alloc = allocate(make_cfg(*overrides), visible, SYNC)
    assert [alloc.current_gpu(rank, len(current)) for rank in range(len(current))] == current


@pytest.mark.parametrize("overrides,current", [
    ([], [0, 1]),                                  # torchrun's convention: rank LOCAL_RANK on GPU LOCAL_RANK
    (["train_model.devices=[2,3]"], [2, 3]),       # LOCAL_RANK 0 and 1 on the GPUs the config names
    (["train_model.num_devices=2", "inference_model.devices=[0]"], [1, 2]),  # GPU 0 claimed first: 1 and 2
])
def test_under_torchrun_each_rank_makes_its_train_gpu_current_whatever_its_local_rank(overrides, current):
    """torchrun's 2 ranks on one node (LOCAL_RANK = RANK = 0, 1): rank 0 makes ``train_model.num_devices=null``
    torchrun's count and allocates, every rank selects the train GPU of its rank in what rank 0 sent."""
    cfg = OmegaConf.create(make_cfg("inference_model.colocate=true", *overrides))
    if (count := agree_with_launcher(PlacementSettings.from_config(cfg), World(rank=0, size=2))) is not None:
        cfg.train_model.num_devices = count  # as hydra_main writes it
    alloc = allocate_devices(cfg, inference_engines=2, dedicated_inference=SYNC, visible_gpus=4)
    assert [alloc.current_gpu(local_rank, 2) for local_rank in (0, 1)] == current


def test_ranks_and_train_gpus_must_match():
    alloc = allocate(make_cfg(), 2, SYNC)  # train on GPU 0 alone
    with pytest.raises(DeviceAllocationError, match=r"2 trainer rank\(s\) started but train_model has 1 GPU\(s\) "
                                                    r"\[0\].*Fix: train_model.num_devices=2"):
        alloc.for_rank(1, 2)


@pytest.mark.parametrize("overrides,fix", [
    (["ref_model.num_devices=2"], "ref_model.num_devices=1"),
    (["train_model.devices=[0]", "ref_model.devices=[1,2]"], "ref_model.devices=[1]"),
])
def test_a_reference_with_more_gpus_than_training_would_idle(overrides, fix):
    """Each rank holds one whole reference on one GPU: reference GPUs beyond the train GPUs would idle."""
    with pytest.raises(DeviceAllocationError, match=r"ref_model has 2 GPUs but train_model has 1.*1 would idle.*"
                                                    rf"Fix: {re.escape(fix)}$"):
        allocate(make_cfg(*overrides), 4, ASYNC)


def test_trainer_ranks_is_the_train_gpu_count():
    assert trainer_ranks(make_cfg()) is None
    assert trainer_ranks(make_cfg("train_model.num_devices=3")) == 3
    assert trainer_ranks(make_cfg("train_model.devices=[1,2]")) == 2
    with pytest.raises(DeviceAllocationError, match=r"train_model.num_devices=0 must be an int >= 1"):
        trainer_ranks(make_cfg("train_model.num_devices=0"))


def rank_engines(*overrides: str, visible: int):
    """Sync as grpo.py asks: an engine per trainer rank at most."""
    cfg = make_cfg(*overrides)
    return allocate_devices(cfg, inference_engines=trainer_ranks(cfg) or 1, dedicated_inference=SYNC,
                            visible_gpus=visible)


@pytest.mark.parametrize("overrides,visible,inference", [
    (["inference_model.colocate=true"], 2, [0, 1]),  # each rank generates on its own train GPU
    ([], 4, [2, 3]),  # or on an inference GPU of its own
    (["allow_cpu=true"], 0, []),
])
def test_sync_with_an_inference_gpu_per_rank_generates_on_every_rank(overrides, visible, inference):
    alloc = rank_engines("train_model.num_devices=2", "inference_model.num_devices=2", *overrides, visible=visible)
    assert alloc.generating_ranks == 2 and alloc.inference == inference
    if visible:
        assert [alloc.for_rank(rank, 2).inference for rank in (0, 1)] == [[i] for i in inference]


def test_sync_with_one_inference_gpu_generates_on_rank_0_alone():
    alloc = rank_engines("train_model.num_devices=2", "inference_model.colocate=true", visible=2)
    assert alloc.generating_ranks == 1 and alloc.inference == [0] and alloc.for_rank(1, 2).inference == [0]


@pytest.mark.parametrize("overrides,visible,error", [
    (["train_model.num_devices=3", "inference_model.num_devices=2"], 3,
     r"inference_model has 2 GPUs but train_model has 3: sync generates on rank 0 alone \(1 inference GPU\) or on "
     r"every trainer rank, one engine each \(3 GPU\(s\) visible\). "
     r"Fix: inference_model.num_devices=1 or inference_model.num_devices=3$"),
    (["train_model.num_devices=2", "inference_model.num_devices=3", "allow_cpu=true"], 0,
     r"inference_model has 3 GPUs but sync generates with one engine on one GPU \(rank 0's\) or one per trainer rank "
     r"\(2\): 1 would idle \(0 GPU\(s\) visible\). Fix: inference_model.num_devices=2, or run the async script"),
    (["train_model.num_devices=2", "inference_model.num_devices=2", "env.num_envs=24", "env.repeats=8"], 0,
     r"env.num_envs=24 holds 3 prompts \(x env.repeats=8\), which 2 generating ranks cannot split by whole prompts. "
     r"Fix: env.num_envs=16 or inference_model.num_devices=1$"),
])
def test_sync_generating_ranks_that_cannot_work_are_one_line(overrides, visible, error):
    with pytest.raises(DeviceAllocationError, match=error):
        rank_engines(*overrides, "allow_cpu=true", "inference_model.colocate=true", visible=visible)


def ray_cluster(*overrides: str, visible: int = 1) -> DeviceAllocation:
    """The async script's allocation joining a Ray cluster (``ray.address``): Ray places ranks and workers."""
    cfg = make_cfg("ref_model.colocate=true", *overrides)
    return allocate_devices(cfg, inference_engines=cfg["train"]["num_collectors"], dedicated_inference=ASYNC,
                            placed_by_ray=True, visible_gpus=visible)


def test_in_a_ray_cluster_each_rank_trains_on_the_gpu_ray_gave_it_with_its_reference_beside():
    """2 ranks and 2 workers on a cluster, one GPU visible where rank 0 runs (the rest is Ray's, on other nodes):
    the allocation names no GPU until each process names the one Ray gave it; every rank then keeps its own."""
    alloc = ray_cluster("train_model.num_devices=2", "inference_model.num_devices=2", "train.num_collectors=2")
    assert alloc.placed_by_ray and len(alloc.inference) == 2
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        alloc.torch_device("train")  # no GPU to train on before Ray named one
    rank_0, rank_1 = alloc.on_gpu(0), alloc.on_gpu(3)
    assert (rank_0.train, rank_0.ref) == ([0], [0]) and (rank_1.train, rank_1.ref) == ([3], [3])
    assert rank_1.for_rank(1, 2) is rank_1 and rank_1.current_gpu(1, 2) == 3
    assert "2 rank(s), each on a GPU Ray gives it" in rank_0.describe()
    assert ray_cluster("train.use_kl_to_ref=false").on_gpu(1).ref == []
    with pytest.raises(ValueError, match="only a Ray cluster's allocation"):
        allocate(make_cfg(), 1, SYNC).on_gpu(0)


@pytest.mark.parametrize("overrides,error", [
    (["train_model.devices=[0,1]"], r"train_model.devices=\[0,1\] names GPUs of this node, but in a Ray cluster "
     r"\(ray.address\) Ray places every trainer rank and rollout worker on the GPUs its nodes declare. "
     r"Fix: train_model.devices=null train_model.num_devices=2$"),
    (["inference_model.devices=[1]"], r"Fix: inference_model.devices=null inference_model.num_devices=1$"),
    (["ref_model.colocate=false"], r"each trainer rank holds its reference model on its own GPU, but ref_model asks "
     r"for 1 GPU\(s\) of its own. Fix: ref_model.num_devices=null ref_model.colocate=true$"),
    (["ref_model.num_devices=1", "train_model.num_devices=2"], r"asks for 1 GPU\(s\) of its own"),
    (["inference_model.num_devices=2"], r"inference_model has 2 GPUs but train.num_collectors=1 starts 1 generation "
     r"engine\(s\), one GPU each: 1 would idle \(a Ray cluster; 1 GPU\(s\) visible here\)"),
])
def test_a_ray_cluster_layout_that_names_gpus_or_a_reference_apart_is_one_line(overrides, error):
    with pytest.raises(DeviceAllocationError, match=error):
        ray_cluster(*overrides)


def test_a_ray_cluster_on_the_cpu_is_the_cpu_allocation():
    """No GPU where rank 0 runs, allow_cpu: gloo ranks and workers on the cluster's CPUs, as before."""
    assert ray_cluster("allow_cpu=true", "train_model.num_devices=2", visible=0).cpu
