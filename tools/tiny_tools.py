"""A tiny, locally built chat model for the Python-tool twin task.

The task (:mod:`tools.synthetic_tools`) is large-number arithmetic that a model
of a few MB cannot do in its head but can with one call of the Python tool
(:data:`grpo.tasks.python_tool.PYTHON_TOOL`). An episode after the prompt is
either

* a tool episode, three pieces of text::

    <tool_call>{"name": "python", "arguments": {"code": "print(48213 * 917)"}}</tool_call>
    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n44211321\\n\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    <answer>44211321</answer><|im_end|>

  (assistant turn 1, which ends on ``</tool_call>``; the tool turn as the chat
  template renders a ``tool`` message holding what ``print`` wrote; assistant
  turn 2), or
* a direct episode, one turn: ``<answer>N</answer><|im_end|>`` with a
  plausible but wrong ``N``.

Everything here runs offline on a CPU:

* :func:`build_tokenizer`: byte-level BPE (Qwen2's pipeline, one digit per
  token) wrapped as a ``Qwen2Tokenizer`` with ChatML special tokens, the six
  tags of :data:`TAG_TOKENS` as non-special added tokens and
  :data:`CHAT_TEMPLATE` (Qwen2.5's tool style, shortened);
* :func:`build_model`: :func:`tools.tiny_model.build_model`'s Qwen2 (hidden
  128, 3 layers, head_dim 32) with 4 KV heads, MLP 256 and RoPE base 1000;
* :func:`episode_pieces` / :func:`encode_pieces`: the SFT episodes, with the
  loss mask on the assistant tokens only; :func:`sft_examples`: the SFT mix
  (most examples tool episodes, so the copying is learnt; the decision token
  ``<tool_call>`` / ``<answer>`` trained on a 30/70 mix, so the model calls
  the tool in about 30 % of its samples);
* :func:`tools.tiny_model.sft_masked` trains on such masked examples;
* :func:`parse_tool_call` / :func:`tool_call_expression`: read a turn 1 back.

``scripts/build_tiny_tools_model.py`` uses these to write
``assets/tiny-tools-model``.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Sequence

from grpo.tasks.python_tool import PYTHON_TOOL
from tools import tiny_model
from tools.synthetic_tools import expression, parse_answer
from tools.tiny_model import (
    CHATML_ASSISTANT_TURN,
    CHATML_OTHER_TURN_AND_END,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    model_file_size,
)

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_DIR",
    "IM_END",
    "IM_START",
    "MODEL_SETTINGS",
    "PAD_TOKEN",
    "PYTHON_TOOL",
    "SPECIAL_TOKENS",
    "SYSTEM_PROMPT",
    "TAG_TOKENS",
    "answer_text",
    "build_model",
    "build_prompt",
    "build_tokenizer",
    "encode_pieces",
    "episode_pieces",
    "messages",
    "model_file_size",
    "parse_tool_call",
    "sft_examples",
    "tool_call_expression",
    "tool_call_text",
    "tool_turn_text",
    "wrong_answer",
]

DEFAULT_MODEL_DIR = tiny_model.REPO_ROOT / "assets" / "tiny-tools-model"

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAG_TOKENS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

SYSTEM_PROMPT = "Use the python tool to compute, then give the result as <answer>N</answer>."

# Qwen2.5's tool template, shortened. With ``tools``: one system turn holding
# the system message (if any) and the ``# Tools`` block, one tool a line as
# ``tojson`` writes it. ``tool`` messages render as Qwen2.5 renders them: a
# user turn holding ``<tool_response>\n...\n</tool_response>``. Assistant
# content sits inside ``{% generation %}`` (HF assistant masks, TorchRL's
# History.apply_chat_template); the mask does not cover the ``<|im_end|>``.
# Without ``tools`` it renders like tools/tiny_model.CHAT_TEMPLATE (ChatML).
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    + CHATML_ASSISTANT_TURN
    + "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    + CHATML_OTHER_TURN_AND_END
)

_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_PRINT_RE = re.compile(r"print\((\d+) ([+\-*]) (\d+)\)")


# --------------------------------------------------------------------------
# Texts
# --------------------------------------------------------------------------


def messages(question: str) -> list[dict]:
    """[system prompt, user question] as chat messages."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def build_prompt(tokenizer, question: str) -> str:
    """Prompt text for ``question``: system + tools block + user turn + ``<|im_start|>assistant\\n``."""
    return tokenizer.apply_chat_template(
        messages(question), tools=[PYTHON_TOOL], add_generation_prompt=True, tokenize=False
    )


def tool_call_text(problem: dict) -> str:
    """Assistant turn 1 of a tool episode (ends on ``</tool_call>``, no ``<|im_end|>``)."""
    call = {"name": "python", "arguments": {"code": f"print({expression(problem)})"}}
    return CALL_OPEN + json.dumps(call) + CALL_CLOSE


