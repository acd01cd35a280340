"""A tiny, locally built chat model for the synthetic GSM8K-format task.

Everything here runs offline on a CPU:

* :func:`build_tokenizer` trains a small byte-level BPE with the ``tokenizers``
  library and wraps it as a ``Qwen2Tokenizer`` (a
  :class:`transformers.PreTrainedTokenizerFast`, the class ``AutoTokenizer``
  and vLLM load for a qwen2 model directory) with ChatML special tokens (``<|im_start|>``, ``<|im_end|>`` = eos,
  ``<|endoftext|>`` = pad), the non-special added tokens ``<think>``,
  ``</think>``, ``<answer>``, ``</answer>`` and a ChatML ``chat_template``.
* :func:`build_model` makes a randomly initialised ``Qwen2ForCausalLM`` of a
  few MB (head_dim 32, so that vLLM's CPU attention accepts it).
* :func:`build_prompt` renders a prompt exactly as TorchRL's ``GSM8KEnv`` does
  in history mode (system prompt + user question, through
  ``torchrl.data.llm.History.apply_chat_template``).
* :func:`sft` is a short supervised fine-tuning loop and
  :func:`evaluate_greedy` / :func:`evaluate` score generations on problems.
* :func:`load_tokenizer` / :func:`load_model` load a saved model back as
  users do, :func:`model_fixtures` makes them a test module's fixtures.

``scripts/build_tiny_model.py`` uses these to write ``assets/tiny-model``.
"""

from __future__ import annotations

import inspect
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tools.synthetic import parse_answer

__all__ = [
    "DEFAULT_MODEL_DIR",
    "PAD_TOKEN",
    "IM_START",
    "IM_END",
    "CHAT_TEMPLATE",
    "CHATML_ASSISTANT_TURN",
    "CHATML_OTHER_TURN_AND_END",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "STYLES",
    "DEFAULT_ANSWER_PROB",
    "assign_styles",
    "system_prompt",
    "build_tokenizer",
    "train_qwen2_tokenizer",
    "build_model",
    "make_history",
    "build_prompt",
    "format_response",
    "extract_answer",
    "score_response",
    "sft",
    "sft_masked",
    "evaluate",
    "evaluate_greedy",
    "model_file_size",
    "load_tokenizer",
    "load_model",
    "model_fixtures",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "assets" / "tiny-model"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# ChatML. The ``{% generation %}`` markers let HF compute assistant masks and
# make TorchRL's History.apply_chat_template use this template as it is. It
# renders the same text as TorchRL's ``chatml_format`` and (for conversations
# that start with a system turn) ``qwen`` templates; like them, the assistant
# mask covers the content but not the closing ``<|im_end|>``.
# Its two pieces that tools/tiny_tools.CHAT_TEMPLATE shares: an assistant turn, and the branch for any other
# turn that closes the loop over the messages, then the generation prompt.
CHATML_ASSISTANT_TURN = (
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message['content'] -}}{% endgeneration %}"
    "{{- '<|im_end|>\\n' -}}"
)
CHATML_OTHER_TURN_AND_END = (
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    + CHATML_ASSISTANT_TURN
    + CHATML_OTHER_TURN_AND_END
)

# Response styles used for SFT targets. Only "answer" earns the GSM8K reward.
STYLES = ("answer", "plain", "hash")

_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT_RE = re.compile(r"-?\d+")


