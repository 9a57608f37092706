"""The recovery ladder's operator side, with `ftjob operator` as a real process against the
API emulator and real kubectl: restarts in place counted from rank 0's real progress reporter
over HTTP. A node blamed for a failure kept away from the next gang is the real control
plane's to show (tests/cluster/test_real_operator.py: the real scheduler places the gang)."""

import pytest
from hangs import FLOOR
from support import (
    events_of,
    gang_running,
    job_pods,
    job_status,
    rank0_progress,
    tiny_job,
    wait_phase,
)

pytestmark = pytest.mark.timeout(90)


def event_messages(cluster, name: str, reason: str) -> list[str]:
    return [
        e.get("message", "")
        for e in cluster.list("events")
        if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason
    ]


def test_restarts_in_place_are_counted_from_rank_0_s_progress(
    cluster, operator, kubectl, monkeypatch
):
    doc = tiny_job("inplace")
    port = doc["spec"]["network"]["progressPort"]
    report = rank0_progress(port, 60)
    report.begin(0)
    try:
        cluster.create_job(doc)
        gang_running(cluster, "inplace", 0)
        wait_phase(cluster, "inplace", "Running")
        # The node agent restarted the workers twice in place: the new rank 0 reads the count
        # from the environment the agent gives it, and serves it on the same port.
        report.close()
        monkeypatch.setenv("FTJOB_RESTARTS_IN_PLACE", "2")
        report = rank0_progress(port, 60)
        report.begin(0)
        cluster.wait(
            lambda: job_status(cluster, "inplace").get("restartsInPlace") == 2,
            FLOOR,
            "restartsInPlace in status",
        )
        cluster.wait(
            lambda: "RestartedInPlace" in events_of(cluster, "inplace"), FLOOR, "the Event"
        )
        (message,) = event_messages(cluster, "inplace", "RestartedInPlace")
        assert "2 in this gang" in message
        status = job_status(cluster, "inplace")
        assert status["restarts"] == 0 and status["phase"] == "Running"
        assert {
            p["metadata"]["labels"]["ftjob.dev/attempt"] for p in job_pods(cluster, "inplace")
        } == {"0"}
        wide = kubectl("get", "finetunejob", "inplace", "-o", "wide").stdout.splitlines()
        header = wide[0].split()
        assert wide[1].split()[header.index("IN-PLACE")] == "2"
        assert operator.metric("ftjob_restarts_in_place_total") >= 2
    finally:
        report.close()
