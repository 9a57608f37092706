"""Install on a real kube-apiserver: the CRD (schema, CEL rules and their cost budget,
defaults) accepted and Established; the chart's objects admitted, the operator's pod too."""

from __future__ import annotations

import json


def test_the_crd_is_established_and_serves_the_printer_columns(installed):
    crd = installed.get("crd", "finetunejobs.ftjob.dev")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    # The server answers for the new kind, short name included.
    assert installed.kubectl("get", "ftj", "-A").returncode == 0


def test_the_charts_objects_are_admitted_and_the_operator_pod_created(installed):
    deployment = installed.get("deployment", "ftjob", "ftjob-system")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "ftjob"
    # ftjob-system is a "restricted" namespace: PodSecurity admits the operator's pod, which
    # the real ReplicaSet controller creates and the real scheduler places on a node.
    namespace = installed.get("namespace", "ftjob-system")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"

    def placed():
        pods = installed.get("pods", namespace="ftjob-system", ok=False) or []
        return [p for p in pods if p["spec"].get("nodeName")]

    pods = installed.wait(placed, 60, "the operator's pod placed on a node")
    assert pods[0]["metadata"]["labels"]["app.kubernetes.io/name"] == "ftjob"
    events = installed.kubectl("get", "events", "-n", "ftjob-system", "-o", "json").stdout
    assert "FailedCreate" not in json.dumps(json.loads(events)), events


def test_kubectl_explain_shows_a_fields_default(installed):
    """`kubectl explain` prints the description the server publishes, not the default: the
    CRD says each default in words (issue 52, point 7)."""

    def explain(field: str) -> str:  # kubectl wraps long descriptions
        return " ".join(installed.kubectl("explain", f"ftj.spec.{field}").stdout.split())

    assert "Defaults to 3." in explain("runPolicy.backoffLimit")
    assert 'Defaults to "cosine".' in explain("training.scheduler")
