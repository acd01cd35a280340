"""What is learnt: a task's data, prompts, env, rewards and eval fields (``envs.Task``; IFEval's checkers)."""
