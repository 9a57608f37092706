"""A node's process: what every pod's container (and each node of ``ftjob run``) runs.

    python -m ftjob.trainer.node -m ftjob.trainer --spec job.yaml   # torchrun's options

It takes SIGTERM before anything else, then runs the node's agent (:mod:`ftjob.trainer.agent`).
In a container this process is PID 1, and the kernel drops a signal whose action is the
default for PID 1. The agent handles SIGTERM from its first instruction, but importing it
(torch) takes seconds, more on a node whose page cache is cold, and a SIGTERM in those seconds
was dropped: the pod held its nodes for the whole grace period. So nothing heavy is imported
before this handler is in place.

A SIGTERM before the agent runs ends the node as the agent's own SIGTERM outside the training
loop does: a stop, not a failure, with nothing to save (no worker has started).
"""

from __future__ import annotations

import os
import signal
import sys

from ftjob.api import contract
from ftjob.trainer.gang import termination
from ftjob.trainer.report import secrecy

STOPPED = "stopped for a SIGTERM while starting, before the agent ran; nothing to save"


def _stopped_before_the_agent(signum: int, frame) -> None:
    print(f"ftjob agent: {STOPPED}", flush=True)
    termination.write(contract.preempted_record(None, None, STOPPED))
    # At once, wherever the import was: no child, lease or rendezvous exists yet.
    os._exit(contract.EXIT_PREEMPTED)


def main() -> int:
    signal.signal(signal.SIGTERM, _stopped_before_the_agent)
    secrecy.install()  # before the agent's loggers take hold of stderr
    from ftjob.trainer import agent  # torch: the seconds the handler above covers

    return agent.main()  # which puts its own SIGTERM handler in place first


if __name__ == "__main__":
    sys.exit(main())
