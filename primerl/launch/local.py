"""Run the RL topology on this machine: inference server, orchestrator and trainer as child processes.

Each child gets its own process group and log (`<run>/logs/<name>.log`). Stopping SIGTERMs every child's process
group, then SIGKILLs it after a grace period: no orphans. A driver that dies without stopping them (kill -9) takes
them along: each child gets SIGTERM when the driver exits (primerl.utils.parent_death).
"""

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.config.teacher import teacher_servers
from primerl.inference.gpus import plan_gpus, visible_gpus
from primerl.launch.children import ChildFailed, child_env, log_tail, module_command
from primerl.transport.run_dir import inference_address_path, log_path, sft_run_dir
from primerl.utils.parent_death import dies_with_parent
from primerl.utils.process import STOP_GRACE_S, free_port, stop_process_groups

LOOPBACK_GLOO = {"GLOO_SOCKET_IFNAME": "lo"}  # ranks on one machine: gloo's pair sockets listen on loopback only


def trainer_threads(cfg: RunConfig) -> int | None:
    """The trainer's CPU threads: launcher.trainer_threads, else, on CPU, every core this process may run on but the
    one vLLM pins (every core with launcher.colocate, where they take turns). Never more threads than cores: torch
    waits for its slowest thread at every op, and a thread that shares its core slows the trainer several times over
    (benchmarks/results.md, "The peer, explained")."""
    cpu = cfg.inference.device == "cpu" or (cfg.inference.device == "auto" and not _has_cuda())
    spare = 0 if cfg.launcher.colocate else 1
    return cfg.launcher.trainer_threads or (max(1, len(os.sched_getaffinity(0)) - spare) if cpu else None)


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class LocalLauncher:
    cfg: RunConfig
    run_dir: Path
    poll_s: float = 1.0
    children: dict[str, Child] = field(default_factory=dict)

    def run_sft(self, overrides: list[str]) -> None:
        """In the foreground, so that its progress bar shows."""
        cmd = module_command(
            "primerl.entrypoints.sft", overrides, sft_run_dir(self.run_dir), self.cfg.launcher.trainer_tasks_per_node
        )
        if subprocess.run(dies_with_parent(cmd), env=child_env() | LOOPBACK_GLOO).returncode != 0:
            raise ChildFailed("SFT warm-start failed (its output is above)")

    def start(self, overrides: list[str]) -> None:
        # an address left by an earlier SLURM attempt in this run directory: the orchestrator must not follow it
        inference_address_path(self.run_dir).unlink(missing_ok=True)
        if self.cfg.inference.port == 0:  # free ports, the same for the servers and the orchestrator
            overrides = [*overrides, f"inference.port={free_port(count=self.cfg.inference.replicas)}"]
        cfg, nproc = self.cfg, self.cfg.launcher.trainer_tasks_per_node
        # the servers' own GPUs are placed by primerl.entrypoints.inference; the trainer's and orchestrator's here
        gpus = plan_gpus(cfg.launcher, cfg.inference, visible_gpus(), teacher_servers(cfg.teacher))
        self._spawn("inference", module_command("primerl.entrypoints.inference", overrides, self.run_dir), child_env())
        self._spawn(
            "orchestrator",
            module_command("primerl.entrypoints.orchestrator", overrides, self.run_dir),
            child_env(threads=1) | gpus.orchestrator_env(),
        )
        threads = trainer_threads(self.cfg)
        self._spawn(
            "trainer",
            module_command("primerl.entrypoints.trainer", overrides, self.run_dir, nproc),
            child_env(threads=threads) | LOOPBACK_GLOO | gpus.trainer_env(),
        )

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = log_path(self.run_dir, name)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(
                dies_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.children[name] = Child(name, process, log)

    def finished(self) -> bool:
        for child in self.children.values():
            code = child.process.poll()
            if code not in (None, 0):
                raise ChildFailed(
                    f"{child.name} exited with code {code}; last lines of {child.log}:\n{log_tail(child.log)}"
                )
        if all(self.children[name].process.poll() == 0 for name in ("trainer", "orchestrator")):
            return True
        inference = self.children["inference"]
        if inference.process.poll() is not None:
            raise ChildFailed(f"inference exited; last lines of {inference.log}:\n{log_tail(inference.log)}")
        return False

    def stop_all(self) -> None:
        stop_process_groups([c.process for c in self.children.values()], STOP_GRACE_S)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
