"""agent.py's options that only some supported torch versions have (torch 2.11, the GPU
image's, has no shutdown_timeout): passed where both torch's launch config and its agent take
them. tests/e2e/test_torch_floor.py runs whole jobs on torch 2.11 itself.

python -m pytest tests/unit/test_agent_options.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed import run as torchrun

from ftjob.api import contract
from ftjob.trainer import agent


def launch_config(*argv: str):
    config, _, _ = torchrun.config_from_args(
        torchrun.parse_args(["--standalone", *argv, "-m", "ftjob.trainer"])
    )
    return config


class AgentWithout:
    """torch 2.11's LocalElasticAgent: no shutdown_timeout parameter."""

    def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300,
                 log_line_prefix_template=None):  # fmt: skip
        pass


def test_this_torchs_agent_waits_the_grace_period_for_its_workers(monkeypatch):
    """torch 2.13 (CI's) takes shutdown_timeout: a SIGTERM passed on to the workers gives them
    the grace period to save (ftjob.trainer.gang.preempt), not the launch config's 30 s."""
    monkeypatch.setenv(contract.GRACE_ENV, "120")
    assert agent.optional_agent_options(launch_config()) == {"shutdown_timeout": 120}
    monkeypatch.setenv(contract.GRACE_ENV, "5")  # never before the kubelet's own SIGKILL
    assert agent.optional_agent_options(launch_config()) == {"shutdown_timeout": 30}


def test_a_launch_config_without_the_option_is_not_read(monkeypatch):
    """torch 2.11's LaunchConfig has no shutdown_timeout: reading it raised AttributeError and
    every ftjob run failed at start."""
    monkeypatch.delenv(contract.GRACE_ENV, raising=False)
    assert agent.optional_agent_options(SimpleNamespace(max_restarts=0)) == {"shutdown_timeout": 30}


def test_an_agent_without_the_parameter_is_not_given_it():
    config = SimpleNamespace(shutdown_timeout=30)
    assert agent.optional_agent_options(config, AgentWithout) == {}


def _shutdown_under(monkeypatch, parent_shutdown, ending: bool, *args):
    """Agent._shutdown on a stand-in agent whose torch parent's _shutdown is ``parent_shutdown``."""
    calls = []
    monkeypatch.setattr(agent.LocalElasticAgent, "_shutdown",
                        lambda self, *a, **k: calls.append(parent_shutdown(*a, **k)))  # fmt: skip
    stand_in = agent.Agent.__new__(agent.Agent)  # no torch agent behind it: only _shutdown runs
    stand_in._ending = ending
    stand_in._shutdown(*args)
    return calls


def test_the_agent_stops_its_workers_as_either_torch_asks(monkeypatch):
    """torch 2.13 calls _shutdown(death_sig, timeout); 2.11 (the GPU image's) _shutdown(death_sig)
    with a parent that takes no timeout: both reach the parent as given, and workers stopped
    for a failure get SIGKILL (a worker in the training loop takes SIGTERM as a save)."""
    import signal

    def torch_211(death_sig=signal.SIGTERM):
        return (death_sig,)

    def torch_213(death_sig=signal.SIGTERM, timeout=30):  # not a hang guard: torch's signature
        return (death_sig, timeout)

    assert _shutdown_under(monkeypatch, torch_211, False, signal.SIGTERM) == [(signal.SIGTERM,)]
    assert _shutdown_under(monkeypatch, torch_213, False, signal.SIGTERM, 45) == [
        (signal.SIGTERM, 45)
    ]
    assert _shutdown_under(monkeypatch, torch_211, True, signal.SIGTERM) == [(signal.SIGKILL,)]


def _agent_of(workers: int) -> agent.Agent:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    spec = WorkerSpec(role="trainer", local_world_size=workers, rdzv_handler=None,
                      entrypoint="python", args=())  # fmt: skip
    return agent.Agent(spec=spec, logs_specs=DefaultLogsSpecs(), node_rank=0, termination=None)


def test_the_workers_share_the_nodes_cpus_for_inductors_compile_pool(monkeypatch):
    """Left alone, each worker would start min(32, the node's CPUs) compile processes: 8
    workers on a 64-CPU node, 256. The agent gives its workers their share, and a value the job
    set (spec.env reaches the agent's environment) stands."""
    assert [agent.compile_threads(64, n) for n in (1, 2, 8)] == [32, 32, 8]
    assert agent.compile_threads(2, 2) == 1 and agent.compile_threads(4, 8) == 1
    for name in (agent.COMPILE_THREADS_ENV, contract.RESTARTS_IN_PLACE_ENV):
        monkeypatch.setenv(name, "")  # so that what the agents set is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(agent.os, "sched_getaffinity", lambda pid: set(range(96)))
    _agent_of(8)
    assert agent.os.environ[agent.COMPILE_THREADS_ENV] == "12"
    monkeypatch.setenv(agent.COMPILE_THREADS_ENV, "3")
    _agent_of(8)
    assert agent.os.environ[agent.COMPILE_THREADS_ENV] == "3"
