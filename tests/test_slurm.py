"""SLURM launch: task environment, ``cluster=slurm`` config, and real jobs on a local SLURM.

The tests that call ``require_slurm`` need a running SLURM controller: ``sudo scripts/slurm/start.sh``
starts one (one node; CI starts two with ``--nodes 2``, and these tests run on either, except the sdp
run, which needs the two). Run as root, they start it themselves where SLURM is installed; where it
is not (no slurmctld) they skip, saying so; ``PIPEFISHER_SKIP_SLURM=1`` skips them too
(``tests/slurm_harness.py``). Multi-node runs: tests/test_slurm_multinode.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipefisher.config import register_configs
from pipefisher.launch.slurm import (
    interface_towards,
    master_port_for_job,
    register_resolvers,
    slurm_task_env,
    task_hosts,
    tasks_on_node,
)
from tests.slurm_harness import (
    REPO,
    SUB_ENV,
    all_task_logs,
    array_jobs,
    job_records,
    losses,
    preempt,
    release_requeued,
    require_slurm,
    scontrol_job,
    shared_sweep,
    submitit_job_id,
    task_log,
    wait_for_rows,
)

CONF = REPO / "pipefisher" / "conf"


# --- the task environment, without a cluster ------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment without any SLURM, submitit or torchrun variable."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SUBMITIT_")) or k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    return monkeypatch


def _srun_task(mp: pytest.MonkeyPatch, procid: int, **extra: str) -> None:
    """Variables of task ``procid`` of a two-node, four-task srun step inside a submitit job."""
    env = dict(SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NTASKS="4",
               SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_STEP_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_PROCID=str(procid),
               SLURM_LOCALID=str(procid % 2), SLURM_NODEID=str(procid // 2))
    env.update(extra)
    for k, v in env.items():
        mp.setenv(k, v)


def test_tasks_on_node_expands_slurm_counts() -> None:
    assert tasks_on_node("4", 0) == 4
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="node index 2"):
        tasks_on_node("2(x2)", 2)


def test_task_hosts_follow_the_step_distribution() -> None:
    assert task_hosts("2(x2)", ["n1", "n2"]) == ["n1", "n1", "n2", "n2"]
    assert task_hosts("2(x2)", ["n1", "n2"], "cyclic") == ["n1", "n2", "n1", "n2"]
    assert task_hosts("1(x2)", ["n1", "n2"], "cyclic") == ["n1", "n2"]  # what sbatch --ntasks-per-node=1 reports
    assert task_hosts("3,1", ["n1", "n2"], "cyclic:block") == ["n1", "n2", "n1", "n1"]
    assert task_hosts("2", ["n1"], "plane=2") is None


def test_master_port_is_deterministic_and_in_range() -> None:
    assert master_port_for_job(4242) == master_port_for_job(4242) == 24242
    assert master_port_for_job(123_456) == 23456
    assert all(20000 <= master_port_for_job(j) < 40000 for j in (0, 1, 19_999, 20_000, 10**9 + 7))


def test_every_task_of_a_step_agrees_on_the_rendezvous(clean_env: pytest.MonkeyPatch) -> None:
    seen = []
    for procid in range(4):
        _srun_task(clean_env, procid)
        t = slurm_task_env()
        assert t is not None
        assert (t.rank, t.world_size, t.local_rank, t.local_world_size) == (procid, 4, procid % 2, 2)
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu07", str(master_port_for_job(4242)))
        seen.append((t.master_addr, t.master_port))
    assert len(set(seen)) == 1


def test_gloo_interface_is_the_one_routing_to_the_rendezvous_host(clean_env: pytest.MonkeyPatch) -> None:
    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("no-such-host.invalid") is None  # gloo's own choice then
    clean_env.delenv("GLOO_SOCKET_IFNAME", raising=False)
    _srun_task(clean_env, 0, SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost")
    slurm_task_env()
    assert os.environ["MASTER_ADDR"] == "localhost" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    clean_env.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the user's choice wins
    slurm_task_env()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


def test_array_tasks_get_different_ports(clean_env: pytest.MonkeyPatch) -> None:
    ports = set()
    for job_id, task_id in (("500", "0"), ("501", "1")):  # SLURM_JOB_ID of array 500's tasks
        _srun_task(clean_env, 0, SLURM_ARRAY_JOB_ID="500", SLURM_ARRAY_TASK_ID=task_id)
        clean_env.setenv("SLURM_JOB_ID", job_id)
        ports.add(slurm_task_env(set_environ=False).master_port)
    assert len(ports) == 2


def test_batch_script_and_one_task_steps_are_not_workers(clean_env: pytest.MonkeyPatch) -> None:
    assert slurm_task_env() is None  # no SLURM at all
    _srun_task(clean_env, 0)
    clean_env.delenv("SLURM_STEP_ID")  # the batch step: SLURM_NTASKS=4 but one process
    assert slurm_task_env() is None
    _srun_task(clean_env, 0, SLURM_STEP_NUM_TASKS="1")
    assert slurm_task_env() is None
    assert "MASTER_PORT" not in os.environ


# --- cluster=slurm config --------------------------------------------------------------------------


def _launcher(overrides: list[str]):
    register_configs()
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["cluster=slurm", *overrides], return_hydra_config=True)
    return cfg.hydra.launcher


def test_cluster_slurm_asks_one_task_per_worker() -> None:
    launcher = _launcher(["stages=2", "data_parallel=2"])
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == 4 and launcher.nodes == 1
    assert _launcher(["stages=4", "data_parallel=2", "cluster.nodes=2"]).tasks_per_node == 4
    assert _launcher(["stages=8", "data_parallel=2", "cluster.nodes=4"]).tasks_per_node == 4
    assert _launcher(["stages=4", "data_parallel=2", "hydra.launcher.nodes=2"]).tasks_per_node == 4


def test_cluster_keys_reach_the_launcher() -> None:
    launcher = _launcher(["stages=2", "data_parallel=2", "cluster.nodes=2", "cluster.partition=gpu",
                          "cluster.account=proj"])
    assert (launcher.nodes, launcher.tasks_per_node, launcher.partition, launcher.account) == (2, 2, "gpu", "proj")
    default = _launcher(["stages=2"])
    assert (default.nodes, default.partition, default.account) == (1, None, None)


def test_cluster_nodes_are_checked_before_workers_start() -> None:
    from pipefisher.config import ConfigError
    from tests.conftest import compose_train

    assert compose_train(["cluster=slurm", "cluster.nodes=2", "stages=2", "data_parallel=2"]).cluster.nodes == 2
    with pytest.raises(ConfigError, match=r"cluster.nodes.*cluster=slurm"):
        compose_train(["cluster.nodes=2", "stages=2"])  # cluster=local
    with pytest.raises(ConfigError, match=r"cluster.nodes.*stages\*data_parallel\*sdp\*tp=2 processes.*\[1, 2\]"):
        compose_train(["cluster=slurm", "cluster.nodes=4", "stages=2"])
    with pytest.raises(ConfigError, match=r"cluster.nodes"):
        compose_train(["cluster=slurm", "cluster.nodes=0", "stages=2"])


def test_lost_task_grace_and_progress_interval_are_checked() -> None:
    from pipefisher.config import ConfigError
    from tests.conftest import compose_train

    assert compose_train(["cluster=slurm", "stages=2"]).cluster.lost_task_grace_s == 10.0
    assert compose_train(["cluster=slurm", "stages=2", "cluster.lost_task_grace_s=0"]).cluster.lost_task_grace_s == 0
    with pytest.raises(ConfigError, match=r"cluster.lost_task_grace_s.*>= 0"):
        compose_train(["cluster=slurm", "stages=2", "cluster.lost_task_grace_s=-1"])
    assert compose_train(["cluster=slurm", "stages=2"]).cluster.progress_every_s == 10.0
    with pytest.raises(ConfigError, match=r"cluster.progress_every_s.*> 0"):
        compose_train(["cluster=slurm", "stages=2", "cluster.progress_every_s=0"])


def test_uneven_split_over_nodes_names_the_fix() -> None:
    launcher = _launcher(["stages=3", "cluster.nodes=2"])
    with pytest.raises(Exception, match=r"cluster.nodes=2: stages\*data_parallel\*sdp\*tp=3\*1\*1\*1=3 processes.*\[1, 3\]"):
        OmegaConf.to_container(launcher, resolve=True)


def test_cluster_slurm_asks_one_task_per_sdp_and_tp_process() -> None:
    # A pipeline worker is tp processes and each of its sdp replicas is a worker (TrainConfig.num_workers).
    assert _launcher(["stages=2", "sdp=2"]).tasks_per_node == 4
    assert _launcher(["stages=2", "sdp=2", "cluster.nodes=2"]).tasks_per_node == 2
    assert _launcher(["stages=2", "data_parallel=2", "sdp=2", "tp=2", "cluster.nodes=4"]).tasks_per_node == 4
    assert _launcher(["stages=1", "tp=2", "cluster.nodes=2"]).tasks_per_node == 1
    with pytest.raises(Exception, match=r"cluster.nodes=4: stages\*data_parallel\*sdp\*tp=1\*1\*1\*2=2 processes"):
        OmegaConf.to_container(_launcher(["tp=2", "cluster.nodes=4"]), resolve=True)


# --- a real SLURM cluster --------------------------------------------------------------------------


@pytest.mark.slow
def test_sbatch_runs_a_two_task_job(tmp_path: Path) -> None:
    up = require_slurm()
    out = tmp_path / "job.out"
    subprocess.run(["sbatch", "--wait", "--parsable", "-n", "2", "-t", "2", f"--output={out}",
                    "--wrap", "srun hostname"], check=True, cwd=tmp_path, env=SUB_ENV, timeout=120, capture_output=True)
    hosts = out.read_text().split()  # a node's hostname is its SLURM node name
    assert len(hosts) == 2 and hosts[0] == hosts[1] and hosts[0] in up, (hosts, up)


@pytest.mark.slow
def test_srun_tasks_get_their_worker_environment(tmp_path: Path) -> None:
    up = require_slurm()
    code = ("from pipefisher.launch.slurm import slurm_task_env as e; import os, socket; t = e(); "
            "print(t.rank, t.world_size, t.local_rank, t.local_world_size, os.environ['MASTER_ADDR'], "
            "os.environ['MASTER_PORT'], os.environ['SLURM_JOB_ID'], socket.gethostname())")
    res = subprocess.run(["srun", "-n", "2", "-t", "2", sys.executable, "-c", code], cwd=tmp_path, env=SUB_ENV,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    rows = sorted(line.split() for line in res.stdout.splitlines())
    assert [r[:4] for r in rows] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]
    job_id = int(rows[0][6])
    host = rows[0][7]  # both tasks on one node, whose first (only) host is the rendezvous
    assert host in up
    assert {tuple(r[4:]) for r in rows} == {(host, str(master_port_for_job(job_id)), str(job_id), host)}


@pytest.mark.slow
def test_sweep_runs_as_slurm_job_array_of_two_worker_pipelines(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The sweep `pipeline=gpipe,chimera steps=3` is shared with tests/test_slurm_sweep.py, which
    # checks what its launcher says (the same run: one submission per test session).
    require_slurm()
    run = shared_sweep(tmp_path_factory, "pipeline=gpipe,chimera", "steps=3")
    sweep = run.dir
    assert run.returncode == 0, f"{run.output[-3000:]}\n{all_task_logs(sweep, 2000)}"

    # One job array of two jobs, each with two SLURM tasks, both completed.
    job_dirs = array_jobs(sweep / ".submitit")
    array_id = job_dirs[0].split("_")[0]
    assert job_dirs == [f"{array_id}_0", f"{array_id}_1"], job_dirs
    records = job_records(array_id)
    assert sorted(r.get("ArrayTaskId") for r in records) == ["0", "1"], records
    for r in records:
        assert (r["ArrayJobId"], r["JobState"], r["NumTasks"]) == (array_id, "COMPLETED", "2"), r

    # Each array task was a two-worker pipeline: both of its SLURM tasks logged their rank and job id.
    for r in records:
        d = f"{array_id}_{r['ArrayTaskId']}"
        for rank in (0, 1):
            out = (sweep / ".submitit" / d / f"{d}_{rank}_log.out").read_text()
            assert f"SLURM task: SLURM_JOB_ID={r['JobId']} array={d} rank {rank}/2" in out, out[-2000:]

    # Both runs wrote three steps of metrics.
    methods = {}
    for num in ("0", "1"):
        run = sweep / num
        overrides = (run / ".hydra" / "overrides.yaml").read_text()
        methods[re.search(r"pipeline=(\w+)", overrides).group(1)] = run
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert steps == [0, 1, 2], steps
    assert set(methods) == {"gpipe", "chimera"}


# --- preemption: checkpoint on SLURM's signal, requeue, resume --------------------------------------


# Sixteen steps: the warning signal, sent once four steps are logged, is acted on at the end of a step
# (one step later when the machine is idle), leaving a dozen steps of margin for it to arrive before
# the last step. hardware.peak_tflops: no CPU peak measurement (MFU is not what these tests check).
PREEMPT_STEPS = 16
PREEMPT_RUN = ["model=bert-tiny", "stages=2", "pipeline=1f1b", f"steps={PREEMPT_STEPS}", "progress=false",
               "data.seq_len=32", "micro_batch_size=2", "num_micro_batches=2", "wandb.mode=offline", "device=cpu",
               "hardware.peak_tflops=0.2"]


class Uninterrupted:
    """Losses of PREEMPT_RUN trained straight through on this machine (no SLURM). :meth:`start` runs it
    in the background, once per module: the preemption tests start it after their job was requeued,
    while the requeued job starts (not while the signal is on its way: that has only a dozen tiny
    steps to arrive); :meth:`losses` waits for it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is None:
            with open(self.out / "train.out", "w") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, str(REPO / "train.py"), *PREEMPT_RUN, f"hydra.run.dir={self.out}"], cwd=self.out,
                    env=SUB_ENV, stdout=log, stderr=subprocess.STDOUT)

    def losses(self) -> list[float]:
        self.start()
        self.proc.wait(timeout=300)
        assert self.proc.returncode == 0, (self.out / "train.out").read_text()[-3000:]
        return [json.loads(line)["loss"] for line in (self.out / "metrics.jsonl").read_text().splitlines()]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Uninterrupted]:
    run = Uninterrupted(tmp_path_factory.mktemp("reference"))
    yield run
    run.stop()


