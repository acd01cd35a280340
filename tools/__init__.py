"""Development tools: the tiny test model and its synthetic data (never imported by grpo/)."""
