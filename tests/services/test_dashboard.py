"""deploy/grafana-dashboard.json queries only metrics the roles really expose."""
import json
import re
import urllib.request

from services.client import Client
from services.local_cluster import REPO

METRIC_RE = re.compile(r"\bbaton_[a-z0-9_]+")


def _exposed(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    # A labelled metric with no sample yet (nothing refused, say) is declared all the same.
    declared = {line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return samples | declared


def test_every_metric_the_dashboard_queries_is_exposed(cluster):
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text(encoding="utf-8"))
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in METRIC_RE.findall(target["expr"])}
    assert len(queried) >= 15
    with Client(cluster.sdk, timeout_s=60) as client:
        assert client.generate("for the dashboard", max_tokens=3).token_ids  # histograms get samples
    exposed = (_exposed(f"{cluster.http}/metrics") | _exposed(f"http://127.0.0.1:{cluster.port_base + 3}/metrics")
               | _exposed(f"http://127.0.0.1:{cluster.port_base + 11}/metrics"))
    assert sorted(queried - exposed) == []
