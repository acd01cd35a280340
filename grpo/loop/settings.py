"""What the loop layer reads of the config, in one place: ``RecordSettings.from_config`` (the logger, trackers,
checkpoints, disk room, best weights and the steps), ``EvalSettings.from_config`` (the held-out eval) and
``ResumeSettings.from_config`` (resume='s checks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grpo.loop.trackers import tracker_names


@dataclass(frozen=True)
class RecordSettings:
    """Where a run's rows go and which checkpoints it keeps, read from the config once: the logger, the trackers,
    the run's records, the disk-room checks, the best checkpoint and the loop's steps take these, never the config
    itself."""
    logger: str | Sequence[str]     # logger=: a tracker's name, a list of them, or none
    experiment_name: str            # the trackers' run name (wandb's, MLflow's experiment)
    wandb_project: str
    wandb_entity: str | None        # wandb's team or user; None: its default
    wandb_mode: str                 # auto (online with an API key, else offline), online or offline
    checkpoint_dir: str             # the run dir's folder of checkpoints
    keep_last: int                  # checkpoints kept, older ones deleted; 0: all
    keep_best: bool                 # the best held-out eval's weights kept in <run dir>/best/
    checkpoint_frequency: int       # GRPO steps between checkpoints; 0: only at the end
    total_steps: int                # the run's last step, where its final checkpoint is written
    max_minutes: float | None       # or the run ends once its steps have taken this long (resumed runs included)
    export: bool                    # the end of a run writes <run dir>/export
    samples_every: int              # GRPO steps between shown replies; 0: never
    samples_count: int              # prompts shown each time
    progress_bar: bool              # tqdm's bar over the steps
    profile_step: int | None        # a step recorded with torch.profiler

    @classmethod
    def from_config(cls, cfg) -> RecordSettings:
        logging, wandb = cfg.logging, cfg.wandb
        return cls(logger=cfg.logger, experiment_name=logging.experiment_name, wandb_project=wandb.project,
                   wandb_entity=wandb.entity, wandb_mode=wandb.mode, checkpoint_dir=logging.checkpoint_dir,
                   keep_last=logging.keep_last, keep_best=logging.keep_best,
                   checkpoint_frequency=cfg.train.checkpoint_frequency, total_steps=cfg.train.total_steps,
                   max_minutes=cfg.train.max_minutes,
                   export=logging.export, samples_every=logging.samples_every, samples_count=logging.samples_count,
                   progress_bar=logging.progress_bar, profile_step=logging.profile_step)

    @property
    def trackers(self) -> list[str]:
        """``logger=``'s trackers, ``none`` left out."""
        return tracker_names(self.logger)


@dataclass(frozen=True)
class EvalSettings:
    """When the held-out eval runs and on how many problems, read from the config once: the ``Evaluator`` takes
    these."""
    frequency: int                  # GRPO steps between evals; 0: only before and after training
    total_steps: int                # the run's last step, always evaluated
    num_problems: int               # held-out problems an eval scores (at most the split's)
    batch_size: int                 # prompts generated together
    samples_per_problem: int        # k > 1: k sampled replies a problem too (pass@k, avg@k)
    save_replies: bool              # each eval's greedy replies in eval_replies.jsonl

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        e = cfg.eval
        return cls(frequency=e.frequency, total_steps=cfg.train.total_steps, num_problems=e.num_problems,
                   batch_size=e.batch_size, samples_per_problem=e.samples_per_problem, save_replies=e.save_replies)


@dataclass(frozen=True)
class ResumeSettings:
    """What decides whether a checkpoint may continue this run, beside the resolved config it is compared with
    (``check_resumable``)."""
    checkpoint_dir: str             # the run dir's folder of checkpoints, where a resumed one must sit
    total_steps: int                # 0: evaluation only, any config may read the weights
    importance_sampling: str        # with is_high: what a retired train.inference_is_cap became
    is_high: float
    schedule: str                   # optimizer.schedule: a cosine one's length is part of the run's meaning
    allow_changes: bool             # resume_allow_changes: a changed meaning warns instead of refusing

    @classmethod
    def from_config(cls, cfg) -> ResumeSettings:
        train = cfg.train
        return cls(checkpoint_dir=cfg.logging.checkpoint_dir, total_steps=train.total_steps,
                   importance_sampling=train.importance_sampling, is_high=train.is_high,
                   schedule=cfg.optimizer.schedule, allow_changes=cfg.resume_allow_changes)
