"""A failure's Event names its cause on one bounded line (issue 52, point 2): the words of the
real trainer's record (the file and line of a bad record, a missing folder's path) or the end
of its log tail, never only "retrying cannot help", never a line break that splits
`kubectl describe`'s Events table."""

import pytest
from test_status import decide, pod, run_to

from ftjob.api import contract
from ftjob.operator import status as st


def one_line(text: str) -> str:
    return " ".join(text.split())


def failure_event(decision) -> tuple[str, str, str]:
    return next(e for e in decision.events if e[1] == decision.status["failure"]["reason"])


@pytest.mark.parametrize(
    "scenario, named",
    [
        ("bad-data", "bad.jsonl"),  # the data file, and the line of the bad record
        ("bad-model", "no-such-model"),  # the missing folder's path
        ("disk-full", "No space left"),  # retried: the Restarting Event
    ],
)
def test_the_event_carries_the_records_cause_on_one_line(trainer_runs, scenario, named):
    run = trainer_runs.get(scenario)
    record = contract.parse(run.record)
    d = decide(run_to([pod(0), pod(1)]).status, [pod(0, real=run), pod(1)], backoffLimit=3)
    kind, _, message = failure_event(d)
    assert kind == "Warning" and "\n" not in message and len(message) <= st.EVENT_LIMIT
    assert named in message
    assert one_line(record["message"])[:200] in message
    # The condition keeps the whole message; the Event starts as it does.
    condition = st.condition(d.status["conditions"], d.phase)["message"]
    assert message.startswith(condition.splitlines()[0])


def test_a_log_tails_event_is_bounded_and_keeps_the_tails_end(trainer_runs):
    run = trainer_runs.get("killed")  # no record: the log tail is the cause
    d = decide(run_to([pod(0), pod(1)]).status, [pod(0, real=run), pod(1)], backoffLimit=3)
    _, _, message = failure_event(d)
    assert "\n" not in message and len(message) <= st.EVENT_LIMIT
    last = [line for line in run.message.splitlines() if line.strip()][-1]
    assert message.endswith(one_line(last))


def test_an_event_message_is_one_line_within_its_limit():
    assert st.event_message("what happened: fix it\ncause, line 3\n\n  more  ") == (
        "what happened: fix it | cause, line 3 | more"
    )
    assert len(st.event_message("x" * 5000)) == st.EVENT_LIMIT
    cut = st.event_message("head\n" + "a" * 3000 + "\nthe end")
    assert len(cut) == st.EVENT_LIMIT and cut.startswith("head | ...") and cut.endswith("the end")
