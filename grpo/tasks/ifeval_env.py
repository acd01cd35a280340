"""IFEval's TorchRL side: the reward transform and the env that carries each row's instructions.

What is taken from TorchRL and what is replaced
-----------------------------------------------
TorchRL 0.14 ships ``torchrl.envs.llm.IFEvalEnv`` (data pipeline) and
``torchrl.envs.llm.IfEvalScorer`` (checkers + reward transform).

*Used as is*: the environment side. ``IFEvalEnv`` / ``DatasetChatEnv`` load the rows,
put ``key``, ``query`` (the prompt), ``instruction_id_list`` and ``kwargs`` in the
tensordict and build the chat history; :class:`IFEvalReward` reads exactly those fields,
so it can be appended to an ``IFEvalEnv(..., compute_reward=False)``.
:func:`make_ifeval_env` is an ``IFEvalEnv`` whose loader validates the rows first.

*Replaced*: the checkers (:mod:`grpo.tasks.ifeval_checks` says why) and the scorer transform.
``IfEvalScorer`` scores only the text inside ``<answer>`` (an untagged response is scored as
``""`` and fails everything), supports only history mode, and its reward weights are a list;
the format bonus is fixed. :class:`IFEvalReward` checks the ``<answer>`` block when present
and the whole response otherwise (:func:`grpo.tasks.ifeval.ifeval_reward`), supports history/text/tokens
modes and takes its weights as a plain dict (Hydra friendly).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform
from torchrl.envs.llm import IFEvalEnv

from grpo.tasks.data import StreamLoader
from grpo.tasks.ifeval import ACCURACY_KEYS, ifeval_reward, load_ifeval_rows, resolve_weights
from grpo.tasks.ifeval_checks import normalize_kwargs
from grpo.tasks.rewards import special_tokens, strip_trailing_special_tokens


def _python_list(value: Any) -> list:
    if isinstance(value, (NonTensorData, NonTensorStack)):
        value = value.tolist()
    return list(value)


class IFEvalReward(Transform):
    """IFEval reward transform for ``IFEvalEnv`` / ``DatasetChatEnv`` based envs.

    In ``_step`` it reads, for each env of the batch, the last message of
    ``("history", "full")`` (history mode; ``("text", "response")`` in text mode, decoded
    ``("tokens", "response")`` in tokens mode) and the row's ``instruction_id_list`` and
    ``kwargs`` fields (the names ``IFEvalEnv`` uses), and writes :func:`ifeval_reward`'s
    ``reward`` plus ``prompt_level_strict_acc``, ``inst_level_strict_acc``,
    ``prompt_level_loose_acc``, ``inst_level_loose_acc``, ``format_ok`` and ``success``
    (= prompt-level strict), each of shape ``batch + (1, 1)`` like ``GSM8KRewardParser``.
    A ``reward`` already present (another reward transform) is added to, not overwritten.

    Args:
        tokenizer: used to decode tokens mode and to know the special tokens stripped from a reply's end.
        weights: reward weights (see :data:`DEFAULT_REWARD_WEIGHTS`), a plain dict.
        instruction_ids_key, kwargs_key: data field names.
        eos_token: stripped from the end of responses too (the tokenizer's special tokens always are).
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``; defaults to the parent env's.
    """

    OUT_KEYS = ("reward", *ACCURACY_KEYS, "format_ok", "success")

    def __init__(
        self,
        tokenizer=None,
        weights: Mapping[str, float] | None = None,
        *,
        instruction_ids_key: str = "instruction_id_list",
        kwargs_key: str = "kwargs",
        eos_token: str | None = None,
        input_mode: Literal["history", "text", "tokens"] | None = None,
    ):
        super().__init__(in_keys=[instruction_ids_key, kwargs_key], out_keys=list(self.OUT_KEYS))
        self.tokenizer = tokenizer
        self.weights = resolve_weights(weights)
        self.instruction_ids_key = instruction_ids_key
        self.kwargs_key = kwargs_key
        if eos_token is None and tokenizer is not None:
            eos_token = tokenizer.eos_token
        # the reply a user reward function sees too (grpo.tasks.user_rewards): every trailing special token cut
        specials = set(special_tokens(tokenizer)) | ({eos_token} if eos_token else set())
        self.specials = tuple(sorted(specials, key=len, reverse=True))
        self._input_mode = input_mode

    @property
    def input_mode(self) -> str:
        if self._input_mode is not None:
            return self._input_mode
        parent = self.parent
        base_env = getattr(parent, "base_env", None) if parent is not None else None
        return getattr(base_env, "input_mode", "history")

    def _responses(self, tensordict: TensorDictBase) -> list[str]:
        mode = self.input_mode
        batch = tensordict.batch_size[0]
        if mode == "history":
            full = tensordict.get(("history", "full"))
            texts = []
            for i in range(batch):
                content = full[i][-1].content
                texts.append(content.data if isinstance(content, NonTensorData) else content)
        elif mode == "text":
            texts = _python_list(tensordict[("text", "response")])
        elif mode == "tokens":
            if self.tokenizer is None:
                raise RuntimeError("IFEvalReward needs a tokenizer in tokens mode")
            tokens = tensordict.get(("tokens", "response"))
            rows = tokens.unbind(0) if isinstance(tokens, torch.Tensor) else tokens
            texts = [
                self.tokenizer.decode(torch.as_tensor(t).tolist(), skip_special_tokens=True)
                for t in rows
            ]
        else:
            raise ValueError(f"unknown input_mode {mode!r}")
        return [strip_trailing_special_tokens(text or "", self.specials) for text in texts]

    def _field(self, tensordict, next_tensordict, key) -> list:
        for td in (tensordict, next_tensordict):
            if key in td.keys():
                return _python_list(td[key])
        raise KeyError(
            f"IFEvalReward: no {key!r} in the tensordict; build the env with "
            "IFEvalEnv / make_ifeval_env so that the row fields are carried"
        )

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if next_tensordict.batch_dims > 1:
            with tensordict.view(-1) as td_view, next_tensordict.view(-1) as next_view:
                self._step(td_view, next_view)
            return next_tensordict
        if next_tensordict.batch_dims == 0:
            raise ValueError("IFEvalReward expects a batched env (batch_size=(num_envs,))")
        texts = self._responses(tensordict)
        ids_batch = self._field(tensordict, next_tensordict, self.instruction_ids_key)
        kwargs_batch = self._field(tensordict, next_tensordict, self.kwargs_key)
        scores = [
            ifeval_reward(text, _python_list(ids), _python_list(kws), self.weights)
            for text, ids, kws in zip(texts, ids_batch, kwargs_batch, strict=True)
        ]
        shape = next_tensordict.batch_size + (1, 1)
        device = next_tensordict.device
        dtype = torch.get_default_dtype()
        values = {
            key: torch.tensor([s[key] for s in scores], dtype=dtype, device=device).view(shape)
            for key in ("reward", *ACCURACY_KEYS, "format_ok")
        }
        values["success"] = values["prompt_level_strict_acc"] > 0.5
        previous = next_tensordict.get("reward", None)
        if previous is not None:
            values["reward"] = values["reward"] + previous.view(shape).to(dtype)
        next_tensordict.update(values)
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = reward_spec.shape + (1, 1)
        device = reward_spec.device
        dtype = torch.get_default_dtype()
        specs = {key: Unbounded(shape, dtype=dtype, device=device) for key in self.OUT_KEYS}
        specs["success"] = Unbounded(shape, dtype=torch.bool, device=device)
        reward_spec.update(Composite(specs, shape=reward_spec.shape, device=device))
        return reward_spec


def collate_ifeval_rows(batch: Sequence[Mapping[str, Any]]) -> TensorDict:
    """Collate rows into the fields ``IFEvalEnv`` uses: ``key`` (int64), ``query`` (the
    prompt) and ``instruction_id_list`` / ``kwargs`` (one python list per row)."""
    return TensorDict(
        {
            "key": torch.tensor([int(r["key"]) for r in batch], dtype=torch.int64),
            "query": NonTensorStack(*[NonTensorData(r["prompt"]) for r in batch]),
            "instruction_id_list": NonTensorStack(
                *[NonTensorData(list(r["instruction_id_list"])) for r in batch]
            ),
            "kwargs": NonTensorStack(
                *[NonTensorData([normalize_kwargs(k) for k in r["kwargs"]]) for r in batch]
            ),
        },
        batch_size=[len(batch)],
    )


@functools.cache
def _validated_env_class(system_prompt: str | None = None):
    class ValidatedIFEvalEnv(IFEvalEnv):
        """``IFEvalEnv`` whose ``dataset`` is a list of already validated rows."""

        # IFEvalEnv takes no system_prompt argument; a small model may need a shorter one
        SYSTEM_PROMPT = IFEvalEnv.SYSTEM_PROMPT if system_prompt is None else system_prompt

        @staticmethod
        def _dataloader_factory(dataset, name, split, seed, batch_size_dl, shuffle, collate_fn):
            if seed is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            return StreamLoader(dataset, seed=seed, shuffle=shuffle, collate_fn=collate_ifeval_rows)

    return ValidatedIFEvalEnv


def make_ifeval_env(
    path_or_name: str | os.PathLike,
    split: str = "train",
    *,
    tokenizer=None,
    weights: Mapping[str, float] | None = None,
    num_envs: int = 1,
    repeats: int | None = None,
    batch_size_dl: int = 1,
    seed: int | None = None,
    shuffle: bool = True,
    input_mode: Literal["history", "text", "tokens"] = "history",
    max_steps: int = 1,
    system_prompt: str | None = None,
    **env_kwargs: Any,
):
    """An ``IFEvalEnv`` on rows loaded and validated by :func:`load_ifeval_rows`, with
    :class:`IFEvalReward` (instead of TorchRL's ``IfEvalScorer``) appended.

    Requires ``tensordict.set_list_to_stack(True).set()`` beforehand (TorchRL's rule).
    """
    rows = load_ifeval_rows(path_or_name, split)
    env = _validated_env_class(system_prompt)(
        dataset=rows, shuffle=shuffle, num_envs=num_envs, repeats=repeats, batch_size_dl=batch_size_dl, seed=seed,
        tokenizer=tokenizer, input_mode=input_mode, max_steps=max_steps, compute_reward=False, **env_kwargs)
    env.append_transform(IFEvalReward(tokenizer=tokenizer, weights=weights))
    return env
