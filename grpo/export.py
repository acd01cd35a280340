"""A trained policy as a plain Hugging Face model folder, which transformers and vLLM load as they load any
model: safetensors weights (LoRA adapters merged in), the tokenizer with the chat template the policy was
trained with, and a generation config that ends replies where training ended them.

    python -m grpo.export outputs/2026-11-23/10-00-00 my-model      # a run dir: its latest good checkpoint
    python -m grpo.export outputs/.../checkpoints/step_00000030.json my-model
    vllm serve my-model

A run writes one into ``<run dir>/export`` when it finishes (``logging.export``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from transformers.utils import logging as hf_logging

from grpo.process.errors import ExportError, clear_errors
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.prompt_checks import wrapper_chat_template
from grpo.training import checkpoint as ckpt
from grpo.training.models import inference_state_dict, load_policy_model, load_tokenizer, stop_token_ids
from grpo.training.settings import ModelSettings


def export_model(model, tokenizer, out_dir, state: dict | None = None) -> Path:
    """Write ``model`` (transformers, or PEFT: adapters merged) and ``tokenizer`` into ``out_dir``, a new or
    empty folder. The folder is written beside it and renamed into place: it is whole or absent. ``state``:
    its weights as ``inference_state_dict`` gives them, if already at hand (gathered over data-parallel ranks)."""
    out_dir = Path(out_dir).resolve()
    check_empty(out_dir)
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that was killed
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = inference_state_dict(model) if state is None else state  # HF names, LoRA merged
    bad = ckpt.non_finite(state)
    if bad:
        raise ExportError(f"{len(bad)} weight tensor(s) hold NaN or inf (first: {bad[0]}): no export written to {out_dir}.")
    try:
        with no_progress_bar():  # a bar for writing one file
            base.save_pretrained(partial, state_dict=state)
        served = copy.copy(tokenizer)  # the run's tokenizer keeps its own template
        # TorchRL renders prompts with its template for the model family, which may not be the tokenizer's
        served.chat_template = wrapper_chat_template(tokenizer) or tokenizer.chat_template
        served.save_pretrained(partial)
        generation = copy.deepcopy(base.generation_config)
        generation.eos_token_id = stop_token_ids(tokenizer, base.generation_config)  # the ids rollouts stopped at
        generation.pad_token_id = tokenizer.pad_token_id  # may be one load_tokenizer added
        generation.save_pretrained(partial)
    except (OSError, SafetensorError) as err:  # a full disk (safetensors raises its own error): no half-written export
        shutil.rmtree(partial, ignore_errors=True)
        raise ExportError(f"the export to {out_dir} could not be written ({err}); free space and run "
                          "python -m grpo.export <run dir> <out> (the checkpoints are kept).") from err
    os.replace(partial, out_dir)  # onto an empty folder too
    return out_dir


@contextlib.contextmanager
def no_progress_bar():
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def check_empty(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"export: {out_dir} is not an empty folder and an export overwrites nothing; give a new "
                          "or empty folder.")


def read_checkpoint(target) -> tuple[Path, dict]:
    """The checkpoint ``target`` names: a ``step_N.json`` file, or a run dir (its latest good checkpoint)."""
    path = Path(target).expanduser()
    if path.is_dir():
        found = ckpt.load_latest_good(path / "checkpoints") or ckpt.load_latest_good(path)
        if found is None:
            raise ExportError(f"export: {path} holds no readable step_*.json checkpoint, nor does its checkpoints/ "
                              "folder; give a run dir or one of its checkpoints/step_*.json.")
        path, payload = found
    elif not path.is_file():
        raise ExportError(f"export: {path} does not exist; give a run dir or one of its checkpoints/step_*.json.")
    elif not ckpt.CKPT_PATTERN.match(path.name):
        raise ExportError(f"export: {path} is not a checkpoint (a step_*.json file; older pickled step_*.pt files "
                          "are never loaded); give a run dir or one of its checkpoints/step_*.json.")
    else:
        try:
            payload = ckpt.load_checkpoint(path)
        except Exception as err:  # bad JSON, missing or damaged tensors: all mean "not usable"
            raise ExportError(f"export: {path} is unreadable ({type(err).__name__}: {err}); export another checkpoint "
                              f"of its run (in {path.parent}).") from err
    if not isinstance(payload, dict) or not {"step", "model", "config"} <= payload.keys():
        raise ExportError(f"export: {path} is not a checkpoint of this project (it lacks its weights or config); give "
                          "a run dir or one of its checkpoints/step_*.json.")
    return path, payload


def export_checkpoint(target, out_dir) -> tuple[Path, int]:
    """Export the checkpoint ``target`` names into ``out_dir``; returns the checkpoint's path and step.
    The model is rebuilt on the CPU from the checkpoint's own config (``model.name``, LoRA)."""
    path, payload = read_checkpoint(target)
    check_empty(Path(out_dir))  # before loading a model that may take minutes
    config = OmegaConf.create(payload["config"])
    resolve_local_paths(config)
    tokenizer = load_tokenizer(config.model.name)
    model = load_policy_model(ModelSettings.from_config(config), tokenizer, torch.device("cpu"))
    try:
        _, unexpected = model.load_state_dict(payload["model"], strict=False)
    except RuntimeError as err:  # a shape mismatch: model.name changed since the run
        unexpected = [" ".join(str(err).split())[:300]]
    if unexpected:
        raise ExportError(f"export: {path}'s weights do not fit model.name={config.model.name} as it is now "
                          f"({unexpected[:3]}); export with the model the run trained.")
    export_model(model, tokenizer, out_dir)
    return path, payload["step"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m grpo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a run dir (its latest good checkpoint) or a checkpoints/step_*.json file")
    parser.add_argument("out", help="a new or empty folder for the model")
    args = parser.parse_args(argv)
    with clear_errors():
        path, step = export_checkpoint(args.checkpoint, args.out)
    print(f"exported {path} (step {step}) to {args.out}")


if __name__ == "__main__":
    main()
