"""Helpers for testing code that uses budget-tasks (and for budget-tasks' own tests)."""

from .processes import race

__all__ = ["race"]
