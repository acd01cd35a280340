"""The GRPO step: one batch of grouped replies in, one round of optimisation out.

    batch      = to_training_batch(rollouts)              dense [S, P+R], sampler log-probs kept
    ref_lp     = log pi_ref(reply)                         reference scoring, no grad (or scored early, reference.py)
    reward    -= overlong penalty                          DAPO's soft penalty over the last reward.overlong_buffer tokens
    kl_ref     = k3(sampler || ref) per reply              logged; subtracted from the reward or a loss term
    advantage  = (r - mean_group) / std_group              replies to one prompt form a group (dr_grpo: no / std)
    reply_mask = sampled tokens                            never a tool's; train.overlong_filter: no truncated episode
    for epoch, minibatch (micro-batches of similar lengths, accumulated):
        ratio  = pi(reply) / pi_old(reply)                 pi_old: the sampler (or the trainer, importance.py);
                                                           per token (gspo: per reply, geometric mean)
        loss   = -w min(ratio A, clip(ratio) A) + c_ref KL_ref + c_inf KL_inf - c_ent H
                                                           w: importance weight (importance.py), else 1
                                                           means over the whole minibatch's tokens, whatever
                                                           its cut; dr_grpo: token sum / (replies x max_new_tokens)
        backward; clip grad norm; optimiser and LR schedule step (a NaN/inf gradient: stop, or skip the step)

Every argument is explicit (``GRPOSettings``, the models, the optimiser): the step does not read the
config, and it runs the same on one data-parallel rank or many (``grpo/process/world.py``: every rank
holds the whole batch, scores its share of the reference's rows and trains on its share of each
micro-batch of the sharded ``policy``; ``LossTotals`` are the global minibatch's, the metrics summed over
ranks). Same estimators as TorchRL's ``GRPOLoss`` (tests/test_step.py checks value and gradient against
it); why not ``GRPOLoss`` itself: it runs on per-sample tensordicts and computes full-vocabulary logits
at every prompt position; on a 0.5B model it used 2.4x TRL's GPU memory. Unlike TorchRL 0.14.1, KL terms and diagnostics average over reply
tokens only, so they do not shrink as prompts grow.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from grpo.process.errors import NonFiniteError
from grpo.process.world import World, full, set_gradient_sync
from grpo.training.advantages import group_advantages, overlong_penalty
from grpo.training.batch import micro_batch_rows, rollout_metrics, to_training_batch, trim_padding
from grpo.training.importance import add_importance_weights
from grpo.training.logprobs import ReplyLogProbs, micro_on_device, score_replies
from grpo.training.models import train_mode_if
from grpo.training.reference import ReferenceScores


@dataclass(frozen=True)
class GRPOSettings:
    clip_epsilon_low: float
    clip_epsilon_high: float
    kl_to_ref_coeff: float
    kl_coef_in_loss: bool             # KL-to-ref as a loss term (true) or subtracted from the reward (false)
    overlong_filter: bool             # replies cut at max_new_tokens stay out of the loss
    overlong_buffer: int              # DAPO soft penalty over the last this many tokens before max_new_tokens
    overlong_penalty: float           # the penalty at max_new_tokens
    kl_to_inference_coeff: float      # 0.0 still measures the sampler/trainer mismatch
    entropy_coeff: float
    aggregation: str                  # token_mean or prompt_mean
    loss_variant: str                 # grpo, dr_grpo or gspo
    max_new_tokens: int               # dr_grpo's constant per reply
    temperature: float                # the sampler's: every log-prob is the tempered policy's (logprobs.py)
    importance_sampling: str          # none, or a mode of importance.py: clip against the trainer's log-probs
    is_low: float                     # the bounds of the importance weights
    is_high: float
    epochs: int
    optim_batch_size: int             # replies per optimiser step (a minibatch)
    micro_batch_size: int             # at most this many replies in one forward/backward
    micro_batch_tokens: int | None    # and at most this many tokens: padded (rows x width), or real if packed
    packed_sequences: bool            # the model reads each micro-batch's real tokens end to end, no pads
    ref_micro_batch_tokens: int | None  # the reference's cut, by tokens alone (it keeps no activations); None: training's
    clip_grad_norm: float
    gradient_checkpointing: bool      # needs train mode while optimising
    compile: bool                     # torch.compile the decoder layers and the head's log-probs for training
    on_nonfinite: str                 # a NaN/inf gradient: stop before the optimiser step, or skip that step

    @classmethod
    def from_config(cls, cfg) -> GRPOSettings:
        t = cfg.train
        return cls(
            clip_epsilon_low=t.clip_epsilon_low, clip_epsilon_high=t.clip_epsilon_high,
            kl_to_ref_coeff=t.kl_to_ref_coeff, kl_coef_in_loss=t.kl_coef_in_loss,
            overlong_filter=t.overlong_filter, overlong_buffer=cfg.reward.overlong_buffer,
            overlong_penalty=cfg.reward.overlong_penalty,
            kl_to_inference_coeff=t.kl_to_inference_coeff, entropy_coeff=t.entropy_coeff, aggregation=t.aggregation,
            loss_variant=t.loss_variant, max_new_tokens=cfg.inference_model.max_new_tokens,
            temperature=cfg.inference_model.temperature, ref_micro_batch_tokens=cfg.ref_model.micro_batch_tokens,
            importance_sampling=t.importance_sampling, is_low=t.is_low, is_high=t.is_high,
            epochs=t.epochs, optim_batch_size=t.optim_batch_size,
            micro_batch_size=t.optim_batch_size // t.gradient_accumulation_steps,
            micro_batch_tokens=t.micro_batch_tokens, packed_sequences=t.packed_sequences,
            clip_grad_norm=cfg.optimizer.clip_grad_norm,
            gradient_checkpointing=cfg.train_model.gradient_checkpointing, compile=cfg.train_model.compile,
            on_nonfinite=t.on_nonfinite)


class GRPOStep:
    """``step(rollouts) -> metrics``: ``prepare`` (dense batch, reference, advantages), then ``optimize``.

    ``policy``: the trained model's ``ReplyLogProbs``, sharded over ``world`` when it has several ranks;
    ``ref_model``: the reference model itself (every rank holds all of it)."""

    def __init__(self, settings: GRPOSettings, *, policy: ReplyLogProbs, optimizer, scheduler, ref_model=None,
                 pad_token_id: int, world: World = World()):
        self.s, self.world = settings, world
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        # the reference's scores: of rows the sampler handed it early (grpo.training.reference), or scored here
        self.ref = ReferenceScores(ReplyLogProbs(ref_model, settings.temperature, settings.packed_sequences), settings,
                                   pad_token_id=pad_token_id, world=world) if ref_model is not None else None
        self.pad_token_id = pad_token_id
        if settings.compile:  # fewer, fused kernels: 1.5B on an H100, train part 3.69 -> 2.65 s, reference 0.83 -> 0.57 s
            policy.compile_for_training()
            if self.ref is not None:
                self.ref.scorer.compile_for_scoring()

    def __call__(self, rollouts) -> dict:
        batch, metrics = self.prepare(rollouts)
        return metrics | self.optimize(batch)

    def prepare(self, rollouts) -> tuple[TensorDict, dict]:
        t0 = time.perf_counter()
        batch = to_training_batch(rollouts, self.pad_token_id)
        bad = int((~batch["reward"].isfinite()).sum())
        if bad:  # its advantages would be NaN, and so every weight after the update
            raise NonFiniteError(f"{bad} of the step's {batch.batch_size[0]} rewards are NaN or inf (a reward above "
                                 "3.4e38 is inf in float32): fix the reward (reward.functions) so it returns finite "
                                 "numbers; no update was made.")
        metrics = rollout_metrics(rollouts, batch)
        if self.s.overlong_buffer:
            penalty = overlong_penalty(batch["sampled_length"], self.s.max_new_tokens, self.s.overlong_buffer,
                                       self.s.overlong_penalty)
            batch["reward"] = batch["reward"] - penalty
            metrics["overlong_penalty_mean"] = penalty.mean().item()
        if self.ref is not None:
            batch["ref_log_probs"], scored_early = self.ref(batch)
            metrics["reference_rows_scored_early"] = scored_early / batch.batch_size[0]
            metrics["reference_queue_s"], self.ref.queue_s = self.ref.queue_s, 0.0
            kl = per_sample_kl_to_ref(batch)
            metrics["kl_to_ref"] = kl.mean().item()
            if not self.s.kl_coef_in_loss:
                batch["reward"] = batch["reward"] - self.s.kl_to_ref_coeff * kl
        if self.s.importance_sampling != "none":
            # all rows on every rank: the sharded policy needs the same passes on every rank
            batch["trainer_log_probs"] = score_replies(batch, self.policy, self.s)
        batch["advantage"] = group_advantages(batch["reward"], batch["group_id"],
                                              scale_by_std=self.s.loss_variant != "dr_grpo",
                                              in_baseline=batch["in_baseline"])
        if not bool(batch["advantage"].isfinite().all()):  # dr_grpo's unscaled differences of rewards near 3.4e38
            raise NonFiniteError(f"the step's advantages overflow float32: its rewards reach "
                                 f"{float(batch['reward'].abs().max()):.3g}; scale the reward (reward.functions) to "
                                 "ordinary sizes (say within +-1e6); no update was made.")
        metrics |= {"advantage_std": batch["advantage"].std().item(), "advantage_mean": batch["advantage"].mean().item()}
        if self.s.overlong_filter:  # after the advantages: a cut reply still counts in its group's baseline
            batch["reply_mask"] = batch["reply_mask"] & batch["reply_stopped"][:, None]
        metrics |= add_importance_weights(batch, loss_mask(batch), self.s.importance_sampling, self.s.is_low,
                                          self.s.is_high)
        return batch, metrics | {"reference_s": time.perf_counter() - t0}

    def optimize(self, batch: TensorDict) -> dict:
        """``epochs`` passes of shuffled minibatches, one optimiser step each; metrics averaged over them.

        A minibatch runs as micro-batches of similar lengths (``micro_batches``), each term divided by
        the whole minibatch's totals, so the gradient is that of the minibatch in one pass however it is
        cut. ``mismatch/kl`` is the first minibatch's sampler/trainer KL, before any update: on-policy it
        must be ~0 (< 1e-3), or sampler and trainer disagree on the tokens.
        """
        t0, s, world = time.perf_counter(), self.s, self.world
        device = next(self.policy.parameters()).device
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # device tensors until the end: a .item() per micro-batch would stall the GPU queue
        sums, grad_norms, n_minibatches, pre_update_kl, skipped, n_micro = defaultdict(float), [], 0, 0.0, 0, 0
        pre_update_gap = torch.zeros((), device=device)
        advantage_abs = 0.0
        with train_mode_if(self.policy, s.gradient_checkpointing):
            for _ in range(s.epochs):
                order = world.from_main(torch.randperm(batch.batch_size[0]))
                for start in range(0, len(order), s.optim_batch_size):
                    minibatch = batch[order[start:start + s.optim_batch_size]]
                    totals = LossTotals.of(minibatch)  # every rank holds the whole minibatch: global totals
                    # cut as one rank's budget times the ranks, then dealt out: each rank a like share
                    cuts = micro_batch_rows(minibatch, s.micro_batch_size * world.size,
                                            s.micro_batch_tokens and s.micro_batch_tokens * world.size, world.size,
                                            packed=s.packed_sequences)
                    for i, rows in enumerate(cuts):
                        micro = micro_on_device(trim_padding(minibatch[world.share(rows)]), device,
                                                s.packed_sequences)
                        set_gradient_sync(self.policy, i == len(cuts) - 1)  # one gradient sync per minibatch
                        terms = grpo_terms(self.policy, micro, s, totals)
                        weighted_loss(terms, s).backward()
                        for name, value in logged_terms(terms, s).items():
                            sums[name] = sums[name] + value
                        if n_minibatches == 0:
                            pre_update_kl = pre_update_kl + terms["kl_to_inference"].detach()
                            pre_update_gap = torch.maximum(pre_update_gap, terms["max_abs_logprob_gap"])
                        n_micro += 1
                    advantage_abs = advantage_abs + minibatch["advantage"].abs().mean()
                    n_minibatches += 1
                    grad_norm = full(torch.nn.utils.clip_grad_norm_(params, s.clip_grad_norm)).detach()
                    # one host sync per optimiser step: a NaN/inf gradient must never reach the weights
                    # (the norm is global, so every rank decides alike)
                    if not bool(grad_norm.isfinite()):
                        if s.on_nonfinite == "stop":
                            raise NonFiniteError(
                                f"the gradient norm is {float(grad_norm)} "
                                f"(loss {float(weighted_loss(terms, s).detach())}) "
                                "before an optimiser step, which was not taken: the weights are as before it. "
                                "Lower optimizer.lr, or set train.on_nonfinite=skip to skip such steps.")
                        skipped += 1
                    else:
                        grad_norms.append(grad_norm)
                        self.optimizer.step()
                        self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
        names = sorted(sums)  # each rank's sums are its share of the global ones: one all-reduce adds them
        totals_over_ranks = world.sum(torch.stack([torch.as_tensor(sums[n], device=device) for n in names]
                                                  + [torch.as_tensor(pre_update_kl, device=device)]).float())
        train_s = time.perf_counter() - t0
        return {name: float(value) / n_minibatches for name, value in zip(names, totals_over_ranks)} | {
            "advantage_abs": float(advantage_abs) / n_minibatches,
            "mismatch/kl": float(totals_over_ranks[-1]),
            "mismatch/max_abs_logprob_gap": float(world.sum(pre_update_gap, dist.ReduceOp.MAX)),
            "grad_norm": float(sum(grad_norms)) / len(grad_norms) if grad_norms else float("nan"),
            "optim_steps": len(grad_norms), "skipped_optim_steps": skipped, "lr": self.scheduler.get_last_lr()[0],
            "micro_batches": n_micro / n_minibatches, "train_s": train_s,
            "train_samples_per_s": batch.batch_size[0] * s.epochs / train_s}


@dataclass(frozen=True)
class LossTotals:
    """What a minibatch's means divide by. Every term of ``grpo_terms`` is a sum over its micro-batch
    divided by these, so the micro-batches of any cut add up to the minibatch's loss and gradient
    exactly; data-parallel ranks pass the totals of the global minibatch."""
    tokens: int       # reply tokens in the loss
    rows: int         # replies
    replies: int      # replies with at least one token in the loss

    @classmethod
    def of(cls, batch: TensorDict) -> LossTotals:
        mask = loss_mask(batch)
        return cls(tokens=max(1, int(mask.sum())), rows=mask.shape[0], replies=max(1, int(mask.any(-1).sum())))


def loss_mask(batch: TensorDict) -> torch.Tensor:
    """The reply tokens the loss sees: real ones with a finite sampler log-prob."""
    return batch["reply_mask"] & batch["behaviour_log_probs"].isfinite()


def grpo_terms(score, batch: TensorDict, s: GRPOSettings, totals: LossTotals | None = None) -> dict:
    """The loss terms, unweighted (``objective``, ``entropy``, ``kl_to_ref``, ``kl_to_inference``),
    and diagnostics without gradient, all averaged over reply tokens (``aggregation`` for the first two;
    the objective of ``dr_grpo`` and ``gspo`` as ``loss_variant`` says): sums over ``batch`` divided by
    ``totals`` (those of ``batch`` itself by default), so a minibatch's micro-batches add up to it."""
    cur, entropy = score(batch["input_ids"], batch["attention_mask"], batch["reply_mask"].shape[1],
                         with_entropy=True, entropy_grad=s.entropy_coeff != 0)
    sampler = batch["behaviour_log_probs"]
    mask = loss_mask(batch)
    totals = totals or LossTotals.of(batch)
    n_tokens = totals.tokens
    # The ratio is taken against the sampler's log-probs or, with importance sampling, against the trainer's own
    # before the step's first update, each token's gain then weighted by its importance weight (importance.py)
    importance = s.importance_sampling != "none"
    old = batch["trainer_log_probs"] if importance else sampler
    log_ratio = torch.where(mask, cur - old, 0.0)
    advantage = batch["advantage"].to(cur.dtype).unsqueeze(-1)
    if s.loss_variant == "gspo":
        # one ratio per reply, the geometric mean of its tokens', clipped per reply; each token carries it as value,
        # with its own share of its gradient, so that a token's weight acts on that token alone
        seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
        gain, clipped = clipped_gain(seq.detach() + (log_ratio - log_ratio.detach()), advantage, s)
        clipped_share = ((clipped != seq) & mask).any(-1).sum() / totals.replies
    else:
        gain, clipped = clipped_gain(log_ratio, advantage, s)
        clipped_share = ((clipped != log_ratio) & mask).sum() / n_tokens
    if importance:
        gain = gain * batch["is_weight"]
    if s.loss_variant == "gspo":
        objective = -((gain * mask).sum(-1) / mask.sum(-1).clamp_min(1)).sum() / totals.replies
    elif s.loss_variant == "dr_grpo":  # no length normalisation: every token counts the same in any reply
        objective = -(gain * mask).sum() / (totals.rows * s.max_new_tokens)
    else:
        objective = aggregate(-gain, mask, s.aggregation, totals)
    terms = {"objective": objective, "entropy": aggregate(entropy, mask, s.aggregation, totals),
             "kl_to_inference": k3(sampler, cur, mask).sum() / n_tokens}
    if "ref_log_probs" in batch.keys() and s.kl_coef_in_loss:
        terms["kl_to_ref"] = k3(batch["ref_log_probs"], cur, mask).sum() / n_tokens
    # masked sums rather than boolean indexing, which would synchronise with the GPU
    with torch.no_grad():
        lw = torch.where(mask, log_ratio, -torch.inf).flatten()
        terms["clip_fraction"] = clipped_share.detach()  # of tokens (gspo: of replies)
        # not a sum: the micro-batch's own effective sample size, weighted by its share of the tokens
        terms["ess"] = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / n_tokens
        terms["kl_approx"] = -log_ratio.sum() / n_tokens
        gap = torch.where(mask, cur - sampler, 0.0).abs().flatten()
        terms["max_abs_logprob_gap"] = torch.nn.functional.pad(gap, (0, 1)).max()  # not a sum: optimize takes the max
    return terms


