"""Snapshots: the model, optimizer and random state a probe's real trials change, put back after them."""
