"""`ftjob run` as a person sees it: on a terminal (a pseudo-terminal), in a pipe, on failure,
and on Ctrl-C typed at the terminal. Each test asserts on the screen's text.

python -m pytest tests/e2e/test_run_display.py -q
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import hangs
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def tiny_job(tmp_path: Path, name: str, **training) -> Path:
    """examples/tiny.yaml with its sources made absolute and ``training`` changed."""
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"]["name"] = name
    for key in ("model", "dataset"):
        doc["spec"][key]["source"] = str(ROOT / "examples" / doc["spec"][key]["source"])
    doc["spec"]["training"].update(training)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Terminal:
    """`ftjob ...` on a pseudo-terminal of 120x40, as from an interactive shell: the process
    leads its own session with the terminal as controlling tty, so ^C typed here sends SIGINT
    to its foreground process group, as a real terminal does."""

    def __init__(self, *args: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
        env.pop("NO_COLOR", None)
        env["TERM"] = "xterm-256color"
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes ftjob
            os.execve(sys.executable, [sys.executable, "-m", "ftjob", *args], env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.raw = b""

    def read(self, until: str | None = None, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until is not None and until in self.text():
                break
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            self.raw += chunk
        return self.text()

    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace")).replace("\r", "\n")

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read(timeout=0.5)  # not a hang guard: one read of a poll
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"ftjob did not exit:\n{self.text()[-3000:]}")


def trainer_pids(workdir: Path) -> list[int]:
    """Live processes started for this job folder (torchrun agents and ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        if f"FTJOB_JOB_DIR={workdir}".encode() in env.split(b"\0") and proc.name.isdigit():
            pids.append(int(proc.name))
    return pids


def test_a_terminal_gets_a_live_bar_and_a_line_per_checkpoint(tmp_path):
    job = tiny_job(tmp_path, "shown", maxSteps=60)
    term = Terminal("run", str(job), "--workdir", str(tmp_path / "shown"))
    code = term.wait(timeout=hangs.RUN)
    screen = term.text()
    assert code == 0, screen[-3000:]
    # The bar: phase, steps done of the total, loss, tokens/s and ETA, redrawn as it goes.
    frames = re.findall(
        r"training .*? (\d+)/60 +loss [\d.]+ +tok/s [\d,]+ +eta \d:\d\d:\d\d", screen
    )
    assert frames, screen[-3000:]
    # Start-up says what it is doing, not a bare "starting 0/?": the imports with their
    # seconds first, then the trainer's own start-up phases.
    assert re.search(r"starting .*importing torch and the trainer \(\d+ s\)", screen), screen
    assert re.search(r"(preparing-data|loading) .*(data: \w+|loading the model)", screen), screen
    # Checkpoint and evaluation lines stay on screen above the bar.
    checkpoints = tmp_path / "shown" / "checkpoints"
    assert f"checkpoint saved: step 20 in {checkpoints / 'step-00000020'}" in screen, screen
    assert "checkpoint saved: step 40 in " in screen
    assert "eval  step 60/60" in screen
    assert f"the exported model is in {tmp_path / 'shown' / 'model'}" in screen
    # Warnings and the other node's output go to the logs, not to the screen.
    assert "Warning" not in screen and "W1" not in screen
    logs = tmp_path / "shown" / "logs"
    assert "step 60/60" in (logs / "node-0.log").read_text()
    assert (logs / "node-1.log").exists()


def assert_start_up_said_and_kept(stdout: str, workdir: Path) -> None:
    """Rank 0 says its start-up once, phase by phase, and progress.json keeps the figures."""
    from ftjob.trainer.report.startup import PHASES

    said = re.findall(r"^start-up ([\d.]+) s: (.*)$", stdout, re.M)
    assert len(said) == 1, stdout
    total, listed = float(said[0][0]), [p.rsplit(" ", 1) for p in said[0][1].split(", ")]
    assert [name for name, _ in listed] == list(PHASES)
    # Each figure is rounded to 0.1 s: the sum is the total within the rounding.
    assert abs(sum(float(s) for _, s in listed) - total) <= 0.05 * (len(PHASES) + 1)
    kept = json.loads((workdir / "progress.json").read_text())["startup"]
    assert list(kept["phases"]) == list(PHASES) and kept["seconds"] == pytest.approx(
        total, abs=0.06
    )
    assert sum(kept["phases"].values()) == pytest.approx(kept["seconds"], abs=0.01 * len(PHASES))
    # The phases that always work took time; the others may round to 0.00 s (the tiny job
    # downloads nothing, reads 0.00 GiB of weights and resumes from no checkpoint).
    assert all(kept["phases"][p] >= 0 for p in PHASES), kept
    assert all(kept["phases"][p] > 0 for p in ("imports", "data", "shard", "first step")), kept


@pytest.mark.slow  # tests/deadline.py: a terminal's run is the core's; Ctrl-C is
# test_trainer_run's and test_recovery's too
def test_ctrl_c_stops_quietly_and_the_command_again_in_a_pipe_resumes_where_it_said(tmp_path):
    """^C at the terminal stops the run quietly and names the checkpoint to resume from; the
    same command again, in a pipe, gets plain lines and resumes from that checkpoint."""
    job = tiny_job(tmp_path, "stopped", maxSteps=3000, logEvery=50)
    workdir = tmp_path / "stopped"
    term = Terminal("run", str(job), "--workdir", str(workdir))
    term.read(until="checkpoint saved: step 20 in", timeout=hangs.RUN)
    assert "checkpoint saved: step 20 in" in term.text(), term.text()[-3000:]
    assert trainer_pids(workdir)
    term.type(b"\x03")  # ^C at the terminal: SIGINT to the foreground process group
    code = term.wait(timeout=60)
    screen = term.text()
    after = screen[screen.index("checkpoint saved: step 20 in") :]
    assert code == 130, screen[-3000:]
    assert "interrupted; every process stopped" in after
    hint = re.search(r"Run the same command again to resume from the newest checkpoint in "
                     r"(\S+) \(step (\d+)\)", after)  # fmt: skip
    assert hint and hint[1] == str(workdir / "checkpoints") and int(hint[2]) >= 20, after
    for noise in ("Traceback", "death signal", "SIGTERM", "KeyboardInterrupt", "W1"):
        assert noise not in after, after
    assert trainer_pids(workdir) == []
    resumed_in_a_pipe(tmp_path, workdir, int(hint[2]))


def resumed_in_a_pipe(tmp_path: Path, workdir: Path, saved: int) -> None:
    """The command again, in a pipe, told to stop 20 steps after the checkpoint ``saved``
    (training.maxSteps may change between runs of a job)."""
    total = saved + 20
    job = tiny_job(tmp_path, "stopped", maxSteps=total)
    cmd = [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(workdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTJOB_PROGRESS_PORT": "0"}
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=hangs.RUN)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "\x1b[" not in again.stdout and "\r" not in again.stdout  # no bar in a pipe
    checkpoint = workdir / "checkpoints" / f"step-{saved:08d}"
    assert f"resuming from checkpoint {checkpoint} (step {saved})" in again.stdout
    assert f"step {total}/{total}" in again.stdout
    assert f"step {5:>{len(str(total))}}/{total}" not in again.stdout  # nothing trained twice
    assert_start_up_said_and_kept(again.stdout, workdir)


def test_a_gpu_job_on_a_machine_without_enough_gpus_is_refused_at_once(tmp_path):
    job = ROOT / "examples" / "llama3-8b-lora-efa.yaml"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(tmp_path / "gpu")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"ftjob run: {job}: needs ") and "GPUs" in first
    assert "resources.gpusPerNode: 0" in first and "kubectl apply" in first
    # The CPU variant it suggests must pass the rules: it names what else has to change.
    assert first.endswith("(then also change network.fabric, resources.gpuType)"), first
    assert len(result.stdout.splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "gpu").exists()  # nothing started, nothing written
    assert time.monotonic() - started < 60


def test_a_failure_is_summarised_first_with_node_rank_cause_fix_and_log(tmp_path):
    """Bad data, a permanent failure: summarised first, and not restarted in place."""
    # Parquet: read by the trainer itself (ftjob run reads JSON lines, JSON and CSV first)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}], None]}), bad)
    job = tiny_job(tmp_path, "broken")
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["dataset"]["source"] = str(bad)
    job.write_text(yaml.safe_dump(doc))
    workdir = tmp_path / "broken"
    result = subprocess.run(
        [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=hangs.RUN,
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    summary = next(i for i, x in enumerate(lines) if x.startswith("ftjob run: node "))
    headline = lines[summary]
    assert re.match(r"ftjob run: node \d \(rank \d\) failed: BadData: ", headline), headline
    assert f"{bad} record 2" in headline
    assert lines[summary + 1].startswith("  fix: ") and "spec.dataset.source" in lines[summary + 1]
    log = lines[summary + 2].removeprefix("  full log: ")
    assert log.startswith(str(workdir / "logs" / "node-")) and Path(log).exists()
    assert "record 2" in Path(log).read_text()
    # Before the summary: only the start line and rank 0's own lines, no traceback.
    assert "Traceback" not in result.stdout and summary <= 4, result.stdout
    # Retrying on the same nodes cannot fix the data: the agents say so and restart nothing.
    logs = "".join(p.read_text() for p in (workdir / "logs").glob("node-*.log"))
    assert "retrying on these nodes cannot help, so no restart in place" in logs
    assert "restarting the workers" not in logs and "restart 1 of" not in logs


def test_a_job_the_plan_says_will_not_fit_ends_at_once_in_one_attempt_with_the_figures(tmp_path):
    """resources.memory far below the plan's peak (issue 73): every rank plans the job from the
    model's config.json before the data or the weights and refuses it as WillNotFit, a
    permanent failure: the plan's figures and fits-with first, nothing prepared, no restart."""
    job = tiny_job(tmp_path, "small")
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["resources"]["memory"] = "300Mi"
    job.write_text(yaml.safe_dump(doc))
    workdir = tmp_path / "small"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "ftjob", "run", str(job), "--workdir", str(workdir)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=hangs.RUN,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    summary = next(i for i, x in enumerate(lines) if x.startswith("ftjob run: node "))
    assert re.match(
        r"ftjob run: node \d \(rank \d\) failed: WillNotFit: WILL NOT FIT: 2\.5 GiB "
        r"of 300\.0 MiB CPU memory per pod \(peak while preparing",
        lines[summary],
    )
    assert lines[summary + 1].startswith("  fix: set resources.memory: 3Gi "), lines[summary + 1]
    logs = "".join(p.read_text() for p in (workdir / "logs").glob("node-*.log"))
    assert "retrying on these nodes cannot help, so no restart in place" in logs
    assert "restarting the workers" not in logs
    assert not (workdir / "data").exists()  # refused before the data was prepared
    assert time.monotonic() - started < 60
