"""Run the RL topology as SLURM jobs through submitit: inference, orchestrator and trainer (SFT first when needed).

Invariants:
- Each job's body is a `ModuleJob` (primerl.launch.slurm_job: what runs on the node, and how the jobs find each other);
  submitit's own files are in `<run>/slurm/<job id>/`.
- `inference.replicas=N`: `launcher.inference_jobs=J` jobs (on any nodes) serve N/J each; the orchestrator waits for
  all of their addresses. With `inference.pd.enabled`, inference job j is two jobs, placed each by its own
  `launcher.sbatch` role: `prefill` (`prefill-<j>`) and `decode` (`decode-<j>`). Each side takes
  `launcher.inference_gpus`. With `teacher.path` one more job, `teacher`, serves the teacher
  (`launcher.teacher_gpus`, `launcher.sbatch.teacher`); the orchestrator waits for its address too.
- A job that ends in any state but COMPLETED (failed, cancelled, timed out, out of memory, node failure) cancels the
  other jobs, and the driver exits 1 naming the job, its state and its last log lines. Unless SLURM took it back: a
  job whose node failed is requeued by SLURM (JobRequeue=1, its default) and runs again elsewhere, while sacct, which
  submitit reads, may still report the failed start; the controller's own queue (`squeue`) decides then.
- While it lives the driver renews its lease; a job whose driver is gone (killed with -9) stops by itself after
  `launcher.driver_lease_s` (primerl.launch.lease).
"""

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from primerl.config.launcher import job_role
from primerl.config.schema import RunConfig
from primerl.launch.children import ChildFailed, log_tail
from primerl.launch.lease import DriverLease
from primerl.launch.slurm_job import ModuleJob
from primerl.transport.run_dir import inference_address_path, log_path
from primerl.utils.log import get_logger
from primerl.utils.wait import wait_until

log = get_logger("train")

# States a job can be in while it still may finish well (a requeued job passes through PENDING/REQUEUED again).
LIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "PREEMPTED",
    "SIGNALING",
    "STAGE_OUT",
    "UNKNOWN",
}
SLURM_QUERY_TIMEOUT_S = 30.0


def job_states(job_ids: list[str]) -> dict[str, str]:
    """Each job's state by its latest accounting record (sacct without -D: a requeued job's earlier starts are not
    its state); {} when sacct cannot say (the accounting daemon busy: asked again at the next poll)."""
    if not job_ids:
        return {}
    command = ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=SLURM_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    return dict(line.split("|", 1) for line in out.stdout.splitlines() if "|" in line)


