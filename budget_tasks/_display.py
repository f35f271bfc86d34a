"""How the operator's tools (the CLI, the dashboard) write a value for a person."""

from __future__ import annotations


def age(seconds: int | None) -> str:
    """A person's reading of a duration: 45s, 12m05s, 3h20m, 2d04h."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
