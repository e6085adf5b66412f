"""The shipped ops files pass their tools: promtool, systemd-analyze, and the dashboard's shape."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

PROMETHEUS = REPO / "deploy" / "prometheus"
UNIT = REPO / "systemd" / "resurgo-supervisor.service"
USER_UNIT = REPO / "systemd" / "user" / "resurgo-supervisor.service"
DASHBOARD = REPO / "deploy" / "grafana" / "resurgo-dashboard.json"


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is not installed: run deploy/setup"
    return found


def run(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_prometheus_config_and_rules_pass_promtool_check() -> None:
    done = run([tool("promtool"), "check", "config", "prometheus.yml"], cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout + done.stderr


def test_the_alert_rules_pass_their_unit_tests() -> None:
    done = run([tool("promtool"), "test", "rules", "tests/resurgo_rules_test.yml"], cwd=PROMETHEUS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_supervisor_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this installation's daemon.
    daemon = Path(sys.executable).with_name("resurgo-supervisor")
    assert daemon.exists(), "resurgo-supervisor is not installed in this environment"
    text = UNIT.read_text().replace("/opt/resurgo/venv/bin/resurgo-supervisor", str(daemon))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    done = run([tool("systemd-analyze"), "verify", str(unit)])
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    for hardening in ("NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                      "Restart=on-failure", "User=resurgo", "--config /etc/resurgo/"):  # fmt: skip
        assert hardening in text


def test_the_per_user_unit_passes_systemd_analyze_verify_user(tmp_path: Path) -> None:
    daemon = Path(sys.executable).with_name("resurgo-supervisor")
    assert daemon.exists(), "resurgo-supervisor is not installed in this environment"
    text = USER_UNIT.read_text().replace("/opt/resurgo/venv/bin/resurgo-supervisor", str(daemon))
    unit = tmp_path / USER_UNIT.name
    unit.write_text(text)
    # verify --user starts a user manager in miniature: it needs a runtime directory,
    # which a session has and a test runner (root, or CI) may not.
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    done = run([tool("systemd-analyze"), "verify", "--user", str(unit)], env=env)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    # A researcher's supervisor: no other user, no capability, its own state
    # directory, localhost until told otherwise.
    for absent in ("User=", "Group=", "AmbientCapabilities=", "CAP_"):
        assert absent not in text
    for setting in ("StateDirectory=resurgo", "RESURGO_STATE_DIR=%S/resurgo",
                    "RESURGO_SUPERVISOR_LISTEN_HOST=127.0.0.1",
                    "EnvironmentFile=-%E/resurgo/supervisor.env", "Restart=on-failure",
                    "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                    "WantedBy=default.target"):  # fmt: skip
        assert setting in text


def test_the_dashboard_is_provisioning_ready_and_templated_by_job() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["job_id"]["definition"] == "label_values(resurgo_job_info, job_id)"
    assert variables["datasource"]["type"] == "datasource"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    per_job = [e for e in exprs if "resurgo_job_" in e]
    assert per_job and all('job_id=~"$job_id"' in e for e in per_job)
    # Every metric the supervisor exports is on a panel.
    metrics = set(re.findall(r"resurgo_[a-z_]+", (REPO / "supervisor" / "metrics.py").read_text()))
    shown = set(re.findall(r"resurgo_[a-z_]+", " ".join(exprs)))
    exported = {m for m in metrics if not m.endswith("_") and m != "resurgo_job_info"}
    missing = {m for m in exported if not any(s.startswith(m) for s in shown)}
    assert not missing, f"metrics on no panel: {sorted(missing)}"
