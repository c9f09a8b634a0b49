"""What a vLLM server's `/metrics` says of its load, summed over its engines: running and waiting requests, KV-cache
usage, preemptions. Read by the idle gauge (primerl.orchestrator.gauges) and by admission
(primerl.orchestrator.admission) through `InferenceClient.engine_load`."""

import re
from dataclasses import dataclass

_GAUGES = {  # vLLM's /metrics lines: `vllm:<name>{labels} <value>`, one per engine
    name: re.compile(rf"^vllm:{name}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.M)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total")
}


@dataclass
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    preemptions: float  # cumulative since the server started


def parse_engine_load(text: str) -> EngineLoad | None:
    """The load in a `/metrics` answer; None when it has no `num_requests_running` (not vLLM's metrics), and a metric
    the server does not export reads 0."""
    values = {name: [float(v) for v in pattern.findall(text)] for name, pattern in _GAUGES.items()}
    if not values["num_requests_running"]:
        return None
    return EngineLoad(
        running=sum(values["num_requests_running"]),
        waiting=sum(values["num_requests_waiting"]),
        kv_usage=max(values["kv_cache_usage_perc"], default=0.0),
        preemptions=sum(values["num_preemptions_total"]),
    )
