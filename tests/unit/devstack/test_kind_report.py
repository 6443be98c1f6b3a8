"""The kind test's failure message: the script's FAILED line and the failing step's output come
before the cluster diagnostics, which are cut to fit (a reader sees why first)."""

from __future__ import annotations

from tests.integration.test_kind import failure_report

LOG = "\n".join([
    "=== prerequisites (0 s)", "kind-e2e: provider podman",
    "=== helm install (40 s)", "NAME: flowkube",
    "=== the flow: examples/flows/inline-feedback.yaml (61 s)",
    'Error from server (InternalError): failed calling webhook "flows.validate.flowkube.io": x509: unknown authority',
    "=== failed (exit 1) after 76 s",
    'kind-e2e: FAILED in step "the flow: examples/flows/inline-feedback.yaml": `kubectl create -f x` exited 1',
    "=== diagnostics", "--- events", *[f"event {i} " + "x" * 80 for i in range(500)],
])


def test_the_failed_step_and_its_reason_come_first_and_the_diagnostics_are_cut() -> None:
    report = failure_report(LOG)
    lines = report.splitlines()
    assert lines[0].startswith('kind-e2e: FAILED in step "the flow')
    assert lines[2] == "=== the flow: examples/flows/inline-feedback.yaml (61 s)"
    assert "x509: unknown authority" in lines[3]
    assert "NAME: flowkube" not in report  # an earlier step's output is not the reason
    assert "=== diagnostics" in report and "event 0 " in report
    assert len(report) <= 6000 + 200


def test_a_script_that_said_nothing_is_named_so() -> None:
    assert failure_report("=== prerequisites (0 s)\nboom").startswith("kind-e2e: the script did not say")
