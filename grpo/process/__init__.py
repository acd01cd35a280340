"""Process plumbing: Hydra entry, seeds and signals, config checks, user errors, the device plan,
the data-parallel world."""
