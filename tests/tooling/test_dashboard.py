"""deploy/'s Grafana dashboard and its Prometheus against the metrics the server serves
(files only: no Grafana, no Prometheus, no docker)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from voicebot.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def served_names() -> set[str]:
    """Every sample name /metrics can serve (with _bucket/_sum/_count/_total suffixes)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_every_metric_the_dashboard_queries_is_served() -> None:
    dash = json.loads((DEPLOY / "monitoring/grafana/dashboards/voicebot.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"\b((?:voicebot|process)_[a-z_]+)\b", e)}
    served = served_names()
    assert used - served == set(), "the dashboard queries metrics the server does not serve"
    wanted = {"voicebot_active_sessions", "voicebot_session_capacity", "voicebot_voice_to_voice_seconds_bucket",
              "voicebot_llm_ttft_seconds_bucket", "voicebot_barge_ins_total", "voicebot_errors_total",
              "voicebot_engine_up", "voicebot_engine_restarts", "voicebot_event_loop_lag_seconds_bucket"}
    assert wanted <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"


def test_compose_provisions_prometheus_and_grafana_with_the_dashboard() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    grafana_mounts = {m.split(":")[0]: m.split(":")[1] for m in services["grafana"]["volumes"] if m.startswith("./")}
    assert grafana_mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((DEPLOY / "monitoring/grafana/provisioning/dashboards/voicebot.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == grafana_mounts["./monitoring/grafana/dashboards"]
    source = yaml.safe_load((DEPLOY / "monitoring/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090" and "prometheus" in services
    prom = yaml.safe_load((DEPLOY / compose["configs"]["prometheus-config"]["file"]).read_text())
    (job,) = prom["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["frontend"] and "frontend" in services
    assert job["authorization"]["credentials_file"] in {c["target"] for c in services["prometheus"]["configs"]}
    assert "VOICEBOT_METRICS_KEY" in services["frontend"]["environment"]["VOICEBOT_API_KEYS"]
