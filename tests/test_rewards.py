import random

import pytest
import torch

from grpo.tasks.rewards import (_NUMBER, _numbers_text, is_well_formatted, last_number, numbers_match, parse_number,
                                reference_answer)
from grpo.tasks.settings import TaskSettings


@pytest.mark.parametrize("text, value", [
    ("8", 8.0),
    ("$1,200", 1200.0),
    ("The answer is 1,234,567.", 1234567.0),
    ("-3", -3.0),
    ("\u22125 degrees", -5.0),
    ("0.5", 0.5),
    (".75", 0.75),
    ("72.", 72.0),
    ("costs $ 18.00 in total", 18.0),
    ("first 3 then 4 so 7", 7.0),
    ("no number here", None),
    ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("predicted, reference, match", [
    ("18", "18", True),
    ("$18.00", "18", True),
    ("18.", "18", True),
    ("1,080", "1080", True),
    ("-7", "-7", True),
    ("7", "-7", False),
    ("0.25", ".25", True),
    ("19", "18", False),
    ("eighteen", "18", False),
    ("The total is 42 apples.", "42", True),
])
def test_numbers_match(predicted, reference, match):
    assert numbers_match(predicted, reference) is match


def test_reference_answer_takes_text_after_hashes():
    assert reference_answer("3 + 5 = 8\n#### 8") == "8"
    assert reference_answer("He pays $1,200 #### 1,200") == "1,200"
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final line")


@pytest.mark.parametrize("response, ok", [
    ("<think>3 + 5 = 8</think><answer>8</answer>", True),
    ("<think>x</think> <answer>8</answer>\n", True),
    ("  <think>\na\n</think>\n\n<answer>\nb\n</answer>\n", True),
    ("<answer>8</answer>", False),
    ("<think>x</think>", False),
    ("<think>3 + 5 = 8</think>The answer is 8.", False),
    ("<answer>8</answer><think>x</think>", False),
    ("text <think>x</think><answer>8</answer>", False),
    ("<think>x</think><answer>8</answer> and more text", False),
])
def test_format(response, ok):
    assert is_well_formatted(response) is ok


# --- reward.answer_extraction: flexible, strict or tag ----------------------------------------

TINY_REF = "3 + 5 = 8\n#### 8"


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from grpo.training.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))  # ChatML: <|im_end|> = eos, <|endoftext|> = pad, both special


def _score(reward, replies, references):
    """Run the reward transform's step on assistant replies, as the env does (history mode)."""
    from tensordict import TensorDict
    from torchrl.data.llm import History

    n = len(replies)
    history = History(role=[["user", "assistant"]] * n, content=[["Q?", r] for r in replies], batch_size=(n, 2))
    reward.in_keys = [("history", "full"), "answer"]  # what the env's input mode sets
    td = TensorDict({("history", "full"): history}, batch_size=(n,))
    nxt = reward._step(td, TensorDict(answer=list(references), batch_size=(n,)))
    return {key: nxt[key].view(-1).tolist() for key in ("reward", "success", "reward_answer", "reward_think",
                                                        "correct_strict", "correct_flexible", "marked_answer")}


def _one(reward, reply, reference=TINY_REF):
    return {key: values[0] for key, values in _score(reward, [reply], [reference]).items()}


