"""`primerl inference`: serve the run's policy with vLLM until stopped (Ctrl-C / SIGTERM).

Reads the `inference` and `model` groups. Serves the SFT warm-start checkpoint when `sft.enabled` and it exists,
else the base model; with LoRA, the base model and the run's start adapter (primerl.launch.start). Prints the base
URL once ready. `inference.replicas` servers start side by side; with prefill/decode a pair per replica and a router
in front of each (primerl.inference.pd_router), or on SLURM one side of the pairs (`inference.pd.role`: the prefill
job's servers, or the decode job's servers and the routers). With `teacher.path` the teacher's servers start beside
them, or under SLURM alone in the teacher's job (`teacher_specs`).

A server that exits while serving (a crash, an OOM kill), or whose process lives on with its port closed (an engine
that died under a request it never answers), is started again (the pool policy of primerl.utils.pool); the others
keep serving meanwhile, and the orchestrator takes the restarted one back with the current policy
(primerl.orchestrator.watcher). A start counts as bringing it back only once it has answered a generation request
(its access line in the log, `VllmServer.has_served`), not at readiness: MAX_RESTARTS starts in a row that fail, or
that die before serving anything (a model the engine loads but cannot run), end this process with code 1 and one line
quoting the engine's own error.
"""

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from primerl.app import hydra_app, to_run_config
from primerl.config.inference import PdRole, pd_pairs
from primerl.config.model_dir import check_model_dir
from primerl.config.schema import RunConfig
from primerl.config.teacher import teacher_ports, teacher_servers
from primerl.inference.engine_support import check_servable, check_supported, resolve_device
from primerl.inference.gpus import job_server_env, plan_gpus, visible_gpus
from primerl.inference.pd_router import PdRouter, follow_prefill
from primerl.inference.server import InferenceStartError, VllmServer
from primerl.inference.serving import server_for, serving
from primerl.inference.vllm_args import ServerSpec, bind_cores, render_specs, teacher_spec
from primerl.launch.start import prepare_start_adapter, prepare_start_model
from primerl.metrics import INFERENCE, serve_live_metrics
from primerl.utils.errors import ConfigError, RunError
from primerl.utils.log import get_logger
from primerl.utils.pool import HEALTH_EVERY_S, RestartBudget

log = get_logger("inference")
MAX_RESTARTS = 3
REFUSING_LIMIT_S = 6.0  # a live server refusing connections this long is stuck in its shutdown
STUCK_GRACE_S = 1.0  # ...and ignores SIGTERM as well (it waits for the same request): killed after this


@dataclass
class Supervised:
    """One server under `keep_serving`: its restart budget, and what its polls since its last start have seen."""

    server: VllmServer
    budget: RestartBudget
    served: bool = False  # it has finished a request since its last start
    refusing_since: float | None = None  # when its port began refusing connections while its process lived

    def ended(self) -> str | None:
        """None while the server serves; else why it ended. A process that lives but has refused connections for
        REFUSING_LIMIT_S is stopped here and counts as ended: vLLM whose engine core died during a request the
        engine never answers (a `/collective_rpc` weight load with `cpu_executor=uni`) closes its port and waits for
        that request forever, in uvicorn's graceful shutdown. A slow server is not refused: its kernel still
        accepts connections."""
        server = self.server
        exited = server.process.poll() is not None
        self.served = self.served or server.has_served()  # from its log: still there after a kill
        if exited:
            return server.exit_reason()
        if not server.refuses_connections():
            self.refusing_since = None
            return None
        now = time.monotonic()
        self.refusing_since = self.refusing_since or now
        if now - self.refusing_since < REFUSING_LIMIT_S:
            return None
        server.stop(STUCK_GRACE_S)
        cause = server.error_of_this_start() or f"no error in {server.log_path}"
        return f"its process lived but refused connections for {REFUSING_LIMIT_S:.0f} s: {cause}; stopped it"

    def started_again(self) -> None:
        self.served, self.refusing_since = False, None


def keep_serving(servers: list[VllmServer], startup_timeout_s: float, each_poll: Callable[[], None]) -> None:
    """Restart each server that exits or stops accepting connections (`Supervised.ended`), until this process is
    stopped; raises RunError when one cannot come back. `each_poll` runs once per poll."""
    watched = [Supervised(s, RestartBudget(f"the vLLM server at {s.base_url}", MAX_RESTARTS)) for s in servers]
    while True:
        each_poll()
        for one in watched:
            reason = one.ended()
            if reason is None:
                continue
            if one.served:
                one.budget.served()  # a crash after serving: a fault to ride out
            else:
                one.budget.failed(f"it died before serving a request: {reason}")
            when = "after serving" if one.served else "before serving a request"
            log.warning(
                f"the vLLM server at {one.server.base_url} ended {when} ({reason}); "
                f"restarting it ({one.budget.failed_in_a_row + 1}/{MAX_RESTARTS})"
            )
            restart(one.server, one.budget, startup_timeout_s)
            one.started_again()
        time.sleep(HEALTH_EVERY_S)


