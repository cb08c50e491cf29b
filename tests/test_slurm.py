"""SLURM launch: task environment, ``cluster=slurm`` config, and real jobs on a local SLURM.

The tests that call ``_require_slurm`` need a running SLURM controller: start the single-node
cluster with ``sudo scripts/slurm/start.sh`` (CI does, in ``.ci/run``). Without one they fail,
on purpose; on a developer machine without SLURM, ``PIPEFISHER_SKIP_SLURM=1`` skips them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipefisher.config import register_configs
from pipefisher.launch.slurm import (
    master_port_for_job,
    register_resolvers,
    slurm_task_env,
    tasks_on_node,
)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "pipefisher" / "conf"
START = "scripts/slurm/start.sh"
# Subprocesses (and the SLURM jobs, which inherit the environment) import this checkout, installed or not.
SUB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "WANDB_MODE": "offline"}


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
    assert _launcher(["stages=4", "data_parallel=2", "hydra.launcher.nodes=2"]).tasks_per_node == 4


def test_uneven_split_over_nodes_names_the_fix() -> None:
    launcher = _launcher(["stages=3", "hydra.launcher.nodes=2"])
    with pytest.raises(Exception, match=r"hydra.launcher.nodes=2.*stages\*data_parallel=3"):
        OmegaConf.to_container(launcher, resolve=True)


# --- a real SLURM cluster --------------------------------------------------------------------------


def _require_slurm() -> str:
    """The name of an up node of the SLURM cluster; fails the test (not skips) when there is none."""
    if os.environ.get("PIPEFISHER_SKIP_SLURM") == "1":
        pytest.skip("PIPEFISHER_SKIP_SLURM=1")
    if shutil.which("sinfo") is None:
        pytest.fail(f"SLURM is not installed (no sinfo on PATH): run `sudo {START}` first "
                    "(or set PIPEFISHER_SKIP_SLURM=1 on a machine without SLURM)", pytrace=False)
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SLURM controller does not answer: run `sudo {START}`", pytrace=False)
    nodes = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    up = [n for n, state in nodes.items() if state in ("idle", "mix", "alloc")]
    if out.returncode or not up:
        pytest.fail(f"the SLURM controller does not answer or no node is up ({out.stderr.strip() or nodes}): "
                    f"run `sudo {START}`", pytrace=False)
    return up[0]


@pytest.mark.slow
def test_sbatch_runs_a_two_task_job(tmp_path: Path) -> None:
    slurm = _require_slurm()
    out = tmp_path / "job.out"
    subprocess.run(["sbatch", "--wait", "--parsable", "-n", "2", "-t", "2", f"--output={out}",
                    "--wrap", "srun hostname"], check=True, cwd=tmp_path, env=SUB_ENV, timeout=120, capture_output=True)
    assert out.read_text().split() == [slurm, slurm]


@pytest.mark.slow
def test_srun_tasks_get_their_worker_environment(tmp_path: Path) -> None:
    slurm = _require_slurm()
    code = ("from pipefisher.launch.slurm import slurm_task_env as e; import os; t = e(); "
            "print(t.rank, t.world_size, t.local_rank, t.local_world_size, os.environ['MASTER_ADDR'], "
            "os.environ['MASTER_PORT'], os.environ['SLURM_JOB_ID'])")
    res = subprocess.run(["srun", "-n", "2", "-t", "2", sys.executable, "-c", code], cwd=tmp_path, env=SUB_ENV,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    rows = sorted(line.split() for line in res.stdout.splitlines())
    assert [r[:4] for r in rows] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]
    job_id = int(rows[0][6])
    assert {tuple(r[4:]) for r in rows} == {(slurm, str(master_port_for_job(job_id)), str(job_id))}


def _array_jobs(submitit_dir: Path) -> list[str]:
    """submitit's per-job folders ``<array job id>_<task id>`` (``<id>/`` holds the batch script)."""
    if not submitit_dir.exists():
        return []
    return sorted(p.name for p in submitit_dir.iterdir() if p.is_dir() and re.fullmatch(r"\d+_\d+", p.name))


