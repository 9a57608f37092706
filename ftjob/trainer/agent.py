"""Each node's agent: torchrun's elastic agent, with ftjob's rules for restarting in place.

    python -m ftjob.trainer.node -m ftjob.trainer --spec job.yaml   # torchrun's options

Every node (a pod, or a node process of ``ftjob run``) runs this (through
:mod:`ftjob.trainer.node`, which holds SIGTERM while it is imported) instead of
``torch.distributed.run``; it reads the same options and ``PET_*`` environment, and runs
torch's own agent (:class:`LocalElasticAgent`) with three differences:

* **Rendezvous** is c10d's, re-formed on every restart: node 0 hosts its store (said, not
  guessed from host names, which a Kubernetes DNS name does not match), and every node keeps
  its node rank as group rank (c10d orders nodes by host name and pid), so global rank 0 --
  the one that serves progress and writes the job folder -- is always on node 0.
* **Restarts in place**: when a worker fails, this node's workers stop, the rendezvous
  re-forms and every node starts its workers again (the other agents see a node waiting and
  restart theirs), at most ``--max-restarts`` times (``spec.runPolicy.inPlaceRestarts``);
  the trainer resumes from the newest checkpoint. Only a spent budget fails the node process.
* **Never where it cannot help**: when the trainer's termination record names a reason
  retrying on these nodes cannot help (``ftjob.api.contract.NOT_IN_PLACE``: bad data, model or
  spec, and the preflight's unfit node, fabric or volume), the agent stops restarting and
  fails; closing the rendezvous ends the other nodes' agents too. The operator then fails the
  job (permanent) or starts a new gang away from the node at fault.

Before restarting, the agent says why in the log and clears the node's termination record
(a later success must not be read as that failure), and wakes stopped workers (SIGCONT) so
that torch's SIGTERM ends them at once. The workers see the gang's restarts so far in
``FTJOB_RESTARTS_IN_PLACE`` (the same count on every node: each restart of the gang is one
rendezvous round that every node joins); their process group keeps its keys in the store
under that round (:func:`ftjob.trainer.model.parallel.init`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousError

from ftjob.api import contract
from ftjob.job import lease
from ftjob.trainer.gang import preempt, signal_watch, termination

TERMINATION_ENV = "FTJOB_TERMINATION_LOG"
# inductor's compile pool: each process left alone starts min(32, the node's CPUs) compile
# workers (torch._inductor.config.decide_compile_threads), so 8 workers on a node start 256
# processes that compete for its CPUs and memory while they compile (pytorch#190941). A value
# the job sets (spec.env) stands.
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
TORCH_COMPILE_THREADS_CAP = 32


def compile_threads(cpus: int, workers: int) -> int:
    """Each of a node's ``workers`` its share of the node's ``cpus`` for inductor's compile
    pool, at most torch's own cap; 1 compiles in the worker itself, starting no pool."""
    return max(1, min(TORCH_COMPILE_THREADS_CAP, cpus // max(1, workers)))


def _usable_cpus() -> int:
    """The CPUs this process may run on (Linux's affinity; elsewhere, the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class NodeRanks(RendezvousHandler):
    """c10d's rendezvous, with each node's rank its own node rank (a permutation of c10d's
    ranks: every node asks for its own, and two nodes asking for one are refused)."""

    def __init__(self, inner: RendezvousHandler, node_rank: int):
        self.inner, self.node_rank = inner, node_rank

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        if not 0 <= self.node_rank < info.world_size:
            raise RendezvousError(
                f"node rank {self.node_rank} is outside 0..{info.world_size - 1} (--nnodes)"
            )
        # The store is this round's: a second node with the same rank is found at once.
        if info.store.add(f"ftjob/node-rank/{self.node_rank}", 1) > 1:
            raise RendezvousError(f"two nodes joined with node rank {self.node_rank}")
        return RendezvousInfo(
            info.store, self.node_rank, info.world_size, info.bootstrap_store_info
        )

    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


class Agent(LocalElasticAgent):
    """torch's local agent that will not restart a permanent failure, clears the record of a
    failure it restarts from, and says in the log what it does."""

    def __init__(
        self,
        *args,
        node_rank: int,
        termination: Path | None,
        watch: signal_watch.Watch | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.node_rank, self.termination, self.watch = node_rank, termination, watch
        self.restarts, self._restarting, self._ending = 0, False, False
        # The workers' environment (ftjob.trainer.model.parallel, progress, __main__).
        os.environ[contract.RESTARTS_IN_PLACE_ENV] = "0"
        shared = compile_threads(_usable_cpus(), self.get_worker_group().spec.local_world_size)
        os.environ.setdefault(COMPILE_THREADS_ENV, str(shared))

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        # Workers in the training loop take SIGTERM as "checkpoint at the next step boundary"
        # (ftjob.trainer.gang.preempt), which a worker blocked in a collective with a failed
        # peer never reaches: workers stopped for a failure are killed at once, as SIGTERM's
        # default action did before. Only this agent's own SIGTERM is passed on as SIGTERM.
        # The rest goes on as torch gave it: 2.13 adds a timeout that 2.11 (the GPU image's)
        # does not take.
        if self._ending:
            death_sig = signal.SIGKILL
        super()._shutdown(death_sig, *args, **kwargs)

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._decide(result, worker_group.spec.max_restarts)
        return result

    def _decide(self, result: RunResult, budget: int) -> None:
        stopped = read_preempted(self.termination)
        if stopped is not None:
            # The gang stopped for a SIGTERM and saved where it could: no failure, no restart
            # here (the pod is going away); the operator or `ftjob run` starts the next gang.
            self._remaining_restarts = 0
            what = stopped.get("message", "stopped for a SIGTERM")
            say(f"node {self.node_rank}: {what}; no restart in place: the next gang resumes "
                "from the newest checkpoint")  # fmt: skip
            return
        failed = read_failure(self.termination)
        what = describe(failed, result)
        if failed is not None and failed.get("reason") in contract.NOT_IN_PLACE:
            self._remaining_restarts = 0  # torch's own loop then stops the workers and fails
            say(f"node {self.node_rank}: {what}; retrying on these nodes cannot help, so no "
                "restart in place")  # fmt: skip
        elif result.state == WorkerState.UNHEALTHY and self._remaining_restarts == 0:
            # torch's agent gave the budget up itself: a fresh worker would contend with the
            # stuck one for its GPU or NIC.
            say(f"node {self.node_rank}: {what}; torch's agent restarts no workers beside it, "
                "so no restart in place")  # fmt: skip
        elif self._remaining_restarts > 0:
            used = budget - self._remaining_restarts + 1
            say(f"node {self.node_rank}: {what}; restarting the workers of every node in place "
                f"from the newest checkpoint (restart {used} of {budget})")  # fmt: skip
        else:
            say(f"node {self.node_rank}: {what}; no in-place restart left ({budget} used)")

    def _restart_workers(self, worker_group) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # another node's workers failed
            say(f"node {self.node_rank}: another node restarts its workers; restarting these")
        self.restarts += 1
        os.environ[contract.RESTARTS_IN_PLACE_ENV] = str(self.restarts)  # the next workers' env
        self._restarting = True
        try:
            super()._restart_workers(worker_group)  # stop, rendezvous, start
        finally:
            self._restarting = False

    def _start_workers(self, worker_group):
        try:
            return super()._start_workers(worker_group)
        finally:
            # torch's process context put its own SIGTERM handler in place (one that raises
            # SignalException, as ours does): ours again, so the signal watch sees it run.
            if self.watch is not None:
                self.watch.install()

    def _stop_workers(self, worker_group) -> None:
        # A stopped process ignores SIGTERM until continued: wake it so it ends now, not at
        # torch's SIGKILL after the shutdown timeout.
        if self._pcontext is not None:
            for pid in self._pcontext.pids().values():
                _signal_group(pid, signal.SIGCONT)
        self._ending = True
        try:
            super()._stop_workers(worker_group)
        finally:
            self._ending = False
        if self._restarting and self.termination is not None:
            # The failure restarted from is said in the log; the next workers write their
            # own. (A node that fails for good keeps its record: it says why.) Emptied, not
            # removed: in a pod the file is kubelet's mount (/dev/termination-log).
            with contextlib.suppress(FileNotFoundError):
                self.termination.write_text("")


def read_record(path: Path | None) -> dict | None:
    """The node's termination record (the trainer writes it before its process exits, so
    the agent that sees the exit finds it)."""
    if path is None:
        return None
    try:
        return contract.parse(path.read_text())
    except OSError:
        return None


def read_failure(path: Path | None) -> dict | None:
    """The node's termination record if it is a failure."""
    rec = read_record(path)
    return rec if rec is not None and rec.get("outcome") == "failed" else None


def read_preempted(path: Path | None) -> dict | None:
    """The node's termination record if its workers stopped for a SIGTERM."""
    rec = read_record(path)
    return rec if rec is not None and rec.get("outcome") == "preempted" else None


def describe(failed: dict | None, result: RunResult) -> str:
    """One line: which rank failed and why (the record, else the exit code or signal)."""
    if failed is not None:
        return (
            f"rank {failed.get('rank', '?')} failed: {failed.get('reason')}: "
            + (str(failed.get("message", "")).splitlines() or [""])[0][:300]
        )
    for rank, failure in sorted(result.failures.items()):
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else failure.exitcode
        return f"rank {rank} failed (exit {how})"
    if result.state == WorkerState.UNHEALTHY:  # torch's only cause of it (2.13)
        return (
            "a worker is stuck in uninterruptible sleep (D-state) past torch's limit "
            "(TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT)"
        )
    return f"the workers are {result.state.name.lower()}"


def _termination_path() -> Path | None:
    path = os.environ.get(TERMINATION_ENV)
    return Path(path) if path else None


def say(message: str) -> None:
    print(f"ftjob agent: {message}", flush=True)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # torch starts each worker in a session of its own


# torch's agent options that not every supported torch has, each passed only where both the
# launch config and the agent take it: shutdown_timeout came after 2.11 (the GPU image's torch).
OPTIONAL_AGENT_OPTIONS = ("shutdown_timeout",)


def optional_agent_options(config, agent_class: type = LocalElasticAgent) -> dict:
    """Those of :data:`OPTIONAL_AGENT_OPTIONS` this torch has (feature detection, not a version
    check): on torch 2.11 neither LaunchConfig nor LocalElasticAgent knows shutdown_timeout.

    A SIGTERM to the agent (the pod's main process) is passed on to the workers, which stop
    at the next step boundary and save (ftjob.trainer.gang.preempt): torch's agent waits
    shutdown_timeout for them before SIGKILL: the grace period, and never less than
    Kubernetes' default (the kubelet's SIGKILL ends the pod at the grace period anyway; the
    agent's own must not come first, also where the grace is too short for a save and the
    workers only need the moment to stop at a step boundary and say so)."""
    accepted = inspect.signature(agent_class.__init__).parameters
    options = {
        name: getattr(config, name)
        for name in OPTIONAL_AGENT_OPTIONS
        if name in accepted and hasattr(config, name)
    }
    if "shutdown_timeout" in accepted:
        options["shutdown_timeout"] = _shutdown_seconds()
    return options


def _shutdown_seconds() -> int:
    """How long the workers are given to stop after this agent's SIGTERM before SIGKILL."""
    return math.ceil(max(preempt.grace_seconds(), preempt.DEFAULT_GRACE_SECONDS))


def launch(
    config, entrypoint, args: list[str], node_rank: int, watch: signal_watch.Watch | None = None
) -> int:
    """torch's ``launch_agent`` (torch.distributed.launcher.api) with :class:`Agent` and
    :class:`NodeRanks`. Left out of it, as ftjob does not use them: the launch-config log
    line, a generated run id (ours always has one), the early health-check server
    (TORCHELASTIC_HEALTH_CHECK_PORT), torchelastic's metrics and events, and the WorkerSpec's
    master address and port, event log handler, NUMA binding, stdout/stderr duplicate
    filters and virtual local rank: torchrun's options for those are accepted and ignored.

    Returns the node's exit code: 0, or contract.EXIT_PREEMPTED when its workers stopped for
    a SIGTERM (this agent's, passed on, or another node's, agreed by the gang)."""
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    handler = registry.get_rendezvous_handler(params)
    # static: torchrun's default backend, when the agent is started by hand without
    # --standalone (ftjob's own launchers always say c10d); its node ranks are given already.
    if config.rdzv_backend != "static":
        handler = NodeRanks(handler, node_rank)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    termination = _termination_path()
    agent = Agent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        node_rank=node_rank,
        termination=termination,
        watch=watch,
        **optional_agent_options(config),
    )
    if watch is not None:
        watch.on_stuck = lambda: _end_held(node_rank, config.run_id, agent)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    close = True
    try:
        result = agent.run()
        if result.is_failed() and read_preempted(agent.termination) is None:
            raise ChildFailedError(name=str(entrypoint), failures=result.failures)
        return contract.EXIT_PREEMPTED if result.is_failed() else 0
    except SignalException as e:
        close = False  # stopped from outside: torch's launcher leaves the rendezvous open too
        if read_preempted(agent.termination) is not None:
            say(f"node {node_rank}: stopped by a SIGTERM; the workers stopped at a step "
                "boundary (see their record)")  # fmt: skip
            return contract.EXIT_PREEMPTED
        if e.sigval != signal.SIGTERM:
            raise
        return _stopped_outside_loop(agent.termination, node_rank)
    finally:
        if close:
            handler.shutdown()  # closes the rendezvous: the other agents stop waiting


