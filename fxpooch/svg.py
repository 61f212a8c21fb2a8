"""A plan's memory over time as a standalone SVG picture (plain string building, no plotting library).

The picture shows device memory of the planned step against the in-core step (every activation
kept, same costs) and the limit, with the peaks marked, the forward / backward boundary, and
under the plot three lanes of what the plan adds: offloads (D2H), prefetches (H2D), and on the
compute stream recomputations and stalls waiting for a prefetch.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from .schedule import Kind
from .units import format_bytes

if TYPE_CHECKING:
    from .plan import Plan
    from .simulator import Timeline

log = logging.getLogger("fxpooch.svg")

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels

WIDTH, HEIGHT = 1000, 540
LEFT, RIGHT = 84, 24  # plot margins (pixels)
PLOT_TOP, PLOT_BOTTOM = 96, 400
LANE_TOP, LANE_HEIGHT, LANE_GAP = 420, 16, 6
LANES_BOTTOM = LANE_TOP + 3 * LANE_HEIGHT + 2 * LANE_GAP
FONT = "Helvetica, Arial, sans-serif"
MAX_TOOLTIP_NAMES = 12  # activations named in one lane bar's tooltip; the rest are "..."
COLORS = {"plan": "#1f6fb4", "in-core": "#8c8c8c", "limit": "#d62728", "offload": "#2ca02c",
          "prefetch": "#9467bd", "recompute": "#ff7f0e", "stall": "#d62728", "grid": "#e6e6e6",
          "text": "#222222", "muted": "#666666"}


def _nice_step(span: float, target: int) -> float:
    """A 1/2/5 x 10^k step giving about ``target`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _ticks(hi: float, target: int) -> tuple[list[float], float]:
    step = _nice_step(hi, target)
    n = int(math.ceil(hi / step - 1e-9))
    return [i * step for i in range(n + 1)], step


def _label(v: float, step: float) -> str:
    """Tick label with as many decimals as the step needs (0.25 -> 2, 0.5 -> 1, 5 -> 0)."""
    decimals = next((d for d in range(7) if abs(step * 10**d - round(step * 10**d)) < 1e-6), 6)
    return f"{v:.{decimals}f}"


def _byte_unit(nbytes: float) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return name, scale
    return "B", 1


def _merge(intervals: Iterable[tuple[float, float, str]], min_gap: float) -> list[tuple[float, float, list[str]]]:
    """Sorted (start, end, label) intervals merged where the gap between them is below ``min_gap``
    (in their units), each with the distinct labels of what it merged."""
    out: list[tuple[float, float, list[str]]] = []
    for s, e, label in sorted(intervals):
        if out and s - out[-1][1] <= min_gap:
            out[-1] = (out[-1][0], max(out[-1][1], e), out[-1][2] + ([label] if label not in out[-1][2] else []))
        else:
            out.append((s, e, [label]))
    return out


class _Canvas:
    """Pixel mapping and SVG element helpers for one picture."""

    def __init__(self, t_max: float, y_max: float):
        self.t_max, self.y_max = t_max, y_max
        self.parts: list[str] = []

    def x(self, t: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * t / self.t_max

    def y(self, v: float) -> float:
        return PLOT_BOTTOM - (PLOT_BOTTOM - PLOT_TOP) * v / self.y_max

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(self, x: float, y: float, s: str, size: float = 12, anchor: str = "start", color: str | None = None,
             weight: str = "normal") -> None:
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'fill="{color or COLORS["text"]}" font-weight="{weight}" stroke="white" stroke-width="3" '
                 f'stroke-linejoin="round" paint-order="stroke">{escape(s)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, color: str, width: float = 1,
             dash: str | None = None) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{color}" '
                 f'stroke-width="{width}"{d}/>')

    def rect(self, x: float, y: float, w: float, h: float, color: str, opacity: float = 1.0, title: str = "") -> None:
        """A filled box; ``title`` becomes its tooltip."""
        tip = f"<title>{escape(title)}</title></rect>" if title else ""
        self.add(f'<rect x="{x:.2f}" y="{y:.1f}" width="{max(w, 0.8):.2f}" height="{h:.1f}" fill="{color}" '
                 f'fill-opacity="{opacity}"' + (f">{tip}" if tip else "/>"))

    def step_path(self, points: Sequence[tuple[float, int]], start: int, end_t: float) -> str:
        """SVG path data of a step curve: value ``start`` at t=0, then each (t, value) change."""
        d = [f"M{self.x(0):.1f},{self.y(start):.1f}"]
        last_x = self.x(0)
        group: list[float] = []
        for t, v in points:
            px = round(self.x(t) * 2) / 2  # half-pixel columns: many changes collapse into one
            if px != last_x:
                if group:
                    d.append(_column(group))
                    group = []
                d.append(f"H{px:.1f}")
                last_x = px
            group.append(self.y(v))
        if group:
            d.append(_column(group))
        d.append(f"H{self.x(end_t):.1f}")
        return "".join(d)


def _column(ys: list[float]) -> str:
    """Path data for several changes in one pixel column: up to the highest (peaks stay), then the last.

    Momentary dips (a free and an allocation at the same instant) are not drawn.
    """
    top = min(ys)  # SVG y grows downwards
    return f"V{top:.1f}" if top == ys[-1] else f"V{top:.1f}V{ys[-1]:.1f}"


def _regions(plan: Plan) -> dict[str, list[tuple[float, float, str]]]:
    """Seconds intervals of offloads, prefetches, recomputations and stalls in the plan, each with
    the activation it is for ("relu_3 (layer1.0.relu)")."""
    tl = plan.timeline
    kinds = {Kind.OFFLOAD: "offload", Kind.PREFETCH: "prefetch", Kind.RECOMPUTE: "recompute", Kind.WAIT: "stall"}
    out: dict[str, list[tuple[float, float, str]]] = {k: [] for k in kinds.values()}
    for i, ins in enumerate(plan.schedule.instrs):
        s, e = tl.start[i], tl.end[i]
        if e <= s or ins.kind not in kinds:
            continue
        module = plan.module_of(ins.act)
        name = plan.graph.activations[ins.act].name
        out[kinds[ins.kind]].append((s, e, f"{name} ({module})" if module else name))
    return out


def _legend(c: _Canvas, y: float, planner: str) -> None:
    x = LEFT
    items = [("line", COLORS["plan"], f"planned ({planner})", None), ("line", COLORS["in-core"], "in-core (all kept)",
             "6,4"), ("line", COLORS["limit"], "memory limit", "8,4"), ("box", COLORS["offload"], "offload (D2H)", None),
             ("box", COLORS["prefetch"], "prefetch (H2D)", None), ("box", COLORS["recompute"], "recompute", None),
             ("box", COLORS["stall"], "stall", None)]
    for kind, color, label, dash in items:
        if kind == "line":
            c.line(x, y - 4, x + 22, y - 4, color, 2.5, dash)
            x += 28
        else:
            c.rect(x, y - 10, 12, 12, color, 0.85)
            x += 17
        c.text(x, y, label, 12)
        x += 6.6 * len(label) + 18


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _step_segments(c: _Canvas, points: Sequence[tuple[float, int]], start: int, end_t: float) -> list[Box]:
    """A step curve as thin boxes (one per horizontal and vertical stroke), for label placement."""
    out: list[Box] = []
    x, y = c.x(0), c.y(start)
    for t, v in [*points, (end_t, points[-1][1] if points else start)]:
        nx, ny = c.x(t), c.y(v)
        out.append((x, y - 1, nx, y + 1))
        out.append((nx - 1, min(y, ny), nx + 1, max(y, ny)))
        x, y = nx, ny
    return out


def _place_label(px: float, py: float, width: float, taken: list[tuple[Box, float]], height: float = 15) -> Box:
    """A label box near the point (px, py), inside the plot, overlapping as little as possible of
    ``taken`` (boxes with weights: other labels and the limit line weigh more than curve strokes)."""
    candidates = []
    for dy in (-8 - height, 8, -30 - height, 30, -52 - height, 52, -80 - height, 80):
        for x0 in (px + 8, px - 8 - width, px + 60, px - 60 - width):
            candidates.append((x0, py + dy, x0 + width, py + dy + height))
    inside = [b for b in candidates if b[0] >= LEFT + 2 and b[2] <= WIDTH - RIGHT and b[1] >= PLOT_TOP
              and b[3] <= PLOT_BOTTOM]
    return min(inside or candidates, key=lambda b: sum(w for t, w in taken if _overlaps(b, t)))


def _header(c: _Canvas, plan: Plan) -> None:
    slowdown = plan.step_time / plan.in_core_time if plan.in_core_time else float("nan")
    n = plan.counts()
    c.text(LEFT, 28, f"fxpooch: device memory of one training step, planner {plan.planner!r}", 17, weight="bold")
    c.text(LEFT, 50, f"peak {format_bytes(plan.peak_bytes)}, limit {format_bytes(plan.mem_limit)}, in-core "
           f"{format_bytes(plan.in_core_peak_bytes)}   |   step {plan.step_time * 1e3:.3f} ms = {slowdown:.2f}x "
           f"in-core ({plan.in_core_time * 1e3:.3f} ms)   |   keep {n['keep']}, swap {n['swap']}, "
           f"recompute {n['recompute']}", 12.5, color=COLORS["muted"])
    _legend(c, 78, plan.planner)


def _axes(c: _Canvas, y_ticks: list[float], y_step: float, scale: float, unit: str, x_ticks: list[float],
          x_step: float, source: str) -> None:
    plot_w = WIDTH - LEFT - RIGHT
    for v in y_ticks:
        y = c.y(v * scale)
        c.line(LEFT, y, LEFT + plot_w, y, COLORS["grid"])
        c.text(LEFT - 8, y + 4, _label(v, y_step), 11, "end", COLORS["muted"])
    for v in x_ticks:
        x = c.x(v / 1e3)
        c.line(x, PLOT_TOP, x, LANES_BOTTOM, COLORS["grid"])
        c.text(x, LANES_BOTTOM + 18, _label(v, x_step), 11, "middle", COLORS["muted"])
    c.line(LEFT, PLOT_BOTTOM, LEFT + plot_w, PLOT_BOTTOM, "#444444")
    c.line(LEFT, PLOT_TOP, LEFT, PLOT_BOTTOM, "#444444")
    c.text(LEFT + plot_w / 2, LANES_BOTTOM + 38, f"time (ms), simulated with {source} costs", 12, "middle")
    yl = (PLOT_TOP + PLOT_BOTTOM) / 2
    c.add(f'<text x="22" y="{yl:.1f}" font-size="12" text-anchor="middle" fill="{COLORS["text"]}" '
          f'transform="rotate(-90 22 {yl:.1f})">device memory ({unit})</text>')


def _peaks(c: _Canvas, plan: Plan, in_core: Timeline, limit_y: float) -> None:
    """Dots on both peaks, labels placed off the limit line, the curves and each other."""
    tl, resident, plot_w = plan.timeline, plan.graph.resident_bytes, WIDTH - LEFT - RIGHT
    taken: list[tuple[Box, float]] = [
        ((LEFT, limit_y - 8, LEFT + plot_w, limit_y + 8), 50),
        ((LEFT + plot_w - 260, limit_y - 24, LEFT + plot_w, limit_y + 18), 100),
        *((b, 1) for b in _step_segments(c, in_core.memory, resident, in_core.step_time)),
        *((b, 1) for b in _step_segments(c, tl.memory, resident, tl.step_time))]
    for curve, peak, color, label in ((in_core.memory, in_core.peak_bytes, COLORS["in-core"], "in-core peak"),
                                      (tl.memory, tl.peak_bytes, COLORS["plan"], "planned peak")):
        when = next((t for t, v in curve if v == peak), 0.0)
        px, py = c.x(when), c.y(peak)
        c.add(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{color}" stroke="white" stroke-width="1.5"/>')
        text = f"{label} {format_bytes(peak)}"
        box = _place_label(px, py, 6.9 * len(text), taken)
        taken.append((box, 1000))
        if box[1] > py + 10 or box[3] < py - 10 or not -10 < box[0] - px < 10 and not -10 < box[2] - px < 10:
            end_x = min(max(px, box[0]), box[2])  # a leader line to the label
            c.line(px, py, end_x, box[3] - 5 if box[3] < py else box[1] + 5, color, 0.8)
        c.text(box[0], box[3] - 3, text, 12, "start", color, "bold")


def _lanes(c: _Canvas, regions: dict[str, list[tuple[float, float, str]]], px_s: float) -> None:
    """Offloads, prefetches, and recomputations / stalls as bars under the plot; each bar's tooltip
    names the activations (and their modules) it stands for."""
    plot_w = WIDTH - LEFT - RIGHT
    for row, (label, kinds) in enumerate((("D2H", ("offload",)), ("H2D", ("prefetch",)),
                                          ("compute", ("recompute", "stall")))):
        y = LANE_TOP + row * (LANE_HEIGHT + LANE_GAP)
        c.rect(LEFT, y, plot_w, LANE_HEIGHT, "#f2f2f2")
        c.text(LEFT - 8, y + LANE_HEIGHT - 4, label, 11, "end", COLORS["muted"])
        for kind in kinds:
            for s, e, labels in _merge(regions[kind], px_s):
                shown = ", ".join(labels[:MAX_TOOLTIP_NAMES]) + (" ..." if len(labels) > MAX_TOOLTIP_NAMES else "")
                c.rect(c.x(s), y, c.x(e) - c.x(s), LANE_HEIGHT, COLORS[kind], 0.85, f"{kind}: {shown}")


def memory_svg(plan: Plan, path: str | os.PathLike | None = None) -> str:
    """SVG of device memory over the simulated step: the plan vs in-core vs the limit.

    Returns the SVG text; also writes it to ``path`` when given.
    """
    tl, in_core = plan.timeline, plan.what_ifs.in_core_timeline
    resident = plan.graph.resident_bytes
    top_bytes = max(in_core.peak_bytes, tl.peak_bytes)
    limit_shown = plan.mem_limit <= 1.5 * top_bytes  # a far-away limit would flatten the curves
    if limit_shown:
        top_bytes = max(top_bytes, plan.mem_limit)
    unit, scale = _byte_unit(top_bytes)
    y_ticks, y_step = _ticks(top_bytes * 1.15 / scale, 7)  # headroom for the peak labels
    x_ticks, x_step = _ticks((max(tl.step_time, in_core.step_time) or 1e-9) * 1e3, 10)
    c = _Canvas(x_ticks[-1] / 1e3, y_ticks[-1] * scale)
    plot_w = WIDTH - LEFT - RIGHT

    c.add(f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>')
    _header(c, plan)
    _axes(c, y_ticks, y_step, scale, unit, x_ticks, x_step, plan.profile.source)
    regions = _regions(plan)
    px_s = c.t_max / plot_w  # seconds per pixel
    for kind in ("recompute", "stall"):  # shaded across the plot
        for s, e, _ in _merge(regions[kind], px_s):
            c.rect(c.x(s), PLOT_TOP, c.x(e) - c.x(s), PLOT_BOTTOM - PLOT_TOP, COLORS[kind], 0.09)
    fwd = c.x(tl.forward_end)
    c.line(fwd, PLOT_TOP, fwd, LANES_BOTTOM, "#444444", 1, "3,3")
    c.text(fwd - 6, PLOT_TOP + 14, "forward", 11, "end", COLORS["muted"])
    c.text(fwd + 6, PLOT_TOP + 14, "backward", 11, "start", COLORS["muted"])

    # curves: in-core first (under), then the plan with a light fill
    c.add(f'<path d="{c.step_path(in_core.memory, resident, in_core.step_time)}" fill="none" '
          f'stroke="{COLORS["in-core"]}" stroke-width="1.6" stroke-dasharray="6,4"/>')
    plan_d = c.step_path(tl.memory, resident, tl.step_time)
    c.add(f'<path d="{plan_d}V{PLOT_BOTTOM}H{LEFT}Z" fill="{COLORS["plan"]}" fill-opacity="0.12" stroke="none"/>')
    c.add(f'<path d="{plan_d}" fill="none" stroke="{COLORS["plan"]}" stroke-width="2"/>')
    if limit_shown:
        limit_y = c.y(plan.mem_limit)
        c.line(LEFT, limit_y, LEFT + plot_w, limit_y, COLORS["limit"], 2, "8,4")
        c.text(LEFT + plot_w - 4, limit_y - 6, f"limit {format_bytes(plan.mem_limit)}", 12, "end", COLORS["limit"],
               "bold")
    else:
        limit_y = PLOT_TOP
        c.text(LEFT + plot_w - 4, PLOT_TOP + 14, f"limit {format_bytes(plan.mem_limit)} (far above the chart)", 12,
               "end", COLORS["limit"], "bold")
    _peaks(c, plan, in_core, limit_y)
    _lanes(c, regions, px_s)

    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="{FONT}">\n'
           f"<title>fxpooch memory plan ({escape(plan.planner)})</title>\n" + "\n".join(c.parts) + "\n</svg>\n")
    if path is not None:
        with open(path, "w") as f:
            f.write(svg)
        log.info("wrote %s", path)
    return svg
