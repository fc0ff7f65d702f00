"""The Grafana dashboard's panels as a real Prometheus answers their queries, drawn into one PNG.

    benchmarks/dashboard_preview.py --prometheus http://127.0.0.1:9090 --start 2026-11-29T01:30:00Z \\
        --end 2026-11-29T01:35:00Z --scrape-interval 5 --out docs/img/dashboard-preview.png --strict

This is not Grafana and the picture says so in its title. It reads the dashboard JSON
(``deploy/monitoring/grafana/dashboards/voicebot.json``), runs every panel's PromQL
targets over ``--start``..``--end`` through Prometheus's ``query_range`` API, and draws
each panel where its ``gridPos`` puts it on Grafana's 24-column grid (rows as headers,
time series as lines, stat panels as their last values coloured by the panel's
thresholds). The dashboard's variables are filled as Grafana fills them: ``$job`` from
``--job`` (a regex, ``.*`` for All), ``$__interval`` as the range over ``--max-points``
but never below the scrape interval, ``$__rate_interval`` as the larger of
``$__interval`` + the scrape interval and four scrape intervals.

Every panel whose queries returned no series is reported, with the metrics its queries
name that Prometheus holds no sample of; with ``--exposition`` (the server's /metrics,
a URL or a saved file) each such metric is also told apart as "declared by the server,
no sample yet" (a labelled counter before its first event) or "not served at all" (a
wrong name in the dashboard). ``--strict`` exits 1 when any panel is empty.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import JSON_EPILOG, write_result  # noqa: E402  (benchmarks/, beside this file)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "voicebot.json"
COLUMNS = 24  # Grafana's grid
TITLE = ("the voicebot dashboard's panels, as Prometheus answered their queries; "
         "rendered by benchmarks/dashboard_preview.py (not Grafana)")
# PromQL words that look like metric names but are not.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One panel of the dashboard as this script draws it (``kind`` is Grafana's ``type``)."""

    title: str
    kind: str
    x: int
    y: int
    w: int
    h: int
    unit: str = "short"
    targets: tuple[Target, ...] = ()
    thresholds: tuple[tuple[float, str], ...] = ()  # (from value, colour), ascending; the first from -inf


def panels_of(dashboard: dict[str, Any]) -> list[Panel]:
    """Every panel of the dashboard, rows included, collapsed rows' panels after their row,
    in reading order (top to bottom, left to right)."""
    out: list[Panel] = []

    def add(raw: dict[str, Any]) -> None:
        pos = raw.get("gridPos") or {}
        defaults = (raw.get("fieldConfig") or {}).get("defaults") or {}
        steps = ((defaults.get("thresholds") or {}).get("steps")) or []
        out.append(Panel(
            title=str(raw.get("title", "")), kind=str(raw.get("type", "")),
            x=int(pos.get("x", 0)), y=int(pos.get("y", 0)), w=int(pos.get("w", 12)), h=int(pos.get("h", 8)),
            unit=str(defaults.get("unit") or "short"),
            targets=tuple(Target(str(t["expr"]), str(t.get("legendFormat") or ""))
                          for t in raw.get("targets", []) if t.get("expr") and not t.get("hide")),
            thresholds=tuple((-math.inf if s.get("value") is None else float(s["value"]), str(s.get("color", "green")))
                             for s in steps)))
        for inner in raw.get("panels", []):  # a collapsed row keeps its panels inside it
            add(inner)

    for raw in dashboard.get("panels", []):
        add(raw)
    return sorted(out, key=lambda p: (p.y, p.x))


def grid_height(panels: list[Panel]) -> int:
    """Grid units from the top of the dashboard to the bottom of its lowest panel."""
    return max((p.y + p.h for p in panels), default=0)


def place(panel: Panel, height: int, *, top: float = 1.0, pad: float = 0.0) -> tuple[float, float, float, float]:
    """The panel's box in figure fractions (left, bottom, width, height), the grid drawn from
    ``top`` (a fraction: the space above is the title's) down to 0, ``height`` units tall;
    ``pad`` (a fraction of a column) is left free on every side."""
    col = 1.0 / COLUMNS
    unit = top / height
    left = panel.x * col + pad * col
    width = panel.w * col - 2 * pad * col
    bottom = top - (panel.y + panel.h) * unit + pad * unit
    return left, bottom, width, panel.h * unit - 2 * pad * unit


def grafana_intervals(range_s: float, scrape_s: float, max_points: int) -> tuple[float, float]:
    """(``$__interval``, ``$__rate_interval``) in seconds, by Grafana's rules for a Prometheus
    data source whose scrape interval is ``scrape_s``."""
    interval = max(scrape_s, math.ceil(range_s / max(1, max_points)))
    return interval, max(interval + scrape_s, 4 * scrape_s)