def _check_resumed(log: str, metrics: Path, run_dir: Path, uninterrupted: Uninterrupted) -> None:
    stopped = int(re.search(r"stopped after step (\d+) of", log).group(1))
    assert 3 <= stopped < PREEMPT_STEPS - 1, log[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'}: continuing at step {stopped + 1}" in log
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(PREEMPT_STEPS))
    assert [r["loss"] for r in rows] == pytest.approx(uninterrupted.losses(), rel=1e-6)


@pytest.mark.slow
def test_preempted_submitit_job_checkpoints_requeues_and_resumes(tmp_path: Path, uninterrupted: Uninterrupted) -> None:
    # SLURM's warning signal (USR2, as sent before a time limit or a preemption) reaches the two
    # workers (SLURM tasks) of a running job mid-run. They finish the step and checkpoint it,
    # worker 0 requeues the job through submitit, and the requeued job resumes from the
    # checkpoint: every step's loss equals the uninterrupted run's.
    require_slurm()
    sweep = tmp_path / "sweep"
    launcher = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *PREEMPT_RUN, "hydra.launcher.timeout_min=5",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=SUB_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    alive = lambda: launcher.poll() is None  # noqa: E731
    job_id = None
    try:
        wait_for_rows(sweep / "0" / "metrics.jsonl", 4, alive)
        job_id = submitit_job_id(sweep)
        preempt(job_id, alive)
        uninterrupted.start()
        out, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            if job_id:
                subprocess.run(["scancel", job_id], check=False, timeout=30)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((sweep / ".submitit").glob("*/*_log.*")))
    assert launcher.returncode == 0, f"{out[-3000:]}\n{logs}"
    assert scontrol_job(job_id).get("Restarts") == "1"
    log = (sweep / "0" / "train.log").read_text()  # Hydra's job log, appended to by both attempts
    assert f"Requeued job {job_id}" in log
    _check_resumed(log, sweep / "0" / "metrics.jsonl", sweep / "0", uninterrupted)


