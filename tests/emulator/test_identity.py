"""A job is its UID, not its name, and the operator acts on changes at once: a job deleted
before its finalizer lands, a job of the same name created after it, suspend and resume and
progress with the resync far away (60 s)."""

import time

import pytest
from cluster import Cluster
from hangs import FLOOR
from support import (
    Operator,
    gang_running,
    job_pods,
    job_status,
    rank0_progress,
    tiny_job,
    wait_phase,
)

pytestmark = pytest.mark.timeout(90)

# not a hang guard: "acts within a few seconds", on the event, well before the 60 s resync
PROMPT = 20.0


@pytest.fixture(scope="module")
def slow_resync(tmp_path_factory):
    """An operator whose periodic resync is too slow to hide a missing wake-up."""
    with Cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        env = {"FTJOB_RESYNC_SECONDS": "60", "FTJOB_PROGRESS_SECONDS": "1"}
        op = Operator(cluster, tmp_path_factory.mktemp("op") / "operator.log", env=env)
        op.start()
        yield cluster, op
        op.stop()


def owners(obj: dict) -> set[str]:
    return {r["uid"] for r in obj["metadata"].get("ownerReferences") or []}


def own_gang(cluster, name: str, uid: str) -> list[dict]:
    """Wait until the job's pods are two running pods owned by ``uid``, and only those."""

    def check():
        pods = job_pods(cluster, name)
        ok = len(pods) == 2 and all(
            owners(p) == {uid} and p["status"].get("phase") == "Running" for p in pods
        )
        return ok and pods

    return cluster.wait(check, FLOOR, f"two running pods of {name} {uid}, and only those")


def test_a_job_deleted_before_its_finalizer_and_recreated_is_run_for_the_new_uid(slow_resync):
    cluster, op = slow_resync
    old = cluster.create_job(tiny_job("race"))
    # It is reconciled; then the job is gone without a finalizer having run (as when
    # kopf's finalizer patch lost the race to the first status write).
    gang_running(cluster, "race", 0)
    cluster.call(lambda: cluster.api.remove("finetunejobs", "default", "race"))
    time.sleep(1.5)  # the old job, if still known, has had time to be acted on
    new = cluster.create_job(tiny_job("race"))
    old_uid, new_uid = old["metadata"]["uid"], new["metadata"]["uid"]
    assert old_uid != new_uid

    own_gang(cluster, "race", new_uid)

    def children_owned():  # the old job's are deleted and made again, maybe after the pods
        found = (cluster.get("services", "race"), cluster.get("configmaps", "race-spec"))
        return all(c is not None and owners(c) == {new_uid} for c in found)

    cluster.wait(children_owned, FLOOR, f"the service and configmap of race owned by {new_uid}")
    status = wait_phase(cluster, "race", "Running")
    assert status["attempt"] == 0 and status["restarts"] == 0

    # The old object was dropped (a line the operator writes when it is: wait for it);
    # nothing is written for the dead UID any more.
    def stops():
        return [x for x in op.log.read_text().splitlines() if "stopping: default/race" in x]

    cluster.wait(stops, FLOOR, "the old object to be dropped")
    assert len(stops()) == 1 and old_uid in stops()[0], stops()
    time.sleep(2)
    leftovers = [o for plural in ("pods", "services", "configmaps") for o in cluster.list(plural)]
    assert not [o["metadata"]["name"] for o in leftovers if old_uid in owners(o)]
    assert op.metric("ftjob_reconcile_errors_total") == 0


def test_children_left_by_a_dead_uid_are_removed_not_adopted(slow_resync):
    cluster, op = slow_resync
    # A pod of a deleted job "heir", not yet garbage-collected, under the name the new job's
    # rank 1 will use.
    cluster.create_job(tiny_job("heir"))
    stale = gang_running(cluster, "heir", 0)[1]
    cluster.call(lambda: cluster.api.remove("finetunejobs", "default", "heir"))
    cluster.wait(lambda: not job_pods(cluster, "heir"), PROMPT, "the old gang to go")
    dead = "00000000-dead-4000-8000-000000000000"
    meta = stale["metadata"]
    owner = {**meta["ownerReferences"][0], "uid": dead}
    orphan = {**stale, "metadata": {"name": meta["name"], "labels": meta["labels"],
                                    "ownerReferences": [owner]}}  # fmt: skip
    cluster.call(lambda: cluster.api.create_object(("", "v1", "pods"), "default", orphan))

    second = cluster.create_job(tiny_job("heir"))
    own_gang(cluster, "heir", second["metadata"]["uid"])
    wait_phase(cluster, "heir", "Running")
    assert op.logged(f"Pod default/heir-node-1 belongs to ['{dead}'], not to job")


def test_suspend_and_resume_act_within_seconds(slow_resync):
    cluster, _ = slow_resync
    cluster.create_job(tiny_job("pause"))
    gang_running(cluster, "pause", 0)
    wait_phase(cluster, "pause", "Running")
    started = time.monotonic()
    cluster.patch_job_spec("pause", {"runPolicy": {"suspend": True}})
    cluster.wait(lambda: not job_pods(cluster, "pause"), PROMPT, "the gang to be deleted")
    wait_phase(cluster, "pause", "Suspended", timeout=PROMPT)
    suspended = time.monotonic() - started
    started = time.monotonic()
    cluster.patch_job_spec("pause", {"runPolicy": {"suspend": False}})
    cluster.wait(lambda: len(job_pods(cluster, "pause")) == 2, PROMPT, "the gang again")
    resumed = time.monotonic() - started
    print(f"suspend acted in {suspended:.2f} s, resume in {resumed:.2f} s (resync 60 s)")


def test_progress_is_polled_on_its_own_timer(slow_resync):
    cluster, _ = slow_resync
    doc = tiny_job("poll")
    report = rank0_progress(doc["spec"]["network"]["progressPort"], 60)
    report.begin(0)
    report.step(1, 1e-3, 0.0)
    report.logged(1, 3.0, tokens=4096, flops=0.0)
    try:
        cluster.create_job(doc)
        gang_running(cluster, "poll", 0)
        wait_phase(cluster, "poll", "Running")
        for step in (10, 20):
            report.step(step, 1e-3, 0.0)
            cluster.wait(
                lambda s=step: job_status(cluster, "poll").get("progress", {}).get("step") == s,
                PROMPT,
                f"step {step} in status",
            )
    finally:
        report.close()
