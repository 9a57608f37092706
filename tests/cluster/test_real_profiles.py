"""FineTuneProfiles on the real control plane, with the operator holding only the chart's
ServiceAccount token: two namespaces taking different default profiles (one by the namespace
label, one by a profile's namespaceSelector), a job over a limit refused at kubectl apply by the
ValidatingAdmissionPolicy (and what the door cannot see, by the operator before any pod) with
the limit, the profile and the fix, and a profile edited while a job runs (the running gang
keeps its generation; the next gang takes the new one and says so in status). A team member
(a ServiceAccount that may only edit FineTuneJobs in its own namespace) cannot widen its limits:
not by naming another namespace's profile, not by an edit (image, profile, budget), not by an
image under a longer registry name; a limit lowered under a running job stops only its next
gang."""

from __future__ import annotations

import copy
import json
import sys
import time
from types import SimpleNamespace

import hangs
import pytest
from plane import ROOT, Plane, token_kubeconfig

sys.path.append(str(ROOT / "tests" / "emulator"))
from support import Operator  # noqa: E402  (the emulator tests' launcher, reused)

from ftjob.api import manifest  # noqa: E402
from ftjob.api.profile import NAMESPACE_LABEL, not_served, parse_profile  # noqa: E402
from ftjob.cli import validate  # noqa: E402

pytestmark = pytest.mark.timeout(180)
TINY = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
TEAM_A = manifest.load(ROOT / "examples" / "profiles" / "team-a.yaml")[0]
# ns-a takes team-a by team-a's namespaceSelector (team: a); ns-b names team-b by its label.
NAMESPACES = {"ns-a": {"team": "a"}, "ns-b": {"team": "a", NAMESPACE_LABEL: "team-b"}}


def profile(name: str, image: str, **limits) -> dict:
    doc = copy.deepcopy(TEAM_A)
    doc["metadata"] = {"name": name}
    defaults = doc["spec"]["defaults"]
    defaults["image"] = image
    # What every kwok node satisfies: no Kueue queue or priority class on this plane.
    defaults["scheduling"] = {"tolerations": defaults["scheduling"]["tolerations"]}
    defaults["env"] = [{"name": "TEAM", "value": name}]
    doc["spec"]["limits"].update(limits)
    doc["spec"]["prices"] = [{"gpuType": "H100-SXM-80GB", "perGpuHour": 3.0}]
    if name != "team-a":
        doc["spec"].pop("namespaceSelector")
    if name == "team-b":
        doc["spec"]["limits"] = {}
    if name in ("team-c", "team-d"):  # named by jobs of ns-a, which they do not select
        doc["spec"]["nameableFrom"] = "Anywhere"
    return doc


# team-a's images: under registry.example.com on a boundary (a path or a port), never under a
# longer registry name (registry.example.com.evil.io).
TEAM_A_LIMITS = {"maxNodes": 2, "maxGpuHoursPerJob": 50}
TEAM_A_LIMITS |= {"allowedImagePrefixes": ["registry.example.com"]}


def job(name: str, namespace: str, nodes: int = 2, profile: str | None = None) -> dict:
    """The tiny job on GPUs without an image: its profile gives it. A job naming its profile
    takes the volume from it too (the CRD's rule lets a multi-node job without one in only
    then: a namespace's default is not known at the door)."""
    doc = copy.deepcopy(TINY)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["resources"] = {"nodes": nodes, "gpusPerNode": 8}
    doc["spec"]["network"] = {"collectiveTimeoutSeconds": 30}
    if profile:
        doc["spec"]["profile"] = profile
        del doc["spec"]["checkpoint"]["volume"]
    return doc


@pytest.fixture(scope="module")
def operator(installed: Plane, tmp_path_factory):
    for ns, labels in NAMESPACES.items():
        installed.namespace(ns, *(f"{k}={v}" for k, v in labels.items()))
    installed.apply(profile("team-a", "registry.example.com/ml/a:1", **TEAM_A_LIMITS))
    installed.apply(profile("team-b", "registry.example.com/ml/b:1"))
    installed.apply(profile("team-d", "registry.example.com/ml/d:1", maxNodes=2))
    no_volume = profile("team-c", "registry.example.com/ml/c:1")
    del no_volume["spec"]["defaults"]["checkpoint"]
    installed.apply(no_volume)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = token_kubeconfig(installed, "ftjob-system", "ftjob", work / "sa.kubeconfig")
    op = Operator(SimpleNamespace(kubeconfig=kubeconfig, wait=Plane.wait), work / "op.log").start()
    op.plane = installed
    yield op
    op.stop()