# reply -> (tag: reward, success, reward_answer), (flexible: reward, success, reward_answer); format bonus 0.1
SCORING_CASES = [
    # <answer> present: both modes read it (flexible: it is the last explicit final answer)
    ("<think>3 + 5 = 8</think><answer>8</answer>", (1.1, True, 1.0), (1.1, True, 1.0)),
    ("<think>3 + 5 = 9</think><answer>9</answer>", (0.1, False, 1.0), (0.1, False, 1.0)),
    ("<answer>The answer is $8.00.</answer>", (1.0, True, 1.0), (1.0, True, 1.0)),
    # the tag wins over a later number; a tag without a number leaves flexible the last number
    ("<answer>9</answer> Actually it is 8", (0.0, False, 1.0), (0.0, False, 1.0)),
    ("<think>3 + 5 = 8</think><answer>eight</answer>", (0.1, False, 1.0), (1.1, True, 1.0)),
    ("<think>8</think><answer></answer>", (0.1, False, 0.0), (1.1, True, 1.0)),
    # no tag: only flexible finds an answer
    ("3 + 5 = 8", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("3 + 5 = 8, so the answer is 8.", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("I think it is 8, no wait, 9.", (0.0, False, 0.0), (0.0, False, 1.0)),
    ("<think>3 + 5 = 8</think>The answer is 8.", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("<answer>8 (never closed", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("I do not know.", (0.0, False, 0.0), (0.0, False, 0.0)),
    ("", (0.0, False, 0.0), (0.0, False, 0.0)),
    # trailing special tokens are no numbers and no format break
    ("3 + 5 = 8<|im_end|>", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("The answer is 8.<|im_end|>\n<|endoftext|><|endoftext|>", (0.0, False, 0.0), (1.0, True, 1.0)),
    ("No number here<|im_end|><|endoftext|>", (0.0, False, 0.0), (0.0, False, 0.0)),
    ("<think>3 + 5 = 8</think><answer>8</answer><|im_end|><|endoftext|>", (1.1, True, 1.0), (1.1, True, 1.0)),
    ("<think>x</think><answer>7</answer>\n<|endoftext|>", (0.1, False, 1.0), (0.1, False, 1.0)),
]


@pytest.mark.parametrize("mode", ["tag", "flexible"])
@pytest.mark.parametrize("reply, tag_expected, last_expected", SCORING_CASES)
def test_answer_extraction_scoring(tiny_tok, mode, reply, tag_expected, last_expected):
    from grpo.tasks.rewards import GSM8KReward

    reward_value, success, answer = tag_expected if mode == "tag" else last_expected
    got = _one(GSM8KReward(tiny_tok, answer_extraction=mode, format_reward=0.1), reply)
    assert got["reward"] == pytest.approx(reward_value)
    assert got["success"] is success
    assert got["reward_answer"] == answer


@pytest.mark.parametrize("reply, reference, correct", [
    ("It costs $1,200 in total", "He pays 1200\n#### 1200", True),
    ("It costs $1,200.00.", "#### 1,200", True),
    ("So 1,080 apples", "#### 1080", True),
    ("Total: $ 18", "#### 18", True),
    ("The temperature drops to -7 degrees", "#### -7", True),
    ("She has 0.5 left", "#### .5", True),
    ("It costs $1,200 and 3 cents", "#### 1200", False),  # the last number is 3
    ("1,2 or 12?", "#### 12", True),
])
def test_flexible_reads_numbers_with_dollars_and_commas(tiny_tok, reply, reference, correct):
    from grpo.tasks.rewards import GSM8KReward

    got = _one(GSM8KReward(tiny_tok, answer_extraction="flexible"), reply, reference)
    assert got["success"] is correct
    assert got["reward"] == pytest.approx(1.0 if correct else 0.0)
    assert got["reward_answer"] == 1.0


def test_special_tokens_with_digits_never_count(tiny_model_dir):
    from grpo.tasks.rewards import GSM8KReward, special_tokens
    from grpo.training.models import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_7|>"]})
    specials = special_tokens(tok)
    assert {"<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|reserved_special_token_7|>"} <= set(specials)
    assert not {"<think>", "</think>", "<answer>", "</answer>"} & set(specials)  # added, but reply text
    reward = GSM8KReward(tok, answer_extraction="flexible")
    assert _one(reward, "So 8<|reserved_special_token_7|><|im_end|>")["success"] is True
    assert _one(reward, "So 8 <|reserved_special_token_7|> apples")["success"] is True
    nothing = _one(reward, "Nothing<|reserved_special_token_7|>")
    assert nothing["reward_answer"] == 0.0 and nothing["success"] is False


def test_batch_and_think_outputs(tiny_tok):
    from grpo.tasks.rewards import GSM8KReward

    replies = ["3 + 5 = 8", "<think>3 + 5</think><answer>8</answer>", "no", "<think>5 + 3 = 8</think> 8<|im_end|>"]
    refs = [TINY_REF, TINY_REF, TINY_REF, "#### 8"]
    tag = _score(GSM8KReward(tiny_tok, answer_extraction="tag", format_reward=0.5), replies, refs)
    last = _score(GSM8KReward(tiny_tok, answer_extraction="flexible", format_reward=0.5), replies, refs)
    assert tag["reward_answer"] == [0.0, 1.0, 0.0, 0.0]  # eval/answer_rate 0.25
    assert last["reward_answer"] == [1.0, 1.0, 0.0, 1.0]  # eval/answer_rate 0.75
    assert tag["reward"] == pytest.approx([0.0, 1.5, 0.0, 0.0])
    assert last["reward"] == pytest.approx([1.0, 1.5, 0.0, 1.0])
    assert tag["reward_think"] == last["reward_think"] == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("bad", ["last_number", "TAG", "", None])
def test_bad_answer_extraction_is_refused(tiny_tok, bad):
    from grpo.tasks.rewards import GSM8KReward

    with pytest.raises(ValueError, match=r"reward\.answer_extraction.*'flexible'.*'strict'.*'tag'"):
        GSM8KReward(tiny_tok, answer_extraction=bad)


@pytest.mark.parametrize("mode, rewards, answered", [
    ("tag", [0.0, 0.1, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]),
    ("flexible", [1.0, 0.1, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]),
])
def test_env_reward_follows_answer_extraction(mode, rewards, answered):
    """The real GSM8K env, built from the composed config, stepped with hand-written replies."""
    from conftest import compose
    from torchrl.data.llm import History

    import grpo.tasks.paths
    from grpo.tasks.envs import make_env
    from grpo.training.models import load_tokenizer

    cfg = compose("grpo_tiny", [f"reward.answer_extraction={mode}"])
    grpo.tasks.paths.resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    env = make_env(TaskSettings.from_config(cfg), tok, split="test", repeats=2, num_envs=4, shuffle=False)
    td = env.reset()
    # test.jsonl rows 0 and 1, each twice: 19 + 6 = 25, 4 * 2 = 8
    assert [a.rsplit("#### ", 1)[1] for a in td["answer"]] == ["25", "25", "8", "8"]
    replies = [
        "19 + 6 = 25<|im_end|>",  # no tags: right under flexible only
        "<think>19 + 6 = 24</think><answer>24</answer><|im_end|><|endoftext|>",  # tag wins; wrong but formatted
        "4 * 2 is 8 eggs.",
        "I do not know.<|im_end|>",
    ]
    response = History(role=["assistant"] * 4, content=replies, batch_size=(4,)).unsqueeze(-1)
    td["history", "full"] = td["history", "prompt"].extend(response, inplace=False, dim=-1)
    nxt = env.step(td)["next"]
    assert nxt["reward"].shape == (4, 1, 1)
    assert nxt["reward"].view(-1).tolist() == pytest.approx(rewards)
    assert nxt["reward_answer"].view(-1).tolist() == answered
    assert nxt["success"].view(-1).tolist() == [r == 1.0 for r in rewards]
    assert nxt["done"].all()


# reply -> (strict answer right, flexible answer right, has an explicit final answer); the reference is 8
FINAL_ANSWER_CASES = [
    ("3 + 5 = 8. #### 8", (True, True, True)),
    ("So she has 3 + 5 = 8 apples.\n\n#### 8<|im_end|>", (True, True, True)),
    ("The total is \\boxed{8}.", (True, True, True)),
    ("Final answer: $\\boxed{\\$8.00}$", (True, True, True)),
    ("The answer is 8. Check: 3 + 5 = 8, and 2 apples are left.", (True, True, True)),  # the marked 8, not the 2
    ("**Final Answer:** 8 apples", (True, True, True)),
    ("<answer>8</answer>", (True, True, True)),
    ("The answer is 9.\n#### 8", (True, True, True)),  # the last explicit answer wins
    ("#### 8\nWait, the answer is 9.", (False, False, True)),
    ("3 + 5 = 8", (False, True, False)),  # no explicit answer: flexible only
    ("The answer is unclear; maybe 8", (False, True, False)),  # a mark holding no number is none
    ("#### eight, 3 + 5 = 7", (False, False, False)),
    ("\\boxed{1{,}208} or 8?", (False, False, True)),
]


@pytest.mark.parametrize("reply, expected", FINAL_ANSWER_CASES)
def test_strict_and_flexible_answers(tiny_tok, reply, expected):
    from grpo.tasks.rewards import GSM8KReward

    for mode in ("strict", "flexible"):
        got = _one(GSM8KReward(tiny_tok, answer_extraction=mode), reply, "#### 8")
        assert (got["correct_strict"], got["correct_flexible"], got["marked_answer"]) == expected
        assert got["success"] is expected[0 if mode == "strict" else 1]
        assert got["reward"] == pytest.approx(float(got["success"]))  # no format reward by default: right answers only


def test_boxed_thousands_in_latex(tiny_tok):
    from grpo.tasks.rewards import GSM8KReward

    got = _one(GSM8KReward(tiny_tok, answer_extraction="strict"), "So \\boxed{1{,}208}", "#### 1208")
    assert got["success"] is True


def test_last_number_read_from_the_end_is_the_last_match_over_the_whole_reply():
    """The flexible answer is found from the reply's end; it must be what matching the whole reply gives, for any
    mix of digits (unicode ones too), separators, signs, spaces and the rest."""
    alphabet = [*"0123456789,.$- \n\tab{}", "\u2212", "{,}", "\u0663", "\uff13", "\u00a0", "\u2009"]
    rng = random.Random(0)
    texts = ["", "no digits", "1,", "-.5", "$ 1,200.50.", "pay $3 then 4 ,5"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(20000)]
    for text in texts:
        every = _NUMBER.findall(_numbers_text(text))
        assert last_number(text) == (every[-1].strip() if every else None), text


@pytest.mark.parametrize("mode", ["flexible", "strict", "tag"])
def test_batched_step_writes_what_torchrl_s_step_writes(tiny_tok, mode):
    """GSM8KReward scores a batch as columns; TorchRL's GSM8KRewardParser._step (a TensorDict a reply, stacked) must
    give the same keys, dtypes, shapes, values and done flags, on episodes of one and of several turns."""
    from tensordict import TensorDict, lazy_stack
    from torchrl.data.llm import History
    from torchrl.envs.llm import GSM8KRewardParser

    from grpo.tasks.rewards import GSM8KReward

    replies = [reply for reply, _, _ in SCORING_CASES] + [reply for reply, _ in FINAL_ANSWER_CASES]
    refs = [TINY_REF if i % 2 else "#### 8" for i in range(len(replies))]

    def episode(i, reply):  # every third one: a tool's answer, then the reply as a second turn
        turns = [("user", "Q?"), ("assistant", reply)]
        if i % 3 == 0:
            turns = [("user", "Q?"), ("assistant", "```python\nprint(3 + 5)\n```"), ("tool", "8"), ("assistant", reply)]
        return lazy_stack([History(role=role, content=text) for role, text in turns])

    def step(step_fn):
        reward = GSM8KReward(tiny_tok, answer_extraction=mode, format_reward=0.1)
        reward.in_keys = [("history", "full"), "answer"]
        td = TensorDict({("history", "full"): lazy_stack([episode(i, r) for i, r in enumerate(replies)])},
                        batch_size=(len(replies),))
        nxt = TensorDict(answer=list(refs), done=torch.zeros(len(replies), 1, dtype=torch.bool),
                         batch_size=(len(replies),))
        return step_fn(reward, td, nxt)

    ours, torchrl_s = step(GSM8KReward._step), step(GSM8KRewardParser._step)
    keys = ("reward", "success", "reward_answer", "reward_think", "reward_right", "correct_strict",
            "correct_flexible", "marked_answer", "done")
    for key in keys:
        assert ours[key].dtype == torchrl_s[key].dtype, key
        assert ours[key].shape == torchrl_s[key].shape, key
        assert torch.equal(ours[key], torchrl_s[key]), key
    assert ours["reward"].shape == (len(replies), 1, 1) and ours["done"].any() and not ours["done"].all()
