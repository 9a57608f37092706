"""How long kopf retries the API (operator/watches.py), and the operator's last line when it
gave up on a watch. The whole on the real control plane: tests/cluster/test_real_outage.py."""

from __future__ import annotations

import pytest
from kopf._cogs.clients.errors import APIForbiddenError

from ftjob.operator import watches
from ftjob.operator.__main__ import _cause


@pytest.mark.parametrize("total", [0, 10, 54, 300, 301.5])
def test_the_backoffs_span_the_retry_time_in_kopfs_ramp_then_steady_steps(total):
    waits = watches.backoffs(total)
    steps = watches.RAMP + (watches.STEP,) * len(waits)
    assert sum(waits) == total
    assert waits[:-1] == steps[: max(len(waits) - 1, 0)]  # all but the last: it ends the span
    assert all(0 < w <= watches.STEP for w in waits)


def test_a_watch_kopf_gave_up_on_ends_the_operator_with_the_api_servers_answer():
    refused = {"kind": "Status", "message": 'pods is forbidden: User "x" cannot watch "pods"'}
    try:
        try:
            raise APIForbiddenError(refused, status=403, headers={})
        except APIForbiddenError as e:
            raise RuntimeError("Multidimensional multitasker has failed") from e
    except RuntimeError as e:
        line = _cause(e)
    assert line == (
        "a watch failed past FTJOB_API_RETRY_SECONDS of retries (HTTP 403, APIForbiddenError: "
        'pods is forbidden: User "x" cannot watch "pods"); the operator ends, to start again '
        "and list everything afresh"
    )
    assert _cause(RuntimeError("anything else")) is None  # raised as it is, traceback and all