@pytest.mark.slow
def test_preempted_batch_job_with_local_workers_requeues_and_resumes(tmp_path: Path,
                                                                     uninterrupted: Uninterrupted) -> None:
    # Without submitit: `sbatch --wrap "exec python train.py stages=2"` starts both workers as
    # local processes of the batch script. The signal reaches the launcher process only
    # (scancel --batch); it passes it on, the workers checkpoint, the launcher runs
    # `scontrol requeue`, and the requeued batch script resumes.
    require_slurm()
    run_dir = tmp_path / "run"
    cmd = shlex.join([sys.executable, str(REPO / "train.py"), *PREEMPT_RUN, f"hydra.run.dir={run_dir}"])
    job_id = subprocess.run(["sbatch", "--parsable", "-n1", "-c2", "-t5", f"--output={tmp_path / 'job.out'}",
                             "--open-mode=append", "--wrap", f"exec {cmd}"], cwd=tmp_path, env=SUB_ENV, check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    state = lambda: scontrol_job(job_id).get("JobState")  # noqa: E731
    try:
        wait_for_rows(run_dir / "metrics.jsonl", 4, lambda: state() in ("PENDING", "RUNNING", "CONFIGURING"))
        subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True, timeout=30)
        release_requeued(job_id, lambda: state() not in ("FAILED", "CANCELLED", "COMPLETED"))
        uninterrupted.start()
        deadline = time.monotonic() + 240
        while (now := state()) != "COMPLETED":  # one read per check: the job may complete between two
            assert now in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and time.monotonic() < deadline, \
                (tmp_path / "job.out").read_text()[-3000:]
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
    assert scontrol_job(job_id).get("Restarts") == "1"
    log = (run_dir / "train.log").read_text() + (tmp_path / "job.out").read_text()
    assert "requeueing SLURM job" in log
    _check_resumed(log, run_dir / "metrics.jsonl", run_dir, uninterrupted)


