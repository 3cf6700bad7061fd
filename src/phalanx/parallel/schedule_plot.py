"""A pipeline schedule's simulated timeline drawn as a PNG (``phalanx schedule --png``).

Example:
    >>> import tempfile, os
    >>> from phalanx.parallel.schedules import build_schedule
    >>> from phalanx.plan.simulator import simulate
    >>> path = draw_png(simulate(build_schedule("1f1b", 2, 4)), os.path.join(tempfile.mkdtemp(), "t.png"))
    >>> open(path, "rb").read(4)
    b'\\x89PNG'
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def draw_png(timeline: Any, path: str, title: str | None = None) -> str:
    """Draw a simulated timeline (``phalanx.plan.simulator.Timeline``) as a PNG.

    ``timeline`` needs ``.schedule``, ``.events`` (objects with ``rank``, ``action``,
    ``start``, ``end``), ``.makespan`` and ``.bubble_fraction``. Returns ``path``.
    """
    sched = timeline.schedule
    fig_w = min(max(8.0, 0.25 * len(timeline.events) / max(sched.pp, 1)), 30.0)
    # A Figure of its own (not pyplot): no global backend or figure registry is touched.
    fig = Figure(figsize=(fig_w, 0.6 * sched.pp + 1.6))
    ax = fig.subplots()
    for e in timeline.events:
        colour = _COLOURS[e.action.kind]
        alpha = 1.0 - 0.45 * (e.action.chunk / max(sched.virtual_stages - 1, 1)) if sched.virtual_stages > 1 else 1.0
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=colour, alpha=alpha,
                edgecolor="black", linewidth=0.4)
        if e.end - e.start >= 0.02 * timeline.makespan:
            ax.text((e.start + e.end) / 2, e.rank, str(e.action), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(sched.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(sched.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    ax.set_title(title or (f"{sched.name}: pp={sched.pp}, m={sched.microbatches}"
                           + (f", v={sched.virtual_stages}" if sched.virtual_stages > 1 else "")
                           + f", bubble {timeline.bubble_fraction:.1%}"))
    kinds = ["F", "B", "W"] if sched.split_backward else ["F", "B"]
    names = {"F": "forward", "B": "backward" if not sched.split_backward else "backward (input grad)",
             "W": "backward (weight grad)"}
    ax.legend(handles=[Patch(color=_COLOURS[k], label=names[k]) for k in kinds], loc="upper right",
              fontsize=7, ncol=len(kinds))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
