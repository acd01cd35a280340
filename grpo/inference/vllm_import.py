"""vLLM imported only by the runs that use it (``inference_model.backend=vllm``).

TorchRL's LLM modules import vLLM at their own import when it is installed (``vllm_wrapper``'s
``SamplingParams``...), vLLM engine or not: importing grpo.py's modules took 9.4 s, 5.8 s without it
(2 cores, one thread), in every script, rank, Ray worker and test run. ``import_torchrl_llm`` imports
them with vLLM hidden, so they take their no-vLLM branch; ``import_vllm`` later imports it for real and
binds what those modules would have bound.
"""

from __future__ import annotations

import importlib
import sys


def import_torchrl_llm() -> None:
    """Import TorchRL's LLM modules, those grpo uses and those they import, as if vLLM were not installed.

    ``sys.modules["vllm"] = None`` makes ``find_spec("vllm")`` return None and ``import vllm`` raise
    ImportError, TorchRL's two tests for it. Called by ``grpo/__init__.py``, before any of them is imported:
    ``torchrl.collectors`` and ``torchrl.envs.llm`` import ``torchrl.modules.llm`` too. Nothing to do
    where vLLM or they are already imported (a test, a user's script).
    """
    if "vllm" in sys.modules or "torchrl.modules.llm" in sys.modules:
        return
    sys.modules["vllm"] = None
    try:
        # collectors.llm's weight updaters import backends.vllm.vllm_utils, which tries vLLM's NCCL helpers
        for name in ("torchrl.modules.llm", "torchrl.envs.llm", "torchrl.collectors.llm"):
            importlib.import_module(name)
    finally:
        if sys.modules.get("vllm", 0) is None:
            del sys.modules["vllm"]


def import_vllm():
    """Import vLLM and set the module globals that TorchRL's LLM modules bound at their import to what they bind
    with vLLM installed (after ``import_torchrl_llm`` they hold None/False); returns ``vllm``. Idempotent, and
    harmless where TorchRL saw vLLM itself. Raises what ``import vllm`` raises."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams

    from torchrl.collectors.llm.weight_update import vllm as updater
    from torchrl.modules.llm.backends.vllm import vllm_utils
    from torchrl.modules.llm.policies import vllm_wrapper

    vllm_wrapper.__dict__.update(_HAS_VLLM=True, SamplingParams=SamplingParams, RequestOutput=RequestOutput,
                                 TokensPrompt=TokensPrompt)
    updater._has_vllm = True
    try:  # optional for TorchRL too; its get_open_port stays TorchRL's own (vLLM 0.32's vllm.utils has none)
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError:
        return vllm
    vllm_utils.__dict__.update(_has_vllm=True, PyNcclCommunicator=PyNcclCommunicator,
                               StatelessProcessGroup=StatelessProcessGroup)
    return vllm
