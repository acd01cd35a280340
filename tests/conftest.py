import os
from pathlib import Path

# Tests never reach the Hugging Face hub: everything runs on what the project ships or builds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
from tensordict import set_list_to_stack

from grpo.setup import compose_config as compose  # noqa: F401 - the tests import it from here

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
