"""`primerl COMMAND [OVERRIDES...]`: every primerl entry point behind one installed command.

Each command is a module (`primerl.train`, `primerl.compare`, `primerl.replay`, `primerl.rerun`, and the processes of a
run in `primerl.entrypoints`) with the same Hydra overrides and the same one-line config errors; `primerl COMMAND --help` shows Hydra's help for it (the config groups and their options).
"""

import importlib
import sys

COMMANDS = {  # command: (module, what it does)
    "train": ("primerl.train", "the whole RL run: SFT warm-start if needed, inference, orchestrator, trainer"),
    "sft": ("primerl.entrypoints.sft", "the SFT warm-start alone (reused by later runs with the same settings)"),
    "eval": ("primerl.entrypoints.eval", "score a model, or a run's policy, on any verifiers environment"),
    "compare": ("primerl.compare", "compare runs recorded in the MLflow ledger (table and reward curves)"),
    "rerun": ("primerl.rerun", "run a recorded run again from its MLflow record (its overrides, seeds and commit)"),
    "replay": ("primerl.replay", "train a run's stored batches again and check each step against its record"),
    "inference": ("primerl.entrypoints.inference", "serve the run's policy with vLLM (one process of a run)"),
    "orchestrator": ("primerl.entrypoints.orchestrator", "rollouts to trainer batches (one process of a run)"),
    "trainer": (
        "primerl.entrypoints.trainer",
        "the FSDP2 RL trainer (one process of a run; torchrun for several ranks)",
    ),
}

USAGE = """usage: primerl COMMAND [OVERRIDES...]

Asynchronous RL for LLM agents: an FSDP2 trainer, vLLM inference and verifiers environments, configured with Hydra.

commands:
{commands}

examples:
  primerl train +experiment=reverse_text                  # SFT warm-start, then RL, on this machine
  primerl train +experiment=reverse_text trainer.max_steps=10 ledger=none
  primerl train -m +experiment=reverse_text seed=0,1,2     # a sweep, recorded as one parent run in MLflow
  primerl eval +experiment=reverse_text eval.run=outputs/reverse_text/RUN
  primerl compare --experiment reverse_text
  primerl rerun RUN_ID                                     # the same command again, tagged rerun_of
  primerl replay outputs/reverse_text/RUN                  # train its batches again, check against its record
  primerl train +experiment=reverse_text --cfg job        # print the composed config and exit

`primerl COMMAND --help` lists the config groups and their options. Docs: docs/ in the source repository.
"""


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    if sys.argv[1] in ("-V", "--version"):
        from primerl import __version__

        print(f"primerl {__version__}")
        sys.exit(0)
    command = sys.argv[1]
    if command not in COMMANDS:
        print(f"primerl: unknown command '{command}'; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[command][0])
    sys.argv = [f"primerl {command}", *sys.argv[2:]]
    status = (
        module.main()
    )  # compare, replay and rerun return their exit status; the Hydra entry points exit on failure themselves
    sys.exit(status if type(status) is int else 0)


if __name__ == "__main__":
    main()