@dataclass(frozen=True)
class FaultRun:
    """A finished ``train.py -m cluster=slurm`` run with an injected fault: its sweep folder, the
    launcher's exit status (None: still running after 300 s, killed), stdout, stderr, and the seconds
    from its start to its end."""

    sweep: Path
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


FAULTS = {  # worker 1 fails at step 2: SIGKILLs itself, or raises
    "kill": ["fault.mode=kill", "fault.rank=1", "fault.step=2", "cluster.lost_task_grace_s=2"],
    "raise": ["fault.mode=raise", "fault.rank=1", "fault.step=2"],
}


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FaultRun]:
    """Both FAULTS runs, launched at the same time (two jobs, each of two SLURM tasks; each launcher
    in its own folder, timed from its own start): each test below checks its own."""
    require_slurm()
    procs = {}
    for fault, overrides in FAULTS.items():
        cwd = tmp_path_factory.mktemp(f"fault-{fault}")
        cmd = [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *PREEMPT_RUN, *overrides,
               "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={cwd / 'sweep'}"]
        with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
            procs[fault] = (cwd, time.monotonic(), subprocess.Popen(cmd, cwd=cwd, env=SUB_ENV, stdout=out, stderr=err))
    ended: dict[str, float] = {}
    deadline = time.monotonic() + 300
    while len(ended) < len(procs) and time.monotonic() < deadline:
        ended.update({f: time.monotonic() for f, (_, _, p) in procs.items() if f not in ended and p.poll() is not None})
        time.sleep(0.1)
    runs = {}
    for fault, (cwd, start, proc) in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        runs[fault] = FaultRun(cwd / "sweep", proc.returncode if fault in ended else None,
                               (cwd / "stdout").read_text(), (cwd / "stderr").read_text(),
                               ended.get(fault, time.monotonic()) - start)
    return runs