def _stopped_outside_loop(path: Path | None, node_rank: int) -> int:
    """A SIGTERM reached this node outside the training loop (rendezvous, data, loading, or
    after the last save): its workers ended at once, with nothing new to save (a checkpoint
    is written only in the loop, the export only whole). A finished node stays finished, and
    a failed one failed: the SIGTERM is often the gang stopping for that very failure (ftjob
    run stops every node when one fails), and "stopped" would hide it. Any other ends as
    stopped, not failed: the next gang resumes from the newest checkpoint."""
    outcome = (read_record(path) or {}).get("outcome")
    if outcome == "succeeded":
        say(f"node {node_rank}: stopped by a SIGTERM after its workers finished")
        return 0
    if outcome == "failed":
        say(f"node {node_rank}: stopped by a SIGTERM after a worker failed (its record says why)")
        return 1
    message = "stopped for a SIGTERM outside the training loop; nothing new to save"
    say(f"node {node_rank}: {message}")
    with contextlib.suppress(OSError):  # a failure a worker writes meanwhile stays (keep)
        termination.write(contract.preempted_record(None, None, message))
    return contract.EXIT_PREEMPTED


def _terminate(signum: int, frame) -> None:
    raise SignalException(f"process {os.getpid()} got signal {signum}", signal.Signals(signum))


