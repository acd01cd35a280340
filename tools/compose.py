"""The config as the scripts see it, for tests and benchmarks (Hydra compose, no run dir)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"


def compose_config(config_name: str = "grpo_tiny", overrides: list[str] | None = None, *,
                   return_hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides or [], return_hydra_config=return_hydra_config)
