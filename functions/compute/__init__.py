"""Torch code shared by the trainer and the sampler; not a function of its own."""
