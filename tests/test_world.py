"""Data-parallel training (grpo/process/world.py): two FSDP2 ranks over gloo train exactly as one rank does,
and a checkpoint written by either resumes on the other."""

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from conftest import compose
from grpo.inference.engine import TransformersInference
from grpo.inference.generation import EngineSettings, weights_checksum
from grpo.tasks.paths import resolve_local_paths
from grpo.process.world import World, is_sharded
from grpo.training.batch import micro_batch_rows
from grpo.training.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from grpo.training.models import load_policy_model, load_reference_model, load_tokenizer, stop_token_ids
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings
from grpo.training.trainer import Trainer, TrainerSettings
from test_step import setup  # noqa: F401 - a fixture: rollouts of the tiny model, 2 groups of 4

OVERRIDES = ["env.repeats=4", "env.num_envs=8", "train.dialog_turns_per_batch=8", "inference_model.max_new_tokens=24",
             "train.optim_batch_size=4", "train.gradient_accumulation_steps=2", "train.micro_batch_tokens=null"]


def rank_trainer(rank: int, size: int, port: int, model_dir: str, data_dir: str,
                 extra: tuple[str, ...] = ()) -> tuple[World, Trainer]:
    """This rank's world and the trainer as the run builds it (policy sharded over the world, reference whole);
    ``extra``: more config overrides."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = World.from_env()
    cfg = compose("grpo_tiny", [f"model.name={model_dir}", f"env.dataset={data_dir}", *OVERRIDES, *extra])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    cpu = torch.device("cpu")
    models = ModelSettings.from_config(cfg)
    policy, ref = load_policy_model(models, tok, cpu), load_reference_model(models, tok, cpu)
    return world, Trainer(TrainerSettings.from_config(cfg), policy, ref, pad_token_id=tok.pad_token_id, world=world)


def whole_weights(trainer: Trainer) -> dict:
    return trainer.checkpoint_state()["model"]  # every trained weight, gathered (led by rank 0)


def lead_or_follow(world: World, trainer: Trainer, lead) -> None:
    """Rank 0 runs ``lead``, each of the trainer's collectives named to the other ranks as a run's rank 0
    does; the others follow until it ends. The process group stays for the rank's next job (``jobs``)."""
    if world.is_main:
        with world.leading():
            lead()
    else:
        trainer.follow()


def train_three_steps(rank: int, size: int, port: int, model_dir: str, data_dir: str, rollouts_file: str, out: str,
                      extra: tuple[str, ...], ckpt_dir: str | None = None):
    """Three GRPO steps on the same rollouts; rank 0 writes each step's metrics and the whole weights after the last.
    With ``ckpt_dir``: then a checkpoint of step 3 (led by rank 0, every rank's shards in it) and step 4, whose
    whole weights rank 0 writes too (``went_on``): what a resume from that checkpoint must reach."""
    world, trainer = rank_trainer(rank, size, port, model_dir, data_dir, extra)
    rollouts = torch.load(rollouts_file, weights_only=False)

    def lead():
        metrics = [trainer.update(rollouts, step) for step in (1, 2, 3)]
        pushed = trainer.whole_weights()  # what a weight push from a sharded policy sends the engines
        torch.save({"metrics": metrics, "weights": whole_weights(trainer), "pushed": pushed}, out)  # now: one rank's
        if ckpt_dir is not None:                                       # weights are the live tensors, step 4 moves them
            save_checkpoint(ckpt_dir, 3, state=trainer.checkpoint_state(), resolved_config={},
                            counters={"step": 3, "policy_version": trainer.policy_version})
            trainer.update(rollouts, 4)
            torch.save(whole_weights(trainer), out + ".went_on")

    lead_or_follow(world, trainer, lead)