@record
def main(argv: list[str] | None = None) -> int:
    # From the first moment, not only once torch starts the workers (its PContext installs
    # this same handler then): in a container this agent is PID 1, and the kernel drops a
    # signal whose action is the default for PID 1. Without it, a SIGTERM during the
    # rendezvous was ignored and the pod held its nodes for the whole grace period. (While
    # this module was imported, ftjob.trainer.node's handler held it.) Watched: a main
    # thread held in a store call cannot run it (ftjob.trainer.gang.signal_watch).
    watch = signal_watch.Watch(_terminate)
    args = torchrun.parse_args(argv)
    node_rank = args.node_rank
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = (
            "c10d",
            "localhost:0",
            str(uuid.uuid4()),
        )
    elif args.rdzv_backend != "static":
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port or 29500}"
        if "is_host" not in args.rdzv_conf:
            host = f"is_host={int(node_rank == 0)}"
            args.rdzv_conf = f"{args.rdzv_conf},{host}" if args.rdzv_conf else host
        args.node_rank = 0  # torchrun warns that c10d ignores it; NodeRanks does not
    config, cmd, cmd_args = torchrun.config_from_args(args)
    watch.on_stuck = lambda: _end_held(node_rank, config.run_id, None)  # launch: the agent
    try:
        return launch(config, cmd, cmd_args, node_rank, watch)
    finally:
        _release(node_rank, config.run_id)


def _release(node_rank: int, run: str) -> None:
    """The gang is over on node 0: the job folder is free (its workers released it on
    success; a failure keeps it for restarts in place until now)."""
    job_dir = os.environ.get("FTJOB_JOB_DIR")
    if node_rank == 0 and job_dir:
        lease.release(Path(job_dir), run)


def _end_held(node_rank: int, run: str, agent: Agent | None) -> None:
    """A SIGTERM the main thread could not take (held in a store call whose host is gone):
    end the node from the signal watch's thread as the handler would have, at once."""
    say(f"node {node_rank}: a SIGTERM found the agent held in a call (the rendezvous store's "
        "host gone?); ending the node without it")  # fmt: skip
    pcontext = agent._pcontext if agent is not None else None
    if pcontext is not None:  # the workers save at their next step boundary, as on any SIGTERM
        pcontext.close(signal.SIGTERM, _shutdown_seconds())
    path = agent.termination if agent is not None else _termination_path()
    ended = read_preempted(path) is not None
    code = contract.EXIT_PREEMPTED if ended else _stopped_outside_loop(path, node_rank)
    _release(node_rank, run)
    sys.stdout.flush()
    os._exit(code)  # the main thread stays held: only this ends the process now
