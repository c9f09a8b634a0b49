"""Whether the run's tracking server answers, before the run starts.

MLflow's own client retries a refused connection for about four minutes and then raises a traceback from deep in
its REST layer (measured: `primerl train ... ledger.tracking_uri=http://127.0.0.1:9`, 4 min 14 s). A run whose
record cannot be opened must not start, but a server that is restarting (a few seconds to a minute) should not stop
it either: the driver waits up to `ledger.connect_timeout_s`, saying so, and then stops with one line.

Any HTTP answer counts as an answer (an auth proxy's 401 included): only a refused, reset or silent connection is
a server that is down. Stores that are not HTTP (the embedded sqlite store, `databricks`) are not checked here.
"""

import urllib.error
import urllib.request
from urllib.parse import urlsplit

from primerl.utils.errors import RunError
from primerl.utils.log import get_logger
from primerl.utils.wait import WaitTimeout, wait_until

ATTEMPT_TIMEOUT_S = 5.0  # one /health request; a live server on loopback answers in milliseconds
log = get_logger(__name__)


def shown(uri: str) -> str:
    """The URI without credentials a user may have put in it (user:password@host)."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    return parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host).geturl()


def answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=ATTEMPT_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def wait_for_tracking_server(uri: str, timeout_s: float) -> None:
    """Return once the server at `uri` answers; RunError after `timeout_s` of no answer."""
    if urlsplit(uri).scheme not in ("http", "https") or answers(uri):
        return
    log.warning(f"the tracking server at {shown(uri)} does not answer; waiting up to {timeout_s:.0f} s for it")
    try:
        wait_until(lambda: answers(uri), f"the tracking server at {shown(uri)}", timeout_s, poll_s=1.0, note_every_s=15)
    except WaitTimeout:
        raise RunError(
            f"no tracking server answers at {shown(uri)} (waited {timeout_s:.0f} s): start it, point "
            "ledger.tracking_uri at another, or run without a record (ledger.enabled=false)"
        ) from None
    log.info(f"the tracking server at {shown(uri)} answers")
