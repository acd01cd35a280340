import os

# Importing TorchRL's LLM modules imports vLLM, which sets its logging up then: without this, every
# process (the scripts, Ray workers, tests) floods the console with vLLM's INFO lines. An engine
# then logs at inference_model.vllm_log_level.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
