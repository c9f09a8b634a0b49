"""SLURM: where each inference job serves. Job j writes `inference_address_path(run, j)` once it knows its node and
first port ({"host", "port", "job_id"}, atomically; rewritten when a requeued job starts elsewhere); the orchestrator
job reads them: to start (the launcher waits for its jobs' addresses) and to follow a moved replica (the watcher).
With prefill/decode, job j is a prefill job and a decode job: the decode job (its routers) writes the inference
address, the prefill job its servers' in `inference_address_path(run, j, "prefill")`, which the decode job reads.
The teacher's job (teacher.path) advertises its server in `inference_address_path(run, 0, "teacher")`."""

import dataclasses
import json
from pathlib import Path

from primerl.config.inference import InferenceConfig, replica_urls
from primerl.transport.atomic import atomic_file
from primerl.transport.run_dir import inference_address_path


def write_address(run_dir: str | Path, job: int, host: str, port: int, job_id: str, role: str = "inference") -> None:
    with atomic_file(inference_address_path(run_dir, job, role)) as tmp:
        tmp.write_text(json.dumps({"host": host, "port": port, "job_id": job_id}))


def read_address(run_dir: str | Path, job: int, role: str = "inference") -> dict | None:
    """Job `job`'s address ({"host": str, "port": int, "job_id": str}), or None while it cannot be read."""
    try:
        found = json.loads(inference_address_path(run_dir, job, role).read_text())
        return {"host": str(found["host"]), "port": int(found["port"]), "job_id": str(found.get("job_id", ""))}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def advertised_urls(run_dir: str | Path, inf: InferenceConfig, jobs: int = 1) -> list[str | None] | None:
    """The replica URLs the inference jobs advertise: job j serves replicas j*k .. j*k+k-1 (k = replicas / jobs) from
    its address's port. None for the replicas of a job whose address cannot be read yet; None when no job's can."""
    per_job = inf.replicas // jobs
    urls: list[str | None] = []
    for job in range(jobs):
        found = read_address(run_dir, job)
        if found is None:
            urls += [None] * per_job
        else:
            urls += replica_urls(dataclasses.replace(inf, host=found["host"], port=found["port"], replicas=per_job))
    return urls if any(urls) else None


def advertised_urls_of(run_dir: str | Path, role: str, servers: int) -> list[str] | None:
    """The URLs of the `servers` the one job of `role` (the teacher's) serves on consecutive ports from the address it
    advertises, or None while it cannot be read."""
    found = read_address(run_dir, 0, role)
    return None if found is None else [f"http://{found['host']}:{found['port'] + i}" for i in range(servers)]
