"""How replies are sampled: the engine interface and settings, the transformers engine and its
decode loop, the vLLM engine."""
