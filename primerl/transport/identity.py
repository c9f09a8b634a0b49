"""Which run an inference server belongs to, proven before the run's key is sent to it.

A second run on the same address (the default `inference.port`, say) would pass every readiness check on the first
run's server, and another local user can bind a server's port while it restarts: whatever answers there would then be
sent the run's key with the next request. So:

- every response of a primerl server carries `x-primerl-server: <id>`, a hash of the run directory (primerl.inference.
  guard, from `PRIMERL_SERVER_ID`): a label, which tells two runs of one user apart, and which anyone can compute;
- a server with a key proves it holds the key: a request to `/health` (open without the key) that carries
  `x-primerl-challenge: <nonce>` is answered with `x-primerl-proof: HMAC(sha256(key), "primerl-server|port|nonce")`,
  `port` the one it listens on (a foreigner that relays the challenge to another server of the run gets a proof for
  that server's port, not its own);
- every client that sends the key proves each new connection first (`challenge_request`, `verified`): before any
  request with the key goes over a connection, a `/health` with a fresh nonce goes over it, and a connection whose
  answer is not the proof is closed with `NotOurServer`. The clients: the orchestrator's admin calls
  (primerl.orchestrator.inference_client), the prefill/decode router's calls to its servers (primerl.inference.
  pd_router), the rollouts' HTTP (primerl.envs.http_transport), and the launcher's readiness check.

Without a key (a process started alone without one) there is nothing to prove and nothing to leak: the label alone
tells the run's servers apart.
"""

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path

SERVER_ID_ENV = "PRIMERL_SERVER_ID"
SERVER_ID_HEADER = "x-primerl-server"
CHALLENGE_HEADER = "x-primerl-challenge"
PROOF_HEADER = "x-primerl-proof"
_MAX_ANSWER = 16384  # bytes of a /health answer's head: more is not a primerl server


class NotOurServer(ConnectionError):
    """What answers at an address is not the run's server: no proof of the run's key."""


def server_identity(run_dir: str | Path) -> str:
    """The id of the run at `run_dir` (its resolved path: the same on every node of a shared filesystem)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def served_by(headers: Mapping[str, str], identity: str | None) -> bool:
    """Whether a response with these headers came from the run whose id is `identity` (None: any server will do)."""
    return identity is None or headers.get(SERVER_ID_HEADER) == identity


def new_challenge() -> str:
    return secrets.token_hex(16)


def key_digest(key: str) -> bytes:
    """The key as servers and clients keep it in memory (the guard compares requests' keys by it too)."""
    return hashlib.sha256(key.encode()).digest()


def proof(digest: bytes, nonce: str, port: int) -> str:
    """What a server holding the key of `digest`, listening on `port`, answers to the challenge `nonce`."""
    return hmac.new(digest, f"primerl-server|{port}|{nonce}".encode(), "sha256").hexdigest()


def proves(headers: Mapping[str, str], key: str, nonce: str, port: int) -> bool:
    return hmac.compare_digest(headers.get(PROOF_HEADER, ""), proof(key_digest(key), nonce, port))


def challenge_request(host: str, port: int, nonce: str) -> bytes:
    """The bytes of a `/health` request with the challenge, as a client writes them on a new connection."""
    return f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n{CHALLENGE_HEADER}: {nonce}\r\n\r\n".encode("latin-1")


class ChallengeAnswer:
    """The answer to `challenge_request`, fed as it arrives (`feed`, True once whole); the connection is then at the
    end of it, free for the client's own requests."""

    def __init__(self) -> None:
        self.data = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self._body = -1  # the body's length, once the head is read

    def feed(self, chunk: bytes) -> bool:
        if not chunk:
            raise NotOurServer("the connection closed before a whole answer to the identity challenge")
        self.data += chunk
        if self._body < 0:
            head, found, _ = self.data.partition(b"\r\n\r\n")
            if not found:
                if len(self.data) > _MAX_ANSWER:
                    raise NotOurServer("no HTTP answer to the identity challenge")
                return False
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise NotOurServer("no HTTP answer to the identity challenge")
            self.status = int(parts[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
            length = self.headers.get("content-length", "")
            if not length.isdigit() or "chunked" in self.headers.get("transfer-encoding", ""):
                raise NotOurServer("an answer to the identity challenge without a length")
            self._body = len(head) + 4 + int(length)
        if len(self.data) < self._body:
            return False
        if len(self.data) > self._body:
            raise NotOurServer("more than one answer to the identity challenge")
        return True

    def check(self, key: str, nonce: str, port: int, where: str) -> None:
        """Raise NotOurServer unless the answer proves the run's key."""
        if self.status != 200 or not proves(self.headers, key, nonce, port):
            raise NotOurServer(
                f"{where} is not this run's server: it does not prove the run's key (status {self.status}); nothing "
                "is sent to it"
            )
