"""Exact recurrent-state checkpoints: what a sequence's state is after consuming tokens ``[0, n)``."""
