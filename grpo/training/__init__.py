"""What the trainer computes: models, the dense batch, reply log-probs, the GRPO step, the optimiser, checkpoints."""
