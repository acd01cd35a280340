"""How replies reach the trainer: the local collector source, the Ray rollout pool, dynamic sampling."""
