"""Reading a vLLM server's log: the engine's own error among what a dying process prints, whether a start came up,
and whether it answered a generation request (primerl.inference.server quotes them when a server exits)."""

import re

STARTUP_COMPLETE = b"Application startup complete"  # uvicorn's line once vLLM's HTTP server serves
# uvicorn's access line of a generation request answered 2xx (`127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200 OK`)
SERVED_REQUEST = re.compile(rb'"POST /(?:inference/)?v1/(?:chat/completions|completions|generate) HTTP/[\d.]+" 2\d\d')
# an exception's last line, as Python prints it ("RuntimeError: ..."), wherever a log prefix puts it
_ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.+)$")
# a vLLM log record below ERROR ("(APIServer pid=1) WARNING 12-06 15:41:13 [x.py:1] ..."): it may quote an error
# ("fd limit errors like `OSError: [Errno 24] Too many open files`") without being one
_NOT_AN_ERROR = re.compile(r"\b(?:WARNING|INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d\b")


def engine_error(log_text: str) -> str | None:
    """The last exception line of a vLLM log ("RuntimeError: Unsupported CPU attention configuration: ..."), not the
    reports that follow a dying process (nanobind's leak lists, warnings); None when there is none."""
    for line in reversed(log_text.splitlines()):
        found = _ERROR_LINE.search(line)
        if found and not line.lstrip().startswith(("nanobind", "-")) and not _NOT_AN_ERROR.search(line):
            return f"{found.group(1)}: {found.group(2).strip()}"[:400]
    return None
