"""Shared test set-up: deterministic Hypothesis (same examples on every run, no example database)."""

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.load_profile("deterministic")
