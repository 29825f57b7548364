"""`loss.png` beside `summary.json`: the training loss of every region per inner step, and the held-out loss
of θ_global per outer step. matplotlib is imported here only (Agg, no pyplot: no global backend state);
without it the picture is skipped with a warning and the run is unaffected."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def write_loss_png(summary: dict[str, Any], path: Path) -> Path | None:
    """Draw `summary["loss_curve"]` (per region: [inner step, loss] of rank 0) and `summary["eval_curve"]`
    into `path`. Returns the path, or None if matplotlib is missing or nothing could be drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install matplotlib)", path.name)
        return None
    try:
        figure = Figure(figsize=(11, 4), layout="constrained")
        FigureCanvasAgg(figure)
        inner, held_out = figure.subplots(1, 2)
        for region, curve in sorted(summary.get("loss_curve", {}).items()):
            if curve:
                inner.plot([step for step, _ in curve], [loss for _, loss in curve], label=region, linewidth=1.2)
        H = summary.get("inner_steps") or 0
        total = H * (summary.get("outer_steps") or 0)
        if summary.get("mode") == "diloco" and H:
            for boundary in range(H, total, H):  # outer steps: where the regions' models meet
                inner.axvline(boundary, color="grey", linewidth=0.5, linestyle=":")
        inner.set(xlabel="inner step", ylabel="training loss (region mean)", title="Training loss per region")
        if inner.lines:
            inner.legend(title="region")
        points = summary.get("eval_curve", [])
        held_out.plot([p["outer_step"] for p in points], [p["eval_loss"] for p in points], marker="o")
        held_out.xaxis.set_major_locator(MaxNLocator(integer=True))
        held_out.set(xlabel="outer step", ylabel="held-out loss",
                     title="Held-out loss of the global model" if summary.get("mode") == "diloco"
                     else "Held-out loss of the model")
        figure.suptitle(f"{summary.get('run', '')}: {summary.get('mode', '')}, "
                        f"{len(summary.get('regions', []))} region(s), H={H}")
        figure.savefig(path, dpi=100)
        return path
    except Exception as error:  # noqa: BLE001 — a picture must not fail a finished run
        logger.warning("could not draw %s: %r", path, error)
        return None
