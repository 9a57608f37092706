"""How long the operator's watches ride out a failing API server, and what it says after.

kopf retries a failed API request (a 5xx, a timeout, a 403) on the backoffs of
``settings.networking.error_backoffs``; when they run out, the watch that made the request
fails and kopf stops the operator with a traceback. Its own backoffs span 54 s, so a load
balancer that answers 503 for a minute while the API servers behind it are upgraded, or a
ClusterRole replaced in two steps, would restart the operator. (A refused connection is
different: kopf's watches retry it for as long as it lasts.) So:

* the backoffs span ``FTJOB_API_RETRY_SECONDS`` (:func:`backoffs`; 300 s by default);
* past them the operator still ends, so that its pod restarts and lists everything afresh,
  but with one line that says so (:func:`gave_up`), not a traceback.
"""

from __future__ import annotations

RAMP = (1, 1, 2, 3, 5, 8, 13, 21)  # kopf's default backoffs, seconds
STEP = 30.0  # then a retry every STEP seconds, as client-go's reflectors back off to


def backoffs(total: float) -> tuple[float, ...]:
    """Waits between retries that add up to ``total`` seconds: kopf's ramp, then STEP."""
    waits: list[float] = []
    while sum(waits) < total:
        waits.append(float(RAMP[len(waits)]) if len(waits) < len(RAMP) else STEP)
    if waits:
        waits[-1] -= sum(waits) - total  # the last one ends the span exactly
    return tuple(waits)


def gave_up(error: BaseException) -> str:
    """The operator's last line when kopf gave up on a watch: the API's answer (kopf's
    APIError carries the Status message: what was refused, and to whom) and what follows."""
    status = getattr(error, "status", None)
    return (
        f"a watch failed past FTJOB_API_RETRY_SECONDS of retries (HTTP {status}, "
        f"{type(error).__name__}: {error.args[0] if error.args else error}); the operator "
        "ends, to start again and list everything afresh"
    )
