"""The Python tool a model calls between turns, in its own tool-call format, or as a code interpreter.

The chat template renders ``PYTHON_TOOL`` where its ``tools=`` argument asks (Qwen2.5's ``# Tools`` block); the model
calls it as ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (or a fenced JSON object of that shape,
``FENCED_CALL``) and the result comes back as a
``tool`` message, rendered by the template (Qwen2.5: a user turn holding ``<tool_response>...</tool_response>``).

As a code interpreter (``tools.call_format: code_block``) the call is a fenced ```` ```python ```` block in the
model's reply, as coder models write code unprompted, and what it prints follows in the same reply as an
```` ```output ```` block (``output_block``), the model writing on after it.
"""

from __future__ import annotations

import contextlib
import json
import re

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
        },
    },
}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


# A fenced JSON object naming a function and its arguments: how Qwen2.5-Coder-0.5B-Instruct writes a call under
# the tools block (16 samples of 2 GSM8K-style prompts, temperature 1: none in <tool_call> tags, 9 fenced objects
# with "name" and "arguments"), so a turn holding one calls the tool too, and can learn the tags from the errors
FENCED_CALL = re.compile(r"```(?:json|python)?\s*(\{.*?\})\s*```", re.DOTALL)


def holds_call(text: str) -> bool:
    """Whether an assistant turn calls a tool: a ``<tool_call>`` tag, or a fenced JSON object with a name and
    arguments."""
    return CALL_OPEN in text or fenced_call(text) is not None


def fenced_call(text: str) -> str | None:
    for match in FENCED_CALL.finditer(text):
        with contextlib.suppress(json.JSONDecodeError):
            call = json.loads(match.group(1))
            if isinstance(call, dict) and {"name", "arguments"} <= call.keys():
                return match.group(1)
    return None


def parse_call(text: str) -> tuple[str | None, str | None]:
    """The code of the first tool call in an assistant turn's ``text``, or why the call is malformed (one line a
    model can act on): ``(code, None)`` or ``(None, error)``."""
    start = text.find(CALL_OPEN)
    body = fenced_call(text) if start < 0 else None
    if body is None:
        end = text.find(CALL_CLOSE, start)
        if end < 0:
            return None, f"the tool call has no closing {CALL_CLOSE} tag; write {CALL_OPEN}{EXAMPLE_CALL}{CALL_CLOSE}"
        body = text[start + len(CALL_OPEN):end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return None, f"the tool call is not valid JSON ({err.msg} at character {err.pos}); write {EXAMPLE_CALL}"
    if not isinstance(call, dict) or "name" not in call:
        return None, f"the tool call must be a JSON object with a name and arguments; write {EXAMPLE_CALL}"
    if call["name"] != PYTHON_TOOL["function"]["name"]:
        # the 0.5B's invented tools (2026-11-30, 64 samples: 3 of its 4 calls, e.g. "total_sales" with the problem's
        # numbers as arguments): the answer shows the one call it can make, as the other errors do
        return None, f"unknown tool {call['name']!r}: the only tool is python, which runs code; write {EXAMPLE_CALL}"
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return None, f'python takes one argument, "code", a string of Python; write {EXAMPLE_CALL}'
    return arguments["code"], None


EXAMPLE_CALL = '{"name": "python", "arguments": {"code": "print(6 * 7)"}}'


# A fenced Python block as a code interpreter's call: the reply is cut at its closing fence (``code_block_end``), so
# the model reads what the code printed, not what it guessed. Qwen2.5-Coder-0.5B-Instruct wrote one, unasked, in
# 55 of 319 held-out GSM8K replies at step 0; under the tool_call prompt it called the tool in 4 of 64 (docs/tools.md)
CODE_BLOCK = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def code_block_end(text: str) -> int | None:
    """Where the first complete ```python block of ``text`` ends (after its closing fence), or None."""
    match = CODE_BLOCK.search(text)
    return match.end() if match else None


def code_block(text: str) -> str | None:
    """The code of the first complete ```python block of ``text``, or None."""
    match = CODE_BLOCK.search(text)
    return match.group(1) if match else None


def output_block(output: str) -> str:
    """What follows a code block in the reply: what the code printed, fenced as ```output."""
    return f"\n```output\n{output.rstrip()}\n```\n"
