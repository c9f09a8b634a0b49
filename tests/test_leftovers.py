"""What a driver killed with -9 leaves behind: children that die with it, a lock that frees, and a rerun that clears
the rest. Real processes, real signals; no servers."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from primerl.inference.server import VllmServer, stop_side_by_side
from primerl.inference.vllm_args import ServerSpec
from primerl.launch.leftovers import claim_run_dir, clear_leftovers, run_processes
from primerl.transport.atomic import shared_staging_path, stale_temporaries
from primerl.transport.run_dir import scratch_prefix
from primerl.utils.errors import ConfigError, RunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_children_die_with_a_parent_killed_with_sigkill():
    parent_code = (
        "import subprocess, sys, time\n"
        "from primerl.utils.parent_death import dies_with_parent\n"
        "child = subprocess.Popen(dies_with_parent(['sleep', '600']), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = int(parent.stdout.readline())
    assert _wait(lambda: b"sleep" in open(f"/proc/{child}/cmdline", "rb").read())  # exec'd, alive
    time.sleep(0.3)
    assert not _gone(child)  # its own session: a signal to the parent's group would not reach it
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _wait(lambda: _gone(child))


def test_servers_that_hang_on_sigterm_stop_within_one_grace(tmp_path):
    # the inference wrapper's stop must end within the driver's grace, else the driver's SIGKILL cuts it short and
    # the servers (each leading its own group) outlive the run: one grace for all servers, not one each
    hanging = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)"
    )
    servers = []
    for port in (1, 2):
        server = VllmServer(ServerSpec(args=[], port=port), tmp_path / f"{port}.log")
        server.process = subprocess.Popen(
            [sys.executable, "-c", hanging], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        server.process.stdout.readline()  # its SIGTERM handler is set
        servers.append(server)
    grace_s = 2.0
    started = time.monotonic()
    stop_side_by_side(servers, grace_s)
    took = time.monotonic() - started
    assert all(server.process.poll() == -signal.SIGKILL for server in servers)
    assert grace_s <= took < 2 * grace_s - 0.5, took  # one after another would take two graces


def test_one_driver_per_run_directory(tmp_path):
    holder_code = (
        f"from pathlib import Path; from primerl.launch.leftovers import claim_run_dir; import time\n"
        f"lock = claim_run_dir(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunError, match=f"another driver \\(pid {holder.pid}\\) is running on {tmp_path}"):
        claim_run_dir(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)  # the kernel drops the lock with the process
    holder.wait()
    claim_run_dir(tmp_path).close()
    # a run inside another run's directory, or around it, would reach into it when cleaning up: refused at once
    runs = tmp_path.with_name(tmp_path.name + "-runs")  # beside tmp_path, itself a run directory above
    claim_run_dir(runs / "a").close()
    with pytest.raises(
        ConfigError, match=f"hydra.run.dir: {runs}/a/ablation is inside the run directory {runs}/a of another run$"
    ):
        claim_run_dir(runs / "a" / "ablation")
    with pytest.raises(ConfigError, match=f"hydra.run.dir: {runs} holds other runs' directories \\({runs}/a\\)"):
        claim_run_dir(runs)
    claim_run_dir(runs / "b").close()  # beside it: fine


def test_a_rerun_clears_processes_and_temporaries_a_dead_driver_left(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "weights").mkdir()
    # a process of the run that outlived its driver (as the launcher starts them: -m primerl.<process> ...
    # output_dir=<run>), and processes that must be left alone: another run's, a run nested in this one, and one
    # that is not primerl's but names the run (a monitor, a wrapper)
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    leftover = subprocess.Popen([*sleep, "-m", "primerl.entrypoints.trainer", f"output_dir={run}"])
    others = [
        subprocess.Popen([*sleep, "-m", "primerl.entrypoints.trainer", f"output_dir={run}-other"]),
        subprocess.Popen([*sleep, "-m", "primerl.entrypoints.trainer", f"output_dir={run}/ablation"]),
        subprocess.Popen([*sleep, "watch", f"output_dir={run}"]),
    ]
    # what atomic_dir and atomic_file leave when their process is killed mid-write (the names they use), and
    # vLLM's scratch dir
    staging = tempfile.mkdtemp(prefix=".primerl-tmp-step_000003-", dir=run / "weights")
    fd, partial = tempfile.mkstemp(prefix=".primerl-tmp-ledger_offsets.json-", suffix=".tmp", dir=run)
    (run / ".notes-20240101").write_text("a user's file")  # dot-named, dated: not a temporary of primerl's
    os.close(fd)
    shared = shared_staging_path(run / "checkpoints" / "step_000002")  # a checkpoint's ranks write it together
    shared.mkdir(parents=True)
    scratch = tempfile.mkdtemp(prefix=scratch_prefix(run, "vllm"))
    env_scratch = tempfile.mkdtemp(prefix=scratch_prefix(run, "env"))  # a killed orchestrator's env workers' sockets
    other_scratch = tempfile.mkdtemp(prefix=scratch_prefix(run / "ablation", "env"))
    try:
        assert run_processes(run) == [leftover.pid]
        assert stale_temporaries(run) == sorted(
            [
                run / "checkpoints" / shared.name,
                run / "weights" / os.path.basename(staging),
                run / os.path.basename(partial),
            ]
        )
        clear_leftovers(run, grace_s=0.5)
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert all(other.poll() is None for other in others)
        assert stale_temporaries(run) == [] and not os.path.exists(scratch) and not os.path.exists(env_scratch)
        assert os.path.isdir(other_scratch)  # another run's
        assert (run / ".hydra").is_dir() and (run / "weights").is_dir()
    finally:
        for process in (*others, leftover):
            process.kill()
        shutil.rmtree(other_scratch, ignore_errors=True)


def test_processes_sharing_a_cache_entry_take_turns(tmp_path, caplog):
    """What two sweep jobs with one SFT cache key do (primerl.launch.supervise.warm_start): the second waits, says so,
    and enters once the first is done with the entry."""
    from primerl.utils.locks import locked

    entry = tmp_path / "sft" / "reverse_text-1a2b3c"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from primerl.utils.locks import locked\n"
            f"with locked(Path({str(entry)!r})):\n    print('held', flush=True); time.sleep(1.5)\n"
            "print('released', flush=True)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with caplog.at_level("INFO", logger="primerl"), locked(entry, "waiting for the other warm-start"):
            waited = time.monotonic() - started
            assert holder.stdout.readline().strip() == "released"  # the holder was done before this one entered
        assert waited > 1.0 and "waiting for the other warm-start" in caplog.text
        with locked(entry, "never said: nobody holds it"):
            pass
        assert "never said" not in caplog.text
    finally:
        holder.kill()


def test_a_published_directory_is_removed_whole_and_a_fork_never_copies_half_of_one(tmp_path, monkeypatch):
    """Rotation renames a STABLE directory away before deleting it: midway through the deletion (here: cut short)
    no STABLE directory is left with some of its files, only a temporary the next start clears; a fork copying a
    checkpoint the parent removes meanwhile is a one-line ConfigError, not a partial checkpoint."""
    import primerl.transport.atomic as atomic
    from primerl.launch.fork import _seed_checkpoint
    from primerl.transport.atomic import STABLE_MARKER, remove_published

    published = tmp_path / "checkpoints" / "step_000001"
    published.mkdir(parents=True)
    for name in ("model.safetensors", "trainer_state.json", STABLE_MARKER):
        (published / name).write_text(name)

    def cut_short(path, ignore_errors=False):
        assert not published.exists()  # gone from its name before a single file is deleted
        os.unlink(next(p for p in sorted(path.iterdir()) if p.name == "model.safetensors"))
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", cut_short)
    with pytest.raises(KeyboardInterrupt):
        remove_published(published)
    monkeypatch.undo()
    assert not published.exists() and [p.name for p in stale_temporaries(tmp_path)][0].startswith(".primerl-tmp-")

    published.mkdir()
    (published / STABLE_MARKER).write_text("")
    link = atomic.os.link

    def removed_meanwhile(source, target):
        remove_published(published)  # the parent rotates it while the fork links its files
        link(source, target)

    monkeypatch.setattr("primerl.launch.fork.os.link", removed_meanwhile)
    with pytest.raises(ConfigError, match="was removed while it was copied"):
        _seed_checkpoint(published, tmp_path / "fork" / "step_000001", weights_only=False)
    assert not (tmp_path / "fork" / "step_000001").exists()


def test_a_slurm_job_whose_driver_stopped_renewing_its_lease_stops_its_process(tmp_path, monkeypatch):
    """A job's body (ModuleJob, run here as a plain call) keeps its process while the driver renews the lease, and
    stops it once the lease lapses (a driver killed with -9 renews nothing)."""
    from primerl.launch import lease as lease_module
    from primerl.launch.lease import DriverLease
    from primerl.launch.slurm_job import ModuleJob

    monkeypatch.setattr(lease_module, "RENEW_S", 0.2)
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parents[1]}:{os.environ.get('PYTHONPATH', '')}")
    lease = DriverLease(tmp_path)
    lease.start()
    job = ModuleJob("trainer", "tests.workers.sleeps", [], str(tmp_path), lease_s=2.0)
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: outcome.append(_raised(job)), daemon=True)
    thread.start()
    time.sleep(4.0)
    assert thread.is_alive()  # renewed: the job goes on
    lease.stop()  # the driver is gone
    thread.join(timeout=30)
    (err,) = outcome
    assert "the driver has not renewed its lease" in str(err) and "launcher.driver_lease_s" in str(err)
    from primerl.launch import slurm_job

    assert slurm_job._running.poll() is not None  # its process stopped with it


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as err:  # noqa: BLE001 - the test looks at it
        return err
    return None
