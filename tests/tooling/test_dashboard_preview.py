"""benchmarks/dashboard_preview.py's pure parts, on the real dashboard JSON (no Prometheus,
no drawing): panels and targets read from the JSON, their place on the grid, Grafana's
variables and intervals, the metric names a query selects, legends, thresholds."""

from __future__ import annotations

import itertools
import json
import math
from types import ModuleType

import bench_scripts
import pytest


@pytest.fixture(scope="module")
def preview() -> ModuleType:
    # The script puts benchmarks/ on the path for its helpers (load restores it), and its
    # dataclasses look their module up while it loads.
    return bench_scripts.load("dashboard_preview", register=True)


@pytest.fixture(scope="module")
def dashboard(preview: ModuleType) -> dict:
    return json.loads(preview.DASHBOARD.read_text())


def test_every_panel_and_target_of_the_dashboard_is_read(preview: ModuleType, dashboard: dict) -> None:
    panels = preview.panels_of(dashboard)
    assert len(panels) == len(dashboard["panels"])
    assert [p.kind for p in panels if p.kind == "row"] and all(p.targets == () for p in panels if p.kind == "row")
    graphs = [p for p in panels if p.kind != "row"]
    assert all(p.targets for p in graphs), "every panel queries something"
    v2v = next(p for p in panels if p.title.startswith("Voice to voice"))
    assert v2v.unit == "s" and [t.legend for t in v2v.targets] == ["p50", "p95", "p99"]
    assert "voicebot_voice_to_voice_seconds_bucket" in v2v.targets[0].expr
    up = next(p for p in panels if p.kind == "stat")
    assert up.thresholds == ((-math.inf, "red"), (1.0, "green"))
    assert [(p.y, p.x) for p in panels] == sorted((p.y, p.x) for p in panels), "reading order"


def test_a_collapsed_rows_panels_and_hidden_targets(preview: ModuleType) -> None:
    dash = {"panels": [
        {"type": "row", "title": "Later", "gridPos": {"x": 0, "y": 9, "w": 24, "h": 1}, "collapsed": True,
         "panels": [{"type": "timeseries", "title": "inside", "gridPos": {"x": 0, "y": 10, "w": 12, "h": 8},
                     "targets": [{"expr": "up", "legendFormat": "{{job}}"}, {"expr": "down", "hide": True}]}]},
        {"type": "timeseries", "title": "first", "gridPos": {"x": 12, "y": 0, "w": 12, "h": 9},
         "targets": [{"expr": "a"}]},
    ]}
    panels = preview.panels_of(dash)
    assert [p.title for p in panels] == ["first", "Later", "inside"]
    assert panels[2].targets == (preview.Target("up", "{{job}}"),) and panels[2].unit == "short"


def test_the_panels_tile_the_grid_and_land_in_the_figure_without_overlap(preview: ModuleType, dashboard: dict) -> None:
    panels = preview.panels_of(dashboard)
    height = preview.grid_height(panels)
    assert height == max(p.y + p.h for p in panels)
    boxes = [preview.place(p, height, top=0.9) for p in panels]
    for (left, bottom, width, h) in boxes:
        assert left >= 0 and left + width <= 1 + 1e-9 and bottom >= -1e-9 and bottom + h <= 0.9 + 1e-9
    for (a, pa), (b, pb) in itertools.combinations(zip(boxes, panels, strict=True), 2):
        apart = (a[0] + a[2] <= b[0] + 1e-9 or b[0] + b[2] <= a[0] + 1e-9
                 or a[1] + a[3] <= b[1] + 1e-9 or b[1] + b[3] <= a[1] + 1e-9)
        assert apart, f"{pa.title!r} overlaps {pb.title!r}"