@pytest.fixture(scope="module")
def member(operator, tmp_path_factory):
    """kubectl as a team member of ns-a: a ServiceAccount whose Role lets it edit FineTuneJobs
    in ns-a and nothing else (what docs/platform.md has a platform team grant a team)."""
    plane = operator.plane
    plane.kubectl("create", "serviceaccount", "dev", "-n", "ns-a")
    plane.kubectl(
        "create", "role", "ftj-editor", "-n", "ns-a", "--resource=finetunejobs.ftjob.dev",
        "--verb=get,list,watch,create,update,patch,delete",
    )  # fmt: skip
    plane.kubectl(
        "create", "rolebinding", "dev", "-n", "ns-a", "--role=ftj-editor",
        "--serviceaccount=ns-a:dev",
    )  # fmt: skip
    path = token_kubeconfig(plane, "ns-a", "dev", tmp_path_factory.mktemp("dev") / "kubeconfig")
    return lambda *args, **kw: plane.kubectl(*args, kubeconfig=path, **kw)


def denied(result) -> str:
    """The policy's words in kubectl's refusal (the same whatever the job's name)."""
    assert result.returncode != 0, result.stdout
    assert "ValidatingAdmissionPolicy" in result.stderr, result.stderr
    return result.stderr.split("denied request: ", 1)[1].strip()


@pytest.fixture(autouse=True)
def one_job_at_a_time(operator):
    yield
    operator.plane.delete_every_job()


def pods_of(plane: Plane, name: str, namespace: str) -> list[dict]:
    pods = plane.get("pods", namespace=namespace, ok=False) or []
    return [p for p in pods if p["metadata"]["labels"].get("ftjob.dev/job-name") == name]


def status_of(plane: Plane, name: str, namespace: str) -> dict:
    return (plane.get("ftj", name, namespace) or {}).get("status") or {}


def running(plane: Plane, name: str, namespace: str, attempt: int, nodes: int = 2) -> list[dict]:
    def check():
        pods = pods_of(plane, name, namespace)
        return (
            len(pods) == nodes
            and all(
                p["metadata"]["labels"]["ftjob.dev/attempt"] == str(attempt)
                and p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")
                for p in pods
            )
            and pods
        )

    return plane.wait(check, 60, f"{nodes} running pods of {name} attempt {attempt}")


def fail(plane: Plane, pod: str, namespace: str) -> None:
    """What a kubelet writes when the trainer container exits 1."""
    ended = {"exitCode": 1, "reason": "Error", "startedAt": None, "finishedAt": None}
    container = {"name": "trainer", "ready": False, "restartCount": 0, "image": "x"}
    container |= {"imageID": "sha256:0", "state": {"terminated": ended}}
    patch = {"status": {"phase": "Failed", "containerStatuses": [container]}}
    plane.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}


def test_two_namespaces_take_their_own_default_profile(operator):
    plane = operator.plane
    plane.apply(job("tiny", "ns-a"))
    plane.apply(job("tiny", "ns-b", profile="team-b"))  # as ns-b's label says, and its volume
    for ns, team in (("ns-a", "team-a"), ("ns-b", "team-b")):
        pods = running(plane, "tiny", ns, 0)
        letter = team[-1]
        assert {p["spec"]["containers"][0]["image"] for p in pods} == {
            f"registry.example.com/ml/{letter}:1"
        }
        assert {env_of(p)["TEAM"] for p in pods} == {team}
        pulls = [p["spec"].get("imagePullSecrets") for p in pods]
        assert pulls == [[{"name": "registry-example-com"}]] * 2  # the profile's
        volumes = [v for p in pods for v in p["spec"]["volumes"]]
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in volumes
            if v.get("persistentVolumeClaim")
        }
        assert claims == {"ftjob-shared"}  # ns-b: the profile's volume
        recorded = status_of(plane, "tiny", ns)["profile"]
        assert (recorded["name"], recorded["generation"], recorded["attempt"]) == (team, 1, 0)

    # What the pods have run, priced at the profile's H100 rate, and in kubectl get -o wide:
    # once their first running seconds are counted (kwok's pods make no progress that would
    # write status with them).
    def spent():
        cost = status_of(plane, "tiny", "ns-a").get("cost") or {}
        return cost if (cost.get("attempts") or [{}])[0].get("gpuSeconds") else None

    cost = plane.wait(spent, hangs.after(30), "a cost in status")
    assert cost["attempts"][0]["attempt"] == 0 and cost["currency"] == "USD"
    assert cost["amount"] == pytest.approx(cost["gpuHours"] * 3.0, abs=0.01)
    wide = plane.kubectl("get", "ftj", "tiny", "-n", "ns-a", "-o", "wide").stdout
    assert "COST" in wide and "GPU-h" in wide and "USD" in wide


