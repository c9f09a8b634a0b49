"""The body of a SLURM job of the run (`ModuleJob`): it starts one process of the topology on its node and, for
inference jobs, finds and advertises the addresses that tie the jobs together (primerl.launch.slurm submits it).

Invariants:
- A job runs the same process command as the local launcher and logs to the same `<run>/logs/<name>.log`
  (the trainer's rank r > 0 to `trainer-rank<r>.log`).
- The inference job writes its address to `<run>/inference_address.json` (with its job id) once it knows its node and
  port; the orchestrator job waits for the address of *its* inference job and is given it as overrides. A wildcard
  `inference.host` (0.0.0.0) is advertised as the node's name (SLURMD_NODENAME, else its host name);
  `inference.port=0` takes a free port on the node. Job j > 0 of `launcher.inference_jobs` advertises in its own file
  (`inference_address_path(run, j)`) and serves its share of the replicas on consecutive ports from that address.
- With prefill/decode, the `prefill` job serves its pairs' prefill servers on free ports of its node and advertises
  them (`inference_address_path(run, j, "prefill")`); the `decode` job waits for that address, serves the decode
  servers and a router per pair, and advertises the routers as inference job j. Pair i of job j is run-wide pair
  j*k + i (its KV store).
- With `teacher.path` the teacher's job (`teacher`) serves it alone on `teacher.replicas` consecutive ports from
  `teacher.port` of its node (None: free ones) and advertises the first (`inference_address_path(run, 0,
  "teacher")`); the orchestrator job waits for that address too and is given it as `teacher.host` /
  `teacher.port`. A requeued teacher job advertises its new address, which the orchestrator follows
  (primerl.orchestrator.teacher).
- The trainer's tasks rendezvous from SLURM's variables (MASTER_ADDR = first node of the job, RANK = SLURM_PROCID):
  no torchrun inside a job.
- SLURM signals a job `launcher.signal_delay_s` before its time limit, or on preemption: the job stops its process
  and requeues itself (submitit's Checkpointable). The processes resume from their last checkpoint and batch.
- A job whose driver has not renewed its lease for `launcher.driver_lease_s` (a driver killed with -9) stops its
  process and ends (primerl.launch.lease).
"""

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from primerl.launch.children import child_env, log_tail, module_command
from primerl.launch.lease import lease_lapsed_s
from primerl.transport.address import read_address, write_address
from primerl.transport.run_dir import inference_address_path, log_path, sft_run_dir
from primerl.utils.process import free_port
from primerl.utils.wait import WaitTimeout, wait_until

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}

_running: subprocess.Popen | None = None  # the process of this job, for `checkpoint` to stop