@pytest.mark.slow
def test_killed_worker_ends_the_slurm_job_and_the_launcher_promptly(fault_runs: dict[str, FaultRun]) -> None:
    # Worker 1 (SLURM task 1) SIGKILLs itself: it leaves no submitit result. Worker 0 sees the
    # closed connection, fails, and files task 1's result naming it, so that `train.py -m` ends
    # (this SLURM has no accounting for submitit to read the job's end from). Worker 0 waits
    # cluster.lost_task_grace_s for task 1's own result, which never comes: 2 s, not the default 10.
    require_slurm()
    res = fault_runs["kill"]
    sweep = res.sweep
    assert res.returncode is not None, f"the launcher still ran after 300 s\n{res.stderr[-3000:]}"
    assert res.returncode != 0
    assert res.seconds < 240
    job_id = submitit_job_id(sweep)
    log0 = task_log(sweep, job_id, 0)
    assert re.search(rf"task 1 of SLURM job {job_id} on \S+ ended without a result \(killed by a signal", log0), log0[-3000:]
    assert "injecting fault 'kill' on worker 1 at step 2" in task_log(sweep, job_id, 1)


@pytest.mark.slow
def test_exception_in_a_slurm_worker_reaches_the_launcher_with_its_traceback(fault_runs: dict[str, FaultRun]) -> None:
    require_slurm()
    res = fault_runs["raise"]
    assert res.returncode is not None, f"the launcher still ran after 300 s\n{res.stderr[-3000:]}"
    assert res.returncode != 0 and res.seconds < 240
    assert "--- SLURM task 1 failed:" in res.stderr and "injected fault on worker 1 at step 2" in res.stderr, res.stderr[-3000:]
    assert "Traceback" in res.stderr and "inject_fault" in res.stderr


