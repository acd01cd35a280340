"""What is learnt: a task's data, prompts, env, rewards and eval fields (``envs.Task``; IFEval's checkers), and what
answers between an episode's turns (``tool_env``)."""
