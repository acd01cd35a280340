import os
from pathlib import Path

# Tests never reach the Hugging Face hub: everything runs on what the project ships or builds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from tensordict import set_list_to_stack

from grpo.step import token_log_probs

from tools.compose import compose_config as compose  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = Path(os.environ.get("GRPO_TEST_MODEL", REPO / "assets" / "tiny-model"))
TINY_DATA = Path(os.environ.get("GRPO_TEST_DATA", REPO / "data" / "gsm8k_tiny"))

set_list_to_stack(True).set()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return TINY_MODEL


@pytest.fixture(scope="session")
def tiny_data_dir() -> Path:
    return TINY_DATA


# The real model and GSM8K rows are not in git: scripts/fetch_real_assets.py fetches them (CI runs it
# before the tests). Missing assets fail rather than skip, so a broken fetch cannot pass unnoticed.
REAL_MODEL = Path(os.environ.get("GRPO_REAL_MODEL", REPO / "assets" / "smollm2-135m-instruct"))
REAL_DATA = Path(os.environ.get("GRPO_REAL_DATA", REPO / "data" / "gsm8k_real"))


def _fetched(path: Path, *files: str) -> Path:
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        pytest.fail(f"{path} lacks {', '.join(missing)}: run `python scripts/fetch_real_assets.py`", pytrace=False)
    return path


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    return _fetched(REAL_MODEL, "config.json", "model.safetensors", "tokenizer.json")


@pytest.fixture(scope="session")
def real_gsm8k_dir() -> Path:
    return _fetched(REAL_DATA, "train.jsonl", "test.jsonl")


def compose_in_run_dir(run_dir, overrides, config_name: str = "grpo_tiny"):
    """The config as Hydra hands it to a script whose hydra.run.dir is ``run_dir``."""
    cfg = compose(config_name, list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def reply_log_probs(model, batch) -> torch.Tensor:
    """``[S, R]`` log-probs the model gives a dense batch's reply tokens (no entropy, no grad needed)."""
    lp, _ = token_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["reply_mask"].shape[1],
                            with_entropy=False, entropy_grad=False)
    return lp
