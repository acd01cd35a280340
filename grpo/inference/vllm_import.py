"""vLLM imported only by the runs that use it (``inference_model.backend=vllm``): ``import_vllm`` imports it and tells
TorchRL's LLM modules, imported without it (``grpo.process.torchrl_import``), that it is there.
"""

from __future__ import annotations


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
