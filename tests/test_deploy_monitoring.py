"""The deploy files: docker-compose.yml's `monitoring` profile (Prometheus + Grafana on the host
network, mounting deploy/), the Prometheus scrape config and Grafana's provisioning. No docker here: the
files are parsed and cross-checked (what compose mounts exists, Prometheus scrapes the gateway's default
port, Grafana's provider path is where compose mounts the dashboard). That the dashboard only queries
exported metrics is checked against a live /metrics in test_metrics.py. The `dp2` profile (a front before
two engines) is cross-checked the same way: ports, addresses and GPUs agree, and each command parses."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_the_monitoring_profile_runs_prometheus_and_grafana_on_the_host_network_beside_the_stack():
    services = _compose()["services"]
    monitoring = {name: service for name, service in services.items() if "monitoring" in service.get("profiles", ())}
    assert set(monitoring) == {"prometheus", "grafana"}
    assert monitoring["prometheus"]["image"].startswith("prom/prometheus:")
    assert monitoring["grafana"]["image"].startswith("grafana/grafana:")
    for service in monitoring.values():
        assert service["network_mode"] == "host"
    assert all("profiles" not in services[name] for name in ("scheduler", "worker", "gateway"))  # not optional


def test_every_file_the_monitoring_profile_mounts_exists_and_grafana_finds_its_dashboard():
    compose = _compose()
    mounts: dict[str, str] = {}
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
                mounts[target] = source
            else:
                assert source in compose["volumes"], f"named volume {source} is not declared"
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "pagedserve.yml").read_text())["providers"][0]
    dashboard_dir = provider["options"]["path"]
    mounted_dashboards = [source for target, source in mounts.items() if target.startswith(dashboard_dir + "/")]
    assert mounted_dashboards == ["./deploy/grafana/pagedserve-dashboard.json"]
    json.loads((ROOT / mounted_dashboards[0]).read_text())
    prometheus_config = mounts["/etc/prometheus/prometheus.yml"]
    assert prometheus_config == "./deploy/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["services"]["prometheus"]["command"]


def test_prometheus_scrapes_the_gateways_metrics_and_grafana_reads_that_prometheus():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]  # the gateway's default --port
    command = _compose()["services"]["prometheus"]["command"]
    listen = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--web.listen-address="))
    datasources = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "datasources" /
                                  "prometheus.yml").read_text())["datasources"]
    assert [(source["type"], source["url"], source["isDefault"]) for source in datasources] == [
        ("prometheus", f"http://{listen}", True)]


# ---- the dp2 profile (data parallel) -----------------------------------------------------------------------

def _interpolated(text: str, env: dict[str, str]) -> str:
    """Compose's `${NAME:-default}` (nested defaults too) with `env` set and everything else at its default."""
    import re

    innermost = re.compile(r"\$\{(\w+):-([^${}]*)\}")
    while (match := innermost.search(text)) is not None:
        text = text[:match.start()] + env.get(match.group(1), match.group(2)) + text[match.end():]
    return text


def _command(service: str, env: dict[str, str]) -> list[str]:
    return _interpolated(_compose()["services"][service]["command"], env).split()


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_dp2_profile_runs_two_engines_behind_a_front_that_the_gateway_reaches():
    """The front routes over engine 0 (`scheduler`) and engine 1 (`scheduler-engine1`) at the ports they bind,
    each engine's worker connects to its own scheduler on its own GPU and rendezvous port, every command parses
    as `pagedserve` parses it, and the documented variable points the gateway at the front."""
    from pagedserve.cli import build_parser

    services = _compose()["services"]
    assert all(services[name]["profiles"] == ["dp2"] for name in ("scheduler-engine1", "worker-engine1", "front"))
    documented = {"PAGEDSERVE_GATEWAY_FLAGS": "--grpc-target 127.0.0.1:50050"}
    front, gateway = _command("front", documented), _command("gateway", documented)
    engines = [_command("scheduler", documented), _command("scheduler-engine1", documented)]
    workers = [_command("worker", documented), _command("worker-engine1", documented)]
    targets = front[front.index("--engine-targets") + 1:front.index("--router-policy")]
    assert targets == [f"127.0.0.1:{_flag(engine, '--grpc-port')}" for engine in engines]
    assert len(set(targets)) == 2
    parser = build_parser()
    assert parser.parse_args(gateway).grpc_target == f"127.0.0.1:{_flag(front, '--grpc-port')}"
    assert parser.parse_args(_command("gateway", {})).grpc_target == targets[0]  # without the profile: engine 0
    for engine, worker in zip(engines, workers):
        assert _flag(worker, "--scheduler-address") == _flag(engine, "--worker-address")
    assert len({_flag(worker, "--distributed-init-method") for worker in workers}) == 2
    gpus = [services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in ("worker", "worker-engine1")]
    assert _interpolated(str(gpus[0]), {}) != _interpolated(str(gpus[1]), {})
    for argv in (front, *engines, *workers):
        assert parser.parse_args(argv).command == argv[0]
    assert _flag(services["front"]["healthcheck"]["test"], "--grpc-target") == (
        "127.0.0.1:${PAGEDSERVE_FRONT_GRPC_PORT:-50050}")
