"""examples/turn_env: a user's own multi-turn environment, plugged in by config with no edit to grpo/, in a whole
run; its episodes reach the reward functions whole."""

import json

from conftest import SHORT_RUN, train_in_process

EPISODE_REWARD = '''
def turns_seen(episode, reply):
    """How many messages the function saw; the reply must be the episode's last one."""
    assert episode[-1]["content"] == reply or reply in episode[-1]["content"]
    return float(len(episode))
'''


def test_a_user_s_environment_answers_between_turns_and_rewards_see_the_whole_episode(tmp_path):
    rewards = tmp_path / "episode_reward.py"
    rewards.write_text(EPISODE_REWARD)
    run_dir = tmp_path / "run"
    train_in_process(run_dir, [*SHORT_RUN, "train.total_steps=1", "env.max_turns=2",
                               "env.turn_env=examples/turn_env/checker.py:FormatChecker",
                               f"reward.functions=[{rewards}:turns_seen]", "reward.weights=[100.0]",
                               "inference_model.max_new_tokens=24", "logging.samples_every=1", "logging.samples_count=4"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "episode/turns" in r)
    assert 1.0 <= step["episode/turns"] <= 2.0
    evals = [r for r in rows if "eval/turns" in r]
    assert evals and all(1.0 <= r["eval/turns"] <= 2.0 for r in evals)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    asked = [s for s in samples if "⟦env: " in s["reply"]]
    assert asked and len(asked) < len(samples), "the test needs episodes the checker answered and ones it did not"
    # an episode the checker answered has 3 messages (100 x 3 = 300 from the function), one it did not has 1
    assert all(s["reward"] >= 299 for s in asked) and all(s["reward"] < 199 for s in samples if s not in asked)