def tool_turn_text(tokenizer, content: str) -> str:
    """The text the template puts between an assistant turn and the next assistant turn,
    for a ``tool`` message holding ``content``: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n
    {content}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.

    Computed from the template (render with and without the tool message) so
    that it always matches what the chat template renders.
    """
    before, after = _tool_turn_parts(tokenizer.chat_template)
    return before + content + after


_SENTINEL = "\x00TOOL-CONTENT\x00"


@functools.lru_cache(maxsize=8)
def _tool_turn_parts(chat_template: str) -> tuple[str, str]:
    base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "X"}]
    head = _render(chat_template, base)
    full = _render(chat_template, base + [{"role": "tool", "content": _SENTINEL}], add_generation_prompt=True)
    cut = head.rindex("X") + 1
    assert full[:cut] == head[:cut] and full.count(_SENTINEL) == 1
    before, after = full[cut:].split(_SENTINEL)
    return before, after


def _render(chat_template: str, conversation: list[dict], add_generation_prompt: bool = False) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[conversation], tools=[PYTHON_TOOL], chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


def answer_text(value) -> str:
    """``<answer>value</answer><|im_end|>``: a final assistant turn."""
    return f"{ANSWER_OPEN}{value}{ANSWER_CLOSE}{IM_END}"


def wrong_answer(result: int, rng: random.Random) -> int:
    """``result`` with 1-3 of its digits changed (same length, never ``result``)."""
    digits = list(str(result))
    k = min(len(digits), rng.choice((1, 1, 2, 2, 3)))
    for i in rng.sample(range(len(digits)), k):
        choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)]
        digits[i] = rng.choice(choices)
    out = int("".join(digits))
    assert out != result
    return out


def episode_pieces(tokenizer, problem: dict, kind: str, rng: random.Random | None = None) -> list[tuple[str, bool]]:
    """An SFT episode as ``(text, trained)`` pieces (``trained``: loss on it).

    ``kind="tool"``: prompt, turn 1 (the tool call), the tool turn (the result
    printed, as a tool message), turn 2 (``<answer>r</answer><|im_end|>``).
    ``kind="direct"``: prompt, ``<answer>w</answer><|im_end|>`` with ``w`` a
    wrong result (:func:`wrong_answer`, drawn from ``rng``).
    """
    info = parse_answer(problem["answer"])
    prompt = build_prompt(tokenizer, problem["question"])
    if kind == "tool":
        return [
            (prompt, False),
            (tool_call_text(problem), True),
            (tool_turn_text(tokenizer, f"{info['result']}\n"), False),
            (answer_text(info["result"]), True),
        ]
    if kind == "direct":
        rng = rng if rng is not None else random.Random(0)
        return [(prompt, False), (answer_text(wrong_answer(info["result"], rng)), True)]
    raise ValueError(f"unknown episode kind {kind!r}")