def clipped_gain(log_ratio: torch.Tensor, advantage: torch.Tensor, s: GRPOSettings):
    """min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A), and the clipped log-ratio."""
    clipped = log_ratio.clamp(math.log1p(-s.clip_epsilon_low), math.log1p(s.clip_epsilon_high))
    return torch.minimum(log_ratio.exp() * advantage, clipped.exp() * advantage), clipped


def weighted_loss(terms: dict, s: GRPOSettings) -> torch.Tensor:
    """Every loss weight, applied here and nowhere else."""
    return (terms["objective"] - s.entropy_coeff * terms["entropy"] + s.kl_to_ref_coeff * terms.get("kl_to_ref", 0.0)
            + s.kl_to_inference_coeff * terms["kl_to_inference"])


def logged_terms(terms: dict, s: GRPOSettings) -> dict:
    """The terms as the metrics file names them."""
    out = {name: value.detach() for name, value in terms.items() if name not in ("objective", "kl_to_ref", "max_abs_logprob_gap")}
    out["loss_objective"] = terms["objective"].detach()
    if "kl_to_ref" in terms:
        out["loss_kl_to_ref"] = s.kl_to_ref_coeff * terms["kl_to_ref"].detach()
    return out


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, totals: LossTotals) -> torch.Tensor:
    per_token = per_token * mask
    if aggregation == "prompt_mean":
        return (per_token.sum(-1) / mask.sum(-1).clamp_min(1)).sum() / totals.rows
    return per_token.sum() / totals.tokens


def k3(other: torch.Tensor, cur: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimate of KL(pi || other): exp(d) - 1 - d with d = other - pi; 0 off the mask."""
    diff = torch.where(mask, other - cur, 0.0)
    return diff.expm1() - diff


def per_sample_kl_to_ref(batch: TensorDict) -> torch.Tensor:
    """Per reply, the mean over its tokens of the k3 estimate of KL(sampler || reference)."""
    mask = batch["reply_mask"]
    return k3(batch["ref_log_probs"], batch["behaviour_log_probs"], mask).sum(-1) / mask.sum(-1).clamp_min(1)