def resume_and_go_on(rank: int, size: int, port: int, model_dir: str, data_dir: str, rollouts_file: str,
                     ckpt_dir: str, out: str):
    """The checkpoint restored (every rank reads it), then step 4. Rank 0 writes the whole weights after step 4."""
    world, trainer = rank_trainer(rank, size, port, model_dir, data_dir)
    rollouts = torch.load(rollouts_file, weights_only=False)

    def lead():
        path = list_checkpoints(Path(ckpt_dir))[-1]
        trainer.restore(load_checkpoint(path), path)
        trainer.update(rollouts, 4)
        torch.save(whole_weights(trainer), out)

    lead_or_follow(world, trainer, lead)


def engine_beside_sharded_policy(rank: int, size: int, port: int, model_dir: str, data_dir: str, rollouts_file: str,
                                 out: str):
    """The transformers engine built on the trained (sharded) policy, as a run's rank 0 builds it, then a step
    and a push; rank 0 writes what the engine holds before and after."""
    world, trainer = rank_trainer(rank, size, port, model_dir, data_dir)

    def lead():
        cfg = compose("grpo_tiny", [f"model.name={model_dir}", f"env.dataset={data_dir}", *OVERRIDES])
        tok = load_tokenizer(model_dir)
        stop_ids = stop_token_ids(tok, trainer.policy_model.generation_config)
        engine = TransformersInference(EngineSettings.from_config(cfg), trainer.engine_weights(), tok,
                                       torch.device("cpu"), stop_ids)
        shares = engine.model is trainer.policy_model
        before = engine.weights_checksum()
        trainer.update(torch.load(rollouts_file, weights_only=False), step=1)
        sent = trainer.whole_weights()  # sharded: gathered on every rank
        engine.push_weights(sent, version=trainer.policy_version)
        torch.save({"shares": shares, "plain": not is_sharded(engine.model), "before": before,
                    "after": engine.weights_checksum(), "sent": weights_checksum(sent)}, out)

    lead_or_follow(world, trainer, lead)


def test_the_engine_keeps_its_own_whole_copy_of_a_sharded_policy(world_runs):
    """One rank: the engine generates with the policy module itself. Two: the policy is sharded, so the engine
    loads its own plain copy, starting from the same weights, and a push after a step lands in it."""
    seen = {size: world_runs.result(f"engine{size}.pt") for size in (1, 2)}
    assert seen[1]["shares"] and not seen[2]["shares"] and seen[2]["plain"]
    assert seen[2]["before"] == seen[1]["before"]  # the copy starts from the policy's weights
    assert seen[2]["after"] == seen[2]["sent"] != seen[2]["before"]  # the step moved them and the push landed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jobs(rank: int, size: int, port: int, model_dir: str, data_dir: str, rollouts_file: str, plan: list) -> None:
    """This rank's share of each of ``plan``'s jobs, in turn, in one process group: ``(function, its arguments after
    the rollouts' file)``, each function above building its own trainer (seeded anew). One process a rank for them
    all, not one a job: each new process spent ~8 s importing."""
    for name, args in plan:
        globals()[name](rank, size, port, model_dir, data_dir, rollouts_file, *args)
    if size > 1:
        dist.destroy_process_group()


TWO_RANKS_WITH = [(), ("train_model.reshard_after_forward=false",), ("train_model.compile=true",)]


