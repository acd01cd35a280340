"""Where a run's rows go besides ``metrics.jsonl``: ``logger=`` wandb, tensorboard, mlflow or csv (or a list of
them), each through TorchRL's own logger (``torchrl.record.loggers``) and written under the run dir; a ``Tracker``
adds what TorchRL's loggers take unevenly: text (replies to read) and an image (the final plot)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # settings.py imports tracker_names from here
    from grpo.loop.settings import RecordSettings

TRACKER_DIRS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlruns", "csv": "csv"}  # in the run dir


def tracker_names(value) -> list[str]:
    """``logger=``'s trackers: one name, a list of names, or none."""
    names = [value] if isinstance(value, str) else list(value)
    return [name for name in names if name != "none"]


class Tracker:
    """One TorchRL logger (``kind`` one of ``grpo.loop.config.TRACKERS``): every row's numbers as scalars at its
    step, replies as text where the tool takes text, the final plot as an image where it takes images."""

    def __init__(self, kind: str, logger):
        self.kind, self.logger = kind, logger
        self._samples_table = None  # wandb: one table for the run, each log uploading only the new rows

    def log(self, row: dict) -> None:
        numbers = {self._name(k): v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self.logger.log_metrics(numbers, step=int(row["step"]))

    def samples(self, step: int, rows: list[dict], columns: list[str], text: str) -> None:
        """Replies to read: ``rows`` (wandb: a table of ``columns``), else ``text`` (the console's lines)."""
        if self.kind == "wandb":
            import wandb

            if self._samples_table is None:
                self._samples_table = wandb.Table(columns=columns, log_mode="INCREMENTAL")
            for row in rows:
                self._samples_table.add_data(*(row[c] for c in columns))
            self.logger.experiment.log({"samples": self._samples_table, "step": step})
        elif self.kind == "tensorboard":  # markdown: indented, the lines stay as printed
            self.logger.experiment.add_text("samples", "\n".join("    " + line for line in text.splitlines()), step)
        elif self.kind == "csv":  # csv/texts/samples<step>.txt
            self.logger.experiment.add_text("samples", text + "\n", step)
        else:
            import mlflow

            mlflow.log_text(text + "\n", f"samples/step_{step:08d}.txt")

    def image(self, name: str, png: Path, step: int) -> None:
        """The plot ``png`` (CSV takes no images: the file is beside it in the run dir)."""
        if self.kind == "wandb":
            import wandb

            self.logger.experiment.log({name: wandb.Image(str(png)), "step": step})
        elif self.kind == "tensorboard":
            from matplotlib.image import imread

            self.logger.experiment.add_image(name, imread(png)[..., :3], step, dataformats="HWC")
        elif self.kind == "mlflow":
            import mlflow

            mlflow.log_artifact(str(png))

    def close(self, exit_code: int) -> None:
        if self.kind == "wandb":
            self.logger.experiment.finish(exit_code=exit_code)
        elif self.kind == "mlflow":  # TorchRL's MLFlowLogger leaves its run open
            import mlflow

            mlflow.end_run("FINISHED" if exit_code == 0 else "FAILED")
        else:
            self.logger.shutdown()

    def _name(self, name: str) -> str:
        # MLflow takes letters, digits, _ - . / : and spaces only
        return name.replace("@", "_at_") if self.kind == "mlflow" else name


def start_trackers(settings: RecordSettings, run_dir: Path, resolved_config: dict,
                   wandb_run_id: str | None) -> list[Tracker]:
    """A tracker for each of ``logger=``'s names, writing under ``run_dir``; ``resolved_config``: the run's whole
    config, which wandb keeps with the run."""
    from torchrl.record.loggers import CSVLogger, MLFlowLogger, TensorboardLogger

    trackers = []
    for kind in settings.trackers:
        if kind == "wandb":
            logger = _wandb_logger(settings, run_dir, resolved_config, wandb_run_id)
        elif kind == "tensorboard":
            logger = TensorboardLogger(exp_name=TRACKER_DIRS[kind], log_dir=str(run_dir))
        elif kind == "csv":
            logger = CSVLogger(exp_name=TRACKER_DIRS[kind], log_dir=str(run_dir))
        else:
            store = run_dir / TRACKER_DIRS[kind]
            logger = MLFlowLogger(exp_name=_mlflow_experiment(settings.experiment_name, store),
                                  tracking_uri=store.as_uri())
        trackers.append(Tracker(kind, logger))
    return trackers


def _mlflow_experiment(name: str, store: Path) -> str:
    """``name``, made in the file store ``store`` if new, with MLflow's own artifact place (inside its folder).
    TorchRL's would put run folders at the store's top, which MLflow's readers then take for broken experiments."""
    import mlflow

    # MLflow 3.10+ refuses a file store unless asked: a folder in the run dir needs no database or server
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(store.as_uri())
    if mlflow.get_experiment_by_name(name) is None:
        mlflow.create_experiment(name)
    return name


def wandb_naming(experiment_name: str, hydra_cfg) -> dict:
    """wandb.init's name, group and notes: a sweep job (``--multirun``) is ``<experiment_name>-<job number>``
    in the group of its sweep dir, its overrides in the notes; a single run is ``experiment_name``, in no group."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return {"name": experiment_name}
    # The overrides would make distinct names too, but with paths in them they pass the 128 characters wandb
    # takes; for the group, the end of the sweep dir (its time) matters most.
    return {"name": f"{experiment_name}-{hydra_cfg.job.num}", "notes": hydra_cfg.job.override_dirname,
            "group": f"{experiment_name} {hydra_cfg.sweep.dir}"[-128:]}


def _wandb_logger(settings: RecordSettings, run_dir: Path, resolved_config: dict, run_id: str | None):
    import wandb
    from hydra.core.hydra_config import HydraConfig
    from torchrl.record.loggers import WandbLogger

    mode = settings.wandb_mode
    if mode == "auto":
        mode = "online" if (os.environ.get("WANDB_API_KEY") or _has_netrc_key()) else "offline"
    # wandb advertises Weave whenever openai is imported (vLLM and others import it); no use to a GRPO run
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    naming = wandb_naming(settings.experiment_name, HydraConfig.get())
    return WandbLogger(
        exp_name=naming.pop("name"), save_dir=str(run_dir), id=run_id, project=settings.wandb_project,
        log_env_packages=False, entity=settings.wandb_entity, **naming, config=resolved_config, mode=mode,
        resume="allow" if run_id else None,
        # quiet: where the run is saved, but no history and summary dump at the end (metrics.jsonl has them)
        settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True))


def _has_netrc_key() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
