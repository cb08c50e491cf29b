"""Pipeline workers spread over two SLURM nodes (issue 17), on a real SLURM cluster of two nodes.

``sudo scripts/slurm/start.sh --nodes 2`` (``.ci/run`` does) runs each node's slurmd in its own
network and UTS namespace: the workers of a two-node job live on two hosts with their own names and
addresses, and reach each other only over the bridge between them, as on a real cluster. The
module fixture starts the two nodes once (as root) when fewer are up, and every test shares them
(skipped where SLURM is not installed: ``tests/slurm_harness.py``).

The reference of every run is single-process training of the same model and samples (dropout
off), computed in this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import compose_train
from tests.reference import train_single_process
from tests.slurm_harness import (
    REPO,
    START,
    SUB_ENV,
    all_task_logs,
    losses,
    preempt,
    require_slurm,
    scontrol_job,
    submitit_job_id,
    task_log,
    wait_for_rows,
)

pytestmark = pytest.mark.slow

# bert-tiny on 32-token sequences, no dropout: the same tiny run as the other SLURM tests. No CPU peak
# measurement (hardware.peak_tflops) and no W&B run: neither is what these tests check (tests/test_slurm.py
# runs SLURM jobs with both).
RUN = ["model=bert-tiny", "model.vocab_size=512", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
       "data.seq_len=32", "data.max_predictions=5", "micro_batch_size=2", "num_micro_batches=2", "progress=false",
       "device=cpu", "hardware.peak_tflops=0.2"]
SLURM = ["-m", "cluster=slurm", "cluster.nodes=2", "wandb.mode=disabled", "hydra.launcher.timeout_min=5"]
TASK_LINE = re.compile(r"SLURM task: SLURM_JOB_ID=(\d+) \S+ rank (\d+)/(\d+) \(local (\d+)/(\d+)\) on host (\S+) "
                       r"\(node (\S+)\), rendezvous (\S+):(\d+), gloo interface (\S+)")


@pytest.fixture(scope="module")
def two_nodes() -> list[str]:
    """The up nodes (at least two). Starts the two-node cluster when fewer nodes are up, SLURM is
    installed and this runs as root; skips where SLURM is not installed (``slurm_harness.slurm_plan``)."""
    return require_slurm(min_nodes=2)


def _single_process_losses(out: Path, overrides: list[str], data_parallel: int = 1) -> list[float]:
    """Losses of ``RUN + overrides`` trained in this process (metrics in ``out``): one stage, one
    replica, and all ``num_micro_batches x data_parallel`` micro-batches of a step accumulated."""
    cfg = compose_train(RUN + overrides, tiny=False)
    single = dataclasses.replace(cfg, stages=1, data_parallel=1,
                                 num_micro_batches=cfg.num_micro_batches * data_parallel,
                                 pipeline=dataclasses.replace(cfg.pipeline, method="gpipe"))
    train_single_process(single, output_dir=out)
    return losses(out / "metrics.jsonl")


def _train(sweep: Path, overrides: list[str], script: str = "train.py") -> subprocess.Popen:
    """Start ``script -m cluster=slurm cluster.nodes=2 …`` (the launcher) with its output in
    ``<sweep>.log`` (a file: a pipe nobody reads while the test waits could fill up)."""
    cmd = [sys.executable, str(REPO / script), *SLURM, *RUN, *overrides, f"hydra.sweep.dir={sweep}"]
    with open(f"{sweep}.log", "w") as out:
        return subprocess.Popen(cmd, cwd=sweep.parent, env=SUB_ENV, stdout=out, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, sweep: Path, timeout_s: float = 300) -> tuple[int, str]:
    """Wait for a launcher; on a time-out kill it and cancel its job. Returns (exit status, output)."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for d in (sweep / ".submitit").glob("*"):
            if d.name.isdigit():
                subprocess.run(["scancel", d.name], check=False, timeout=30)
        raise AssertionError(f"launcher still running after {timeout_s} s\n"
                             f"{Path(f'{sweep}.log').read_text()[-3000:]}\n{all_task_logs(sweep)}")
    return proc.returncode, Path(f"{sweep}.log").read_text()


def _placement(sweep: Path, job_id: str, workers: int) -> list[dict[str, str]]:
    """Each worker's line ``SLURM task: … on host H (node N), rendezvous A:P, gloo interface I``
    (the last one when a requeued job logged twice), by rank."""
    rows = []
    for task in range(workers):
        found = TASK_LINE.findall(task_log(sweep, job_id, task))
        assert found, f"task {task} logged no SLURM task line:\n{task_log(sweep, job_id, task)[-3000:]}"
        job, rank, world, local, local_world, host, node, addr, port, ifname = found[-1]
        assert (job, int(rank), int(world)) == (job_id, task, workers), found[-1]
        rows.append(dict(local=int(local), local_world=int(local_world), host=host, node=node, addr=addr,
                         port=port, ifname=ifname))
    return rows