def test_a_job_over_a_limit_is_refused_at_the_door_with_the_limit_and_the_fix(operator):
    plane = operator.plane
    # team-a allows 2 nodes in ns-a (its namespaceSelector); the ValidatingAdmissionPolicy
    # with the profiles as params refuses the job at kubectl apply.
    refused = plane.apply(job("big", "ns-a", nodes=3), ok=False)
    assert refused.returncode != 0
    said = refused.stderr
    assert "3 nodes exceed limits.maxNodes 2 of FineTuneProfile team-a" in said, said
    assert "fix: set resources.nodes to at most 2" in said
    assert plane.get("ftj", "big", "ns-a") is None
    rich = job("rich", "ns-a")
    rich["spec"]["budget"] = {"gpuHours": 75.5}
    said = plane.apply(rich, ok=False).stderr
    assert "spec.budget.gpuHours: 75.5 GPU-hours exceed limits.maxGpuHoursPerJob 50 of " in said
    assert "fix: set budget.gpuHours to at most 50" in said, said
    # The same job in ns-b (team-b has no node limit) is let in: the limit is team-a's.
    plane.apply(job("big", "ns-b", nodes=3, profile="team-b"))
    running(plane, "big", "ns-b", 0, nodes=3)


def test_what_the_door_cannot_see_the_operator_refuses_before_any_pod(operator):
    plane = operator.plane
    # team-c gives no volume; the CRD lets a two-node job without one in because it names its
    # profile, and the merge finds no volume on either side.
    plane.apply(job("novolume", "ns-a", profile="team-c"))
    failure = plane.wait(
        lambda: status_of(plane, "novolume", "ns-a").get("failure"),
        hangs.after(30),
        "the job to be refused",
    )
    assert failure["reason"] == "OverLimit"
    assert (
        "neither the job nor defaults.checkpoint.volume of FineTuneProfile team-c"
        in (failure["message"])
    )
    assert status_of(plane, "novolume", "ns-a")["phase"] == "Failed"
    assert pods_of(plane, "novolume", "ns-a") == []
    table = plane.kubectl("get", "ftj", "novolume", "-n", "ns-a").stdout
    assert "Failed" in table and "OverLimit" in table
    events = plane.get("events", namespace="ns-a", ok=False) or []
    said = [e for e in events if e.get("involvedObject", {}).get("name") == "novolume"]
    assert any(e["reason"] == "OverLimit" and e["type"] == "Warning" for e in said), said


def test_a_profile_edited_while_a_job_runs_reaches_only_the_next_gang(operator):
    plane = operator.plane
    plane.apply(job("edited", "ns-b"))
    first = running(plane, "edited", "ns-b", 0)
    plane.apply(profile("team-b", "registry.example.com/ml/b:2"))
    generation = plane.get("ftp", "team-b")["metadata"]["generation"]
    assert generation == 2
    # Several reconciles later (the operator resyncs every second) the gang is the same one.
    time.sleep(3)
    now = pods_of(plane, "edited", "ns-b")
    assert {p["metadata"]["uid"] for p in now} == {p["metadata"]["uid"] for p in first}
    assert status_of(plane, "edited", "ns-b")["profile"]["generation"] == 1
    # A pod fails: the next gang is made from generation 2, and status says so.
    fail(plane, first[0]["metadata"]["name"], "ns-b")
    second = running(plane, "edited", "ns-b", 1)
    assert {p["spec"]["containers"][0]["image"] for p in second} == {"registry.example.com/ml/b:2"}
    recorded = status_of(plane, "edited", "ns-b")["profile"]
    assert (recorded["generation"], recorded["attempt"]) == (2, 1)
    # The first gang's GPU time stays counted beside the second's.
    cost = plane.wait(
        lambda: (
            len((c := status_of(plane, "edited", "ns-b").get("cost") or {}).get("attempts") or [])
            == 2
            and c
        ),
        hangs.after(30),
        "both attempts' GPU time",
    )
    assert cost["attempts"][0]["gpuSeconds"] > 0
    assert cost["gpuHours"] * 3600 == pytest.approx(
        sum(a["gpuSeconds"] for a in cost["attempts"]),
        abs=1,  # gpuHours: 4 decimals
    )


