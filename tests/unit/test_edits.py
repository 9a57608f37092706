"""An edit of what a gang's pods are made of (issue 52, point 1): a gang that never ran is
replaced by one made from the edited spec, spending no restart budget; a running gang keeps
its spec, and an Event says so once and how to apply it.

    python -m pytest tests/unit/test_edits.py -q

The same on the real control plane: tests/cluster/test_real_operator.py (a nodeSelector no
node has, edited away) and tests/cluster/test_real_gang.py (an image no registry serves,
edited to the built one).
"""

import copy
from datetime import timedelta

from test_pending import unschedulable
from test_status import ROOT, T0, pod

from ftjob.api import manifest
from ftjob.api.jobspec import parse_resource
from ftjob.api.schema import camel
from ftjob.operator import lifecycle, render
from ftjob.operator import status as st

GOOD = "ghcr.io/ftjob/trainer:1.0"


def spec(**edits):
    doc = manifest.load(ROOT / "examples" / "tiny.yaml")[0]
    doc["spec"]["image"] = GOOD
    doc["spec"]["network"] = {"collectiveTimeoutSeconds": 60}
    doc["spec"].update(edits)
    return parse_resource(doc)


def made(p: dict, **edits) -> dict:
    """Pod ``p`` as the operator made it from the spec with ``edits``."""
    name, s = spec(**edits)
    out = copy.deepcopy(p)
    out["metadata"]["annotations"] = render.pod(name, "ns", s, 0, 0, "uid")["metadata"][
        "annotations"
    ]
    return out


def decide(status, pods, generation, now=T0, **edits):
    name, s = spec(**edits)
    views = [st.observed_pod(p) for p in pods]  # the operator decides from its trimmed views
    return lifecycle.decide(s, name, generation, status, views, now, template=render.template(s))


STUCK_GANG = [pod(0), unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")]


def stuck(**edits):
    """A gang of generation 1 whose pod 1 cannot be scheduled."""
    created = decide(None, [], 1, **edits)
    pods = [made(p, **edits) for p in STUCK_GANG]
    d = decide(created.status, pods, 1, **edits)
    assert d.phase == "Pending" and d.status["attempt"] == 0
    return d, pods


def test_an_image_edit_replaces_a_gang_that_never_ran_without_spending_budget():
    before, pods = stuck(image="ghcr.io/ftjob/nope:1")
    d = decide(before.status, pods, 2)
    assert d.status["attempt"] == 1 and d.status["restarts"] == 0
    assert sorted(d.delete) == ["tiny-node-0", "tiny-node-1"] and not d.create
    assert d.phase == "Pending" and "failure" not in d.status
    [(kind, reason, message)] = d.events
    assert (kind, reason) == ("Normal", "SpecChanged")
    assert "generation 2 (image ghcr.io/ftjob/nope:1 -> ghcr.io/ftjob/trainer:1.0)" in message
    assert "attempt 0 never ran" in message and "attempt 1" in message
    # The old gang going: still Pending, saying why, and nothing said twice.
    going = [p | {"metadata": p["metadata"] | {"deletionTimestamp": "t"}} for p in pods]
    waiting = decide(d.status, going, 2, now=T0 + timedelta(seconds=5))
    assert waiting.phase == "Pending" and not waiting.events and not waiting.create
    assert st.condition(waiting.status["conditions"], "Running")["reason"] == "SpecChanged"
    # Gone: the new gang is created, as attempt 1, from the edited spec.
    new = decide(waiting.status, [], 2, now=T0 + timedelta(seconds=10))
    assert new.create == [0, 1] and new.status["attempt"] == 1 and not new.events


def test_the_start_limit_counts_again_for_the_new_gang():
    before, pods = stuck(image="ghcr.io/ftjob/nope:1")
    assert lifecycle.WAITING_SINCE in before.status
    d = decide(before.status, pods, 2)
    assert lifecycle.WAITING_SINCE not in d.status


def test_an_env_or_scheduling_edit_is_named_by_its_section():
    before, pods = stuck()
    d = decide(before.status, pods, 2, env=[{"name": "A", "value": "1"}],
               scheduling={"nodeSelector": {"pool": "a"}})  # fmt: skip
    [(_, _, message)] = d.events
    assert "(env, scheduling)" in message and d.status["attempt"] == 1


def test_an_edit_the_pods_are_not_made_of_leaves_the_gang():
    """runPolicy's timeouts, plan: nothing the pods carry; a stuck gang is not replaced."""
    before, pods = stuck()
    d = decide(before.status, pods, 2, runPolicy={"startTimeoutSeconds": 9000})
    assert d.status["attempt"] == 0 and not d.delete and not d.events


def test_a_running_gang_keeps_its_spec_and_says_once_how_to_apply_the_edit():
    created = decide(None, [], 1)
    pods = [made(pod(0)), made(pod(1))]
    running = decide(created.status, pods, 1)
    assert running.phase == "Running"
    d = decide(running.status, pods, 2, image="ghcr.io/ftjob/trainer:2.0")
    assert d.phase == "Running" and d.status["attempt"] == 0 and not d.delete
    [(kind, reason, message)] = d.events
    assert (kind, reason) == ("Warning", "SpecChangeWaits")
    assert "generation 2 (image ghcr.io/ftjob/trainer:1.0 -> ghcr.io/ftjob/trainer:2.0)" in message
    assert "suspend and resume" in message and "delete and re-apply" in message
    # Level-triggered: said once for the generation.
    again = decide(
        d.status, pods, 2, now=T0 + timedelta(seconds=5), image="ghcr.io/ftjob/trainer:2.0"
    )
    assert not again.events and again.status["attempt"] == 0


def test_pods_that_do_not_say_what_they_were_made_of_are_left_alone():
    """Made by an operator before pods carried their template: no edit can be told apart."""
    before, pods = stuck()
    bare = copy.deepcopy(pods)
    for p in bare:
        p["metadata"].pop("annotations")
    d = decide(before.status, bare, 2, image="ghcr.io/ftjob/trainer:2.0")
    assert d.status["attempt"] == 0 and not d.delete


def test_the_template_names_the_image_and_moves_only_with_an_editable_section():
    _, s = spec()
    t = render.template(s)
    assert t["image"] == GOOD and set(t) == {"image", *map(camel, render.EDITABLE),
                                              "runPolicy.inPlaceRestarts"}  # fmt: skip
    assert render.template(spec(runPolicy={"backoffLimit": 9})[1]) == t
    assert render.template(spec(runPolicy={"inPlaceRestarts": 9})[1]) != t
    assert render.template(s, "other:1") == t  # spec.image wins over the default
    _, bare = spec(image=None)
    assert render.template(bare, "other:1")["image"] == "other:1"
