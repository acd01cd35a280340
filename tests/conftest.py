import contextlib
import fcntl
import importlib.util
import io
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# Tests never reach the Hugging Face hub: everything runs on what the project ships or builds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The Rays that tests start themselves (ray.init, a test cluster) start no idle workers either, as the scripts' do
# (grpo.process.ray_placement.PRESTART; not imported here: before torch, below)
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Under pytest-xdist (-n N) N tests run at once: one thread each, in the workers and in the runs they start
# (inherited), so N workers on N cores do not thrash. Before torch is imported: it reads this once.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

import grpo.process.torchrl_import  # noqa: F401 - as in the scripts: TorchRL's LLM modules without vLLM, first
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from tensordict import set_list_to_stack

from grpo.training.logprobs import token_log_probs

from tools.compose import compose_config as compose  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = Path(os.environ.get("GRPO_TEST_MODEL", REPO / "assets" / "tiny-model"))
TINY_DATA = Path(os.environ.get("GRPO_TEST_DATA", REPO / "data" / "gsm8k_tiny"))

set_list_to_stack(True).set()


# Under the README's `-n 2 --dist loadfile` each test file runs whole on one worker, and xdist hands the files out
# by their number of tests, most first: two of the slowest files came last, one worker idling while the other ran
# them. Slowest first instead (seconds each took in a full run on 2 cores, rounded); the files not named here, a
# few seconds each, come after, as collected.
SLOW_FILES = {"test_ranks.py": 400, "test_async.py": 290, "test_ray_ranks.py": 355, "test_checkpoint.py": 115,
              "test_e2e.py": 200, "test_faults.py": 180, "test_rank_generation.py": 170, "test_user_task.py": 165,
              "test_world.py": 120, "test_real_model.py": 145, "test_async_placement.py": 95, "test_setup.py": 80,
              "test_bad_inputs.py": 40, "test_config.py": 36, "test_export.py": 31, "test_emergency_checkpoint.py": 24,
              "test_step.py": 23, "test_run.py": 20, "test_no_step_lost.py": 60, "test_trackers.py": 50,
              "test_vllm_backend.py": 35, "test_layout.py": 12, "test_e2e_tools.py": 115, "test_real_tools.py": 110}


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", False):  # xdist's --dist loadfile: take the files in our order
        config.option.loadscopereorder = False


# The two files that hold one_real_model_at_a_time stood next to each other in that order, so the second waited out
# the first's lock on the other worker; test_real_model.py goes first instead, done long before test_real_tools.py.
FIRST_FILE = "test_real_model.py"


def pytest_collection_modifyitems(items):
    # stable: each file's tests keep their order
    items.sort(key=lambda item: (item.path.name != FIRST_FILE, -SLOW_FILES.get(item.path.name, 0)))


@pytest.fixture(scope="module")
def one_real_model_at_a_time(tmp_path_factory):
    """Held by a module that trains a real model in the test process: Qwen 0.5B with its reference and AdamW state
    took 17 GB, and with the other xdist worker's 6.5 GB CI's 24 GB machine killed a worker for memory
    (2026-11-29). The workers of one run share the lock file, so such modules take turns."""
    with open(tmp_path_factory.getbasetemp().parent / "one-real-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return TINY_MODEL


@pytest.fixture(scope="session")
def tiny_data_dir() -> Path:
    return TINY_DATA


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir, tiny_data_dir):
    """grpo_tiny's config on the tiny model and data, its tokenizer, the model (float32, CPU, eval) and stop ids."""
    from grpo.tasks.paths import resolve_local_paths
    from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids

    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    return cfg, tok, model, stop_token_ids(tok, model.generation_config)


# The real model and GSM8K rows are not in git: scripts/fetch_real_assets.py fetches them (CI runs it
# before the tests). Missing assets fail rather than skip, so a broken fetch cannot pass unnoticed.
REAL_MODEL = Path(os.environ.get("GRPO_REAL_MODEL", REPO / "assets" / "smollm2-135m-instruct"))
REAL_DATA = Path(os.environ.get("GRPO_REAL_DATA", REPO / "data" / "gsm8k_real"))
REAL_QWEN = Path(os.environ.get("GRPO_REAL_QWEN", REPO / "assets" / "qwen2.5-coder-0.5b-instruct"))


def _fetched(path: Path, *files: str) -> Path:
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        pytest.fail(f"{path} lacks {', '.join(missing)}: run `python scripts/fetch_real_assets.py`", pytrace=False)
    return path


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    return _fetched(REAL_MODEL, "config.json", "model.safetensors", "tokenizer.json")


