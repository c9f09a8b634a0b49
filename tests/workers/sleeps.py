"""A process that only waits (a stand-in for a run's process in a job whose lease is tested): `python -m
tests.workers.sleeps [ARGS...]` sleeps 600 s, whatever its arguments."""

import time

if __name__ == "__main__":
    time.sleep(600)
