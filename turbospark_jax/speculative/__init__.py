"""Speculative decoding: the target-and-drafter pair, its rounds on the device, the drafters, and
which drafter a model uses."""