def _job_records(job_id: str, timeout_s: float = 60) -> list[dict[str, str]]:
    """``scontrol show job`` records of ``job_id`` (one per array task) once all have ended.

    Hydra returns when submitit has the results; the SLURM job may still be completing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        records = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.stdout.splitlines()]
        if (records and all(r.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for r in records)) \
                or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


@pytest.mark.slow
def test_sweep_runs_as_slurm_job_array_of_two_worker_pipelines(tmp_path: Path) -> None:
    _require_slurm()
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", "model=bert-tiny", "stages=2",
           "pipeline=gpipe,chimera", "steps=3", "progress=false", "wandb.mode=offline", "data.seq_len=32",
           "micro_batch_size=2", "num_micro_batches=2", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}"]
    try:
        res = subprocess.run(cmd, cwd=tmp_path, env=SUB_ENV, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        ids = sorted({d.split("_")[0] for d in _array_jobs(sweep / ".submitit")})
        subprocess.run(["scancel", *ids], check=False, timeout=30)
        raise
    logs = sorted((sweep / ".submitit").glob("*/*_log.*"))
    tails = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in logs)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}\n{tails}"

    # One job array of two jobs, each with two SLURM tasks, both completed.
    job_dirs = _array_jobs(sweep / ".submitit")
    array_id = job_dirs[0].split("_")[0]
    assert job_dirs == [f"{array_id}_0", f"{array_id}_1"], job_dirs
    records = _job_records(array_id)
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


def _scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


PREEMPT_STEPS = 30
PREEMPT_RUN = ["model=bert-tiny", "stages=2", "pipeline=1f1b", f"steps={PREEMPT_STEPS}", "progress=false",
               "data.seq_len=32", "micro_batch_size=2", "num_micro_batches=2", "wandb.mode=offline"]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Losses of PREEMPT_RUN trained straight through on this machine (no SLURM)."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, str(REPO / "train.py"), *PREEMPT_RUN, f"hydra.run.dir={out}"], cwd=out,
                   env=SUB_ENV, check=True, capture_output=True, timeout=300)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _wait_for_rows(metrics: Path, rows: int, alive: Callable[[], bool], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert alive() and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)


def _release_requeued(job_id: str, alive: Callable[[], bool], timeout_s: float = 120) -> None:
    """Wait until SLURM requeued ``job_id``, then let it start now (SLURM holds a requeued job back
    for about two minutes through its BeginTime). Not in the second of the requeue: slurmd compares
    the new launch credential with the old one's revocation time in whole seconds and would refuse
    it ("Job credential revoked")."""
    deadline = time.monotonic() + timeout_s
    while (info := _scontrol_job(job_id)).get("Restarts", "0") == "0" or info.get("JobState") != "PENDING":
        assert alive() and time.monotonic() < deadline, f"job {job_id} was not requeued: {info}"
        time.sleep(0.2)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)


def _check_resumed(log: str, metrics: Path, run_dir: Path, uninterrupted: list[float]) -> None:
    stopped = int(re.search(r"stopped after step (\d+) of", log).group(1))
    assert 3 <= stopped < PREEMPT_STEPS - 1, log[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'}: continuing at step {stopped + 1}" in log
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(PREEMPT_STEPS))
    assert [r["loss"] for r in rows] == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.slow
def test_preempted_submitit_job_checkpoints_requeues_and_resumes(tmp_path: Path, uninterrupted_losses: list[float]) -> None:
    # SLURM's warning signal (USR2, as sent before a time limit or a preemption) reaches the two
    # workers (SLURM tasks) of a running job mid-run. They finish the step and checkpoint it,
    # worker 0 requeues the job through submitit, and the requeued job resumes from the
    # checkpoint: every step's loss equals the uninterrupted run's.
    _require_slurm()
    sweep = tmp_path / "sweep"
    launcher = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *PREEMPT_RUN, "hydra.launcher.timeout_min=5",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=SUB_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    alive = lambda: launcher.poll() is None  # noqa: E731
    job_id = None
    try:
        _wait_for_rows(sweep / "0" / "metrics.jsonl", 4, alive)
        job_id = next(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and d.name.isdigit())
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        _release_requeued(job_id, alive)
        out, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            if job_id:
                subprocess.run(["scancel", job_id], check=False, timeout=30)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((sweep / ".submitit").glob("*/*_log.*")))
    assert launcher.returncode == 0, f"{out[-3000:]}\n{logs}"
    assert _scontrol_job(job_id).get("Restarts") == "1"
    log = (sweep / "0" / "train.log").read_text()  # Hydra's job log, appended to by both attempts
    assert f"Requeued job {job_id}" in log
    _check_resumed(log, sweep / "0" / "metrics.jsonl", sweep / "0", uninterrupted_losses)


@pytest.mark.slow
def test_preempted_batch_job_with_local_workers_requeues_and_resumes(tmp_path: Path,
                                                                     uninterrupted_losses: list[float]) -> None:
    # Without submitit: `sbatch --wrap "exec python train.py stages=2"` starts both workers as
    # local processes of the batch script. The signal reaches the launcher process only
    # (scancel --batch); it passes it on, the workers checkpoint, the launcher runs
    # `scontrol requeue`, and the requeued batch script resumes.
    _require_slurm()
    run_dir = tmp_path / "run"
    cmd = shlex.join([sys.executable, str(REPO / "train.py"), *PREEMPT_RUN, f"hydra.run.dir={run_dir}"])
    job_id = subprocess.run(["sbatch", "--parsable", "-n1", "-c2", "-t5", f"--output={tmp_path / 'job.out'}",
                             "--open-mode=append", "--wrap", f"exec {cmd}"], cwd=tmp_path, env=SUB_ENV, check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    state = lambda: _scontrol_job(job_id).get("JobState")  # noqa: E731
    try:
        _wait_for_rows(run_dir / "metrics.jsonl", 4, lambda: state() in ("PENDING", "RUNNING", "CONFIGURING"))
        subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True, timeout=30)
        _release_requeued(job_id, lambda: state() not in ("FAILED", "CANCELLED", "COMPLETED"))
        deadline = time.monotonic() + 240
        while state() != "COMPLETED":
            assert state() in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and time.monotonic() < deadline, \
                (tmp_path / "job.out").read_text()[-3000:]
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
    assert _scontrol_job(job_id).get("Restarts") == "1"
    log = (run_dir / "train.log").read_text() + (tmp_path / "job.out").read_text()
    assert "requeueing SLURM job" in log
    _check_resumed(log, run_dir / "metrics.jsonl", run_dir, uninterrupted_losses)


@pytest.mark.slow
def test_killed_worker_ends_the_slurm_job_and_the_launcher_promptly(tmp_path: Path) -> None:
    # Worker 1 (SLURM task 1) SIGKILLs itself: it leaves no submitit result. Worker 0 sees the
    # closed connection, fails, and files task 1's result naming it, so that `train.py -m` ends
    # (this SLURM has no accounting for submitit to read the job's end from).
    _require_slurm()
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *PREEMPT_RUN, "fault.mode=kill", "fault.rank=1",
         "fault.step=2", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=SUB_ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert time.monotonic() - start < 240
    job_id = next(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and d.name.isdigit())
    log0 = "".join(p.read_text() for p in (sweep / ".submitit" / job_id).glob(f"{job_id}_0_log.*"))
    assert f"task 1 of SLURM job {job_id} ended without a result (killed by a signal" in log0
    log1 = "".join(p.read_text() for p in (sweep / ".submitit" / job_id).glob(f"{job_id}_1_log.*"))
    assert "injecting fault 'kill' on worker 1 at step 2" in log1


@pytest.mark.slow
def test_exception_in_a_slurm_worker_reaches_the_launcher_with_its_traceback(tmp_path: Path) -> None:
    _require_slurm()
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *PREEMPT_RUN, "fault.mode=raise", "fault.rank=1",
         "fault.step=2", "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=tmp_path, env=SUB_ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and time.monotonic() - start < 240
    assert "--- SLURM task 1 failed:" in res.stderr and "injected fault on worker 1 at step 2" in res.stderr, res.stderr[-3000:]
    assert "Traceback" in res.stderr and "inject_fault" in res.stderr
