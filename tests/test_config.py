"""Every config composes, every key is documented, and bad values stop the run with one clear message."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose
from grpo.loop.config import validate_config, warn_if_too_few_rows
from grpo.process.config_keys import RETIRED_KEYS, check_command_line, check_retired_overrides, no_gpu_here
from grpo.process.errors import NO_GPU, ConfigError, DataError, ModelLoadError
from grpo.tasks.envs import TASKS, load_gsm8k
from grpo.tasks.settings import TASK_NAMES

CONFIG_NAMES = sorted(p.stem for p in (REPO / "config").glob("*.yaml"))


def test_config_names():
    assert {"grpo_gsm8k", "grpo_tiny", "grpo_ifeval", "grpo_ifeval_tiny"} <= set(CONFIG_NAMES)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_composes_and_validates(name):
    cfg = compose(name)
    validate_config(cfg)
    assert cfg.env.task in TASKS


def test_the_task_names_the_config_check_knows_are_the_tasks():
    assert sorted(TASK_NAMES) == sorted(TASKS)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_key_has_a_comment(name):
    lines = (REPO / "config" / f"{name}.yaml").read_text().splitlines()
    undocumented = [
        line for line in lines
        if re.match(r"^\s*[\w.]+:\s*\S", line) and "#" not in line and not line.lstrip().startswith(("-", "#"))
        and not re.match(r"^\s*(dir|subdir|run|sweep|hydra):", line)
    ]
    assert not undocumented, f"keys without a one-line comment in {name}.yaml: {undocumented}"


# The bad values issue 20 lists are in test_bad_inputs.py's table; these are their kin.
@pytest.mark.parametrize("override, pattern", [
    ("env.repeats=1", r"env.repeats=1.*at least 2.*env.repeats=4"),
    ("env.num_envs=12", r"env.num_envs=12 must be a multiple of env.repeats=8"),
    ("train.optim_batch_size=48", r"train.optim_batch_size=48 must divide train.dialog_turns_per_batch=64"),
    ("env.num_envs=128", r"train.dialog_turns_per_batch=64 must be a multiple of env.num_envs=128 \(or smaller than it "
                         r"with train.dynamic_sampling=true"),
    ("train.micro_batch_tokens=0", r"train.micro_batch_tokens=0 must be a whole number >= 1 \(e.g. 16384\) or null"),
    ("train_model.checkpoint_fraction=1.5", r"train_model.checkpoint_fraction=1.5 must be in \[0, 1\]"),
    (("ray.address=auto", "ray.num_cpus=2"), r"ray.num_cpus=2 sizes a local Ray, but ray.address=auto joins a cluster.*"
                                             r"Fix: ray.num_cpus=null"),
    ("ray.kill_on_low_memory=maybe", r"ray.kill_on_low_memory='maybe' must be true or false"),
    ("inference_model.compact_rows=maybe", r"inference_model.compact_rows='maybe' must be true or false"),
    ("inference_model.compile_prefill=yes", r"inference_model.compile_prefill='yes' must be true or false"),
    ("ref_model.score_early=yes", r"ref_model.score_early=.yes. must be true or false"),
    ("train.packed_sequences=1", r"train.packed_sequences=1 must be true or false"),
    ("env.task=mmlu", r"env.task='mmlu' is unknown"),
    ("inference_model.backend=sglang", r"inference_model.backend='sglang'"),
    ("inference_model.max_new_tokens=600", r"inference_model.max_new_tokens=600 leaves no room.*max_model_len=512"),
    ("train_model.mixed_precision=true", r"mixed_precision=true computes the loss in bfloat16.*"
                                         r"train_model.mixed_precision=false"),
    ("inference_model.top_k=-1", r"inference_model.top_k=-1 must be a whole number >= 0"),
    ("reward.answer_extraction=regex", r"reward.answer_extraction='regex'; use flexible .* strict .* or tag"),
    ("optimizer.betas=[0.9,1.5]", r"both betas in \[0, 1\)"),
    ("inference_model.dtype=fp8", r"inference_model.dtype='fp8'; use float32, bfloat16 or float16"),
    ("optimizer.lr=1e-4x", r"optimizer.lr='1e-4x' must be a number"),  # was a TypeError traceback
    ("optimizer.betas=[0.9,x]", r"optimizer.betas.1='x' must be a number"),
    ("train.inference_is_cap=2.0", r"train.inference_is_cap is retired: write train.importance_sampling=token_truncate "
                                   r"train.is_high=2.0 instead"),
    ("train.importance_sampling=tis", r"train.importance_sampling='tis'; use one of none, token_truncate, token_mask"),
    (["inference_model.backend=vllm", "inference_model.top_p=0.9", "inference_model.temperature=0.7"],
     r"backend=vllm with top_k=0, top_p=0.9 and temperature=0.7: .* set inference_model.temperature=1.0"),
    ("train.is_high=0.9", r"train.is_low=0.5 and train.is_high=0.9 must bound .* 0 <= is_low <= 1 <= is_high"),
    ("eval.max_new_tokens=0", r"eval.max_new_tokens=0 must be a whole number >= 1"),
    ("train.checkpoint_frequency=-1", r"train.checkpoint_frequency=-1 must be >= 0"),  # was: a checkpoint every step
    ("logger=tensorbord", r"logger='tensorbord'; use one of wandb, tensorboard, mlflow, csv or none, or a list"),
    ("logger=[csv,csv]", r"logger=.*'csv', 'csv'.*; use one of"),
    ("eval.samples_per_problem=-2", r"eval.samples_per_problem=-2 must be a whole number >= 0"),
    ("eval.temperature=0", r"eval.temperature=0 must be a number > 0"),
    ("logging.keep_last=-1", r"logging.keep_last=-1 must be >= 0 \(0 or null: keep every checkpoint\)"),
    ("+train.totl_steps=3", r"train.totl_steps is not a config key \(did you mean train.total_steps\?\)"),
    ("+trainer.lr=1", r"trainer is not a config key \(did you mean train\?\)"),
    ("+model.cudnn_attention=true", r"model.cudnn_attention is retired: cuDNN's attention is now always off"),
    ("train.use_kl_to_ref=yes", r"train.use_kl_to_ref='yes' must be true or false"),  # a non-empty string is true
    ("inference_model.gpu_memory_utilization=1.5", r"inference_model.gpu_memory_utilization=1.5 must be in \(0, 1\]"),    ("inference_model.vllm_log_level=LOUD", r"inference_model.vllm_log_level='LOUD'; use one of DEBUG, INFO, WARNING"),
])
def test_bad_values_name_key_and_fix(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_config(compose("grpo_tiny", [override] if isinstance(override, str) else list(override)))


@pytest.mark.parametrize("logger, fix", [("wandb", "pip install wandb, or logger=csv or none"),
                                         ("tensorboard", "pip install -e '.[loggers]'")])
def test_a_logger_whose_package_is_missing_stops_at_start(monkeypatch, logger, fix):
    """A machine without the package (the GPU machines have no wandb) hears it before the models load, in one line."""
    import grpo.loop.config as config

    find_spec = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None if name == logger else find_spec(name))
    with pytest.raises(ConfigError, match=rf"^logger={logger} needs the {logger} package, which is not installed; "
                                          rf"{re.escape(fix)}"):
        validate_config(compose("grpo_tiny", [f"logger=[csv,{logger}]"]))


@pytest.mark.parametrize("key", sorted(RETIRED_KEYS))
def test_a_retired_key_is_in_no_config_and_an_override_of_it_says_what_replaced_it(key):
    """Hydra refuses a key no config has ("not in struct"); before it, the scripts name what replaced it."""
    for name in CONFIG_NAMES:
        assert OmegaConf.select(compose(name), key) is None, (name, key)
    for override in (f"{key}=false", f"+{key}=1"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is retired: .*drop"):
            check_retired_overrides(["--config-name", "grpo_tiny", override])
    check_retired_overrides(["--config-name", "grpo_tiny", "train.total_steps=4"])


def test_missing_local_dataset(tmp_path):
    with pytest.raises(DataError, match="env.dataset=.*no such file or folder"):
        load_gsm8k(str(tmp_path / "missing"), "train")


@pytest.mark.parametrize("override, expected", [
    ("env.repeats=1", "env.repeats=1"),
    ("env.dataset=/nonexistent/gsm8k", "env.dataset='/nonexistent/gsm8k': no such file or folder"),
    ("env.dataset=nobody/unknown-dataset", "could not load split 'train' from the Hugging Face hub"),
    ("inference_model.sampler_kernel=false", "inference_model.sampler_kernel is retired: a GPU now always draws"),
])
def test_script_stops_at_start_with_one_line(tmp_path, override, expected):
    proc = subprocess.run(
        [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny", override,
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                          "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_command_line_check_names_the_closest_key_and_leaves_what_it_does_not_read_to_hydra():
    check_command_line(["--config-name", "grpo_tiny", "train.total_steps=4", "hydra.run.dir=/tmp/x"])  # all good
    with pytest.raises(ConfigError, match=r"^train.totl_steps is not a config key \(did you mean train.total_steps\?\)"):
        check_command_line(["--config-name=grpo_tiny", "train.totl_steps=4"])
    with pytest.raises(ConfigError, match=r"^env.max_turn is not a config key \(did you mean env.max_turns\?\)"):
        check_command_line(["env.max_turn=2"])  # grpo_gsm8k, the scripts' default config
    with pytest.raises(ConfigError, match=r"^train.packed_sequences='yes' must be true or false"):
        check_command_line(["-cn", "grpo_tiny", "train.packed_sequences=yes"])
    with pytest.raises(ConfigError, match=r"^--config-name grpo_tny: no such config \(did you mean grpo_tiny\?\)"):
        check_command_line(["--config-name", "grpo_tny", "train.total_steps=4"])
    check_command_line(["--config-name", "grpo_tiny.yaml", "train.total_steps=4"])
    with pytest.raises(ConfigError, match=r"^env.tools.x=1: cannot be applied \(.*\); a list is set whole"):
        check_command_line(["train.total_steps=4", "env.tools.x=1"])  # Hydra's own report: a 20-line traceback
    check_command_line(["env.tools.0=python"])  # an item of a list, by its index
    # a sweep, Hydra's flags: Hydra's, and the run's own validate_config
    check_command_line(["--config-name", "grpo_tiny", "--multirun", "train.totl_steps=4,5"])


def test_local_paths_are_checked_as_the_run_reads_them_from_the_working_directory_or_the_repo_root(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repo root: the run takes ./assets/tiny-model from there
    check_command_line(["--config-name", "grpo_tiny", "model.name=./assets/tiny-model", "env.dataset=data/gsm8k_tiny"],
                       validate_config)
    with pytest.raises(ModelLoadError, match=r"^model.name='./assets/no-model': no such folder\."):
        check_command_line(["--config-name", "grpo_tiny", "model.name=./assets/no-model"], validate_config)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"^model.name='model': the folder lacks a tokenizer .*, weights "):
        check_command_line(["--config-name", "grpo_tiny", "model.name=model"], validate_config)  # local: it is here
    with pytest.raises(DataError, match=r"^env.dataset='rows.jsonl': no such file or folder\."):
        check_command_line(["--config-name", "grpo_tiny", "env.dataset=rows.jsonl"], validate_config)


@pytest.mark.parametrize("script", ["grpo.py", "grpo-async.py"])
@pytest.mark.parametrize("override, error", [
    ("train.totl_steps=3", "train.totl_steps is not a config key (did you mean train.total_steps?)"),
    ("trian.total_steps=3", "trian is not a config key (did you mean train?)"),
    ("train.total_steps=abc", "train.total_steps='abc' must be a number."),
    ("env.repeats=1", "env.repeats=1: GRPO compares replies within a group"),
    ("train.optim_batch_size=48", "train.optim_batch_size=48 must divide train.dialog_turns_per_batch=64."),
    ("env.dataset=/nonexistent/rows.jsonl", "env.dataset='/nonexistent/rows.jsonl': no such file or folder."),
    ("model.name=/nonexistent/model", "model.name='/nonexistent/model': no such folder."),
    ("allow_cpu=false", NO_GPU),  # CUDA_VISIBLE_DEVICES= below: no GPU, on any machine
])
def test_a_bad_key_or_value_stops_the_script_in_one_line_before_torch_is_imported(tmp_path, script, override, error):
    """Hydra's own refusal of an unknown key took five lines without a suggestion, and any bad value (or a GPU job
    on a machine without one) 9 s of imports before its line."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(REPO / "grpo" / script), "--config-name", "grpo_tiny", override,
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    printed = [line for line in lines if not line.startswith("import time:")]
    assert len(printed) == 1 and printed[0].startswith(f"error: {error}"), printed
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "hydra" in imported and not {"torch", "torchrl", "transformers"} & imported
    assert not (tmp_path / "run").exists()


def test_no_gpu_here_reads_cuda_visible_devices_and_the_machine_s_device_nodes(monkeypatch):
    for hidden in ("", "-1", " "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert no_gpu_here()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    nodes = [p for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg") if Path(p).exists()]
    assert no_gpu_here() == (not nodes)


def test_a_misspelt_key_in_a_users_own_yaml_stops_the_script_in_one_line(tmp_path):
    """Hydra merges a key a user's YAML adds without a word; the run would keep the default it meant to change."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - grpo_tiny\n  - _self_\ntrain:\n  totl_steps: 3\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-dir", str(tmp_path / "conf"), "--config-name", "mine",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                          "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: train.totl_steps is not a config key (did you mean train.total_steps?); "
                      "config/grpo_gsm8k.yaml lists them all."], proc.stderr[-2000:]


def test_a_train_split_smaller_than_a_step_is_flagged():
    cfg = compose("grpo_tiny")  # 64 replies per step in groups of 8: 8 prompts
    with pytest.warns(UserWarning, match=r"has 1 row\(s\), fewer than the 8 prompts a step draws"):
        warn_if_too_few_rows(cfg, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_too_few_rows(cfg, 8)
