"""``ftjob operator``: run the FineTuneJob operator against the cluster of a kubeconfig.

ftjob operator --all-namespaces                 # cluster-wide
ftjob operator -n team-a -n team-b --metrics-port 9090
ftjob operator -A --default-image registry.example.com/ftjob/trainer:0.1.0
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import random
import re
import time

from ftjob.api.kubevalidation import IMAGE
from ftjob.operator import render


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeat)"
    )
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL (empty to turn off)",
    )
    p.add_argument(
        "--default-image",
        default=None,
        help="trainer image of jobs that set no spec.image (default: $FTJOB_DEFAULT_IMAGE; "
        "without either, the unpublished placeholder ghcr.io/ftjob/trainer:<version>)",
    )
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics (0: off)")
    p.add_argument(
        "--peering",
        default=None,
        help="peering name: replicas with one name let only the highest priority act. Needs "
        "kopf's peering CRDs and a ClusterKopfPeering (-A) or KopfPeering (-n) named NAME, as "
        "the chart's peering.enabled creates; without that object kopf pauses every handler "
        "(docs/operator.md). Without --peering kopf peers optionally",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority of this replica (default: random, so replicas never tie)",
    )
    p.add_argument(
        "--peering-lifetime",
        type=_lifetime,
        default=None,
        help="seconds a replica's peering keep-alive holds: a standby acts this long after the "
        "acting replica was lost without a goodbye (SIGKILL, a node gone); a drained one hands "
        "over at once. Default: kopf's 60. Keep it well above the API server's worst delay: a "
        "keep-alive that arrives later lets two replicas act",
    )
    p.add_argument(
        "--pod-groups",
        choices=("auto", "off"),
        default=None,
        help="auto (default: $FTJOB_POD_GROUPS, else auto): each gang is a PodGroup, which "
        "kube-scheduler binds whole, where the API server serves Kubernetes 1.37's "
        "scheduling.k8s.io/v1beta1; off: never (another gang scheduler places the pods), and a "
        "gang partly placed for 30 s gives its pods back and waits whole",
    )
    p.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument("--verbose", "-v", action="store_true")


PEERING_LIFETIME_MIN = 10  # kopf renews a keep-alive 5-10 s before its lifetime ends


def _lifetime(text: str) -> int:
    seconds = int(text)
    if seconds < PEERING_LIFETIME_MIN:
        raise argparse.ArgumentTypeError(
            f"{seconds} is under {PEERING_LIFETIME_MIN} s: kopf renews a keep-alive 5-10 s "
            "before it ends, so a shorter one lapses between renewals (the chart's "
            "peering.lifetime)"
        )
    return seconds


def run(args: argparse.Namespace) -> int:
    if not args.namespace and not args.all_namespaces:
        raise SystemExit("ftjob operator: give --namespace NS (repeatable) or --all-namespaces")
    # The handlers read their settings from the environment when the operator starts.
    os.environ.setdefault("FTJOB_METRICS_PORT", str(args.metrics_port))
    if args.peering_lifetime is not None:
        os.environ["FTJOB_PEERING_LIFETIME"] = str(args.peering_lifetime)
    if args.pod_groups is not None:
        os.environ[render.POD_GROUPS_ENV] = args.pod_groups
    if args.default_image is not None:  # the flag wins over the variable
        os.environ[render.DEFAULT_IMAGE_ENV] = args.default_image
    # Checked however it was set (the chart and `kubectl set env` set the variable).
    image = os.environ.get(render.DEFAULT_IMAGE_ENV)
    if image and not re.match(IMAGE, image):
        raise SystemExit(
            f"ftjob operator: --default-image / ${render.DEFAULT_IMAGE_ENV} {image!r} is not an "
            "image reference (no spaces), e.g. registry.example.com/ftjob/trainer:0.1.0"
        )
    try:  # spec.tracking of jobs that name none (the chart's trainer.tracking)
        render.default_tracking(os.environ.get(render.DEFAULT_TRACKING_ENV))
    except ValueError as e:  # JSON that does not parse, or a wrong field (SpecError)
        raise SystemExit(
            f"ftjob operator: ${render.DEFAULT_TRACKING_ENV} is not a spec.tracking section: "
            f"{e} (the chart's trainer.tracking; docs/progress.md, Experiment trackers)"
        ) from None
    from ftjob.operator import pause

    if why := pause.version_error():  # before kopf is imported or logs in: nothing ran yet
        raise SystemExit(f"ftjob operator: cannot start: {why}")
    import kopf

    from ftjob.operator import handlers  # noqa: F401 - registers the handlers

    configure_logging(args.verbose)
    priority = args.priority
    if priority is None:
        # kopf pauses every replica that ties for the highest priority, so identical replicas
        # of one Deployment would all stand still; a random priority makes one of them lead.
        priority = random.SystemRandom().randint(1, 2**31 - 1)
    try:
        asyncio.run(
            kopf.operator(
                clusterwide=args.all_namespaces,
                namespaces=args.namespace,
                liveness_endpoint=args.liveness or None,
                standalone=args.standalone,
                peering_name=args.peering,
                priority=priority,
                # The start-up handler checks access where the operator will act.
                memo=kopf.Memo(namespaces=[] if args.all_namespaces else args.namespace),
            )
        )
    except Exception as e:  # noqa: BLE001 - the cause, said once, is the exit status's reason
        cause = _cause(e)
        if cause is None:
            raise
        raise SystemExit(f"ftjob operator: {cause}") from None
    return 0


def _cause(error: BaseException | None) -> str | None:
    """The line that says why the operator ended: it could not start (a
    :class:`StartupError` that kopf wraps in its ActivityError, a port kopf's liveness
    endpoint could not take), or kopf gave up on a watch (operator/watches.py)."""
    from kopf._cogs.clients.errors import APIError  # pinned kopf (constraints.txt)

    from ftjob.operator import watches
    from ftjob.operator.startup import StartupError

    while error is not None:
        if isinstance(error, StartupError):
            return f"cannot start: {error}"
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            return (
                f"cannot start: the liveness endpoint's port is taken ({error.strerror}): free "
                "it, or choose another with --liveness (the chart's operator.healthPort)"
            )
        if isinstance(error, APIError):
            return watches.gave_up(error)
        error = error.__cause__ or error.__context__
    return None


KOPF_PEERING_LOGGER = "kopf._core.engines.peering"


class _ObjectName(logging.Filter):
    """kopf's lines about an object carry it (``k8s_ref``) but do not say it: name it."""

    def filter(self, record: logging.LogRecord) -> bool:
        ref = getattr(record, "k8s_ref", None) or {}
        name = f"{ref.get('namespace')}/{ref.get('name')}" if ref.get("name") else ""
        record.object = f"{name}: " if name else ""
        return True


