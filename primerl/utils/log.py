"""One logging set-up for every primerl process: one format, levels, and the same two streams everywhere.

    10:42:07 INFO    orchestrator: step 3: reward 0.412, 64 samples (policy v3, failed 0), 2.1s
    10:42:09 WARNING orchestrator.dispatcher: group 17 cancelled: ...

INFO and DEBUG go to stdout, WARNING and above to stderr (a launcher sends both to `<run>/logs/<process>.log`; at a
terminal, errors stand apart). Loggers are named `primerl.<process>[.<component>]`; the format drops the `primerl.`.
Other libraries log at WARNING and above only. `PRIMERL_LOG_LEVEL=DEBUG` shows more of primerl.
"""

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(short_name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
_configured = False


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.short_name = record.name.removeprefix("primerl.")
        return super().format(record)


def get_logger(name: str) -> logging.Logger:
    """The logger of a process or component: `get_logger("orchestrator")`, `get_logger(__name__)`."""
    return logging.getLogger(name if name.startswith("primerl") else f"primerl.{name}")


def configure_logging() -> None:
    """Install the handlers once per process (idempotent)."""
    global _configured
    if _configured:
        return
    formatter = _Formatter(FORMAT, DATE_FORMAT)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    root = logging.getLogger()
    for handler in list(root.handlers):  # whatever a library installed first (Hydra's own set-up, basicConfig)
        root.removeHandler(handler)
    for handler in (out, err):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("primerl").setLevel(os.environ.get("PRIMERL_LOG_LEVEL", "INFO").upper())
    _configured = True


def adopt_logger(name: str) -> None:
    """Let a library's logger (MLflow's, which installs a handler and a format of its own at import) print through
    primerl's handlers and format instead, at WARNING and above as every other library."""
    adopted = logging.getLogger(name)
    for handler in list(adopted.handlers):
        adopted.removeHandler(handler)
    adopted.propagate = True
    adopted.setLevel(logging.WARNING)