def test_a_budget_reached_stops_the_gang_and_raising_it_resumes(operator):
    """Stopped (not Suspended) with reason BudgetReached; a raise over team-a's cap (50) is
    refused at kubectl by the policy, with the cap, the profile and the fix; one under it
    resumes."""
    plane = operator.plane
    small = job("budget", "ns-a", profile="team-a")
    small["spec"]["budget"] = {"gpuHours": 0.005}  # 18 GPU-seconds: ~1 s of 16 GPUs
    plane.apply(small)
    # No wait for attempt 0's pods to be seen Running: the budget may end them before a poll
    # sees both (CI, 2026-12-04). That they ran is what the cost below says.

    def stopped():
        s = status_of(plane, "budget", "ns-a")
        return s.get("phase") == "Stopped" and not pods_of(plane, "budget", "ns-a") and s

    status = plane.wait(stopped, 60, "the budget to stop the gang")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Stopped"]["status"] == "True", status["conditions"]
    reason = conditions["Running"]
    assert reason["reason"] == "BudgetReached", status["conditions"]
    assert "budget of 0.005 GPU-hours" in reason["message"] and "at step" in reason["message"]
    assert status["cost"]["gpuHours"] >= 0.005
    assert status["cost"]["attempts"][0]["gpuSeconds"] > 0, status["cost"]
    table = plane.kubectl("get", "ftj", "budget", "-n", "ns-a").stdout
    assert "Stopped" in table and "BudgetReached" in table
    over = plane.kubectl(
        "patch", "ftj", "budget", "-n", "ns-a", "--type=merge",
        "-p", json.dumps({"spec": {"budget": {"gpuHours": 60}}}), ok=False,
    )  # fmt: skip
    said = over.stderr
    assert over.returncode != 0 and "ValidatingAdmissionPolicy" in said, said
    assert "spec.budget.gpuHours: 60 GPU-hours exceed limits.maxGpuHoursPerJob 50 of " in said
    assert "FineTuneProfile team-a; fix: set budget.gpuHours to at most 50" in said, said
    assert status_of(plane, "budget", "ns-a")["phase"] == "Stopped"
    # Raised within the cap: a new gang (it resumes from the checkpoint the stopped one saved).
    plane.kubectl(
        "patch", "ftj", "budget", "-n", "ns-a", "--type=merge",
        "-p", json.dumps({"spec": {"budget": {"gpuHours": 10}}}),
    )  # fmt: skip
    running(plane, "budget", "ns-a", 1)
    assert status_of(plane, "budget", "ns-a")["phase"] in ("Pending", "Running")


def test_a_team_member_cannot_widen_their_limits_by_naming_or_editing(operator, member):
    """As the member of ns-a: team-b (no limits, ns-b's) cannot be named; every edit that would
    break a limit of team-a is refused at kubectl with the words a create gets, and the job
    is left as it was; validate --profile refuses what the door refuses, in its words."""
    plane = operator.plane
    for verb, what in (("patch", "namespaces/ns-a"), ("update", "finetuneprofiles/team-a")):
        said = member("auth", "can-i", verb, what, "-n", "ns-a", ok=False).stdout.strip()
        assert said == "no", (verb, what)  # the platform team's rights, not a team's
    wide = job("wide", "ns-a", nodes=3, profile="team-b")
    refused = member("apply", "-f", "-", input=json.dumps(wide), ok=False)
    assert denied(refused) == not_served("team-b", "ns-a")
    assert plane.get("ftj", "wide", "ns-a") is None
    # Let in within team-a's limits; then each edit that would break one.
    member("apply", "-f", "-", input=json.dumps(job("tenant", "ns-a")))
    team_a = parse_profile(plane.get("ftp", "team-a"))
    edits = {
        "image": {"image": "docker.io/evil/miner"},
        "boundary": {"image": "registry.example.com.evil.io/x:1"},
        "profile": {"profile": "team-b"},
        "budget": {"budget": {"gpuHours": 60}},
        # An identity team-a does not list: the namespace's default ServiceAccount only.
        "identity": {"serviceAccountName": "dev"},
    }
    for field, edit in edits.items():
        fresh = job("fresh", "ns-a")
        fresh["spec"].update(edit)
        created = member("create", "--dry-run=server", "-f", "-", input=json.dumps(fresh), ok=False)
        patched = member(
            "patch", "ftj", "tenant", "-n", "ns-a", "--type=merge",
            "-p", json.dumps({"spec": edit}), ok=False,
        )  # fmt: skip
        assert denied(patched) == denied(created), field
        if field in ("image", "boundary", "identity"):
            assert denied(created) in validate.check(fresh, profile=team_a).errors, field
    assert plane.get("ftj", "tenant", "ns-a")["spec"].get("image") is None
    # On a boundary: a port or a path of registry.example.com is under it, at both doors.
    port = job("port", "ns-a")
    port["spec"]["image"] = "registry.example.com:5000/ml/x:1"
    member("create", "--dry-run=server", "-f", "-", input=json.dumps(port))
    said = validate.check(port, profile=team_a).errors
    assert not [e for e in said if e.startswith("spec.image")], said