@pytest.fixture(scope="module")
def world_runs(setup, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Every job of the tests below, on the same rollouts, in 3 rounds (one rank, two, one) rather than one spawn a
    job: the one-rank rounds in this process, the two-rank one spawned. One rank, then two: the engine beside the
    policy (``engine{1,2}.pt``); 3 steps checkpointed at step 3 and
    trained on to step 4 (``ranks{1,2}.pt``, ``ckpt{1,2}``, default FSDP2 settings); on two, the one-rank checkpoint
    resumed (``resumed_by2.pt``) and 3 steps with each of ``TWO_RANKS_WITH``'s settings (``ranks2_with{i}.pt``,
    compiled last); then on one, the two-rank checkpoint resumed (``resumed_by1.pt``). ``result(name)`` loads one."""
    cfg, _, _, rollouts, _ = setup
    tmp_path = tmp_path_factory.mktemp("world_runs")
    rollouts_file = tmp_path / "rollouts.pt"
    torch.save(Replies.from_collector(rollouts), rollouts_file)

    def spawn(size: int, plan: list) -> None:
        args = (size, free_port(), cfg.model.name, cfg.env.dataset, str(rollouts_file), plan)
        if size > 1:
            mp.spawn(jobs, nprocs=size, args=args)
            return
        # a world of one joins no process group: its jobs run here, sparing a new process's ~9 s of imports (twice),
        # with the variables rank_trainer sets, the thread count and the RNG put back after
        threads, variables = torch.get_num_threads(), ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        before = {name: os.environ.get(name) for name in variables}
        with torch.random.fork_rng():
            try:
                jobs(0, *args)
            finally:
                torch.set_num_threads(threads)
                for name, value in before.items():
                    os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)

    def out(name: str) -> str:
        return str(tmp_path / name)

    def three_steps(size: int) -> tuple:
        return "train_three_steps", (out(f"ranks{size}.pt"), (), out(f"ckpt{size}"))

    spawn(1, [("engine_beside_sharded_policy", (out("engine1.pt"),)), three_steps(1)])
    spawn(2, [("engine_beside_sharded_policy", (out("engine2.pt"),)), three_steps(2),
              ("resume_and_go_on", (out("ckpt1"), out("resumed_by2.pt"))),
              *[("train_three_steps", (out(f"ranks2_with{i}.pt"), extra)) for i, extra in enumerate(TWO_RANKS_WITH)
                if extra]])
    spawn(1, [("resume_and_go_on", (out("ckpt2"), out("resumed_by1.pt")))])

    def result(name: str):
        got = torch.load(out(name), weights_only=False)
        if name.startswith("ranks") and Path(out(name) + ".went_on").exists():
            got["went_on"] = torch.load(out(name) + ".went_on", weights_only=False)
        return got

    return SimpleNamespace(result=result, ckpt_dir=lambda size: tmp_path / f"ckpt{size}")


@pytest.mark.parametrize("two_ranks_with", TWO_RANKS_WITH)
def test_two_ranks_train_as_one(setup, world_runs, two_ranks_with):  # noqa: F811 - the imported fixture
    """Same seed, same rollouts: two ranks (each half of every micro-batch, the policy sharded, the
    reference scoring half the rows) give the step-1 loss and gradient norm of one rank to 1e-5, the
    same metrics, and the same weights after 3 steps (6 optimiser steps) to 2e-5; also with the gathered
    weights kept from forward to backward (FSDP2 reshard_after_forward=False), and with the decoder layers and
    LM head compiled (the GPU configs' default) on the two ranks against one eager rank (to 1e-4: compiled
    kernels sum in another order)."""
    cfg = setup[0]
    one = world_runs.result("ranks1.pt")
    two = world_runs.result(f"ranks2_with{TWO_RANKS_WITH.index(two_ranks_with)}.pt" if two_ranks_with else "ranks2.pt")
    first_one, first_two = one["metrics"][0], two["metrics"][0]
    compiled = "train_model.compile=true" in two_ranks_with
    rel = 1e-4 if compiled else 1e-5  # compiled kernels sum in another order
    assert first_one["optim_steps"] == 2 * cfg.train.epochs
    assert first_one["micro_batches"] == 2 and first_two["micro_batches"] == 1
    for key in ("loss_objective", "grad_norm", "loss_kl_to_ref", "kl_to_ref", "entropy", "mismatch/kl"):
        assert first_two[key] == pytest.approx(first_one[key], rel=rel, abs=1e-8), key
    assert abs(first_one["loss_objective"]) > 1e-3 and first_one["loss_kl_to_ref"] > 1e-6  # not trivially equal
    for step_one, step_two in zip(one["metrics"][1:], two["metrics"][1:]):
        for key in ("loss_objective", "loss_kl_to_ref", "grad_norm"):
            assert step_two[key] == pytest.approx(step_one[key], rel=1e-4, abs=1e-8), key
    moved = max(float((w - before).abs().max()) for w, before in zip(one["weights"].values(),
                                                                   load_initial_weights(cfg).values()))
    assert moved > 1e-3  # three steps changed the weights well beyond the tolerance
    # Adam turns the last-digit gradient differences of near-zero gradients into larger steps (the weights moved ~1e-3):
    # compiled ~2e-5; eager, with fused AdamW, one q_proj element of 16,384 1.1e-5 apart (2026-11-30)
    atol = 1e-4 if compiled else 2e-5
    for name, weight in one["weights"].items():
        # a key bias adds the same amount to all of a query's scores, which softmax ignores: its gradient is rounding
        # noise, which Adam makes lr-sized steps of either sign (1.4e-5 apart on 1 and 2 ranks, moved 2e-3 in all)
        noise = name.endswith("k_proj.bias")
        torch.testing.assert_close(two["weights"][name], weight, atol=1e-4 if noise else atol, rtol=1e-5, msg=name)
    # a push from the sharded policy sends whole tensors under the HF names, those of the trained weights
    assert two["pushed"].keys() == one["pushed"].keys()
    for name, tensor in two["pushed"].items():
        assert type(tensor) is torch.Tensor and tensor.shape == one["pushed"][name].shape, name
        if name in two["weights"]:
            assert torch.equal(tensor, two["weights"][name]), name


def load_initial_weights(cfg) -> dict:
    tok = load_tokenizer(cfg.model.name)
    policy = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu"))
    return {n: p.detach() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(world_runs, saved_by, resumed_by):
    """A checkpoint holds whole tensors: written by 2 ranks and resumed by 1 (or the other way), step 4
    gives the weights of the run that wrote it and went on, to 1e-5 (``world_runs``: that run, and the resume)."""
    went_on, ckpt_dir = world_runs.result(f"ranks{saved_by}.pt")["went_on"], world_runs.ckpt_dir(saved_by)
    resumed = world_runs.result(f"resumed_by{resumed_by}.pt")
    saved = load_checkpoint(list_checkpoints(ckpt_dir)[-1])
    assert saved["step"] == 3
    assert saved["model"].keys() == went_on.keys() and all(not isinstance(v, DTensor) for v in saved["model"].values())
    # step 4 moved the weights beyond the tolerance: a resume that restored nothing could not pass
    moved = max(float((went_on[n] - saved["model"][n]).abs().max()) for n in went_on)
    assert moved > 1e-4
    for name, weight in went_on.items():
        # a key bias gets float noise for a gradient (softmax ignores a shift of every key's score), which AdamW
        # scales to steps of the learning rate's size, set by the ranks' summation order: 1.2e-5 apart with one
        # thread a process (CI), 6e-4 moved by step 4
        atol = 5e-5 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(resumed[name], weight, atol=atol, rtol=1e-5, msg=name)


def test_a_world_of_one_is_the_identity():
    world = World()
    rows = torch.arange(5)
    assert world.is_main and torch.equal(world.share(rows), rows)
    assert torch.equal(world.sum(rows), rows) and torch.equal(world.gather_shares(rows, 5), rows)


def test_micro_batches_for_ranks_hold_a_row_for_each():
    """Cut for 2 ranks, no micro-batch has fewer than 2 rows, and the cuts still cover every row once."""
    batch = TensorDict({"prompt_length": torch.tensor([5, 5, 5, 5, 5]),
                        "reply_length": torch.tensor([1, 2, 40, 3, 50])}, batch_size=[5])
    alone = micro_batch_rows(batch, max_rows=4, max_tokens=60)
    assert min(len(rows) for rows in alone) == 1  # the two longest rows exceed the budget together
    paired = micro_batch_rows(batch, max_rows=4, max_tokens=60, min_rows=2)
    assert min(len(rows) for rows in paired) >= 2
    assert sorted(torch.cat(paired).tolist()) == list(range(5))
