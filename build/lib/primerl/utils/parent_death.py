"""Run a command that dies with its parent: `python -m primerl.utils.parent_death PARENT_PID SIGNAL -- CMD...`.

Linux's PR_SET_PDEATHSIG, set here and kept across `exec`, sends SIGNAL to CMD when the process that started it
exits, however it exits (kill -9 included). Without it, a driver killed with -9 would leave its children running
(each leads its own process group), and a rerun of the same command would start a second trainer beside them.
PARENT_PID closes the race of a parent that died before the signal was armed. (`preexec_fn` could set it too, but
it is unsafe in a process with threads, and the driver has some: MLflow's system-metrics monitor.)
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def dies_with_parent(cmd: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`cmd`, prefixed so that it receives `sig` when the calling process exits."""
    return [sys.executable, "-m", "primerl.utils.parent_death", str(os.getpid()), str(int(sig)), "--", *cmd]


def main(argv: list[str]) -> None:
    parent, sig, separator, *cmd = argv
    if separator != "--" or not cmd:
        raise SystemExit("usage: python -m primerl.utils.parent_death PARENT_PID SIGNAL -- CMD...")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # the parent is already gone: the signal will never come
        raise SystemExit(f"parent {parent} exited before {cmd[0]} started")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
