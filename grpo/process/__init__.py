"""Process plumbing: Hydra entry, seeds and signals, user errors, the device plan, the data-parallel world."""
