"""Evaluation: the demo, perplexity, per-position loss, needle-in-a-haystack."""