def _first_host(job_id: str) -> str:
    """The first host of the job's node list, as ``scontrol show hostnames`` expands it."""
    nodelist = scontrol_job(job_id)["NodeList"]
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True,
                          timeout=30).stdout.split()[0]


def _check_spread(rows: list[dict[str, str]], per_node: int, nodes: list[str], job_id: str) -> None:
    """Workers 0..k-1 on one node, k..2k-1 on another; local ranks count per node; all rendezvous at
    the first host of the job's node list over a network interface, not loopback."""
    hosts = [r["host"] for r in rows]
    assert hosts == [hosts[0]] * per_node + [hosts[per_node]] * per_node and hosts[0] != hosts[per_node], hosts
    assert set(hosts) <= set(nodes) and all(r["host"] == r["node"] for r in rows), rows  # hostname = node name
    assert [(r["local"], r["local_world"]) for r in rows] == [(i, per_node) for i in range(per_node)] * 2, rows
    first = _first_host(job_id)
    assert {(r["addr"], r["port"]) for r in rows} == {(first, rows[0]["port"])} and first == hosts[0], rows
    assert {r["ifname"] for r in rows} == {"eth0"}, rows  # the node's bridge interface


def test_chimera_on_two_nodes_one_task_each_equals_single_process(two_nodes: list[str], tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _train(sweep, ["pipeline=chimera", "stages=2", "steps=3"])
    expected = _single_process_losses(tmp_path, ["pipeline=chimera", "stages=2", "steps=3"])  # while the job runs
    code, out = _finish(proc, sweep)
    assert code == 0, f"{out[-3000:]}\n{all_task_logs(sweep)}"
    job_id = submitit_job_id(sweep)
    script = (sweep / ".submitit" / job_id / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=1\n" in script, script
    job = scontrol_job(job_id)
    assert (job["NumNodes"], job["NumTasks"]) == ("2", "2"), job
    _check_spread(_placement(sweep, job_id, 2), 1, two_nodes, job_id)
    assert losses(sweep / "0" / "metrics.jsonl") == pytest.approx(expected, rel=1e-6)


def test_four_workers_on_two_nodes_two_tasks_each_equal_single_process(two_nodes: list[str], tmp_path: Path) -> None:
    # 1f1b D=2 x data_parallel 2: four SLURM tasks, two per node; local ranks 0 and 1 on each.
    # The partition and the account go to sbatch as on a real cluster (this one has no accounting
    # that checks the account).
    sweep = tmp_path / "sweep"
    run = ["pipeline=1f1b", "stages=2", "data_parallel=2", "steps=3"]
    proc = _train(sweep, [*run, "cluster.partition=debug", "cluster.account=pf-ci"])
    expected = _single_process_losses(tmp_path, run, data_parallel=2)  # while the job runs
    code, out = _finish(proc, sweep)
    assert code == 0, f"{out[-3000:]}\n{all_task_logs(sweep)}"
    job_id = submitit_job_id(sweep)
    script = (sweep / ".submitit" / job_id / f"{job_id}_submission.sh").read_text()
    for flag in ("--nodes=2", "--ntasks-per-node=2", "--partition=debug", "--account=pf-ci"):
        assert f"#SBATCH {flag}\n" in script, script
    job = scontrol_job(job_id)
    assert (job["NumNodes"], job["NumTasks"], job["Partition"], job["Account"]) == ("2", "4", "debug", "pf-ci"), job
    _check_spread(_placement(sweep, job_id, 4), 2, two_nodes, job_id)
    assert losses(sweep / "0" / "metrics.jsonl") == pytest.approx(expected, rel=1e-6)


PREEMPT_STEPS = 16  # the signal, sent once four steps are logged, has a dozen steps to arrive before the last


def test_preemption_with_tasks_on_both_nodes_checkpoints_requeues_and_resumes(two_nodes: list[str],
                                                                              tmp_path: Path) -> None:
    # SLURM's warning signal reaches both workers, one on each node; they checkpoint the step they
    # finish, worker 0 requeues the job, and the requeued job (again over two nodes) resumes: every
    # step's loss equals single-process training's.
    sweep = tmp_path / "sweep"
    run = ["pipeline=chimera", "stages=2", f"steps={PREEMPT_STEPS}"]
    proc = _train(sweep, run)
    alive = lambda: proc.poll() is None  # noqa: E731
    job_id = None
    try:
        wait_for_rows(sweep / "0" / "metrics.jsonl", 4, alive)
        job_id = submitit_job_id(sweep)
        preempt(job_id, alive)
        expected = _single_process_losses(tmp_path, run)  # while the requeued job starts
    finally:
        code, out = _finish(proc, sweep)
    assert code == 0, f"{out[-3000:]}\n{all_task_logs(sweep)}"
    assert scontrol_job(job_id).get("Restarts") == "1"
    # Both attempts ran one worker on each node (each task's log holds both attempts' lines).
    for attempt in (0, 1):
        hosts = [TASK_LINE.findall(task_log(sweep, job_id, t))[attempt][5] for t in (0, 1)]
        assert hosts[0] != hosts[1] and set(hosts) <= set(two_nodes), (attempt, hosts)
    log = (sweep / "0" / "train.log").read_text()  # Hydra's job log, appended to by both attempts
    assert f"Requeued job {job_id}" in log
    stopped = int(re.search(r"stopped after step (\d+) of", log).group(1))
    assert 3 <= stopped < PREEMPT_STEPS - 1, log[-3000:]
    assert f"resumed from {sweep / '0' / 'checkpoints' / f'step_{stopped}'}: continuing at step {stopped + 1}" in log
    rows = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(PREEMPT_STEPS))
    assert [r["loss"] for r in rows] == pytest.approx(expected, rel=1e-6)


def test_profile_on_two_nodes_records_each_workers_own_host(two_nodes: list[str], tmp_path: Path) -> None:
    # Each worker's hostname is its own (gathered by rank 0, issue 15): in profile.sqlite's worker
    # and host tables, and in timeline.json's process names.
    sweep = tmp_path / "sweep"
    code, out = _finish(_train(sweep, ["pipeline=chimera", "stages=2"], script="profile.py"), sweep)
    assert code == 0, f"{out[-3000:]}\n{all_task_logs(sweep)}"
    job_id = submitit_job_id(sweep)
    hosts = [r["host"] for r in _placement(sweep, job_id, 2)]
    assert hosts[0] != hosts[1], hosts
    with sqlite3.connect(sweep / "0" / "profile.sqlite") as db:
        recorded = db.execute("SELECT worker, host FROM PIPEFISHER_WORKERS ORDER BY worker").fetchall()
        host_rows = {h for (h,) in db.execute("SELECT host FROM PIPEFISHER_HOSTS")}
    assert recorded == [(0, hosts[0]), (1, hosts[1])]
    assert host_rows == set(hosts)
    trace = json.loads((sweep / "0" / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert sorted(names) == [0, 1] and all(f" on {hosts[w]}," in names[w] for w in (0, 1)), names


def test_a_node_that_dies_mid_run_ends_the_job_promptly_naming_the_lost_task(two_nodes: list[str],
                                                                             tmp_path: Path) -> None:
    # Every process of the node running worker 1 (its slurmd, slurmstepd and the worker) is killed,
    # as when a node fails. Worker 0 sees the connection close, fails, and files worker 1's result
    # naming the task and its node, so that `train.py -m` ends (this SLURM keeps no accounting for
    # submitit to read the job's end from). SLURM then declares the node down. The node is brought
    # back afterwards for the tests that follow. Like a real node failure, this also ends any other
    # job on that node: run it on a cluster nobody else is using at the time (CI's own).
    sweep = tmp_path / "sweep"
    # Worker 0 waits cluster.lost_task_grace_s (2 s here, 10 by default) for worker 1's own result.
    proc = _train(sweep, ["pipeline=chimera", "stages=2", "steps=100000", "cluster.lost_task_grace_s=2"])
    alive = lambda: proc.poll() is None  # noqa: E731
    job_id = victim = None
    try:
        wait_for_rows(sweep / "0" / "metrics.jsonl", 3, alive)
        job_id = submitit_job_id(sweep)
        victim = _placement(sweep, job_id, 2)[1]["host"]
        pids = subprocess.run(["ip", "netns", "pids", victim], check=True, capture_output=True, text=True,
                              timeout=30).stdout.split()
        assert pids, f"no process in node {victim}'s namespace"
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.monotonic()
        code, out = _finish(proc, sweep, timeout_s=180)
        ended_s = time.monotonic() - killed
        assert code != 0
        assert f"task 1 of SLURM job {job_id} on {victim} ended without a result" in out, \
            f"{out[-3000:]}\n{all_task_logs(sweep)}"
        # SLURM sees the node stop answering and ends the job on it (NODE_FAIL, then a requeue that
        # waits for two nodes): nothing is left running.
        deadline = time.monotonic() + 120
        while scontrol_job(job_id).get("JobState") in ("RUNNING", "COMPLETING", "CONFIGURING"):
            assert time.monotonic() < deadline, scontrol_job(job_id)
            time.sleep(1)
        print(f"launcher ended {ended_s:.1f} s after the node died; SLURM ended the job "
              f"{time.monotonic() - killed:.1f} s after ({scontrol_job(job_id).get('JobState')})")
    finally:
        if proc.poll() is None:
            proc.kill()
        if job_id:
            subprocess.run(["scancel", job_id], check=False, timeout=30)
        if victim:  # restart the node's slurmd (the namespace stays); it returns to service
            subprocess.run([str(REPO / START), "--nodes", str(len(two_nodes))], check=True, timeout=300,
                           capture_output=True)