def queued_state(job_id: str) -> str | None:
    """The job's state in the controller's queue when it is there and live (requeued after a node failure: PENDING,
    then RUNNING); None when it is not, or squeue cannot say."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=SLURM_QUERY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split() if out.returncode == 0 else []
    return states[0] if states and states[0] in LIVE_STATES else None


@dataclass
class SlurmLauncher:
    cfg: RunConfig
    run_dir: Path
    jobs: dict[str, submitit.Job] = field(default_factory=dict)
    lease: DriverLease | None = None
    requeued: set[tuple[str, str]] = field(default_factory=set)  # (job id, ended state) already logged as requeued
    states: dict[str, str] = field(default_factory=dict)  # job id -> its state by its latest accounting record

    @property
    def poll_s(self) -> float:
        return self.cfg.launcher.poll_s

    def _submit(
        self, name: str, module: str, overrides: list[str], nodes: int = 1, tasks: int = 1, gpus: int = 0, **job_args
    ) -> submitit.Job:
        lc = self.cfg.launcher
        if self.lease is None:
            self.lease = DriverLease(self.run_dir)
            self.lease.start()
        executor = submitit.SlurmExecutor(folder=self.run_dir / "slurm" / "%j", max_num_timeout=lc.max_requeues)
        executor.update_parameters(
            job_name=f"{self.cfg.name}-{name}",
            partition=lc.partition,
            account=lc.account,
            qos=lc.qos,
            time=lc.time_limit_min,
            nodes=nodes,
            ntasks_per_node=tasks,
            cpus_per_task=lc.cpus_per_task,
            gpus_per_node=gpus or None,
            signal_delay_s=lc.signal_delay_s,
            setup=list(lc.setup),
            additional_parameters=dict(lc.sbatch.get(job_role(name), {})),
        )
        job = executor.submit(
            ModuleJob(name, module, overrides, str(self.run_dir), lease_s=lc.driver_lease_s, **job_args)
        )
        self.jobs[name] = job
        log.info(f"{name} is SLURM job {job.job_id}")
        return job

    def _trainer_placement(self) -> dict:
        lc = self.cfg.launcher
        return {"nodes": lc.trainer_nodes, "tasks": lc.trainer_tasks_per_node, "gpus": lc.trainer_gpus}

    def run_sft(self, overrides: list[str]) -> None:
        self._submit("sft", "primerl.entrypoints.sft", overrides, **self._trainer_placement())

        def ended() -> bool:
            self._refresh()
            return self._ended_well("sft")

        wait_until(ended, "the SFT job", poll_s=self.poll_s)

    @property
    def serving_names(self) -> list[str]:
        """The inference jobs: `inference`, `inference-1` ... (launcher.inference_jobs), or with prefill/decode
        `prefill`, `decode`, `prefill-1`, `decode-1` ..."""
        roles = ("prefill", "decode") if self.cfg.inference.pd.enabled else ("inference",)
        names = [role if j == 0 else f"{role}-{j}" for j in range(self.cfg.launcher.inference_jobs) for role in roles]
        return names + (["teacher"] if self.cfg.teacher.path is not None else [])

    def start(self, overrides: list[str]) -> None:
        inf, lc = self.cfg.inference, self.cfg.launcher
        wait_s = inf.startup_timeout_s + 3600  # what it waits for may queue first
        ids = [self._start_serving(overrides, index, wait_s).job_id for index in range(lc.inference_jobs)]
        teacher = self._start_teacher(overrides) if self.cfg.teacher.path is not None else ""
        self._submit(
            "orchestrator",
            "primerl.entrypoints.orchestrator",
            overrides,
            inference_job_ids=ids,
            teacher_job_id=teacher,
            wait_s=wait_s,
        )
        self._submit("trainer", "primerl.entrypoints.trainer", overrides, **self._trainer_placement())

    def _start_teacher(self, overrides: list[str]) -> str:
        """The teacher's job (primerl.launch.slurm_job: it serves the teacher alone); its job id."""
        inference_address_path(self.run_dir, 0, "teacher").unlink(missing_ok=True)  # an earlier attempt's
        teacher = self.cfg.teacher
        serving = {
            "inference_host": self.cfg.inference.host,
            "inference_port": teacher.port or 0,
            "inference_replicas": teacher.replicas,
        }
        job = self._submit(
            "teacher", "primerl.entrypoints.inference", overrides, gpus=self.cfg.launcher.teacher_gpus, **serving
        )
        return job.job_id

    def _start_serving(self, overrides: list[str], index: int, wait_s: float) -> submitit.Job:
        """Inference job `index`, or with prefill/decode its prefill job and then its decode job (returned)."""
        inf, lc = self.cfg.inference, self.cfg.launcher
        for role in ("inference", "prefill"):  # an earlier attempt's servers are gone
            inference_address_path(self.run_dir, index, role).unlink(missing_ok=True)
        serving = {
            "inference_host": inf.host,
            "inference_port": inf.port,
            "inference_replicas": inf.replicas // lc.inference_jobs,
            "inference_index": index,
        }
        suffix = f"-{index}" if index else ""
        if not inf.pd.enabled:
            return self._submit(
                f"inference{suffix}", "primerl.entrypoints.inference", overrides, gpus=lc.inference_gpus, **serving
            )
        prefill = self._submit(
            f"prefill{suffix}",
            "primerl.entrypoints.inference",
            overrides,
            gpus=lc.inference_gpus,
            pd_role="prefill",
            **serving,
        )
        return self._submit(
            f"decode{suffix}",
            "primerl.entrypoints.inference",
            overrides,
            gpus=lc.inference_gpus,
            pd_role="decode",
            prefill_job_id=prefill.job_id,
            wait_s=wait_s,
            **serving,
        )

    def _ended_well(self, name: str) -> bool:
        """True when the job COMPLETED; raise ChildFailed when it ended any other way."""
        job = self.jobs[name]
        shown = self.states.get(job.job_id, "UNKNOWN")  # e.g. "CANCELLED by 0"; not in the books yet: unknown
        state = shown.split(" ")[0]
        if state == "COMPLETED":
            return True
        if state in LIVE_STATES:
            return False
        if (queued := queued_state(job.job_id)) is not None:
            if (job.job_id, state) not in self.requeued:
                self.requeued.add((job.job_id, state))
                log.info(f"{name} (SLURM job {job.job_id}) ended {state} and SLURM requeued it: {queued}")
            return False
        path = log_path(self.run_dir, name)
        raise ChildFailed(f"{name} (SLURM job {job.job_id}) ended {shown}; last lines of {path}:\n{log_tail(path)}")

    def _refresh(self) -> None:
        """Every job's state in one sacct call (submitit's own refresh slows down to one every several minutes, and
        keeps the first ended state it saw for good: a start that failed with its node, for a job requeued since)."""
        self.states = job_states([job.job_id for job in self.jobs.values()]) or self.states

    def finished(self) -> bool:
        self._refresh()
        done = all([self._ended_well(name) for name in ("trainer", "orchestrator")])  # a list: check both
        for name in self.serving_names:
            if not done and self._ended_well(name):
                raise ChildFailed(f"{name} (SLURM job {self.jobs[name].job_id}) ended before the run did")
        return done

    def stop_all(self) -> None:
        if self.lease is not None:
            self.lease.stop()
        self._refresh()
        for name, job in self.jobs.items():
            state = self.states.get(job.job_id, "UNKNOWN").split(" ")[0]
            if state in LIVE_STATES or queued_state(job.job_id) is not None:
                job.cancel(check=False)
                log.info(f"cancelled {name} (SLURM job {job.job_id})")
