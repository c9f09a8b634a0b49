"""The two failures a primerl process reports in one clear line (primerl.app.hydra_app): a `ConfigError`
(exit 2) for a config value that cannot work, and a `RunError` (exit 1) for a corrupt file, a failed write, training
that went non-finite, an environment that fails every rollout. Anything else that escapes is a bug, and keeps its
traceback. A leaf module: raising either imports nothing else of primerl."""

import asyncio
import contextlib


class ConfigError(ValueError):
    """A config value that cannot work; `key` is the dotted path a user would override."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class RunError(RuntimeError):
    pass


@contextlib.contextmanager
def writing(what: str, consequence: str):
    """A write that fails (full disk, quota, I/O error) becomes a RunError naming what and why. Every file and directory
    primerl writes appears atomically (primerl.transport.atomic), so a rerun resumes from the last complete one."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError, RunError):  # a RunError already says what and why
        raise
    except BaseException as err:  # safetensors, the OS and torch's DCP (a BaseException) each raise their own type
        cause = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        why = (str(cause).splitlines() or [""])[0][:200]
        raise RunError(
            f"could not write the {what} ({type(cause).__name__}: {why}); "
            f"{consequence}. Free space and rerun: the run resumes"
        ) from err
