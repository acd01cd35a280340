import os
import warnings


# vLLM sets its logging up when first imported (an engine starting, a test): without this, every process that
# imports it floods the console with vLLM's INFO lines. An engine then logs at inference_model.vllm_log_level.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# Inductor warns on its first compile on any Ampere or later GPU that float32 matmuls do not use TF32, whatever the
# graph. They stay float32 on purpose: the rotary angles (positions x inverse frequencies: TF32's 10-bit mantissa
# would put a position-2000 angle off by about a radian) and float32 master weights. Every GPU run printed it.
warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication")