@pytest.fixture(scope="session")
def real_qwen_dir() -> Path:
    return _fetched(REAL_QWEN, "config.json", "model.safetensors", "tokenizer.json")


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


@contextlib.contextmanager
def sync_script():
    """grpo/grpo.py loaded in this process; what it does to sys.path and the signal handlers is undone after."""
    path, handlers = list(sys.path), {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    spec = importlib.util.spec_from_file_location("grpo_sync_script", REPO / "grpo" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def train_in_process(run_dir, overrides, config_name: str = "grpo_tiny"):
    """grpo/grpo.py's ``train`` on ``overrides`` in this process, its console output dropped: for runs whose launch is
    not under test (a new process spends ~10 s importing). Its ``Run``."""
    with sync_script() as script, contextlib.redirect_stdout(io.StringIO()):
        return script.train(compose_in_run_dir(run_dir, overrides, config_name))


# A short run of the tiny task, small enough to train in seconds
SHORT_RUN = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=16", "eval.batch_size=16",
             "eval.frequency=0", "env.num_envs=16", "env.repeats=4", "train.dialog_turns_per_batch=16",
             "train.optim_batch_size=8", "inference_model.max_new_tokens=16", "logging.progress_bar=false"]


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory):
    """A finished 2-step run of grpo/grpo.py on the tiny task, trained in this process: its ``Run``
    (the trained policy still in memory), its run dir and what it printed. Tests must leave it as it is."""
    run_dir = tmp_path_factory.mktemp("finished_tiny_run")
    printed = io.StringIO()
    with sync_script() as script, contextlib.redirect_stdout(printed):
        run = script.train(compose_in_run_dir(run_dir, [*SHORT_RUN, "train.total_steps=2"]))
    return SimpleNamespace(run=run, run_dir=run_dir, stdout=printed.getvalue())


def perturbed(weights: dict, seed: int) -> dict:
    """A push's worth of new weights, tied ones kept tied (as the trainer sends them)."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in weights.items():
        tied = next((n for n in new if weights[n].data_ptr() == tensor.data_ptr()), None)
        new[name] = new[tied] if tied else tensor + 1e-3 * torch.randn(tensor.shape, generator=g)
    return new


def reply_log_probs(model, batch) -> torch.Tensor:
    """``[S, R]`` log-probs the model gives a dense batch's reply tokens (no entropy, no grad needed)."""
    lp, _ = token_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["reply_mask"].shape[1],
                            with_entropy=False, entropy_grad=False)
    return lp


def wait_for(proc, ready, what: str, timeout: float = 400) -> None:
    """Poll ``ready()`` while the subprocess ``proc`` runs; fail if it ends first or ``what`` takes too long."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


@contextlib.contextmanager
def ray_cluster_here(monkeypatch, head_gpus: str | None = None, node_gpus: str | None = None):
    """A Ray cluster of two nodes on this machine (Ray's own test cluster): a head that offers no CPU, where a driver
    attaches, and a node of 2 CPUs, where every actor must then go. ``head_gpus``/``node_gpus``: the node's GPUs as
    its ``CUDA_VISIBLE_DEVICES`` (e.g. "5,6"), each declared to Ray, which assigns them on a CPU machine too. Its
    address. Ray points /tmp/ray/ray_current_cluster at it (and leaves it there): restored after.
    Ray is imported here, not at the top: the GPU machines' tests (decoding, attention) run without it."""
    from ray.cluster_utils import Cluster

    from grpo.process.ray_placement import MEMORY_MONITOR
    monkeypatch.setenv(MEMORY_MONITOR, "0")  # its raylets inherit it: no actor killed for the machine's memory
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.exists() else None

    def node(gpus: str | None, **options) -> dict:  # a raylet inherits this process's CUDA_VISIBLE_DEVICES
        if gpus is None:
            return options
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
        return options | {"num_gpus": len(gpus.split(","))}

    cluster = Cluster(initialize_head=True, head_node_args=node(head_gpus, num_cpus=0, include_dashboard=False))
    try:
        cluster.add_node(**node(node_gpus, num_cpus=2))
        cluster.wait_for_nodes()
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        yield cluster.address
    finally:
        cluster.shutdown()
        if before is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(before)


@pytest.fixture
def two_node_cluster(monkeypatch):
    """``ray_cluster_here`` with no GPU."""
    with ray_cluster_here(monkeypatch) as address:
        yield address
