"""Inline SVG geometry, computed on the server: a budget's bar and its spend over time.
Coordinates are for drawing only; the amounts they show stay integers."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .._display import usd

WIDTH, HEIGHT, PAD = 720, 220, 36


def bar(row: dict[str, Any]) -> dict[str, Any]:
    """A budget's bar: spent, held (the budgets below it included), then what is
    available in three parts: granted to the escrowed budgets below and held there
    unused (an admission takes it back), what it can admit, and what its parents
    cannot give it now; in percent of the larger of its cap and what it used (an
    overrun passes the cap mark), and where the cap mark stands."""
    used = row["spent"] + row["held"]
    scale = max(row["cap"], used, 1)
    available = max(row["available"], 0)
    usable = min(row.get("usable", available), available)
    granted = min(row.get("granted", 0), usable)  # the part of usable held below
    segments = []
    x = 0.0
    for kind, amount in (
        ("spent", row["spent"]),
        ("held", row["held"]),
        ("granted", granted),
        ("available", usable - granted),
        ("blocked", available - usable),
    ):
        width = 100.0 * amount / scale
        if width > 0:
            segments.append(
                {"kind": kind, "x": round(x, 3), "w": round(width, 3), "amount": amount}
            )
        x += width
    return {"segments": segments, "cap_x": round(100.0 * row["cap"] / scale, 3)}


def _seconds(at: str) -> float:
    return datetime.fromisoformat(at).timestamp()


def spend_chart(view: dict[str, Any]) -> dict[str, Any]:
    """Bars of each bucket's charges, the running total as a line, the cap as a line."""
    points = view["points"]
    start, end = _seconds(view["since"]), _seconds(view["until"])
    span = max(end - start, 1.0)
    step = 3600.0 if view["bucket"] == "hour" else 86400.0
    top = max([view["cap"] or 0] + [p["total"] for p in points] + [1])
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD

    def x(at: float) -> float:
        return round(PAD + inner_w * (min(max(at, start), end) - start) / span, 2)

    def y(amount: int) -> float:
        return round(PAD + inner_h * (1 - amount / top), 2)

    bars, line = [], [f"{x(start)},{y(0)}"]
    for p in points:
        at = _seconds(p["at"])
        left, right = x(at), x(at + step)
        bars.append(
            {
                "x": left,
                "y": y(p["spent"]),
                "w": max(round(right - left - 1, 2), 1),
                "h": round(y(0) - y(p["spent"]), 2),
                "title": f"{p['at']}: {usd(p['spent'])}",
            }
        )
        # a step: flat until the bucket, up by what it charged
        line.append(f"{left},{y(p['total'] - p['spent'])}")
        line.append(f"{right},{y(p['total'])}")
    if points:
        line.append(f"{x(end)},{y(points[-1]['total'])}")
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "bars": bars,
        "line": " ".join(line),
        "cap_y": None if view["cap"] is None else y(view["cap"]),
        "base_y": y(0),
        "left": PAD,
        "right": WIDTH - PAD,
        "top_label": usd(top),
        "start_label": view["since"][:16].replace("T", " "),
        "end_label": view["until"][:16].replace("T", " "),
    }