def _duration(seconds: float) -> str:
    return f"{int(round(seconds))}s"


def expand(expr: str, *, job: str, interval_s: float, rate_interval_s: float, range_s: float) -> str:
    """The expression with the dashboard's variables filled in as Grafana fills them."""
    values = {"__rate_interval": _duration(rate_interval_s), "__interval": _duration(interval_s),
              "__range": _duration(range_s), "job": job}

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise ValueError(f"the query uses ${name}, which this script does not fill: {expr}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels or keywords)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery durations
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        if not m.group(2) and m.group(1).lower() not in KEYWORDS:
            names.add(m.group(1))
    return names


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' label value; no format gives
    the series' labels as PromQL writes them."""
    if fmt:
        return re.sub(r"\{\{\s*([\w.]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{labels.get('__name__', '')}{{{inner}}}"


def colour_for(value: float, thresholds: tuple[tuple[float, str], ...]) -> str:
    """The colour of the highest threshold step at or below ``value`` (Grafana's absolute mode)."""
    colour = "tab:blue"
    for start, c in thresholds:
        if value >= start:
            colour = c
    return {"green": "tab:green", "red": "tab:red", "yellow": "gold", "orange": "tab:orange"}.get(colour, colour)


def format_value(value: float, unit: str) -> str:
    """A value in the panel's unit, scaled for reading as Grafana does."""
    if math.isnan(value):
        return "NaN"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "bytes":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit == "reqps":
        return f"{value:.3g}/s"
    return f"{value:.3g}"


# -- Prometheus ------------------------------------------------------------------------------

def _get(base: str, path: str, params: dict[str, Any]) -> Any:
    url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        doc = json.load(r)
    if doc.get("status") != "success":
        raise RuntimeError(f"{url}: {doc.get('error')}")
    return doc["data"]


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """The series of ``expr`` (Prometheus's ``query_range`` result: ``metric`` and ``values``)."""
    return list(_get(base, "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})["result"])


def names_with_samples(base: str, start: float, end: float) -> set[str]:
    """Every metric name Prometheus holds a sample of between ``start`` and ``end``."""
    return set(_get(base, "/api/v1/label/__name__/values", {"start": start, "end": end}))


def declared_names(exposition: str) -> set[str]:
    """Every sample name a /metrics text can carry, from its ``# TYPE`` lines and its samples
    (a labelled family with no value yet has the first and none of the second)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                        "summary": ("_sum", "_count", "_created")}.get(kind.strip(), ())
            names.add(name)
            names.update(name + s for s in suffixes)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def read_exposition(where: str) -> str:
    if re.match(r"^https?://", where):
        with urllib.request.urlopen(where, timeout=10) as r:
            return str(r.read().decode())
    return Path(where).read_text()


# -- drawing ---------------------------------------------------------------------------------

@dataclass
class Drawn:
    panel: Panel
    series: list[tuple[str, list[float], list[float]]] = field(default_factory=list)  # (legend, times, values)
    queries: list[str] = field(default_factory=list)


def draw(drawn: list[Drawn], out: Path, start: float, end: float, subtitle: str, dpi: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    height = grid_height([d.panel for d in drawn])
    title_in = 0.7
    fig_w = 16.0
    grid_in = height * 0.28  # a grid unit is 30 px in Grafana, a column about 75: the same proportions
    fig = plt.figure(figsize=(fig_w, grid_in + title_in))
    top = grid_in / (grid_in + title_in)
    fig.text(0.5, 1 - 0.3 * title_in / (grid_in + title_in), TITLE, ha="center", va="center", fontsize=12,
             weight="bold")
    fig.text(0.5, 1 - 0.72 * title_in / (grid_in + title_in), subtitle, ha="center", va="center", fontsize=9,
             color="0.35")
    t0, t1 = (datetime.fromtimestamp(t, UTC) for t in (start, end))
    for d in drawn:
        p = d.panel
        box = place(p, height, top=top, pad=0.12)
        if p.kind == "row":
            fig.text(box[0], box[1] + box[3] / 2, p.title, fontsize=11, weight="bold", va="center")
            continue
        # Room inside the panel's box for the value labels (left), times (below), title (above).
        fig_h = grid_in + title_in
        left, below, above = 0.62 / fig_w, 0.3 / fig_h, 0.25 / fig_h
        ax = fig.add_axes((box[0] + left, box[1] + below, box[2] - left - 0.05 / fig_w, box[3] - below - above))
        ax.set_title(p.title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if not d.series:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "No data", ha="center", va="center", color="tab:red", fontsize=11,
                    transform=ax.transAxes)
            continue
        if p.kind == "stat":
            ax.axis("off")
            n = len(d.series)
            for i, (name, _, values) in enumerate(d.series):
                last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
                cx = (i + 0.5) / n
                ax.text(cx, 0.5, format_value(last, p.unit), ha="center", va="center", fontsize=20, weight="bold",
                        color=colour_for(last, p.thresholds), transform=ax.transAxes)
                ax.text(cx, 0.2, name, ha="center", va="center", fontsize=8, transform=ax.transAxes)
            continue
        for name, times, values in d.series:
            ax.plot([datetime.fromtimestamp(t, UTC) for t in times], values, lw=1.1, label=name)
        ax.set_xlim(t0, t1)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, unit=p.unit: format_value(v, unit)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", ncol=min(3, len(d.series)), frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        return float(text)
    except ValueError:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
        return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=JSON_EPILOG)
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD, help="Grafana dashboard JSON (default: deploy's)")
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    ap.add_argument("--start", help="range start: unix seconds or ISO 8601 (default: --end minus --minutes)")
    ap.add_argument("--end", help="range end: unix seconds or ISO 8601 (default: now)")
    ap.add_argument("--minutes", type=float, default=5.0, help="range length without --start (default: 5)")
    ap.add_argument("--scrape-interval", type=float, default=15.0,
                    help="Prometheus's scrape interval in seconds, as Grafana's data source knows it (default: 15)")
    ap.add_argument("--max-points", type=int, default=400, help="points across a panel, Grafana's max data points")
    ap.add_argument("--job", default=".*", help="value of the dashboard's $job regex (default: .*, All)")
    ap.add_argument("--exposition", help="the server's /metrics (URL or saved file): tells an unserved metric "
                                         "from a declared one with no sample yet")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "dashboard-preview.png", help="PNG to write")
    ap.add_argument("--dpi", type=int, default=72)
    ap.add_argument("--strict", action="store_true", help="exit 1 when any panel has no series")
    ap.add_argument("--json", type=Path, help="write the per-panel report here")
    args = ap.parse_args()

    end = parse_time(args.end) if args.end else time.time()
    start = parse_time(args.start) if args.start else end - args.minutes * 60
    if end <= start:
        ap.error("--end must be after --start")
    interval, rate_interval = grafana_intervals(end - start, args.scrape_interval, args.max_points)
    panels = panels_of(json.loads(args.dashboard.read_text()))
    held = names_with_samples(args.prometheus, start, end)
    declared = declared_names(read_exposition(args.exposition)) if args.exposition else None

    drawn: list[Drawn] = []
    report: list[dict[str, Any]] = []
    for p in panels:
        d = Drawn(p)
        drawn.append(d)
        if p.kind == "row":
            continue
        missing: dict[str, str] = {}
        for t in p.targets:
            q = expand(t.expr, job=args.job, interval_s=interval, rate_interval_s=rate_interval,
                       range_s=end - start)
            d.queries.append(q)
            for s in query_range(args.prometheus, q, start, end, interval):
                times = [float(v[0]) for v in s["values"]]
                values = [float(v[1]) for v in s["values"]]
                d.series.append((legend(t.legend, s["metric"]), times, values))
            for name in sorted(metric_names(t.expr) - held):
                missing[name] = ("no sample in Prometheus" if declared is None else
                                 "declared by the server, no sample yet" if name in declared else
                                 "not served by the server")
        report.append({"title": p.title, "series": len(d.series), "empty": not d.series, "missing_metrics": missing,
                       "queries": d.queries})
        status = f"{len(d.series)} series" if d.series else "NO SERIES"
        print(f"{status:>11}  {p.title}")
        for name, why in missing.items():
            print(f"{'':13}{name}: {why}")

    rng = (f"{datetime.fromtimestamp(start, UTC):%Y-%m-%d %H:%M:%S} to "
           f"{datetime.fromtimestamp(end, UTC):%H:%M:%S} UTC")
    draw(drawn, args.out, start, end,
         f"{rng}; step {interval:g} s, $__rate_interval {rate_interval:g} s; job =~ {args.job}", args.dpi)
    empty = [r["title"] for r in report if r["empty"]]
    print(f"wrote {args.out}: {len(report) - len(empty)} of {len(report)} panels with data"
          + (f"; no series: {', '.join(empty)}" if empty else ""))
    write_result(args.json, "dashboard_preview", args, {"start": start, "end": end, "interval_s": interval,
                                                        "rate_interval_s": rate_interval, "panels": report})
    return 1 if args.strict and empty else 0


if __name__ == "__main__":
    sys.exit(main())