def system_prompt() -> str:
    """TorchRL's GSM8K system prompt (``GSM8KEnv.SYSTEM_PROMPT``)."""
    from torchrl.envs.llm import GSM8KEnv

    return GSM8KEnv.SYSTEM_PROMPT


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _tokenizer_corpus(problems: Sequence[dict]) -> list[str]:
    sp = system_prompt()
    texts: list[str] = []
    for p in problems:
        texts.append(p["question"])
        texts.append(p["answer"])
        for style in STYLES:
            texts.append(format_response(p, style))
    # The system prompt is in every prompt: weight it like the questions so
    # its words get merged into few tokens.
    texts += [sp] * max(1, len(problems) // 4)
    texts += ["system\n", "user\n", "assistant\n"] * 10
    return texts


def build_tokenizer(problems: Sequence[dict], vocab_size: int = 600):
    """Train a byte-level BPE on ``problems`` + the system prompt.

    Returns a ``transformers`` fast tokenizer (a ``Qwen2Tokenizer``, i.e. a
    :class:`transformers.PreTrainedTokenizerFast` subclass) with ChatML
    special tokens, the four tag tokens as non-special added tokens, left
    padding and :data:`CHAT_TEMPLATE`. ``vocab_size`` counts every token,
    special and added ones included (the BPE may stop short of it when it runs
    out of merges).

    The BPE is trained with exactly the normalizer / pre-tokenizer that
    ``Qwen2Tokenizer`` uses (NFC, Qwen's split regex with one digit per
    token, byte-level), because ``AutoTokenizer`` loads any directory whose
    ``config.json`` says ``qwen2`` with that class: tokenization is then the
    same in memory, after ``AutoTokenizer.from_pretrained`` and in vLLM.
    """
    return train_qwen2_tokenizer(_tokenizer_corpus(problems), vocab_size, tags=TAG_TOKENS, chat_template=CHAT_TEMPLATE)


def train_qwen2_tokenizer(corpus: Sequence[str], vocab_size: int, *, tags: Sequence[str], chat_template: str):
    """A byte-level BPE trained on ``corpus`` with ``Qwen2Tokenizer``'s own pipeline, as that class: ChatML special
    tokens, ``tags`` as non-special added tokens (``vocab_size`` counts them), left padding, ``chat_template``.

    The special tokens and tags in ``corpus`` are cut out of it first: added tokens, they stay out of the BPE
    statistics."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tags),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    added = (*SPECIAL_TOKENS, *tags)
    split_re = re.compile("(" + "|".join(re.escape(t) for t in added) + ")")
    backend.train_from_iterator([s for t in corpus for s in split_re.split(t) if s and s not in added], trainer)
    model_state = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_state["merges"]]

    tok = Qwen2Tokenizer(
        vocab=dict(model_state["vocab"]),
        merges=merges,
        unk_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False) for t in tags]
    )
    tok.chat_template = chat_template
    return tok


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def build_model(
    tokenizer,
    *,
    num_layers: int = 3,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    seed: int = 0,
):
    """A randomly initialised, tied-embedding ``Qwen2ForCausalLM`` (float32); ``rope_theta``: Qwen2's default."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if head_dim < 32:
        raise ValueError("head_dim must be >= 32 (vLLM CPU attention)")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": float(rope_theta), "rope_type": "default"},
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


def model_file_size(model_dir: str | Path = DEFAULT_MODEL_DIR) -> int:
    """Total size in bytes of the ``*.safetensors`` files in ``model_dir``."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def load_tokenizer(model_dir: str | Path = DEFAULT_MODEL_DIR):
    """The tokenizer saved in ``model_dir``, loaded the way users load it (``AutoTokenizer``)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_model(model_dir: str | Path = DEFAULT_MODEL_DIR):
    """The model saved in ``model_dir``, loaded the way users load it (``AutoModelForCausalLM``), in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


def model_fixtures(model_dir: str | Path = DEFAULT_MODEL_DIR):
    """Module-scoped pytest fixtures ``tok`` and ``model`` (:func:`load_tokenizer`, :func:`load_model` of
    ``model_dir``), for a test module to bind at its top level: ``tok, model = model_fixtures(MODEL_DIR)``."""
    import pytest

    @pytest.fixture(scope="module")
    def tok():
        return load_tokenizer(model_dir)

    @pytest.fixture(scope="module")
    def model():
        return load_model(model_dir)

    return tok, model


# --------------------------------------------------------------------------
# Prompts and responses
# --------------------------------------------------------------------------


def make_history(question: str):
    """The History TorchRL's ``GSM8KEnv`` builds: [system prompt, user question]."""
    import tensordict
    from torchrl.data.llm import History

    tensordict.set_list_to_stack(True).set()
    return History(
        role=["system", "user"],
        content=[system_prompt(), question],
        batch_size=(2,),
    )


def build_prompt(tokenizer, question: str) -> str:
    """Prompt text for ``question``, rendered by TorchRL's History machinery."""
    return make_history(question).apply_chat_template(
        tokenizer=tokenizer, add_generation_prompt=True
    )


def format_response(problem: dict, style: str = "answer") -> str:
    """Assistant content (without the final ``<|im_end|>``) for ``problem``.

    ``answer``: ``<think>3 + 5 = 8</think><answer>8</answer>`` (rewarded);
    ``plain``: ``<think>3 + 5 = 8</think>The answer is 8.``;
    ``hash``: ``<think>3 + 5 = 8</think>#### 8``.
    """
    info = parse_answer(problem["answer"])
    think = f"<think>{info['equation']}</think>"
    r = info["result"]
    if style == "answer":
        return f"{think}<answer>{r}</answer>"
    if style == "plain":
        return f"{think}The answer is {r}."
    if style == "hash":
        return f"{think}#### {r}"
    raise ValueError(f"unknown style {style!r}")


# Default SFT mixture: probability that a problem's target uses the rewarded
# "answer" style, per operation (the rest use "plain"). Greedy decoding then
# picks <answer> tags for "+" problems and "The answer is N." for "-" and "*"
# ones, while sampling still often emits the rewarded format: a GRPO run only
# has to move probability mass at one decision point to gain accuracy.
DEFAULT_ANSWER_PROB = {"+": 0.8, "-": 0.3, "*": 0.3}


def assign_styles(
    problems: Sequence[dict],
    answer_prob: dict[str, float] | None = None,
    seed: int = 0,
    alt_style: str = "plain",
) -> list[str]:
    """Pick an SFT response style per problem (deterministic in ``seed``).

    A problem gets ``"answer"`` with probability ``answer_prob[op]`` (``op``
    its operation), else ``alt_style``.
    """
    answer_prob = DEFAULT_ANSWER_PROB if answer_prob is None else answer_prob
    rng = random.Random(f"styles:{seed}")
    styles = []
    for p in problems:
        op = parse_answer(p["answer"])["op"]
        styles.append("answer" if rng.random() < answer_prob[op] else alt_style)
    return styles


def _normalize(ans: str) -> str:
    ans = ans.strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".")
    if "." in ans:
        ans = ans.rstrip("0").rstrip(".")
    return ans