def test_a_money_budget_needs_a_price_for_the_jobs_gpu_type(operator, member):
    """team-a prices H100s only: an A100 job's money budget is refused on create and when an
    edit adds it, naming the profile and the fix; validate --profile says the same."""
    unpriced = job("unpriced", "ns-a")
    unpriced["spec"]["resources"]["gpuType"] = "A100-80GB"
    money = copy.deepcopy(unpriced)
    money["spec"]["budget"] = {"amount": 100}
    created = member("apply", "-f", "-", input=json.dumps(money), ok=False)
    said = denied(created)
    assert said == (
        "spec.budget.amount: a budget in money needs a price, and FineTuneProfile team-a has no "
        "price for gpuType A100-80GB; fix: set budget.gpuHours instead, or ask the platform "
        "team to add that gpuType to prices of FineTuneProfile team-a"
    )
    team_a = parse_profile(operator.plane.get("ftp", "team-a"))
    assert said in validate.check(money, profile=team_a).errors
    member("apply", "-f", "-", input=json.dumps(unpriced))
    patched = member(
        "patch", "ftj", "unpriced", "-n", "ns-a", "--type=merge",
        "-p", json.dumps({"spec": {"budget": {"amount": 100}}}), ok=False,
    )  # fmt: skip
    assert denied(patched) == said
    # Priced (the profile's H100 default): let in.
    priced = job("priced", "ns-a")
    priced["spec"]["budget"] = {"amount": 100}
    member("create", "--dry-run=server", "-f", "-", input=json.dumps(priced))


def test_a_limit_lowered_under_a_running_job_stops_only_its_next_gang(operator, member):
    """team-d (nameable from anywhere) allows 2 nodes; lowered to 1 under a running 2-node
    job: the gang runs on, a suspend passes the door, and the resume makes no gang: Failed,
    OverLimit, with the limit and the fix."""
    plane = operator.plane
    member("apply", "-f", "-", input=json.dumps(job("lowered", "ns-a", profile="team-d")))
    first = running(plane, "lowered", "ns-a", 0)
    plane.apply(profile("team-d", "registry.example.com/ml/d:1", maxNodes=1))
    # Not a hang guard: three resyncs of the tests' operator (FTJOB_RESYNC_SECONDS=1), each of
    # which reads the lowered limit; the gang is still the same one.
    time.sleep(3)
    now = pods_of(plane, "lowered", "ns-a")
    assert {p["metadata"]["uid"] for p in now} == {p["metadata"]["uid"] for p in first}
    assert status_of(plane, "lowered", "ns-a")["phase"] == "Running"
    for suspend in (True, False):
        member(
            "patch", "ftj", "lowered", "-n", "ns-a", "--type=merge",
            "-p", json.dumps({"spec": {"runPolicy": {"suspend": suspend}}}),
        )  # fmt: skip
        if suspend:
            plane.wait(
                lambda: (
                    status_of(plane, "lowered", "ns-a").get("phase") == "Suspended"
                    and not pods_of(plane, "lowered", "ns-a")
                ),
                hangs.after(30),
                "the job suspended",
            )
    failure = plane.wait(
        lambda: status_of(plane, "lowered", "ns-a").get("failure"),
        hangs.after(30),
        "the resumed job refused",
    )
    assert failure["reason"] == "OverLimit", failure
    assert "2 nodes exceed limits.maxNodes 1 of FineTuneProfile team-d" in failure["message"]
    assert "fix: set resources.nodes to at most 1" in failure["message"]
    assert status_of(plane, "lowered", "ns-a")["phase"] == "Failed"
    assert pods_of(plane, "lowered", "ns-a") == []