@dataclass
class ModuleJob(submitit.helpers.Checkpointable):
    """One process of the run as the body of a SLURM job (every task of the job runs it)."""

    name: str  # a JOB_ROLES role, <role>-<j> for inference (prefill, decode) jobs j > 0
    module: str
    overrides: list[str]
    run_dir: str
    inference_host: str = "127.0.0.1"
    inference_port: int = 0
    inference_replicas: int = 1  # served by this one job, on consecutive ports from its address's port
    inference_index: int = 0  # inference: which of launcher.inference_jobs this job is
    inference_job_ids: list[str] = field(default_factory=list)  # orchestrator: whose addresses to wait for
    pd_role: str = ""  # with prefill/decode: "prefill" or "decode", the side of its pairs this inference job serves
    prefill_job_id: str = ""  # decode: the prefill job of its pairs, whose address it waits for
    teacher_job_id: str = ""  # orchestrator, with teacher.path: the teacher's job, whose address it waits for
    wait_s: float = 600.0
    lease_s: float = 300.0  # launcher.driver_lease_s

    def __call__(self) -> None:
        global _running
        overrides = [*self.overrides, *self._address_overrides()]
        run_dir = sft_run_dir(self.run_dir) if self.name == "sft" else Path(self.run_dir)
        log = log_path(self.run_dir, self.name)
        if int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # sets RANK, WORLD_SIZE, MASTER_ADDR, ... in os.environ
            dist = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
            if dist.rank > 0:
                log = log.with_name(f"{self.name}-rank{dist.rank}.log")
        env = child_env(threads=int(os.environ.get("SLURM_CPUS_PER_TASK", "0")) or None)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            _running = subprocess.Popen(
                module_command(self.module, overrides, run_dir), stdout=out, stderr=subprocess.STDOUT, env=env
            )
        # polled, not wait()ed: `checkpoint` runs as a signal handler and must be able to wait for the process itself
        started, lapsed = time.time(), None

        def over() -> bool:
            nonlocal lapsed
            lapsed = lease_lapsed_s(self.run_dir, self.lease_s, started)
            return _running.poll() is not None or lapsed is not None

        wait_until(over, f"{self.name} to exit", poll_s=1.0)
        if lapsed is not None and _running.poll() is None:
            _stop(_running)
            raise RuntimeError(
                f"{self.name}: the driver has not renewed its lease ({self.run_dir}/driver.lease) for {lapsed:.0f}s "
                "(launcher.driver_lease_s): it is gone, so this job stops; rerun the command to resume the run"
            )
        if (code := _running.returncode) != 0:
            raise RuntimeError(f"{self.name} exited with code {code}; last lines of {log}:\n{log_tail(log)}")

    def _address_overrides(self) -> list[str]:
        if self.name == "teacher":
            return self._teacher_overrides()
        if self.module == "primerl.entrypoints.inference":
            return self._serving_overrides()
        if self.name == "orchestrator":  # every inference job's address; the first one's as the config's
            found = [
                _wait_for_address(self.run_dir, index, job_id, self.wait_s)
                for index, job_id in enumerate(self.inference_job_ids)
            ]
            given = [f"inference.host={found[0]['host']}", f"inference.port={found[0]['port']}"] if found else []
            if self.teacher_job_id:
                teacher = _wait_for_address(self.run_dir, 0, self.teacher_job_id, self.wait_s, "teacher")
                given += [f"teacher.host={teacher['host']}", f"teacher.port={teacher['port']}"]
            return given
        return []

    def _teacher_overrides(self) -> list[str]:
        """The teacher's job: its servers alone (`inference_replicas`: teacher.replicas), on consecutive ports of this
        node from `inference_port` (teacher.port; 0: free ones), the first one advertised."""
        host = self._advertised_host()
        port = self.inference_port or free_port(count=self.inference_replicas)
        write_address(self.run_dir, 0, host, port, _job_id(), role="teacher")
        alone = [
            "teacher.alone=true",
            "inference.pd.enabled=false",
            "inference.replicas=1",
            "launcher.inference_jobs=1",
        ]
        return [f"teacher.port={port}", *alone]

    def _advertised_host(self) -> str:
        """A wildcard `inference_host` is advertised as the node's name as SLURM knows it: what the other nodes
        resolve."""
        if self.inference_host in WILDCARD_HOSTS:
            return os.environ.get("SLURMD_NODENAME") or socket.getfqdn()
        return self.inference_host

    def _serving_overrides(self) -> list[str]:
        """An inference job's ports on its node and the address it advertises; with prefill/decode, its side."""
        replicas, host = self.inference_replicas, self._advertised_host()
        # this job's share of the replicas, as one job (the run's replicas / inference_jobs would not divide)
        share = [f"inference.replicas={replicas}", "launcher.inference_jobs=1"]
        if not self.pd_role:
            port = self.inference_port or free_port(count=replicas)
            write_address(self.run_dir, self.inference_index, host, port, _job_id())
            return [f"inference.port={port}", *share]
        first = free_port(count=2 * replicas)  # this side's servers, then (decode) its routers
        share += [f"inference.pd.role={self.pd_role}", f"inference.pd.first_pair={self.inference_index * replicas}"]
        if self.pd_role == "prefill":
            write_address(self.run_dir, self.inference_index, host, first, _job_id(), role="prefill")
            return [*share, f"inference.pd.prefill_port={first}"]
        prefill = _wait_for_address(self.run_dir, self.inference_index, self.prefill_job_id, self.wait_s, "prefill")
        port = self.inference_port or first + replicas
        write_address(self.run_dir, self.inference_index, host, port, _job_id())
        return [
            *share,
            f"inference.port={port}",
            f"inference.pd.decode_port={first}",
            f"inference.pd.prefill_host={prefill['host']}",
            f"inference.pd.prefill_port={prefill['port']}",
        ]

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Time limit near, or preempted: stop the process (it checkpoints every step) and requeue this job."""
        if _running is not None and _running.poll() is None:
            _stop(_running)
        return submitit.helpers.DelayedSubmission(self)


def _stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()


def _job_id() -> str:
    return os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID", ""))


def _wait_for_address(run_dir: Path, index: int, job_id: str | None, wait_s: float, role: str = "inference") -> dict:
    def found() -> dict | None:
        address = read_address(run_dir, index, role)
        return address if address is not None and job_id in (None, address["job_id"]) else None

    what = f"the address of {role} job {job_id} in {inference_address_path(run_dir, index, role)}"
    try:
        return wait_until(found, what, wait_s, poll_s=1.0, note_every_s=60)
    except WaitTimeout as err:
        raise RuntimeError(f"no address from {role} job {job_id}: {err}") from None
