"""Sampled rollouts as MLflow traces: what a user opens in the run's Traces tab to read an episode.

One trace per rollout row of `rollouts/samples.jsonl` (the sink's examples): the root span (AGENT) takes the user
turns in (the traces table's Request column) and the final answer out, and holds the task, prompt, reward,
per-function rewards, env metrics and the policy versions that generated it; a child span per model call (LLM: the
messages new since the previous reply in, the reply and its tool calls out, timed from request to response, with
the server's token counts) and per tool result (TOOL: from the reply that asked for it to its arrival). Times are
the ones verifiers recorded (primerl.envs.trace_text.transcript). The reward and each reward function's value are
the trace's feedback (assessments from CODE), so the table sorts and filters on them.

MLflow's trace exporter writes to the process-wide tracking URI, not the client's: `log_rollout_trace` points it at
the ledger's store, and logging is synchronous, so a trace is stored when the call returns (exactly-once bookkeeping
in primerl.ledger.follower.MetricsFollower relies on that).
"""

import os
import time

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_TRACE_LOGGING", "false")

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"

import mlflow  # noqa: E402 - after the setting above, which mlflow reads when its exporter starts
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import AssessmentSource  # noqa: E402
from mlflow.tracing.constant import SpanAttributeKey  # noqa: E402


def _ns(seconds: float | None) -> int | None:
    return int(seconds * 1e9) if seconds else None


SAMPLE_KEY_TAG = "primerl.sample"  # the row's key (its offset in samples.jsonl): a row's trace is stored once


def log_rollout_trace(client: MlflowClient, run_id: str, experiment_id: str, row: dict, key: str) -> str:
    """Store one sampled rollout (a samples.jsonl row) as a trace of run `run_id`, tagged with `key`, unless the run
    has the trace of `key` already (a driver killed after storing it, before saving its progress); returns the trace
    id. (A trace is stored whole when it ends: one cut short by a kill leaves nothing to find.)"""
    stored = client.search_traces(
        locations=[experiment_id], run_id=run_id, filter_string=f"tag.`{SAMPLE_KEY_TAG}` = '{key}'"
    )
    if stored:
        return stored[0].info.trace_id
    previous = os.environ.get(TRACKING_URI_ENV)
    mlflow.set_tracking_uri(client.tracking_uri)
    try:
        return _log_trace(client, run_id, experiment_id, row, key)
    finally:  # MLflow also exports the URI to the environment, where it would reach later runs of this process
        if previous is None:
            os.environ.pop(TRACKING_URI_ENV, None)
        else:
            os.environ[TRACKING_URI_ENV] = previous


def _log_trace(client: MlflowClient, run_id: str, experiment_id: str, row: dict, key: str) -> str:
    messages = row.get("messages") or []
    first_version, last_version = (row.get("policy_versions") or [None, None])[:2]
    starts = [m["start"] for m in messages if m.get("start")] + [m["end"] for m in messages if m.get("end")]
    begin, finish = (min(starts), max(starts)) if starts else (time.time(), time.time())
    attributes = {
        "step": row["step"],
        "task": row.get("task", ""),
        "reward": row.get("reward"),
        "policy_version.first": first_version,
        "policy_version.last": last_version,
        **{f"reward.{k}": v for k, v in (row.get("rewards") or {}).items()},
        **{f"metric.{k}": v for k, v in (row.get("metrics") or {}).items()},
    }
    root = client.start_trace(
        "rollout",
        span_type="AGENT",
        experiment_id=experiment_id,
        run_id=run_id,
        inputs={"request": _user_turns(messages) or row.get("prompt", "")},  # the UI's Request column
        attributes=attributes,
        start_time_ns=_ns(begin),
        tags={"primerl.step": str(row["step"]), "primerl.task": str(row.get("task", "")), SAMPLE_KEY_TAG: key},
    )
    since_reply: list[dict] = []
    previous_end = begin
    turn = 0
    for message in messages:
        if message["role"] == "assistant":
            turn += 1
            span = client.start_span(
                f"turn {turn}",
                root.trace_id,
                root.span_id,
                span_type="LLM",
                inputs={"messages": since_reply},
                attributes={"finish_reason": message.get("finish_reason"), **_token_usage(message)},
                start_time_ns=_ns(message.get("start") or previous_end),
            )
            client.end_span(
                root.trace_id,
                span.span_id,
                end_time_ns=_ns(message.get("end")),
                outputs={"content": message["content"], "tool_calls": message.get("tool_calls", [])},
            )
            since_reply, previous_end = [], message.get("end") or previous_end
            continue
        if message["role"] == "tool":
            span = client.start_span(
                f"tool {message.get('tool_call_id', '')}".strip(),
                root.trace_id,
                root.span_id,
                span_type="TOOL",
                start_time_ns=_ns(previous_end),
            )
            client.end_span(
                root.trace_id,
                span.span_id,
                outputs={"content": message["content"]},
                end_time_ns=_ns(message.get("end")),
            )
        since_reply.append({"role": message["role"], "content": message["content"]})
    client.end_trace(root.trace_id, outputs={"completion": row.get("completion", "")}, end_time_ns=_ns(finish))
    _log_rewards(root.trace_id, row)
    return root.trace_id


def _user_turns(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages if m.get("role") == "user")


def _token_usage(message: dict) -> dict:
    """MLflow's token-usage attribute of an LLM span (summed into the trace's usage by the UI)."""
    usage = message.get("usage")
    if not usage:
        return {}
    total = usage["input_tokens"] + usage["output_tokens"]
    return {SpanAttributeKey.CHAT_USAGE: {**usage, "total_tokens": total}}


def _log_rewards(trace_id: str, row: dict) -> None:
    """The reward, and each reward function's, as the trace's feedback."""
    source = AssessmentSource(source_type="CODE", source_id="primerl")
    values = {"reward": row.get("reward"), **{f"reward/{k}": v for k, v in (row.get("rewards") or {}).items()}}
    for name, value in values.items():
        if isinstance(value, int | float):
            mlflow.log_feedback(trace_id=trace_id, name=name, value=float(value), source=source)
