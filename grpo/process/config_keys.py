"""Every key of a composed config is one of grpo_gsm8k.yaml's, with a value of its type; and the scripts' check of
their command line before they import torch or TorchRL: a misspelt key or a bad value reports in 0.5 s, not 9 s.

Reads the config only (Hydra, OmegaConf). The scripts hand ``check_command_line`` the rest of the config's checks
(``grpo.loop.config.validate_config``, which reads the config alone too); the data and the devices are checked after
the imports, in the run, but for a machine with no GPU at all (``no_gpu_here``).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from grpo.process.errors import NO_GPU, ConfigError, DeviceAllocationError, clear_errors

REPO_ROOT = Path(__file__).resolve().parents[2]  # its config/; relative model and data paths fall back to it
CONFIG_DIR = REPO_ROOT / "config"
# every key a config may hold, with a value of its type: the configs all start from this one
BASE_CONFIG = CONFIG_DIR / "grpo_gsm8k.yaml"

# speed switches a measurement settled (docs/configuration.md): gone from the config, their winner always on
RETIRED_KEYS = {
    "gpu_run_threads": "each process of a GPU run now always takes one CPU thread",
    "model.cudnn_attention": "cuDNN's attention is now always off",
    "inference_model.sampler_kernel": "a GPU now always draws tokens by the Triton kernels where top_k/top_p are off",
    "inference_model.filled_slots": "a GPU in half precision now always reads the filled KV-cache slots only",
}


def base_schema() -> dict:
    base = OmegaConf.to_container(OmegaConf.load(BASE_CONFIG), resolve=False)
    base.pop("defaults", None)
    return base


def not_a_key(key: str, schema: dict) -> ConfigError | None:
    """The error for ``key`` (dotted) where it names no config key, with the closest key at the first unknown level;
    None where it names one."""
    path = ""
    for part in key.split("."):
        if not isinstance(schema, dict) or part not in schema:
            break
        schema, path = schema[part], f"{path}{part}."
    else:
        return None
    where = path + part
    close = difflib.get_close_matches(part, [str(k) for k in schema], n=1) if isinstance(schema, dict) else []
    return ConfigError(f"{where} is not a config key{f' (did you mean {path}{close[0]}?)' if close else ''}; "
                       "config/grpo_gsm8k.yaml lists them all.")


def check_keys_and_types(cfg) -> None:
    """Each key of the composed config is one of grpo_gsm8k.yaml's, and each flag and number is one there too.

    Hydra refuses an unknown key on the command line but merges one from a user's own YAML without a word (a
    misspelt knob would silently keep its default), and takes ``train.packed_sequences=yes`` as a string, which is
    true. A key whose base value is null (a mapping or list the user fills in) is not looked into."""
    base = base_schema()

    def walk(node: dict, schema: dict, path: str) -> None:
        for key, value in node.items():
            where = f"{path}{key}"
            if where in RETIRED_KEYS:
                raise ConfigError(f"{where} is retired: {RETIRED_KEYS[where]} (docs/configuration.md); drop it.")
            if key not in schema:
                raise not_a_key(where, base)
            expected = schema[key]
            if value is None or expected is None or isinstance(value, str) and value.startswith("${"):
                continue  # null, or an interpolation: its target is checked where it stands
            if isinstance(expected, dict):
                if not isinstance(value, dict):
                    raise ConfigError(f"{where}={value!r} must be a mapping of keys ({', '.join(expected)}).")
                walk(value, expected, f"{where}.")
            elif isinstance(expected, bool) and not isinstance(value, bool):
                raise ConfigError(f"{where}={value!r} must be true or false.")
            elif type(expected) in (int, float) and (type(value) not in (int, float)):
                raise ConfigError(f"{where}={value!r} must be a number.")

    walk({k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}, base, "")


def check_retired_overrides(overrides) -> None:
    """A command-line override of a retired key stops the run in one line that says what replaced it (Hydra's own
    refusal only says the key is not in the config)."""
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in RETIRED_KEYS:
            raise ConfigError(f"{key} is retired: {RETIRED_KEYS[key]} (docs/configuration.md); drop {override!r}.")


def show_help() -> None:
    """Hydra's ``--help`` (config/hydra/help/grpo.yaml: the configs, the main knobs) or ``--hydra-help``, printed by a
    Hydra app that runs nothing, as the scripts' own would print it: Hydra exits once it has."""
    hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="grpo_gsm8k")(lambda cfg: None)()


def check_command_line(argv: list[str], validate: Callable = check_keys_and_types):
    """The config a script's command line names, composed as Hydra will and checked by ``validate`` (the scripts
    pass ``grpo.loop.config.validate_config``, which runs ``check_keys_and_types`` first).

    ``--help`` and ``--hydra-help`` are printed here (``show_help``). Only a plain command line (``--config-name``
    and ``key=value`` overrides) is read; any other flag (a sweep, ``--config-dir``...) is left to Hydra and to the
    same checks in the run, as are Hydra's own ``hydra.*`` overrides. Hydra's refusal of an unknown key spans five
    lines without a suggestion; this one is a line that names the closest key. The composed config, or None where
    the command line was left to Hydra."""
    check_retired_overrides(argv)
    if {"--help", "-h", "--hydra-help"} & set(argv):
        show_help()
    config_name, overrides, args = "grpo_gsm8k", [], iter(argv)
    for arg in args:
        if arg in ("--config-name", "-cn"):
            config_name = next(args, config_name)
        elif arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return None
        elif not arg.lstrip("+~").startswith("hydra."):
            overrides.append(arg)
    if not (CONFIG_DIR / f"{config_name.removesuffix('.yaml')}.yaml").is_file():  # Hydra's refusal: its search path
        close = difflib.get_close_matches(config_name, sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"--config-name {config_name}: no such config{hint}; --help lists them.")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides)
        except HydraException as e:
            unknown = re.match(r"Could not override '([^']+)'", str(e))
            if unknown and (error := not_a_key(unknown.group(1), base_schema())):
                raise error from None
            return None  # another mistake (bad override syntax): Hydra's own message, in the run
        except Exception as e:  # an override OmegaConf cannot apply (a name into a list): Hydra shows a traceback
            raise ConfigError(f"{first_unapplied(config_name, overrides)}: cannot be applied ({e}); a list is set "
                              "whole (key=[a,b]) or an item by its index (key.0=a).") from None
    validate(cfg)
    return cfg


def no_gpu_here() -> bool:
    """True only where torch would see no GPU either: CUDA_VISIBLE_DEVICES hides them all, or the machine has no
    NVIDIA, AMD or WSL GPU device node. Read without torch (its import: ~3 s); torch's count decides in the run."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return True
    return not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def first_unapplied(config_name: str, overrides: list[str]) -> str:
    """The first of ``overrides`` that composing ``config_name`` cannot apply (call inside initialize_config_dir)."""
    for n, override in enumerate(overrides, 1):
        try:
            compose(config_name, overrides=overrides[:n])
        except Exception:
            return override
    return " ".join(overrides)


def check_before_imports(validate: Callable) -> None:
    """The scripts' first step: their command line checked by ``check_command_line``, a mistake printed as its one
    line (exit 2). Alone or as rank 0 only: the other ranks hear of a mistake from rank 0."""
    if os.environ.get("RANK", "0") == "0":
        with clear_errors():
            cfg = check_command_line(sys.argv[1:], validate)
            if cfg is not None and not cfg.allow_cpu and cfg.ray.address is None and no_gpu_here():
                raise DeviceAllocationError(NO_GPU)  # on a laptop: this line in 1 s, not after the imports (~11 s)
