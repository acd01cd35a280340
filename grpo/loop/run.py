"""The run both scripts share: ``start_run`` builds its parts, ``train_loop`` drives them over a rollout
source (``grpo.rollout.local_rollouts`` says what one does), and ``guard`` is the crash policy.

    start_run:  config and device checks (``check_start``), data checks, seeds, run dir and resume, models,
                engine, eval, logger
    train_loop: eval; for each step: rollouts -> update -> commit -> weights to the engines -> log,
                eval and checkpoint when due; at the end eval, checkpoint and export

On several trainer ranks this is rank 0's run; ``follow_run`` is the other ranks' (``grpo/process/world.py``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tensordict import set_list_to_stack
from tqdm import tqdm

from grpo.inference.engine import make_inference
from grpo.inference.generation import EngineSettings
from grpo.loop.disk_room import HeldRoom, check_room_at_start, checkpoint_bytes
from grpo.loop.config import validate_config, warn_if_too_few_rows
from grpo.loop.evaluation import Evaluator
from grpo.loop.logger import ROW_FILES, RunLogger, profile_to, reply_samples
from grpo.loop.records import RunRecords, checkpoint_note
from grpo.loop.resume import check_resumable, find_checkpoint, truncate_metrics
from grpo.loop.settings import EvalSettings, RecordSettings, ResumeSettings
from grpo.process.console import say
from grpo.process.devices import DeviceAllocation, PlacementSettings, allocate_devices
from grpo.process.errors import CheckpointError, ConfigError, UserError
from grpo.process.launch import exit_with_leader
from grpo.process.setup import (REPO_ROOT, RunDirClaim, StopFlag, StopRequested, freeze_long_lived_objects,
                                raise_if_interrupted_twice, resolved_config, seed_everything,
                                write_hydra_record)
from grpo.process.world import World
from grpo.rollout.dynamic_sampling import draw_step_batch
from grpo.rollout.local_rollouts import RankGeneration
from grpo.rollout.settings import RolloutSettings
from grpo.tasks.envs import load_splits, task_of
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.prompt_checks import check_prompt_lengths, check_prompt_text
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import make_turn_env, turn_stop_ids
from grpo.training.models import (configure_torch, load_policy_model, load_reference_model, load_tokenizer,
                                  stop_token_ids)
from grpo.training.settings import ModelSettings
from grpo.training.trainer import Trainer, TrainerSettings


@dataclass
class Run:
    """The parts of one run, each with its own job; ``step`` is the GRPO step in progress (or last done)."""
    record_settings: RecordSettings  # the steps, what they show and keep
    rollout: RolloutSettings    # how a step's replies are drawn
    devices: DeviceAllocation
    tokenizer: object
    task: TaskSettings          # what the task envs, data checks and turn environments read
    stop_ids: list[int]
    trainer: Trainer            # policy, optimiser, GRPO step, policy version
    engine: object              # this process's inference engine (sync: the rollouts' too)
    evaluator: Evaluator
    records: RunRecords         # metrics, samples, checkpoints, export, summary
    stop_flag: StopFlag
    claim: RunDirClaim
    resume_payload: dict | None
    eval_only: bool             # train.total_steps=0: evaluate model.name or resume='s checkpoint, train nothing
    step: int = 0
    out_of_minutes: bool = False  # train.max_minutes ended the run before train.total_steps

    @property
    def run_dir(self) -> Path:
        return self.records.run_dir

    def train_on(self, rollouts) -> dict:
        """One GRPO step on a batch of whole groups, its samples shown first (a step that fails still shows
        what it trained on); returns its metrics."""
        shown = self.record_settings
        if shown.samples_every and self.step % shown.samples_every == 0:
            self.records.logger.log_samples(self.step, reply_samples(rollouts, shown.samples_count, self.tokenizer))
        return self.trainer.update(rollouts, self.step)

    def evaluate_if_due(self, force: bool = False) -> None:
        """And after an eval, the best checkpoint and the collapse warning (``grpo.loop.best``)."""
        result = self.evaluator.evaluate_if_due(self.step, self.trainer, self.records.logger, force=force)
        if result and not self.eval_only:
            self.records.after_eval(self.step, result["eval/accuracy"], self.trainer, self.counters())

    def checkpoint_if_due(self, extras: Callable[[], dict], force: bool = False, rng: dict | None = None) -> None:
        """``extras``: what the rollout source keeps in a checkpoint (its ``state``), asked only when one is due."""
        freq = self.record_settings.checkpoint_frequency
        if self.records.last_checkpoint and self.records.last_checkpoint[0] == self.step:
            return  # the end of a run whose last step was a periodic one wrote step N twice, needing room for both
        if force or (freq and self.step % freq == 0):
            self.records.save_checkpoint(self.step, self.trainer, self.counters(), extras(), rng=rng)

    def counters(self) -> dict:
        return {"step": self.step, "policy_version": self.trainer.policy_version,
                "last_eval_step": self.evaluator.last_eval_step}


def check_start(cfg, *, inference_engines: int, dedicated_inference: bool, ray_gpu=None) -> DeviceAllocation:
    """The config and device checks, which read no data, load no model and need no other rank: rank 0 runs them
    before it starts any (``trainer_world``: a bad value of grpo_tiny on 2 CPU ranks fails in 9 s, not 21 s), and
    ``start_run`` again (under torchrun, with ``train_model.num_devices`` torchrun's count by then)."""
    resolve_local_paths(cfg)
    validate_config(cfg)
    return allocate_devices(PlacementSettings.from_config(cfg), inference_engines=inference_engines,
                            dedicated_inference=dedicated_inference, placed_by_ray=ray_gpu is not None)


def start_run(cfg, *, inference_engines: int, dedicated_inference: bool, ray_gpu=None) -> Run:
    """``dedicated_inference``: rollout workers elsewhere generate, and this process's engine (eval only) sits on the
    training GPU. ``ray_gpu``: a Ray cluster places the ranks, rank 0 on this GPU (``ray_placement.driver_gpu``)."""
    task_config = OmegaConf.to_yaml(cfg)  # as Hydra composed it: the run dir's .hydra/config.yaml
    devices = check_start(cfg, inference_engines=inference_engines, dedicated_inference=dedicated_inference,
                          ray_gpu=ray_gpu)
    devices = devices.on_gpu(ray_gpu()) if devices.placed_by_ray else devices
    task = TaskSettings.from_config(cfg)  # after check_start: resolve_local_paths rewrites env.dataset
    splits = load_splits(task)  # bad data, and reward functions that cannot take its rows, stop here
    warn_if_too_few_rows(cfg, len(splits[cfg.env.train_split]))
    print(devices.describe(), flush=True)
    seed_everything(cfg.seed)
    run_dir, payload, last_checkpoint = Path(HydraConfig.get().runtime.output_dir), None, None
    eval_only = cfg.train.total_steps == 0
    # what a second Ctrl-C says the run keeps; the records say it once they exist (below)
    stop_flag = StopFlag(lambda: checkpoint_note(last_checkpoint, run_dir))
    if cfg.resume:
        ckpt_path, payload = find_checkpoint(
            str(cfg.resume), experiment_name=cfg.logging.experiment_name,
            overrides=list(HydraConfig.get().overrides.task),
            search_roots=[REPO_ROOT / "outputs", REPO_ROOT / "multirun"])
        check_resumable(ckpt_path, payload, ResumeSettings.from_config(cfg), resolved_config(cfg))
        last_checkpoint = (payload["step"], ckpt_path)
        if not eval_only:  # continue in the original run dir: its metrics, checkpoints and wandb run
            run_dir = ckpt_path.parent.parent
    claim = RunDirClaim(run_dir)  # before this run writes anything into it
    try:
        run = _build(cfg, task, splits, task_config, run_dir, payload, last_checkpoint, eval_only, devices, stop_flag,
                     claim, dedicated_inference=dedicated_inference)
    except BaseException:
        claim.release()
        raise
    stop_flag.last_checkpoint = run.records.last_checkpoint_note
    return run


def _build(cfg, task: TaskSettings, splits, task_config, run_dir: Path, payload, last_checkpoint, eval_only, devices,
           stop_flag, claim, *, dedicated_inference: bool) -> Run:
    """The rest of the start, in the run dir this run holds: checks, models, optimiser, logger, restore."""
    if payload and not eval_only:  # its .hydra/ stays that of the command that started it (resume=auto's match)
        for rows in ("metrics.jsonl", *ROW_FILES):
            truncate_metrics(run_dir / rows, payload["step"])
        print(f"resuming from {last_checkpoint[1]} (step {payload['step']}) into {run_dir}", flush=True)
    elif (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run (its metrics.jsonl and checkpoints "
                          f"would be mixed with this one's); pass resume={run_dir} to continue it, or another "
                          "hydra.run.dir.")
    else:
        write_hydra_record(run_dir, task_config)
    models, engine_settings = ModelSettings.from_config(cfg), EngineSettings.from_config(cfg)
    if dedicated_inference:  # rollouts come from workers: this engine only evaluates, on the train GPU, through our
        # decode loop over the policy's own weights (a vLLM engine here held a copy and half that GPU: 71 GB of an H200)
        engine_settings = replace(engine_settings, backend="transformers")
    if eval_only:
        print(f"train.total_steps=0: evaluating {last_checkpoint[1] if payload else models.name} only, "
              f"into {run_dir}", flush=True)
    config_record = resolved_config(cfg) | {"device_allocation": devices.as_dict()}
    tokenizer = load_tokenizer(models.name)
    check_prompt_lengths(task, tokenizer, splits)  # before any model loads: a too-long prompt hangs mid-run
    check_prompt_text(task, tokenizer, splits)
    # before the engine: a trainer over several ranks shards the policy, and the engine then keeps its own copy
    say(f"loading {models.name}: the policy{', its frozen reference' if models.reference else ''} and "
        f"the {engine_settings.backend} {'eval ' if dedicated_inference else ''}engine")
    world = World.from_env()
    trainer = make_trainer(models, TrainerSettings.from_config(cfg), tokenizer, devices, world)
    world.lead("start", cfg, devices)  # the other ranks build the same trainer from the config (``follow_run``)
    stop_ids = turn_stop_ids(task, tokenizer, stop_token_ids(tokenizer, trainer.policy_model.generation_config))
    engine = make_inference(engine_settings, trainer.engine_weights(), tokenizer, stop_ids=stop_ids,
                            device=devices.torch_device("train" if dedicated_inference else "inference"))
    engine.turn_env = make_turn_env(task, tokenizer)  # what answers between turns (None: one turn an episode)
    trainer.take_samples_from(engine)  # ref_model.score_early: the reference scores replies as they are sampled
    record_settings = RecordSettings.from_config(cfg)  # what the logger, trackers, checkpoints and disk checks read
    if not eval_only:  # a disk that cannot hold the run's checkpoints would lose every step since the last one
        check_room_at_start(record_settings, run_dir, payload["step"] if payload else 0, trainer.trainable_bytes())
    logger = RunLogger(str(run_dir), record_settings, config_record,
                       wandb_run_id=payload.get("wandb_run_id") if payload and not eval_only else None)
    event = "eval_only" if eval_only else "resume" if payload else "start"
    logger.log({"step": payload["step"] if payload else 0, "event": event,
                **{f"devices/{k}": str(v) for k, v in devices.as_dict().items()}})
    counters = payload["counters"] if payload else {"step": 0, "last_eval_step": None}
    eval_settings = EvalSettings.from_config(cfg)
    evaluator = Evaluator(eval_settings, task, tokenizer, engine, fields=task_of(task).eval_fields,
                          num_problems=min(eval_settings.num_problems, len(splits[task.test_split])),
                          last_eval_step=None if eval_only else counters["last_eval_step"])
    if payload:  # eval only: the checkpoint is evaluated here
        trainer.restore(payload, last_checkpoint[1])  # RNG states last of all
        engine.push_weights(trainer.engine_weights(), trainer.policy_version)
    # this process's GPUs; with dedicated inference its own engine (eval only) sits on the training GPU
    gpu_ids = sorted({*devices.train, *devices.ref, *([] if dedicated_inference else devices.inference)})
    # made last: a start that fails leaves no room file behind
    room = None if eval_only else HeldRoom(run_dir, checkpoint_bytes(trainer.trainable_bytes()))
    records = RunRecords(record_settings, run_dir, config_record, logger, last_checkpoint, gpu_ids, room)
    return Run(record_settings=record_settings, rollout=RolloutSettings.from_config(cfg), devices=devices,
               tokenizer=tokenizer, task=task, stop_ids=stop_ids, trainer=trainer, engine=engine, evaluator=evaluator,
               records=records, stop_flag=stop_flag, claim=claim, resume_payload=payload, eval_only=eval_only,
               step=counters["step"])


def make_trainer(models: ModelSettings, settings: TrainerSettings, tokenizer, devices: DeviceAllocation,
                 world: World) -> Trainer:
    """The policy (sharded over ``world``'s ranks), the frozen reference and the GRPO step."""
    configure_torch(on_gpu=not devices.cpu)
    own = devices.for_rank(world.rank, world.size)  # this rank's train GPU (and the reference beside it)
    if (gpu := devices.current_gpu(world.rank, world.size)) is not None:
        torch.cuda.set_device(gpu)  # before any GPU work: FSDP2 shards onto the current GPU, NCCL's communicator too
    policy_model = load_policy_model(models, tokenizer, own.torch_device("train"))
    ref_model = load_reference_model(models, tokenizer, own.torch_device("ref")) if models.reference else None
    return Trainer(settings, policy_model, ref_model, pad_token_id=tokenizer.pad_token_id, world=world)


def follow_run(own_gpu: int | None = None) -> int:
    """A data-parallel rank other than 0 (rank 0 started it, or torchrun): no config, run dir or output of its own,
    and an engine only where every rank generates (sync, ``DeviceAllocation.generating_ranks``); it ends with rank 0,
    however that ends (``exit_with_leader``). It builds the trainer rank 0 built, from the config rank 0 checked and
    sends, then runs each collective rank 0 leads (``Trainer.follow``) on ``own_gpu`` where a Ray cluster placed it;
    returns the exit status rank 0 ends with."""
    exit_with_leader()
    set_list_to_stack(True).set()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # torchrun forwards them, and a terminal's Ctrl-C reaches every rank
        signal.signal(signum, signal.SIG_IGN)  # rank 0 alone decides: it checkpoints, then leads the stop
    world = World.from_env()
    command, args = world.next_command()
    if command == "stop":  # rank 0 ended before it trained: a bad config or data set, say
        return args[0]
    cfg, devices = args
    devices = devices.on_gpu(own_gpu) if devices.placed_by_ray else devices
    models = ModelSettings.from_config(cfg)
    tokenizer = load_tokenizer(models.name)
    trainer = make_trainer(models, TrainerSettings.from_config(cfg), tokenizer, devices, world)
    if devices.generating_ranks == 1:
        return trainer.follow()
    # sync with an engine per rank: this rank generates its share of every step too
    generation = RankGeneration(EngineSettings.from_config(cfg), RolloutSettings.from_config(cfg),
                                TaskSettings.from_config(cfg), tokenizer,
                                stop_token_ids(tokenizer, trainer.policy_model.generation_config),
                                devices.for_rank(world.rank, world.size).torch_device("inference"), world)
    try:
        return trainer.follow(generation)
    finally:
        generation.shutdown()


def train_loop(run: Run, source) -> Run:
    """Train until ``train.total_steps`` on what ``source`` generates (the end as ``guard`` says); then shut it down."""
    try:
        with guard(run, source):
            run.evaluate_if_due(force=True)
            for step in steps(run):
                t0 = run.records.start_step()
                # one collection; with dynamic sampling, more until every group trained has distinct rewards
                rollouts, filtering = draw_step_batch(
                    lambda: source.next_rollouts(run.trainer.policy_version), run.rollout.replies_per_step,
                    dynamic=run.rollout.dynamic_sampling, max_extra_batches=run.rollout.max_extra_batches)
                metrics = run.train_on(rollouts)  # dense batch, reference and KL, advantages, clipped loss, optimiser
                source.commit()                   # its prompt batches now count as trained
                metrics |= source.after_update(run.trainer.engine_weights, run.trainer.policy_version)  # gathers only if due
                run.records.log_step(step, metrics | filtering | source.step_metrics(), t0)
                run.evaluate_if_due()
                run.checkpoint_if_due(source.state)
                run.records.check_room()
    finally:
        source.shutdown()
    return run


def steps(run: Run):
    """The steps left, under a progress bar; a stop signal ends the run at a step boundary, and so does
    ``train.max_minutes`` once the steps (a resumed run's before too) have taken that long."""
    settings = run.record_settings
    bar = tqdm(range(run.step + 1, settings.total_steps + 1), desc="GRPO", unit="step",
               disable=not settings.progress_bar, dynamic_ncols=True)
    bar.set_postfix_str("the first step: generating, scoring, training (its compiles make it the slowest)")
    for step in bar:
        if settings.max_minutes is not None and run.records.train_seconds >= 60 * settings.max_minutes:
            bar.close()
            run.out_of_minutes = True
            say(f"train.max_minutes={settings.max_minutes} reached after step {run.step} "
                f"({run.records.train_seconds / 60:.2f} minutes of steps): the run ends there, as finished")
            return
        run.step = step
        with profile_to(str(run.run_dir), step) if step == settings.profile_step else contextlib.nullcontext():
            yield step
        freeze_long_lived_objects()  # the first step's compiles are done: the collector need not walk it all again
        bar.set_postfix(run.records.postfix)
        run.stop_flag.raise_if_set()  # at a step boundary, after that step's eval and checkpoint


@contextlib.contextmanager
def guard(run: Run, source):
    """On success: final eval, checkpoint and export (eval only: the eval alone). On SIGTERM/Ctrl-C:
    checkpoint, then exit non-zero. Either way the run ends with its summary. On any other exception:
    an emergency checkpoint of the last finished step if the weights are whole, then the exception goes on.
    ``source``: the rollout source whose state the checkpoints keep."""
    records, trainer, exit_code, ended = run.records, run.trainer, 1, None
    try:
        yield
        run.evaluate_if_due(force=run.out_of_minutes)  # the last step is always evaluated
        if not run.eval_only:
            run.checkpoint_if_due(source.state, force=True)
            if run.record_settings.export:
                records.export(run.step, trainer.policy_model, trainer.whole_weights(), run.tokenizer)
        exit_code, ended = 0, "evaluated (train.total_steps=0)" if run.eval_only else "finished"
    except StopRequested as stop:
        rng = None
        if stop.within_step:  # the step in progress is dropped: the checkpoint is of the last one finished
            run.step, rng = trainer.completed_step, trainer.completed_rng
        if rng is not None or not stop.within_step:
            say(f"stopping after step {run.step}: {stop}; writing a checkpoint")
            run.checkpoint_if_due(source.state, force=True, rng=rng)
        ended = f"stopped after step {run.step} ({stop})"
        raise SystemExit(stop.exit_code)
    except BaseException as err:  # a SystemExit or KeyboardInterrupt from a library too: the finished steps are kept
        raise_if_interrupted_twice()  # no emergency checkpoint: the user asked to stop now
        failed = f"step {run.step} failed ({type(err).__name__})"
        saved = records.last_checkpoint[0] if records.last_checkpoint and records.last_checkpoint[1].exists() else None
        last = records.last_checkpoint_note()
        if trainer.half_updated:
            note = f"{failed} inside the optimiser update: no emergency checkpoint of half-updated weights; {last}"
        elif not trainer.weights_finite():
            note = f"{failed} with non-finite weights: no emergency checkpoint; {last}"
        elif isinstance(err, CheckpointError):  # an emergency checkpoint would fail as this one did
            note = f"{failed}: its checkpoint was not written; {last}"
        elif trainer.completed_rng is None or saved == trainer.completed_step:
            # a bad input's own one line says it all when there is nothing to save
            note = None if isinstance(err, UserError) else \
                f"{failed}; no step finished since the start or the last checkpoint; {last}"
        else:
            run.step = trainer.completed_step  # what the checkpoint describes: counters, RNG and extras of that step
            try:
                run.checkpoint_if_due(source.state, force=True, rng=trainer.completed_rng)
                note = (f"{failed}; emergency checkpoint of step {run.step}: {records.last_checkpoint[1]} "
                        f"(resume={run.run_dir} continues from it)")
            except Exception as save_err:  # the original error matters more: report this one, raise that one
                note = f"{failed}; so did its emergency checkpoint ({type(save_err).__name__}: {save_err}); {last}"
        if note:
            say(note, file=sys.stderr)
        raise
    finally:
        run.engine.shutdown()
        try:
            records.logger.close(exit_code)  # writes metrics.png
        except Exception as close_err:
            if exit_code == 0:  # nothing else went wrong: this is the run's error
                raise
            # the error that stopped the run matters more: report this one, let that one go on
            say(f"also: closing the run's logs failed ({type(close_err).__name__}: {close_err})", file=sys.stderr)
        if ended:
            print(records.summary(ended), flush=True)
        if records.room:
            records.room.release()  # a run that ended keeps no room
        run.claim.release()
