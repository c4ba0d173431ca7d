"""grafana/: the dashboard's shape and every metric it names, without a server.

The real check (every query returns data from a Prometheus scraping a real vLLM server) is in
test_server_metrics.py; this one runs everywhere and fails fast on a misspelt metric.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tieredkv.metrics.specs import METRIC_SPECS

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
DASHBOARD = GRAFANA / "tieredkv.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC_NAME = re.compile(r"vllm:[A-Za-z0-9_:]+")
# vLLM's own series the dashboard reads (vllm/v1/metrics/loggers.py, 0.32).
VLLM_SERIES = {
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_by_source_total",
}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def walk(node, path=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}[{i}]")
    else:
        yield path, node


def test_dashboard_is_current_schema_with_datasource_and_model_variables() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query.startswith("label_values(vllm:tieredkv_") and query.endswith(", model_name)")


def test_every_panel_and_target_uses_the_datasource_variable() -> None:
    dashboard = load_dashboard()
    panels = all_panels(dashboard)
    assert panels
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == DATASOURCE, panel["title"]
    uids = {value for path, value in walk(dashboard) if path.endswith(".uid")}
    assert uids == {"${datasource}"}, "no hard-coded uids"
    assert "uid" not in dashboard or dashboard["uid"] in (None, "")


def test_dashboard_covers_the_questions_operators_ask() -> None:
    titles = " | ".join(p["title"].lower() for p in all_panels(load_dashboard()))
    for needed in ("hit rate per tier", "tokens saved", "throughput per direction",
                   "p50 / p99", "usage vs capacity", "evictions", "failures by cause",
                   "backpressure drops"):
        assert needed in titles, needed
    exprs = " ".join(dashboard_exprs(load_dashboard()))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    assert "_bucket{" in exprs


def test_every_query_filters_by_model_and_names_only_known_series() -> None:
    exposed = {name for spec in METRIC_SPECS.values() for name in spec.exposed_names}
    used: set[str] = set()
    for expr in dashboard_exprs(load_dashboard()):
        names = set(METRIC_NAME.findall(expr))
        assert names, expr
        for name in names:
            assert f'{name}{{model_name="$model_name"' in expr, (name, expr)
        used |= names
    unknown = {n for n in used if n.startswith("vllm:tieredkv_")} - exposed
    assert not unknown, f"dashboard names tieredkv series that are not exported: {unknown}"
    assert {n for n in used if not n.startswith("vllm:tieredkv_")} <= VLLM_SERIES


@pytest.mark.parametrize("path", ["provisioning/datasources/prometheus.yaml",
                                  "provisioning/dashboards/tieredkv.yaml"])
def test_provisioning_files_parse(path: str) -> None:
    config = yaml.safe_load((GRAFANA / path).read_text())
    assert config["apiVersion"] == 1


def test_provisioning_points_at_the_mounted_directory() -> None:
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and "uid" not in source
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/tieredkv.yaml").read_text())
    (provider,) = providers["providers"]
    mount = provider["options"]["path"]
    readme = (GRAFANA / "README.md").read_text()
    assert f'grafana:{mount}' in readme and f"GF_PATHS_PROVISIONING={mount}/provisioning" in readme


def test_readme_lists_every_metric() -> None:
    readme = (GRAFANA.parent / "README.md").read_text()
    section = readme[readme.index("## Observability"):]
    for spec in METRIC_SPECS.values():
        name = spec.exposed_names[0] if spec.kind != "histogram" else spec.name
        assert f"`{name}" in section, name


def test_dashboard_has_a_remote_tier_row_with_every_remote_metric() -> None:
    dashboard = load_dashboard()
    rows = [p["title"].lower() for p in dashboard["panels"] if p["type"] == "row"]
    assert any("remote" in title for title in rows), rows
    titles = " | ".join(p["title"].lower() for p in all_panels(dashboard))
    for needed in ("remote up", "remote probe latency p50 / p99", "remote used vs capacity"):
        assert needed in titles, needed
    exprs = dashboard_exprs(dashboard)
    joined = " ".join(exprs)
    for key, spec in METRIC_SPECS.items():
        if key.startswith("remote_"):
            name = spec.name + "_bucket" if spec.kind == "histogram" else spec.exposed_names[0]
            assert f"{name}{{" in joined, name
    # Redis's used/capacity bytes and evictions are server-wide, the same on every replica:
    # a query either shows them once (tier="remote", max) or leaves them out of a sum.
    for expr in exprs:
        if re.search(r"tieredkv_(used_bytes|capacity_bytes|evictions_total)\{", expr):
            assert 'tier!="remote"' in expr or (
                'tier="remote"' in expr and expr.startswith("max(")), expr


def test_no_metric_label_is_named_like_a_prometheus_target_label() -> None:
    # Prometheus's own target labels (`job`, `instance`) win over a metric's label of the same
    # name, which a default scrape config stores as `exported_job`: the job kind of
    # transfer_latency is therefore labelled `kind`, and the dashboard groups by it.
    assert all(spec.label not in ("job", "instance") for spec in METRIC_SPECS.values())
    exprs = [e for e in dashboard_exprs(load_dashboard()) if "transfer_latency" in e]
    assert exprs
    for expr in exprs:
        assert "kind" in expr and "exported_job" not in expr, expr


def test_dashboard_shows_the_hits_the_cost_model_declined_by_tier_and_reason() -> None:
    spec = METRIC_SPECS["hits_declined"]
    assert (spec.label, spec.label2) == ("tier", "reason")
    assert "slower_than_recompute" in spec.values2
    panels = [p for p in all_panels(load_dashboard())
              if any(spec.exposed_names[0] in t["expr"] for t in p.get("targets", []))]
    assert panels, "no panel shows vllm:tieredkv_hits_declined_total"
    assert any("by (tier, reason)" in t["expr"] for p in panels for t in p["targets"])