# --- sharded data parallel: one SLURM task per process ----------------------------------------------


SDP_RUN = ["model=bert-tiny", "model.vocab_size=512", "data.seq_len=32", "data.max_predictions=5", "stages=2",
           "pipeline=1f1b", "sdp=2", "micro_batch_size=2", "num_micro_batches=2", "steps=3", "progress=false",
           "wandb.mode=disabled", "device=cpu", "hardware.peak_tflops=0.2"]


@pytest.mark.slow
def test_sdp_run_on_two_slurm_nodes_has_a_task_per_process_and_the_local_losses(tmp_path: Path) -> None:
    # stages=2 x sdp=2: four processes, so four SLURM tasks, two on each node (the launcher counted
    # stages x data_parallel = 2 before issue 27); the losses equal the same run's on this machine.
    require_slurm(min_nodes=2)
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", "cluster.nodes=2", *SDP_RUN,
           "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}"]
    # The same run on this machine, trained meanwhile (it waits for nothing of the job's).
    local = tmp_path / "local"
    with open(tmp_path / "local.out", "w") as log:
        local_run = subprocess.Popen([sys.executable, str(REPO / "train.py"), *SDP_RUN, f"hydra.run.dir={local}"],
                                     cwd=tmp_path, env=SUB_ENV, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            res = subprocess.run(cmd, cwd=tmp_path, env=SUB_ENV, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", submitit_job_id(sweep)], check=False, timeout=30)
            raise
        logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in sorted((sweep / ".submitit").glob("*/*_log.*")))
        assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}\n{logs}"
        job_id = submitit_job_id(sweep)
        script = (sweep / ".submitit" / job_id / f"{job_id}_submission.sh").read_text()
        assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=2\n" in script, script
        job = job_records(job_id)[0]
        assert (job["NumNodes"], job["NumTasks"], job["JobState"]) == ("2", "4", "COMPLETED"), job
        for rank in range(4):
            assert f"rank {rank}/4" in task_log(sweep, job_id, rank), task_log(sweep, job_id, rank)[-2000:]
        local_run.wait(timeout=300)
    finally:
        if local_run.poll() is None:
            local_run.kill()
            local_run.wait()
    assert local_run.returncode == 0, (tmp_path / "local.out").read_text()[-3000:]
    got, want = losses(sweep / "0" / "metrics.jsonl"), losses(local / "metrics.jsonl")
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-6), (got, want)
