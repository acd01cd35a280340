import os

from grpo.inference.vllm_import import import_torchrl_llm

# vLLM sets its logging up when first imported (an engine starting, a test): without this, every process that
# imports it floods the console with vLLM's INFO lines. An engine then logs at inference_model.vllm_log_level.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
import_torchrl_llm()  # before anything here imports TorchRL's LLM modules: without vLLM, ~3.5 s less a process
