"""What the trainer computes: models (and their weights as engines take them), the replies it is handed, the dense
batch, reply log-probs, the GRPO step, the optimiser, checkpoints."""
