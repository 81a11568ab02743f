"""The alert rules (docker/prometheus/alerts.yaml) under promtool: valid, every alert
firing and quiet in tests/deploy/prometheus/alerts.test.yaml, and the Kubernetes
PrometheusRule carrying the same groups. promtool is Debian's ``prometheus`` package,
installed by scripts/test. Oracle: promtool's own evaluation of the rules over series."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docker" / "prometheus" / "alerts.yaml"
RULE_TESTS = Path(__file__).resolve().parent / "prometheus" / "alerts.test.yaml"
PROMETHEUS_RULE = REPO / "docker" / "kubernetes" / "base" / "prometheus-rule.yaml"

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool (Debian's prometheus package) is missing; scripts/test installs it as root",
)


def promtool_test(rules: Path, tests: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "test", "rules", str(tests)], capture_output=True, text=True, cwd=tests.parent)


def test_rules_are_valid() -> None:
    checked = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_fires_and_stays_quiet() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert alerts <= tested, f"alerts without a promtool test: {alerts - tested}"
    firing = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    quiet = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if not case["exp_alerts"]
    }
    assert alerts <= firing and alerts <= quiet, (alerts - firing, alerts - quiet)
    result = promtool_test(RULES, RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_changed_threshold_fails_the_rule_tests(tmp_path: Path) -> None:
    """Negative control: the tests catch an alert that waits longer than it should."""
    rules = tmp_path / "docker" / "prometheus" / "alerts.yaml"
    rules.parent.mkdir(parents=True)
    rules.write_text(
        RULES.read_text().replace(
            'expr: up{job="streaming-sessions"} == 0\n        for: 2m',
            'expr: up{job="streaming-sessions"} == 0\n        for: 10m',
        )
    )
    assert rules.read_text() != RULES.read_text()
    tests = tmp_path / "tests" / "deploy" / "prometheus" / "alerts.test.yaml"
    tests.parent.mkdir(parents=True)
    shutil.copy(RULE_TESTS, tests)
    result = promtool_test(rules, tests)
    assert result.returncode != 0 and "StreamsessReplicaDown" in result.stdout + result.stderr


def test_the_prometheus_rule_carries_the_same_groups() -> None:
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