class _OnceAnOutage(logging.Filter):
    """kopf logs every retry of every request the API server does not answer ("Request
    attempt #3/9 failed; will retry: ..."): with five watches, some 40 lines in a 30 s
    restart of the API server. The first retry of an outage passes, saying what it is; the
    others show with --verbose. An outage is over when no request was retried for QUIET s."""

    QUIET = 60.0
    RETRY = re.compile(r"Request attempt #?\d+(/\d+)? failed; will retry")

    def __init__(self) -> None:
        super().__init__()
        self.last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.RETRY.match(str(record.msg)):
            return True
        now = time.monotonic()
        first = self.last is None or now - self.last > self.QUIET
        self.last = now
        if first:
            said = "the API server did not answer; kopf retries (each retry: --verbose)"
            record.msg = f"{said}: {record.msg}"
            record.args = ()
        return first


def configure_logging(verbose: bool) -> None:
    """One line per decision, naming the job (the ftjob.operator logger: handlers.py), and no
    line per routine event at the default level: kopf says every handler call at INFO
    ("Handler 'pod_changed' succeeded.", a line per pod event) and aiohttp every liveness
    probe; those show with --verbose. kopf's warnings and errors always show."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(object)s%(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ObjectName())
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_OnceAnOutage())
        for routine in ("kopf", "aiohttp.access"):
            logging.getLogger(routine).setLevel(logging.WARNING)
        # Peering logs only its decisions (a replica pausing for a leader, resuming when it
        # is gone): those stay.
        logging.getLogger(KOPF_PEERING_LOGGER).setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftjob operator", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
