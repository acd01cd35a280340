"""grpo/inference/episode_policy.py: a one-turn episode holds the replies, tokens, log-probs and chat histories TorchRL's own wrapper wrote
around the same sampler, from one decode a reply."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.data.llm import History
from torchrl.modules.llm.policies.common import ChatHistory

from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.episode_policy import EpisodePolicy
from grpo.inference.episodes import cut_at_stop
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.tasks.envs import make_env
from grpo.tasks.settings import TaskSettings
from grpo.tasks.python_tool import output_block
from grpo.tasks.sandbox import Sandbox, SandboxSettings
from grpo.tasks.tool_env import EnvTurn, PythonCodeBlockEnv
from torchrl_wrapper import torchrl_history_policy


@pytest.fixture(scope="module")
def tiny(tiny_lm):
    cfg, tok, model, stop_ids = tiny_lm
    options = generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=16, stop_ids=stop_ids)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    return cfg, tok, sampler, options


def test_the_policy_writes_what_torchrl_s_wrapper_wrote_and_the_env_scores_it_the_same(tiny):
    cfg, tok, sampler, options = tiny
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=16, shuffle=False)
    reset = env.reset()
    outs, steps = [], []
    for policy in (make_transformers_policy(sampler, tok, gen_kwargs=options),
                   torchrl_history_policy(sampler, tok, options)):
        torch.manual_seed(0)
        outs.append(policy(reset.copy()))
        steps.append(env.step(outs[-1].copy()))
    ours, theirs = outs
    replies = ours.get(("tokens", "response"), as_list=True)
    ended = [bool(r.numel()) and int(r[-1]) in options["eos_token_id"] for r in replies]
    assert any(ended) and not all(ended), "the test needs replies that stopped and replies cut at the cap"
    for key in (("tokens", "prompt"), ("tokens", "response"), ("tokens", "full"), ("log_probs", "response")):
        assert all(torch.equal(a, b) for a, b in zip(ours.get(key, as_list=True), theirs.get(key, as_list=True),
                                                     strict=True)), key
    assert ours["text", "response"] == theirs["text", "response"]
    for part in ("prompt", "response", "full"):
        a, b = ours["history", part], theirs["history", part]
        assert a.batch_size == b.batch_size and a.role == b.role and a.content == b.content, part
    assert ours["history", "response"].is_complete == [[done] for done in ended]
    for key in ("reward", "success"):
        assert torch.equal(steps[0]["next", key], steps[1]["next", key])
    next_prompts = [step["next", "history", "prompt"] for step in steps]  # the next turn's prompt: prompt + reply
    assert next_prompts[0].content == next_prompts[1].content


def test_prompts_without_tokens_are_rendered_by_the_chat_template(tiny):
    cfg, tok, sampler, options = tiny
    chats = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "And 7 - 4?"}]]
    given = TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(2,))
    out = make_transformers_policy(sampler, tok, gen_kwargs=options)(given)
    rendered = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                for chat in chats]
    assert [p.tolist() for p in out.get(("tokens", "prompt"), as_list=True)] == [list(r) for r in rendered]
    assert [m[-1] for m in out["history", "full"].role] == ["assistant", "assistant"]


def test_a_batch_of_other_than_one_dimension_is_refused(tiny):
    cfg, tok, sampler, options = tiny
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=2, num_envs=4, shuffle=False)
    with pytest.raises(ValueError, match="one batch dimension"):
        make_transformers_policy(sampler, tok, gen_kwargs=options)(env.reset().reshape(2, 2))


class ScriptedEnv:
    """A turn environment that answers every turn with the same user text (special-token text included), until
    ``max_turns``: the plug-in point of ``grpo.tasks.tool_env.TurnEnv``."""

    def __init__(self, text: str, max_turns: int, max_episode_tokens: int):
        self.text, self.max_turns, self.max_episode_tokens = text, max_turns, max_episode_tokens
        self.seen = []

    def answers(self, episode):
        return True

    def respond(self, episodes):
        self.seen.append([e.messages[-1]["content"] for e in episodes])
        return [EnvTurn({"role": "user", "content": self.text}, {"tool_calls": 1}) for _ in episodes]


def recording(policy):
    """The policy's sample function, each call's prompts and replies kept."""
    calls, sample = [], policy.sample

    def record(prompts, max_new_tokens, batch_rows):
        out = sample(prompts, max_new_tokens, batch_rows)
        calls.append(([p.clone() for p in prompts], [(r.clone(), lp.clone()) for r, lp in out]))
        return out

    policy.sample = record
    return calls


def test_a_multi_turn_episode_trains_on_exactly_the_sampled_tokens_and_masks_the_environment_s(tiny):
    """Token in, token out: the episode's tokens are each turn's sampled tokens (through its stop token) and the
    environment's, the next turn's prompt is the whole context so far, the sampled ones are bit-identical to what
    the engine returned with their log-probs, and the mask covers those alone; text from the environment that
    spells a special token stays text."""
    cfg, tok, sampler, options = tiny
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=2, num_envs=4, shuffle=False)
    policy = make_transformers_policy(sampler, tok, gen_kwargs=options | {"max_new_tokens": 40}, continuous_turns=False)
    policy.turn_env = ScriptedEnv("go on <|im_end|>", max_turns=3, max_episode_tokens=200)
    calls = recording(policy)
    torch.manual_seed(0)
    out = policy(env.reset())
    stop_ids = torch.tensor(options["eos_token_id"])
    for row, td in enumerate(out.unbind(0)):
        tokens, mask, lps = td["tokens", "response"], td["episode", "sampled_mask"], td["log_probs", "response"]
        context, pieces, turns = td["tokens", "prompt"], [], 0
        for prompts, replies in calls:
            at = sum(len(p) for p in pieces)
            # this episode's turn: the call's row whose prompt is its context (a group's rows share the first)
            match = [(reply[:end], lp[:end]) for p, (reply, lp) in zip(prompts, replies) if torch.equal(p, context)
                     for end in [cut_at_stop(reply, lp, stop_ids)[0].numel()]
                     if torch.equal(tokens[at:at + end], reply[:end])]
            if not match:
                break
            reply, lp = match[0]
            end = len(reply)
            assert torch.equal(lps[at:at + end], lp)
            assert bool(mask[at:at + end].all())
            pieces.append(reply[:end])
            turns += 1
            env_part = tokens[at + end:]
            env_len = int((~mask[at + end:]).cumprod(0).sum())
            assert bool((lps[at + end:at + end + env_len] == 0).all())
            pieces.append(env_part[:env_len])
            context = torch.cat([td["tokens", "prompt"], *pieces])
        assert turns == int(td["episode", "turns"]) >= 1
        assert torch.equal(torch.cat(pieces)[:len(tokens)], tokens)
        assert int(td["episode", "tool_calls"]) == sum(1 for m in td["history", "response"].role if m == "user")
        env_tokens = tokens[~mask]
        if len(env_tokens):  # the text "<|im_end|>" from the environment: never the special token itself
            text_ids = tok.encode("go on <|im_end|>", add_special_tokens=False, split_special_tokens=True)
            assert any(torch.equal(env_tokens[i:i + len(text_ids)], torch.tensor(text_ids))
                       for i in range(len(env_tokens) - len(text_ids) + 1))
    turns = out["episode", "turns"].tolist()
    assert max(turns) == 3, "the test needs episodes that used every turn"
    # every episode used its turns or stopped short of them: the last turn of one that used them all is truncated
    assert all(bool(t) for t, n in zip(out["episode", "truncated"].tolist(), turns) if n == 3)


@pytest.mark.parametrize("continuous", [False, True])
def test_an_episode_ends_within_its_token_budget(tiny, continuous):
    cfg, tok, sampler, options = tiny
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=2, num_envs=4, shuffle=False)
    policy = make_transformers_policy(sampler, tok, gen_kwargs=options | {"max_new_tokens": 40},
                                      continuous_turns=continuous)
    policy.turn_env = ScriptedEnv("more", max_turns=10, max_episode_tokens=30)
    out = policy(env.reset())
    for td in out.unbind(0):
        assert td["tokens", "response"].numel() <= 30
        assert bool(td["episode", "truncated"])  # the environment always answers: only the budget ends it

    # an answer that leaves no episode room to reply: the batch ends, no turn is sampled for zero episodes (a graphed
    # sampler pads a later turn's rows with its last prompt: there is none)
    policy.turn_env = ScriptedEnv("more " * 40, max_turns=10, max_episode_tokens=30)
    out = policy(env.reset())
    assert all(int(td["episode", "turns"]) == 1 and bool(td["episode", "truncated"]) for td in out.unbind(0))


def test_a_turn_ends_at_its_first_stop_token():
    """An engine that pads finished replies with eos (SmolLM2's generation_config does) or samples past a stop
    must not turn that into episode tokens: not in the mask, the log-probs or the lengths."""
    stops = torch.tensor([2, 0])
    reply, lp, stopped = cut_at_stop(torch.tensor([8, 9, 2, 2, 2]), torch.tensor([-1.0, -0.5, -0.25, -14.0, -13.0]),
                                     stops)
    assert reply.tolist() == [8, 9, 2] and lp.tolist() == [-1.0, -0.5, -0.25] and stopped
    reply, lp, stopped = cut_at_stop(torch.tensor([8, 9, 10]), torch.tensor([-0.2] * 3), stops)
    assert reply.tolist() == [8, 9, 10] and not stopped


def test_a_code_interpreter_s_turn_is_cut_at_the_shortest_prefix_holding_its_call_wherever_the_call_ends(tiny):
    """The cut is the shortest prefix whose text holds the whole block, found with few decodes when the call ends
    near the turn's end (where an engine stops it) and still exact when it ends anywhere else."""
    _, tok, _, _ = tiny
    env = PythonCodeBlockEnv(None, max_turns=2, max_episode_tokens=300, max_calls=1)
    policy = EpisodePolicy(lambda *a, **k: None, tok, max_new_tokens=64, stop_ids=[0], pad_id=tok.pad_token_id)
    decodes = []
    counting = lambda text: decodes.append(text) or env.call_end(text)  # noqa: E731
    block = "Compute it.\n```python\nprint(6 * 7)\n```"
    for after in ["", " It", " It prints 41, so", " It prints 41. " + "Then more words follow here. " * 12]:
        tokens = torch.tensor(tok.encode(block + after, add_special_tokens=False))
        log_probs = -torch.arange(1, len(tokens) + 1, dtype=torch.float)
        shortest = next(k for k in range(1, len(tokens) + 1)
                        if env.call_end(tok.decode(tokens[:k], skip_special_tokens=False)) is not None)
        decodes.clear()
        reply, lps, stopped = policy.cut_at_call(tokens, log_probs, False, counting)
        assert stopped and torch.equal(reply, tokens[:shortest]) and torch.equal(lps, log_probs[:shortest])
        if len(tokens) - shortest < 8:  # near the end: a gallop step and a halving of 8
            assert len(decodes) <= 5, (after, len(decodes))
    unchanged = torch.tensor(tok.encode("No code here.", add_special_tokens=False))
    assert policy.cut_at_call(unchanged, torch.zeros(len(unchanged)), True, env.call_end)[0] is unchanged


def test_a_code_interpreter_s_turn_ends_at_its_block_s_fence_and_the_output_continues_the_same_reply(tiny):
    """What the engine sampled after a ```python block's closing fence was written without the code's output: the
    turn is cut there (its tokens and log-probs a prefix of the sampled ones), the output block follows as text
    alone (no chat-template turn around it, masked), and the next turn samples on from that context."""
    _, tok, _, options = tiny
    eos = options["eos_token_id"][0]
    written = ["Let me compute.\n```python\nprint(6 * 7)\n```\nIt prints 41. The answer is 41.", "The answer is 42."]
    sampled = [torch.tensor(tok.encode(text, add_special_tokens=False) + [eos]) for text in written]
    contexts = []

    def sample(prompts, max_new_tokens, batch_rows):
        contexts.append([p.clone() for p in prompts])
        reply = sampled[len(contexts) - 1]
        return [(reply, -torch.arange(1, len(reply) + 1, dtype=torch.float) / 100) for _ in prompts]

    env = PythonCodeBlockEnv(Sandbox(SandboxSettings(timeout_s=5.0, cpu_s=5, workers=2)), max_turns=3,
                             max_episode_tokens=300, max_calls=2)
    policy = EpisodePolicy(sample, tok, max_new_tokens=64, stop_ids=[eos], pad_id=tok.pad_token_id, turn_env=env)
    chats = [[{"role": "user", "content": "What is 6 x 7?"}]]
    out = policy(TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(1,)))[0]

    tokens, mask, lps = out["tokens", "response"], out["episode", "sampled_mask"], out["log_probs", "response"]
    cut = int(mask.long().cumprod(0).sum())  # the first turn: sampled tokens up to the first environment token
    first = tok.decode(tokens[:cut])
    assert first.endswith("```") and "It prints 41" not in first  # cut at the fence, the guess dropped
    assert torch.equal(tokens[:cut], sampled[0][:cut]) and torch.equal(lps[:cut], -torch.arange(1, cut + 1) / 100)
    output = torch.tensor(tok.encode(output_block("42\n"), add_special_tokens=False, split_special_tokens=True))
    assert torch.equal(tokens[cut:cut + len(output)], output) and not bool(mask[cut:cut + len(output)].any())
    assert torch.equal(tokens[cut + len(output):], sampled[1]) and bool(mask[cut + len(output):].all())
    assert torch.equal(contexts[1][0], torch.cat([out["tokens", "prompt"], tokens[:cut + len(output)]]))
    assert out["history", "response"].role == ["assistant", "tool", "assistant"]
    assert out["history", "response"].content[-1] == "The answer is 42."
    assert int(out["episode", "turns"]) == 2 and int(out["episode", "tool_calls"]) == 1
    assert not bool(out["episode", "truncated"])
