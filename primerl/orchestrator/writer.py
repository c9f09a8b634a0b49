"""Writer: the only orchestrator component that touches the run directory.

It writes each cut as the trainer's batch file (packed by `build_batch`, atomically), appends the step's metrics row and
a few sample rollouts, and finds where a restarted orchestrator goes on: the first step without a batch file, the
task position stored in the last batch and the tasks it left pending (run again first). Batches already written stay as they are (they are trained, not regenerated);
a metrics row the predecessor died before writing comes back from its batch's metadata. A full disk stalls the write
(and so the trainer, which waits for the batch) until there is space again; no rollout of the cut is lost.
"""

import json
import time
from pathlib import Path

from primerl.metrics import ORCHESTRATOR, OrchestratorMetric, append_metrics, append_metrics_once
from primerl.orchestrator.accounting import TaskAccount
from primerl.orchestrator.batch import build_batch
from primerl.transport.atomic import append_lines, when_disk_has_space
from primerl.transport.batches import Sample, read_rollout_batch, write_rollout_batch
from primerl.transport.run_dir import rollout_path, samples_path

RESTORE_ROWS = 3  # a killed predecessor can have lost only its last row; a few more cost nothing


class BatchWriter:
    def __init__(
        self,
        run_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        pad_id: int,
        temperature: float,
        async_level: int,
    ):
        self.run_dir = Path(run_dir)
        self.seq_len, self.micro_batch_size, self.pad_id = seq_len, micro_batch_size, pad_id
        self.temperature, self.async_level = temperature, async_level

    def resume_point(self) -> tuple[int, int, list[int]]:
        """(first step without a batch, tasks drawn through the last batch, the tasks it left pending)."""
        start, position, pending = 0, 0, []
        while rollout_path(self.run_dir, start).exists():
            start += 1
        for step in range(max(0, start - RESTORE_ROWS), start):
            batch = read_rollout_batch(rollout_path(self.run_dir, step))
            append_metrics_once(self.run_dir, ORCHESTRATOR, step, batch.metrics)
            position, pending = batch.data_position, batch.tasks_pending
        return start, position, pending

    def write(
        self,
        step: int,
        samples: list[Sample],
        metrics: dict[str, float],
        data_position: int,
        examples: list[dict],
        tasks: TaskAccount | None = None,
    ) -> None:
        started = time.perf_counter()
        batch = build_batch(
            samples,
            step,
            self.seq_len,
            self.micro_batch_size,
            self.pad_id,
            temperature=self.temperature,
            async_level=self.async_level,
            metrics=metrics,
            data_position=data_position,
        )
        tasks = tasks or TaskAccount()
        batch.tasks_trained, batch.tasks_spent, batch.tasks_pending = tasks.trained, tasks.spent, tasks.pending
        when_disk_has_space(lambda: write_rollout_batch(self.run_dir, batch), f"the batch of step {step}")
        # only in the metrics row: the batch file's own copy of the metrics was written before this was known
        metrics = {**metrics, OrchestratorMetric.WRITE_BATCH_S: time.perf_counter() - started}
        when_disk_has_space(
            lambda: append_metrics(self.run_dir, ORCHESTRATOR, step, metrics), f"the metrics row of step {step}"
        )
        if examples:
            lines = [json.dumps(e) for e in examples]
            when_disk_has_space(
                lambda: append_lines(samples_path(self.run_dir), lines), f"the sample rollouts of step {step}"
            )
