"""What ``bearsdk demo`` prints and draws: the runs' table and an SVG plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bearsdk.evaluation import RunSummary

__all__ = ["svg", "table", "unreliable"]


def _short(instance: str) -> str:
    """A profile's name without its GPU and family: ``qwen3-8b-h100`` -> ``8b``."""
    return instance.split("-h100")[0].split("-2xh100")[0].removeprefix("qwen3-")


def _predicts_ttft(policy: str) -> bool:
    from bearsdk.selectors import make_selector

    return make_selector(policy).latency in ("bea", "prefill-tps")


def unreliable(s: RunSummary, max_lag_s: float) -> bool:
    """The run sent its requests too late (arrival lag p99 past ``max_lag_s``)."""
    return not s.arrival_lag_p99_s <= max_lag_s


def table(
    summaries: Sequence[RunSummary],
    rates: Sequence[float],
    order: Sequence[str],
    max_lag_s: float,
) -> str:
    """The runs by rate, best OnTimeUtility first: ``*`` the best, ``!`` unreliable.

    Args:
        summaries: The runs.
        rates: The arrival rates, in the order shown.
        order: Instance name prefixes, in the order of the composition columns.
        max_lag_s: Arrival lag p99 past which a run is unreliable.
    """
    instances = sorted(
        {k for s in summaries for k in s.composition if k},
        key=lambda k: next((i for i, p in enumerate(order) if k.startswith(p)), 9),
    )
    head = f"  {'policy':17} {'OnTimeUtility':>13} {'SLO':>6} {'TTFT p50':>9} {'p99':>7}  "
    head += " ".join(f"{_short(i):>6}" for i in instances) + "  failed  TTFT pred. error"
    lines = []
    for rate in rates:
        rows = sorted((s for s in summaries if s.rate == rate), key=lambda s: -s.on_time_utility)
        if not rows:
            continue
        lines.append(f"\narrival rate {rate:g} req/s ({rows[0].n} requests)")
        lines.append(head)
        best = rows[0].on_time_utility
        for s in rows:
            late = "!" if unreliable(s, max_lag_s) else " "
            mark = late + ("*" if s.on_time_utility == best else " ")
            comp = " ".join(f"{s.composition.get(i, 0.0):6.0%}" for i in instances)
            # The chosen instance's predicted TTFT against the observed one (MAPE),
            # for the policies that predict a TTFT in seconds (the baselines' latency
            # scores are in their own units).
            err = f"{s.ttft_mape:15.0%}" if _predicts_ttft(s.policy) else ""
            lines.append(
                f"{mark}{s.policy:17} {s.on_time_utility:13.3f} {s.attainment:6.0%} "
                f"{s.ttft_p50_s * 1e3:7.0f}ms {s.ttft_p99_s * 1e3:5.0f}ms  {comp}  {s.failed:6}"
                f"  {err}"
            )
    return "\n".join(lines)


_COLORS = (
    "#d62728",
    "#ff7f0e",
    "#1f77b4",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def svg(summaries: Sequence[RunSummary], path: Path) -> None:
    """OnTimeUtility against arrival rate, one line per policy (plain SVG)."""
    policies = list(dict.fromkeys(s.policy for s in summaries))
    rates = sorted({s.rate for s in summaries})
    w, h, left, right, top, bottom = 760, 440, 70, 190, 40, 60
    ys = [s.on_time_utility for s in summaries]
    y_lo, y_hi = min(0.0, min(ys)), max(ys) * 1.08 or 1.0
    x_lo, x_hi = rates[0], rates[-1] if rates[-1] > rates[0] else rates[0] + 1

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (w - left - right)

    def py(y: float) -> float:
        return h - bottom - (y - y_lo) / (y_hi - y_lo) * (h - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2 - right / 2:.0f}" y="22" text-anchor="middle" font-size="15">'
        "OnTimeUtility (eq. 6) by arrival rate</text>",
    ]
    for k in range(6):
        y = y_lo + (y_hi - y_lo) * k / 5
        out.append(
            f'<line x1="{left}" x2="{w - right}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>'
        )
    for r in rates:
        out.append(f'<text x="{px(r):.1f}" y="{h - bottom + 18}" text-anchor="middle">{r:g}</text>')
    out.append(
        f'<text x="{(left + w - right) / 2:.0f}" y="{h - 18}" text-anchor="middle">'
        "arrival rate (requests/s)</text>"
    )
    for i, pol in enumerate(policies):
        color = _COLORS[i % len(_COLORS)]
        pts = sorted((s.rate, s.on_time_utility) for s in summaries if s.policy == pol)
        path_d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        width = 3 if pol == "bear" else 1.5
        out.append(
            f'<polyline points="{path_d}" fill="none" stroke="{color}" stroke-width="{width}"/>'
        )
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = top + 10 + i * 18
        out.append(
            f'<line x1="{w - right + 15}" x2="{w - right + 35}" y1="{ly}" y2="{ly}" '
            f'stroke="{color}" stroke-width="{width}"/>'
            f'<text x="{w - right + 40}" y="{ly + 4}">{pol}</text>'
        )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