def encode_pieces(tokenizer, pieces: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of the pieces, each tokenized on its own, and the loss mask (1 = trained)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        p = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += p
        mask += [int(trained)] * len(p)
    return ids, mask


def sft_examples(
    tokenizer,
    problems: Sequence[dict],
    *,
    tool_rows: float = 0.85,
    call_frac: float = 0.3,
    seed: int = 0,
) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """SFT examples ``(ids, loss_mask)`` for ``problems``, and counts.

    Two mixtures in one: a problem becomes a tool episode with probability
    ``tool_rows`` (the rest direct episodes), so that most examples teach the
    copying (question -> ``print(a op b)``, tool result -> ``<answer>``); but
    the loss on the decision token (the first assistant token: ``<tool_call>``
    or ``<answer>``) is kept only on all direct episodes and on just enough
    tool episodes that ``<tool_call>`` is the target of a ``call_frac``
    fraction of the decision tokens trained. The model then opens with
    ``<tool_call>`` with probability about ``call_frac`` whatever ``tool_rows``.
    """
    rng = random.Random(f"sft-examples:{seed}")
    kinds = ["tool" if rng.random() < tool_rows else "direct" for _ in problems]
    n_direct = kinds.count("direct")
    n_tool_decision = min(kinds.count("tool"), round(call_frac / (1 - call_frac) * n_direct)) if call_frac < 1 else len(kinds)
    episodes = [episode_pieces(tokenizer, p, kind, rng) for p, kind in zip(problems, kinds)]
    # one batched call of the fast tokenizer: same ids as encode_pieces, piece by piece
    flat = tokenizer([t for e in episodes for t, _ in e], add_special_tokens=False)["input_ids"]
    examples = []
    seen_tool = 0
    pos = 0
    for e, kind in zip(episodes, kinds):
        ids, mask = [], []
        for (_, trained), piece_ids in zip(e, flat[pos : pos + len(e)]):
            ids += piece_ids
            mask += [int(trained)] * len(piece_ids)
        pos += len(e)
        if kind == "tool":
            if seen_tool >= n_tool_decision:
                mask[mask.index(1)] = 0  # the <tool_call> decision token: context, not a target
            seen_tool += 1
        examples.append((ids, mask))
    counts = {
        "examples": len(examples),
        "tool_episodes": kinds.count("tool"),
        "direct_episodes": n_direct,
        "tool_decisions_trained": n_tool_decision,
        "call_fraction_of_decisions": n_tool_decision / max(1, n_tool_decision + n_direct),
    }
    return examples, counts


def parse_tool_call(text: str) -> dict | None:
    """The first ``<tool_call>{json}</tool_call>`` of ``text`` as a dict (None if absent or not JSON)."""
    m = _CALL_RE.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
    except (json.JSONDecodeError, ValueError):
        return None
    return call if isinstance(call, dict) else None


def tool_call_expression(text: str) -> str | None:
    """``"a op b"`` if ``text`` holds a well-formed python call ``print(a op b)``, else None."""
    call = parse_tool_call(text)
    if call is None or call.get("name") != "python" or not isinstance(call.get("arguments"), dict):
        return None
    code = call["arguments"].get("code")
    if not isinstance(code, str):
        return None
    m = _PRINT_RE.fullmatch(code.strip())
    return f"{m.group(1)} {m.group(2)} {m.group(3)}" if m else None


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _tokenizer_corpus(tokenizer_for_template, problems: Sequence[dict]) -> list[str]:
    rng = random.Random(0)
    texts: list[str] = []
    for i, p in enumerate(problems):
        kind = "tool" if i % 2 == 0 else "direct"
        texts.extend(t for t, _ in episode_pieces(tokenizer_for_template, p, kind, rng))
    return texts  # train_qwen2_tokenizer keeps the special tokens and tags out of the BPE statistics


class _TemplateOnly:
    """Renders :data:`CHAT_TEMPLATE` the way a tokenizer does, before any tokenizer exists."""

    chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False, tokenize=False):
        assert tools == [PYTHON_TOOL] and not tokenize
        return _render(CHAT_TEMPLATE, conversation, add_generation_prompt)


def build_tokenizer(problems: Sequence[dict], vocab_size: int = 640):
    """Train a byte-level BPE on rendered episodes of ``problems``.

    The corpus is every problem's rendered prompt (system turn with the tools
    block + user turn: the block compresses to few tokens) and episode pieces,
    half tool and half direct episodes. Same pipeline as
    :func:`tools.tiny_model.build_tokenizer` (NFC, Qwen2's split regex with one
    digit per token, byte-level), so ``AutoTokenizer`` loads it back as the
    same ``Qwen2Tokenizer``. ChatML special tokens (``<|im_end|>`` eos,
    ``<|endoftext|>`` pad), the six :data:`TAG_TOKENS` as non-special added
    tokens, left padding and :data:`CHAT_TEMPLATE`. ``vocab_size`` counts every
    token; the BPE stops short of it when it runs out of merges (the corpus has
    few distinct words: 464 tokens for the shipped model, every word of the
    prompt one token, the tools block ~90 tokens since no merge crosses a
    pre-token boundary such as ``{"`` | ``name`` | ``":``).
    """
    return tiny_model.train_qwen2_tokenizer(_tokenizer_corpus(_TemplateOnly(), problems), vocab_size, tags=TAG_TOKENS,
                                            chat_template=CHAT_TEMPLATE)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


# the settings of :func:`build_model` that differ from :func:`tools.tiny_model.build_model`'s
MODEL_SETTINGS = {"num_kv_heads": 4, "intermediate_size": 256, "rope_theta": 1000.0}


def build_model(tokenizer, **settings):
    """A random-init ``Qwen2ForCausalLM``: :func:`tools.tiny_model.build_model`'s
    (hidden 128, 3 layers, 4 heads of 32, tied embeddings, 512 positions, eos
    ``<|im_end|>``; ``settings``: its keyword arguments) with :data:`MODEL_SETTINGS`,
    the settings under which copying digits (question ->
    tool call, tool result -> answer) was learnt in the fewest SFT steps in a
    sweep (GPU, several seeds): no grouped KV heads, MLP 256 and RoPE base 1000
    (Qwen2's default 10000 and 2 KV heads: no copying after 1200 steps for most
    seeds; base 1000 and 4 KV heads: copying from step 400-700 on for 9 seeds
    in 10). Even so, whether the copy comes out exact or only ~75 % right
    (repeated digits confused) depends on the seed.
    """
    return tiny_model.build_model(tokenizer, **{**MODEL_SETTINGS, **settings})
