"""A real Prometheus (Debian's package) for live tests: scrape a supervisor, answer queries."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO, Any

from tests.conftest import REPO, free_port

DASHBOARD = REPO / "deploy" / "grafana" / "resurgo-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "rules" / "resurgo.yml"


class PrometheusProcess:
    """Prometheus scraping ``target`` every second with Resurgo's rules loaded."""

    def __init__(self, directory: Path, target: str) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.target = target
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: run deploy/setup (Debian's prometheus)"
        self.directory.mkdir(parents=True, exist_ok=True)
        rules = self.directory / "resurgo.yml"
        shutil.copy(RULES, rules)
        config = self.directory / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            "  - job_name: resurgo\n"
            f"    static_configs: [{{targets: ['{self.target}']}}]\n"
        )
        self._log = open(self.directory / "prometheus.log", "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"prometheus not ready: {self.log()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query through the HTTP API; the decoded answer (``status``, ``data``)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return dict(json.loads(answer.read()))
        except urllib.error.HTTPError as error:  # 400: the expression does not parse
            return dict(json.loads(error.read()))


def dashboard_expressions(job_id: str) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel, templated for ``job_id``."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"].replace("$job_id", job_id))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
