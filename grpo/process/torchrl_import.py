"""TorchRL's LLM modules, imported as if vLLM and Ray were not installed: importing this module does it.

TorchRL's LLM modules import vLLM at their own import when it is installed (``vllm_wrapper``'s ``SamplingParams``...),
vLLM engine or not: importing grpo.py's modules took 9.4 s, 5.8 s without it (2 cores, one thread), in every script,
rank, Ray worker and test run. Every grpo module that imports TorchRL imports this one first, so TorchRL's modules
take their no-vLLM branch; ``grpo.inference.vllm_import.import_vllm`` later imports vLLM for real and binds what those
modules would have bound. Ray is hidden from them too (its import, 0.65 CPU-s, is the async script's alone), then bound
there to a stand-in that imports it at its first use. Not done by ``grpo/__init__.py``: a process that reads no more
than the config (a misspelt key, ``grpo.process.config_keys``) then imports neither TorchRL nor torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def import_torchrl_llm() -> None:
    """Import TorchRL's LLM modules, those grpo uses and those they import, as if vLLM were not installed.

    ``sys.modules["vllm"] = None`` makes ``find_spec("vllm")`` return None and ``import vllm`` raise
    ImportError, TorchRL's two tests for it. Called when this module is first imported, before any of them is:
    ``torchrl.collectors`` and ``torchrl.envs.llm`` import ``torchrl.modules.llm`` too. Nothing to do
    where vLLM or they are already imported (a test, a user's script).

    Ray too is hidden from them (unless imported already: a Ray worker): TorchRL imports it where installed
    (``torchrl.data.replay_buffers.ray_buffer``), 0.65 CPU-s of every process, for classes grpo never uses, and the
    sync script never starts Ray. ``_ray_on_first_use`` then tells those modules Ray is there after all.
    """
    if "vllm" in sys.modules or "torchrl.modules.llm" in sys.modules:
        return
    hidden = [name for name in ("vllm", "ray") if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))
    try:
        # collectors.llm's weight updaters import backends.vllm.vllm_utils, which tries vLLM's NCCL helpers
        for name in ("torchrl.modules.llm", "torchrl.envs.llm", "torchrl.collectors.llm"):
            importlib.import_module(name)
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    if "ray" in hidden:
        _ray_on_first_use()


class _RayOnFirstUse(types.ModuleType):
    """``ray`` where a TorchRL module imported with Ray hidden would have bound it: imports it at its first use."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("ray"), name)


def _ray_on_first_use() -> None:
    """The TorchRL modules ``import_torchrl_llm`` imported with Ray hidden, as they are with Ray installed: their
    ``_has_ray`` flags true and their module global ``ray`` (a stub, or unbound) Ray, imported at its first use. Their
    other uses of Ray import it in their functions. Nothing to do where Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        return
    ray = _RayOnFirstUse("ray")
    for name, module in list(sys.modules.items()):
        if name.startswith("torchrl.") and getattr(module, "_has_ray", None) is False:
            module._has_ray, module.ray = True, ray
            if getattr(module, "RAY_ERR", None) is not None:  # ray_collector keeps the ImportError it got
                module.RAY_ERR = None


import_torchrl_llm()