def extract_answer(text: str) -> str | None:
    """The (stripped) content of the first ``<answer>...</answer>``, else None."""
    m = _ANSWER_RE.search(text)
    return m.group(1).strip() if m else None


def score_response(text: str, gold_answer: str) -> dict:
    """Score one decoded response against a GSM8K ``answer`` (``... #### N``).

    ``correct``: the ``<answer>`` content equals ``N`` (same normalisation as
    TorchRL's GSM8KRewardParser); ``format``: both ``<think>..</think>`` and
    ``<answer>..</answer>`` are present; ``number_correct``: the last integer
    of the response equals ``N`` whatever the format.
    """
    text = text.removesuffix(IM_END)
    gold = _normalize(gold_answer.split("#### ")[-1])
    ans = extract_answer(text)
    ints = _INT_RE.findall(text)
    return {
        "correct": ans is not None and _normalize(ans) == gold,
        "format": ans is not None and _THINK_RE.search(text) is not None,
        "number_correct": bool(ints) and ints[-1] == gold,
    }


# --------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------


def _encode_example(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)``: the prompt is context, the response (with ``<|im_end|>``) is trained on."""
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(response + IM_END, add_special_tokens=False)["input_ids"]
    return p_ids + r_ids, [0] * len(p_ids) + [1] * len(r_ids)


def sft(
    model,
    tokenizer,
    examples: Sequence[tuple[str, str]],
    *,
    steps: int = 300,
    lr: float = 3e-3,
    log_every: int = 25,
    **options,
) -> list[float]:
    """Train ``model`` on ``(prompt, response)`` pairs, loss on the response only (``<|im_end|>`` appended to
    it): :func:`sft_masked`. Returns the loss per step."""
    encoded = [_encode_example(tokenizer, p, r) for p, r in examples]
    return sft_masked(model, tokenizer, encoded, steps=steps, lr=lr, log_every=log_every, **options)


def _shared_prefix_len(examples: Sequence[tuple[list[int], list[int]]]) -> int:
    """The prefix every example starts with, no trained token in it, at least one token left a row."""
    first = examples[0][0]
    n_shared = min(len(ids) for ids, _ in examples) - 1
    for ids, mask in examples:
        i = 0
        while i < n_shared and ids[i] == first[i] and not mask[i]:
            i += 1
        n_shared = i
    return n_shared


def sft_masked(
    model,
    tokenizer,
    examples: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int = 800,
    batch_size: int = 32,
    lr: float = 1e-3,
    warmup: int = 20,
    weight_decay: float = 0.0,
    seed: int = 0,
    log_every: int = 100,
    log: Callable[[str], None] | None = print,
    share_prefix: bool = True,
    callback: Callable[[int], None] | None = None,
) -> list[float]:
    """Train ``model`` on ``(ids, loss_mask)`` examples: the loss is the mean cross-entropy over the tokens whose
    mask is 1, the rest is context only.

    AdamW, linear warmup, cosine decay to 5 %. The prefix all examples share (the system turn) is encoded once a
    step and given to the batch as a KV cache: exact (same logits as the full sequences) and ~3x cheaper on CPU.
    ``callback(step)`` runs after every step (model in train mode). Returns the loss per step.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    n_shared = _shared_prefix_len(examples) if share_prefix else 0
    # the token after the prefix is predicted from the prefix's last position, whose logits the batch never sees
    assert all(not mask[n_shared] for _, mask in examples), "the first token after the shared prefix must be context"
    prefix = torch.tensor(examples[0][0][:n_shared], dtype=torch.long)[None] if n_shared else None
    pad_id = tokenizer.pad_token_id
    # transformers >= 5.2x names the KV-cache argument ``cache`` (``past_key_values`` deprecated)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model.train()
    order: list[int] = []
    losses: list[float] = []
    t0 = time.time()
    for step in range(steps):
        if len(order) < batch_size:
            extra = list(range(len(examples)))
            rng.shuffle(extra)
            order += extra
        idx, order = order[:batch_size], order[batch_size:]
        batch = [(examples[i][0][n_shared:], examples[i][1][n_shared:]) for i in idx]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            # right padding: positions are contiguous from the prefix on
            t = torch.tensor(ids)
            input_ids[row, : len(ids)] = t
            attn[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), t, -100)
        dev = model.device
        input_ids, labels, attn = input_ids.to(dev), labels.to(dev), attn.to(dev)
        kwargs = {}
        if prefix is not None:
            enc = model.model(input_ids=prefix.to(dev), use_cache=True)
            cache = enc["cache"] if "cache" in enc else enc["past_key_values"]
            cache.batch_repeat_interleave(len(batch))
            kwargs = {
                cache_kw: cache,
                "position_ids": torch.arange(n_shared, n_shared + width, device=dev)[None].expand(len(batch), -1),
            }
            attn = torch.cat([torch.ones((len(batch), n_shared), dtype=torch.long, device=dev), attn], dim=1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        # labels are shifted inside the model: position t predicts token t+1
        out = model(input_ids=input_ids, attention_mask=attn, labels=labels, **kwargs)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        if log is not None and (step % log_every == 0 or step == steps - 1):
            log(f"sft step {step:4d} loss {out.loss.item():.4f} lr {lr_at(step):.2e} ({time.time() - t0:.0f}s)")
        if callback is not None:
            callback(step)
    model.eval()
    return losses


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    problems: Sequence[dict],
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    batch_size: int = 64,
    seed: int = 0,
    return_responses: bool = False,
) -> dict:
    """Generate one response per problem and score it (see :func:`score_response`).

    ``temperature == 0`` is greedy decoding; otherwise plain sampling at that
    temperature (no top-k / top-p). Batched HF ``generate`` with left padding.
    Returns ``accuracy``, ``format_rate``, ``number_accuracy`` and ``n``
    (plus ``responses`` when asked).
    """
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    gen_kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if temperature > 0:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen_kwargs.update(do_sample=False)
    if seed is not None:
        torch.manual_seed(seed)
    responses: list[str] = []
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = [build_prompt(tokenizer, p["question"]) for p in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**enc, **gen_kwargs)
            gen = out[:, enc["input_ids"].shape[1] :]
            for row in gen.tolist():
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                row = [t for t in row if t != tokenizer.pad_token_id]
                responses.append(tokenizer.decode(row, skip_special_tokens=False))
    finally:
        tokenizer.padding_side = old_side
        if was_training:
            model.train()
    scores = [score_response(r, p["answer"]) for r, p in zip(responses, problems)]
    n = max(1, len(scores))
    result = {
        "accuracy": sum(s["correct"] for s in scores) / n,
        "format_rate": sum(s["format"] for s in scores) / n,
        "number_accuracy": sum(s["number_correct"] for s in scores) / n,
        "n": len(scores),
    }
    if return_responses:
        result["responses"] = responses
    return result


def evaluate_greedy(model, tokenizer, problems: Sequence[dict], max_new_tokens: int = 32) -> dict:
    """Greedy-decoding accuracy / format rate on ``problems`` (see :func:`evaluate`)."""
    return evaluate(model, tokenizer, problems, max_new_tokens, temperature=0.0)
