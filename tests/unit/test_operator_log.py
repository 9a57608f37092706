"""``ftjob operator``'s log names an API server outage once, not a line per retry of every
watch (issue 55, point 3): the filter configure_logging puts on the log's handler, fed the
lines kopf's request retries log (kopf/_cogs/clients/api.py's wording)."""

from __future__ import annotations

import logging

from ftjob.operator.__main__ import _OnceAnOutage


def kopf_retry(n: int, url: str) -> logging.LogRecord:
    msg = f"Request attempt #{n}/9 failed; will retry: GET {url} -> ClientConnectorError()"
    return logging.LogRecord("kopf._cogs.clients.watching", logging.ERROR, "", 0, msg, (), None)


def test_an_outage_is_named_once_and_the_next_outage_again(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 5.0, 13.0, 200.0])
    monkeypatch.setattr("ftjob.operator.__main__.time.monotonic", lambda: next(clock))
    once = _OnceAnOutage()
    watches = ["/api/v1/pods", "/apis/ftjob.dev/v1alpha1/finetunejobs", "/api/v1/namespaces"]
    first = [once.filter(kopf_retry(1, url)) for url in watches]
    assert first == [True, False, False]
    assert not once.filter(kopf_retry(2, watches[0])) and not once.filter(kopf_retry(3, watches[1]))
    later = kopf_retry(1, watches[0])  # 187 s without a retry: a new outage
    assert once.filter(later) and "the API server did not answer" in later.getMessage()
    other = logging.LogRecord("kopf.objects", logging.WARNING, "", 0, "reconcile failed", (), None)
    assert once.filter(other)
