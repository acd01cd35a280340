"""What the tasks layer reads of the config, in one place (``TaskSettings.from_config``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grpo.process.errors import ConfigError


@dataclass(frozen=True)
class TaskSettings:
    """The task's data, envs, rewards, turns and tool, read from the config once: the task envs, the data and prompt
    checks and the turn environments take these, never the config itself. Values are kept as composed, never
    converted here: a bad one fails where it is checked (``check_turn_config``, ``validate_config``), as before."""
    task: str                       # env.task: a key of grpo.tasks.envs.TASKS
    dataset: str                    # hub name or local path
    train_split: str
    test_split: str
    system_prompt: str | None       # every prompt's system turn; None: the task's own
    prompt_key: str                 # generic task: the column holding the user turn
    answer_key: str | None          # generic task: the column reward functions also get as answer
    seed: int                       # the envs' prompt order
    tools: Sequence[str]            # env.tools: [python] or []
    turn_env: str | None            # a user's class answering between turns, path/to/file.py:Class or module:Class
    max_turns: int                  # assistant turns an episode may take
    max_episode_tokens: int | None  # tokens after the prompt an episode may hold; None: max_turns x max_new_tokens
    max_new_tokens: int             # a rollout reply's cap (inference_model's)
    eval_max_new_tokens: int        # an eval reply's cap
    max_model_len: int              # prompt + reply: every prompt must leave its reply room in it
    correct_reward: float           # gsm8k: a right final number's reward
    format_reward: float            # gsm8k: the <think>/<answer> format's reward
    answer_extraction: str          # gsm8k: flexible, strict or tag
    ifeval_weights: Mapping[str, float] | None  # ifeval: its reward's parts; None: its defaults
    reward_functions: Sequence[str]  # the user's, module.path:function or path/to/file.py:function
    reward_weights: Sequence[float]  # one per reward function; empty: 1.0 each
    reward_timeout_s: float         # one reward-function call (or batch) may take this long
    success_threshold: float        # generic task: a reply whose reward is above it counts as solved
    tool_call_format: str           # python tool: tool_call (<tool_call> JSON) or code_block (```python blocks)
    tool_max_calls: int             # python tool: calls an episode may make
    tool_timeout_s: float           # python tool: the sandbox's limits on a call (grpo.tasks.sandbox.SandboxSettings)
    tool_cpu_s: int
    tool_memory_mb: int
    tool_file_size_mb: int
    tool_processes: int
    tool_output_chars: int
    tool_workers: int               # calls run at once

    @classmethod
    def from_config(cls, cfg) -> TaskSettings:
        env, reward, tools = cfg.env, cfg.reward, cfg.tools
        return cls(task=env.task, dataset=env.dataset, train_split=env.train_split, test_split=env.test_split,
                   system_prompt=env.system_prompt, prompt_key=env.prompt_key, answer_key=env.answer_key,
                   seed=cfg.seed, tools=env.tools, turn_env=env.turn_env, max_turns=env.max_turns,
                   max_episode_tokens=env.max_episode_tokens, max_new_tokens=cfg.inference_model.max_new_tokens,
                   eval_max_new_tokens=cfg.eval.max_new_tokens, max_model_len=cfg.inference_model.max_model_len,
                   correct_reward=reward.correct, format_reward=reward.format,
                   answer_extraction=reward.answer_extraction, ifeval_weights=reward.ifeval_weights,
                   reward_functions=reward.functions, reward_weights=reward.weights,
                   reward_timeout_s=reward.timeout_s, success_threshold=reward.success_threshold,
                   tool_call_format=tools.call_format, tool_max_calls=tools.max_calls,
                   tool_timeout_s=tools.timeout_s, tool_cpu_s=tools.cpu_s,
                   tool_memory_mb=tools.memory_mb, tool_file_size_mb=tools.file_size_mb,
                   tool_processes=tools.processes, tool_output_chars=tools.output_chars, tool_workers=tools.workers)

    @property
    def python_tool(self) -> bool:
        """Whether the Python tool answers between turns (``env.tools: [python]``)."""
        return list(self.tools) == ["python"]

    @property
    def tool_call_tags(self) -> bool:
        """Whether the Python tool is called in ``<tool_call>`` tags (the template's tools block), not as a code
        interpreter's ```python blocks."""
        return self.python_tool and self.tool_call_format == "tool_call"

    @property
    def episode_tokens(self) -> int:
        """The tokens after the prompt an episode may hold, the environment's included."""
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens


# Read by validate_config, which the scripts run before they import torch (grpo.process.config_keys): kept here,
# in a module that imports no torch, not beside the classes and functions they name.
TASK_NAMES = ("gsm8k", "ifeval", "generic")  # env.task: grpo.tasks.envs.TASKS holds a class for each
CALL_FORMATS = ("tool_call", "code_block")  # tools.call_format: grpo.tasks.tool_env's two Python tool envs
ANSWER_EXTRACTIONS = ("flexible", "strict", "tag")  # gsm8k's reward.answer_extraction (grpo.tasks.rewards)


def check_turn_config(settings: TaskSettings) -> None:
    """``env.max_turns``, ``env.tools`` and ``env.turn_env`` agree."""
    tools, turn_env, turns = list(settings.tools), settings.turn_env, settings.max_turns
    if any(tool != "python" for tool in tools) or len(tools) > 1:
        raise ConfigError(f"env.tools={tools}: the tools are [python] or [] (a tool of your own: env.turn_env).")
    if settings.tool_call_format not in CALL_FORMATS:
        raise ConfigError(f"tools.call_format={settings.tool_call_format!r}: write tool_call (<tool_call> JSON) or "
                          "code_block (```python blocks run as they are written).")
    if tools and turn_env:
        raise ConfigError(f"env.tools={tools} and env.turn_env={turn_env!r}: one answers between turns; set the other "
                          "to [] / null.")
    if not isinstance(turns, int) or turns < 1:
        raise ConfigError(f"env.max_turns={turns!r}: an episode takes at least one assistant turn (1: a reply).")
    if turns > 1 and not (tools or turn_env):
        raise ConfigError(f"env.max_turns={turns} needs something to answer between turns: env.tools=[python] or "
                          "env.turn_env=path/to/file.py:YourEnv (or env.max_turns=1).")
    if turns == 1 and (tools or turn_env):
        raise ConfigError(f"env.max_turns=1 leaves no turn after a tool call's answer; set env.max_turns=2 or more "
                          f"with env.tools={tools} / env.turn_env={turn_env!r}.")
    budget = settings.max_episode_tokens
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ConfigError(f"env.max_episode_tokens={budget!r}: a positive number of tokens, or null "
                          "(env.max_turns x inference_model.max_new_tokens).")


def parse_spec(spec: str, index: int) -> tuple[str, str, str]:
    """``(key, where, name)`` of ``reward.functions[index]``: how messages name it, the module or file, the function."""
    key = f"reward.functions[{index}]={spec!r}"
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ConfigError(f"{key}: write it as module.path:function or path/to/file.py:function.")
    return key, where, name
