"""Pacing: how far the dispatcher may run ahead of the trainer, and how old a group's policy may be to still train.

With policy v served, batches up to v + async_level may be cut. The dispatcher may admit a group while the rollouts in
flight plus the samples buffered leave room in the batches still cuttable:
`inflight + buffered < (min(v + async_level + 1, max_steps) - next_step) * batch_size`. So the orchestrator never runs
more than async_level batches (plus less than one group) ahead, and with async_level = 0 a group is admitted only for
the batch of the policy that generates it (an overshoot is dropped at the next cut, counted). With `drain_per_step`
(lock-step, no continuous dispatch) one batch of groups is admitted at a time. An admission bound by the engines' own
pressure (primerl.orchestrator.admission), where configured, caps what is in flight on top.
"""

from dataclasses import dataclass

from primerl.config.orchestrator import OrchestratorConfig
from primerl.orchestrator.admission import KvAdmission
from primerl.orchestrator.types import Policy, Servers


@dataclass
class Pacing:
    cfg: OrchestratorConfig
    max_steps: int
    policy: Policy
    servers: Servers
    admission: KvAdmission | None = None  # None: orchestrator.max_inflight alone bounds what is in flight
    round_start: int = 0  # drain_per_step: rollouts dispatched before the current round

    def may_admit(self, n: int, step: int, inflight: int, buffered: int, dispatched: int) -> bool:
        """Whether `n` more rollouts may start now, with `step` the next batch to cut, `inflight` rollouts running,
        `buffered` samples waiting for a cut and `dispatched` rollouts started in all."""
        if not self.servers.serving:
            return False
        cfg = self.cfg
        cuttable = min(self.policy.version + cfg.async_level + 1, self.max_steps) - step
        if cuttable <= 0:
            return False
        if self.admission is not None and not self.admission.allows(inflight + n):
            return False
        committed = inflight + buffered
        if cfg.drain_per_step:
            if committed == 0:
                self.round_start = dispatched
            return dispatched - self.round_start + n <= cfg.batch_size
        # room for one more sample is enough: failures and drops leave buffers that are not a multiple of a group, and
        # waiting for room for a whole group could wait forever. The overshoot (< group_size) is the next batch's.
        return committed < cuttable * cfg.batch_size

    def oldest_usable(self, step: int, inflight: int, buffered: int) -> int:
        """The oldest policy version a group admitted now may have sampled with and still train: the batch it will
        likely land in comes after the samples buffered and in flight ahead of it."""
        return step + (inflight + buffered) // self.cfg.batch_size - self.cfg.off_policy_bound
