"""kopf's diff base is not built for this operator (operator/essence.py): its handlers read no
diff, and a handler that would is named so that the operator refuses to start."""

from __future__ import annotations

import kopf

from ftjob.operator import essence, handlers  # noqa: F401 - registers the operator's handlers


def test_the_operators_own_handlers_read_no_diff():
    assert essence.readers(kopf.get_default_registry()) == []


def test_a_change_handler_or_a_daemon_is_named():
    registry = kopf.OperatorRegistry()

    @kopf.on.update("pods", registry=registry, id="resized")
    def resized(**_):
        pass

    @kopf.daemon("pods", registry=registry, id="watcher")
    def watcher(**_):
        pass

    assert sorted(essence.readers(registry)) == ["resized", "watcher"]


def test_an_event_builds_no_copy_of_the_object():
    pod = kopf.Body({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}] * 100}})
    storage = essence.Unused()
    assert storage.build(body=pod) == {} and storage.fetch(body=pod) is None