def test_place_maps_grid_units_to_figure_fractions(preview: ModuleType) -> None:
    panel = preview.Panel("p", "timeseries", x=12, y=0, w=12, h=5)
    assert preview.place(panel, 10) == pytest.approx((0.5, 0.5, 0.5, 0.5))
    full = preview.Panel("row", "row", x=0, y=9, w=24, h=1)
    assert preview.place(full, 10, top=0.5) == pytest.approx((0.0, 0.0, 1.0, 0.05))
    padded = preview.place(panel, 10, pad=0.5)
    assert padded[0] == pytest.approx(0.5 + 0.5 / 24) and padded[3] == pytest.approx(0.5 - 0.1)


def test_grafana_intervals(preview: ModuleType) -> None:
    assert preview.grafana_intervals(240, 5, 400) == (5, 20)  # short range: the scrape interval floors it
    assert preview.grafana_intervals(86_400, 15, 400) == (216, 231)


def test_expand_fills_the_dashboards_variables(preview: ModuleType) -> None:
    expr = 'sum(rate(voicebot_turns_total{job=~"$job"}[$__rate_interval])) + x[${__interval}]'
    out = preview.expand(expr, job=".*", interval_s=5, rate_interval_s=20, range_s=300)
    assert out == 'sum(rate(voicebot_turns_total{job=~".*"}[20s])) + x[5s]'
    with pytest.raises(ValueError, match="instance"):
        preview.expand('up{instance="$instance"}', job=".*", interval_s=5, rate_interval_s=20, range_s=300)


def test_metric_names_are_the_selected_series_only(preview: ModuleType, dashboard: dict) -> None:
    expr = ('histogram_quantile(0.95, sum by (le, code) (rate(voicebot_x_seconds_bucket{job=~"a|b", code!="rate"}'
            '[5m] offset 1m))) / on(job) group_left ignoring(le) clamp_min(sum without (instance) (y_total), 1e-9)'
            ' > bool 0 and up unless inf')
    assert preview.metric_names(expr) == {"voicebot_x_seconds_bucket", "y_total", "up"}
    used = {n for p in preview.panels_of(dashboard) for t in p.targets for n in preview.metric_names(t.expr)}
    assert {"voicebot_barge_ins_total", "voicebot_turns_total", "process_resident_memory_bytes"} <= used
    assert all(n.startswith(("voicebot_", "process_")) for n in used), used


def test_legend(preview: ModuleType) -> None:
    labels = {"__name__": "voicebot_active_sessions", "transport": "native", "job": "voicebot"}
    assert preview.legend("calls {{transport}}", labels) == "calls native"
    assert preview.legend("{{ missing }}", labels) == ""
    assert preview.legend("", labels) == 'voicebot_active_sessions{job="voicebot", transport="native"}'


def test_declared_names_include_families_with_no_sample(preview: ModuleType) -> None:
    text = ("# HELP voicebot_errors_total Errors.\n# TYPE voicebot_errors_total counter\n"
            "# TYPE voicebot_v2v_seconds histogram\nvoicebot_v2v_seconds_bucket{le=\"0.5\"} 3.0\n"
            "process_resident_memory_bytes 1.2e+08\n")
    names = preview.declared_names(text)
    assert {"voicebot_errors_total", "voicebot_v2v_seconds_bucket", "voicebot_v2v_seconds_count",
            "process_resident_memory_bytes"} <= names
    assert "voicebot_turns_total" not in names


def test_thresholds_and_units(preview: ModuleType) -> None:
    steps = ((-math.inf, "red"), (1.0, "green"))
    assert preview.colour_for(0.0, steps) == "tab:red" and preview.colour_for(1.0, steps) == "tab:green"
    assert preview.format_value(0.4321, "s") == "432 ms" and preview.format_value(2.5, "s") == "2.50 s"
    assert preview.format_value(3 * 2**20, "bytes") == "3.0 MiB"
    assert preview.format_value(0.25, "percentunit") == "25%"
    assert preview.parse_time("2026-11-29T01:30:00Z") == preview.parse_time("1795915800")