def restart(server: VllmServer, budget: RestartBudget, startup_timeout_s: float) -> None:
    """Start `server` again until it is ready; each start that fails counts against `budget`."""
    while True:
        server.stop()  # what is left of its process group and its temp dir
        try:
            server.start(startup_timeout_s)
        except InferenceStartError as err:
            budget.failed(server.exit_reason() if server.process.poll() is not None else str(err).splitlines()[0])
            log.warning(f"{str(err).splitlines()[0]}; starting it again ({budget.failed_in_a_row + 1}/{MAX_RESTARTS})")
            continue
        log.info(f"serving at {server.base_url} again")
        return


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    device = resolve_device(cfg.inference)
    check_supported(cfg.inference, device)
    model_path = prepare_start_model(cfg)
    check_servable(cfg.model, model_path, device)
    if not Path(model_path).exists() and cfg.model.source.value != "hub":
        raise ConfigError(
            "sft.enabled",
            f"the SFT checkpoint {model_path} does not exist yet; run "
            "`primerl sft` with the same config first, or set sft.enabled=false",
        )
    node = os.environ.get("SLURMD_NODENAME")  # SLURM: inference jobs on several nodes may pick the same port
    policy = [] if cfg.teacher.alone else render_specs(cfg, model_path, device, prepare_start_adapter(cfg))
    specs = policy + teacher_specs(cfg, model_path)
    bind_cores(specs, device)
    place_on_gpus(cfg, specs, on_slurm=node is not None)
    servers = [server_for(cfg.output_dir, spec, node) for spec in specs]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with serving(cfg.inference, cfg.output_dir, servers, supervised=True) as routers:
            for server in servers:
                if server.process.poll() is not None:  # keep_serving starts it again at its first poll
                    log.warning(f"the vLLM server at {server.base_url} stopped while the servers started")
                else:
                    log.info(f"serving {server.spec.model} at {server.base_url}")
            follow, report = follow_pairs(cfg, routers), live_report(cfg, servers)
            keep_serving(servers, cfg.inference.startup_timeout_s, lambda: (follow(), report()))
    except (InferenceStartError, RunError) as err:
        log.error(str(err))
        sys.exit(1)


def teacher_specs(cfg: RunConfig, model_path: str) -> list[ServerSpec]:
    """With `teacher.path`, the teacher's servers (`teacher.replicas`): locally started and supervised with the
    replicas (in the process of the first pair under prefill/decode), under SLURM by the teacher's own job
    (`teacher.alone`) and no other. It must share the student's tokenizer."""
    if cfg.teacher.path is None or cfg.inference.pd.role == PdRole.prefill:
        return []
    if cfg.launcher.name == "slurm" and not cfg.teacher.alone:
        return []
    from primerl.orchestrator.teacher import check_same_tokenizer  # transformers: only for a run with a teacher

    teacher, device = str(Path(cfg.teacher.path).expanduser()), resolve_device(cfg.inference)
    check_model_dir(Path(teacher), "teacher.path")
    check_same_tokenizer(model_path, teacher)
    ports = teacher_ports(cfg.teacher, cfg.inference.port, cfg.inference.replicas)
    return [teacher_spec(cfg, device, teacher, port) for port in ports]


def live_report(cfg: RunConfig, servers: list[VllmServer]) -> Callable[[], None]:
    """With ledger.prometheus.port, what sets each server's live gauges at each poll: `inference/up` (its process
    runs) and `inference/starts` (its processes started, restarts included), labelled by its port (a replica, a
    prefill or decode server, the teacher)."""
    live = serve_live_metrics(cfg.ledger.prometheus, INFERENCE, cfg.output_dir, cfg.name, cfg.inference.api_key)
    if live is None:
        return lambda: None

    def report() -> None:
        for server in servers:
            up = server.process is not None and server.process.poll() is None
            live.set({"inference/up": float(up), "inference/starts": server.starts}, port=str(server.spec.port))

    return report


def follow_pairs(cfg: RunConfig, routers: list[PdRouter]) -> Callable[[], None]:
    """With prefill/decode, what keeps this process's routers pointed at their prefill servers (a SLURM decode job
    follows its prefill job, which a requeue moves); logs each pair."""
    inf = cfg.inference
    for pair, router in zip(pd_pairs(inf), routers, strict=False):
        log.info(
            f"pair {pair.index}: prefill at {router.prefill_url}, decode at {router.decode_url}, routed at "
            f"http://{inf.host}:{pair.router_port}"
        )
    if not routers or inf.pd.role == PdRole.both:
        return lambda: None

    def follow() -> None:
        for url in follow_prefill(routers, cfg.output_dir, inf):
            log.warning(f"the prefill job moved: prefilling at {url}")

    return follow


def place_on_gpus(cfg: RunConfig, specs: list[ServerSpec], on_slurm: bool) -> None:
    """Each server its GPU(s): locally the launcher's plan (primerl.inference.gpus), on SLURM a share of the job's."""
    visible = visible_gpus()
    if on_slurm:
        for index, spec in enumerate(specs):
            spec.env |= job_server_env(visible, len(specs), index)
        return
    gpus = plan_gpus(cfg.launcher, cfg.inference, visible, teacher_servers(cfg.teacher))
    for index, spec in enumerate(specs):
        spec.env |= gpus.server_env(index)


if __name__ == "__main__":
    main()
