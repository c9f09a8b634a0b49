"""Episode journals (primerl.envs.episode_journal): the transport records each finished turn of a journaled rollout
and serves it again for the same request; the server stamps the version it served; the orchestrator keeps a journal
while its task may run and drops turns too stale to train. The rollout across a real server: tests/test_inference.py.
"""

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from primerl.envs import http_transport
from primerl.envs.episode_journal import EPISODE_KEY, Journals, read_turns
from primerl.envs.http_transport import AiohttpTransport
from primerl.inference.served_version import ServedPolicyVersion
from primerl.orchestrator.episodes import EpisodeJournals
from primerl.transport.weights import POLICY_VERSION_HEADER
from tests.loopback import loopback_server


def _generate_route(seen: list, version: list) -> dict:
    """A stand-in engine's route: answers each generate request with its count, stamps `version[0]`; status 500 for a
    request whose token ids start with 0."""

    async def generate(request):
        body = await request.read()
        seen.append(json.loads(body))
        status = 500 if seen[-1]["token_ids"][0] == 0 else 200
        answer = {"answer": len(seen)}
        return web.json_response(answer, status=status, headers={POLICY_VERSION_HEADER: str(version[0])})

    return {("POST", "/inference/v1/generate"): generate}


def test_a_journaled_turn_is_recorded_once_and_served_again_for_the_same_request_only(tmp_path, monkeypatch):
    journal = str(tmp_path / "episodes" / "task3-1.jsonl")

    def body(token_ids, episode=journal):
        params = {"max_tokens": 4, **({EPISODE_KEY: episode} if episode else {})}
        return {"model": "policy", "token_ids": token_ids, "sampling_params": params}

    async def main():
        seen, version = [], [5]
        async with (
            loopback_server(_generate_route(seen, version)) as url,
            httpx.AsyncClient(transport=AiohttpTransport(httpx.Limits())) as client,
        ):
            post = lambda b: client.post(f"{url}/inference/v1/generate", json=b)  # noqa: E731
            first = await post(body([1, 2]))
            assert first.json() == {"answer": 1} and first.headers[POLICY_VERSION_HEADER] == "5"
            assert EPISODE_KEY not in seen[0]["sampling_params"]  # the key never leaves this process
            version[0] = 6
            second = await post(body([1, 2, 9, 3]))  # the next turn: recorded at v6
            assert second.json() == {"answer": 2}
            failed = await post(body([0, 1]))
            assert failed.status_code == 500  # an error is not a turn: not recorded
            plain = await post(body([1, 2], episode=None))  # a rollout that is not journaled goes to the server
            assert plain.json() == {"answer": 4}
            elsewhere = tmp_path / "episodes" / "notes.txt"  # the key writes files: only a journal's name is taken
            assert (await post(body([7], episode=str(elsewhere)))).json() == {"answer": 5}
            assert not elsewhere.exists() and EPISODE_KEY not in seen[-1]["sampling_params"]

            # a restarted process (nothing cached), its journal cut by a kill mid-append
            with open(journal, "a") as out:
                out.write('{"request": "ab')
            monkeypatch.setattr(http_transport, "JOURNALS", Journals())
            again = await post(body([1, 2]))
            assert again.json() == {"answer": 1} and again.headers[POLICY_VERSION_HEADER] == "5"
            assert (await post(body([1, 2, 9, 3]))).json() == {"answer": 2}
            assert len(seen) == 5  # both served from the journal
            diverged = await post(body([1, 2, 9, 4]))  # the env asked something else: live, and recorded
            assert diverged.json() == {"answer": 6} and len(seen) == 6

    asyncio.run(main())
    turns = read_turns(tmp_path / "episodes" / "task3-1.jsonl")
    assert [t.version for t in turns.values()] == [5, 6, 6]


def _asgi_call(app, path: str, body: dict) -> tuple[int, dict]:
    """Run one POST through the middleware `app`; (status, headers) the client got."""
    sent: list = []

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_the_server_stamps_each_answer_with_the_version_its_last_successful_load_made_it_serve():
    status_of_load = [200]

    async def engine(scope, receive, send):
        request = json.loads((await receive())["body"])
        code = status_of_load[0] if scope["path"] == "/collective_rpc" else 200
        await send(
            {"type": "http.response.start", "status": code, "headers": [(b"x-seen", request.get("m", "").encode())]}
        )
        await send({"type": "http.response.body", "body": b"{}"})

    app = ServedPolicyVersion(engine)
    assert _asgi_call(app, "/inference/v1/generate", {"m": "g"})[1][POLICY_VERSION_HEADER] == "0"
    load = {"method": "primerl_load_weights", "args": ["/run/weights/step_7", "7", ""], "m": "rpc"}
    assert _asgi_call(app, "/collective_rpc", load)[1]["x-seen"] == "rpc"  # the engine still gets the body
    assert _asgi_call(app, "/v1/chat/completions", {})[1][POLICY_VERSION_HEADER] == "7"
    status_of_load[0] = 500
    _asgi_call(app, "/collective_rpc", {**load, "args": ["/run/weights/step_9", "9", ""]})
    _asgi_call(app, "/collective_rpc", {"method": "primerl_get_policy_version", "args": []})
    assert _asgi_call(app, "/inference/v1/generate", {})[1][POLICY_VERSION_HEADER] == "7"  # a failed load: still v7
    assert POLICY_VERSION_HEADER not in _asgi_call(app, "/tokenize", {})[1]


def test_journals_live_while_their_task_may_run_and_turns_too_stale_to_train_are_sampled_afresh(tmp_path):
    journals = EpisodeJournals(tmp_path)

    def write(task: int, sample: int, versions: list[int | None]) -> None:
        path = journals.path(task, sample)
        path.parent.mkdir(exist_ok=True)
        lines = [{"request": f"{task}-{sample}-{i}", "body": "{}", "version": v} for i, v in enumerate(versions)]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    write(4, 0, [3, 4])
    write(4, 1, [5])
    write(7, 0, [2])
    write(9, 0, [8])
    write(12, 0, [9])
    write(2, 0, [1])  # task 2 was settled by the batch a kill came right after: not owed, before the position
    journals.begin([4, 7, 9], position=10)  # a restarted orchestrator owes these and goes on at task 10
    assert not journals.path(2, 0).exists()
    assert sorted([5, 4, 12, 9, 7], key=journals.newest_first) == [12, 9, 4, 7, 5]  # ...and runs them so
    assert journals.kept_turns(5, oldest_usable=0) is None  # nothing kept for task 5
    assert journals.kept_turns(4, oldest_usable=3) == 3 and journals.resumed_turns == 3
    assert journals.kept_turns(4, oldest_usable=3) is None  # drawn once per incarnation: what it writes now is its own
    assert journals.kept_turns(7, oldest_usable=3) is None and journals.stale_turns == 1  # v2 < 3: run afresh
    assert not journals.path(7, 0).exists()
    # a batch lists 9 as trained and 13 as spent (13 kept no journal): theirs go, by name, and the others stay
    journals.settled([9, 13], group_size=2)
    assert sorted(p.name for p in journals.directory.iterdir()) == ["task12-0.jsonl", "task4-0.jsonl", "task4-1.jsonl"]


@pytest.mark.parametrize("body", [b"{}", b'{"sampling_params": []}', b"not json " + EPISODE_KEY.encode()])
def test_a_request_that_names_no_journal_goes_out_unchanged(body):
    from primerl.envs.episode_journal import strip_episode

    assert strip_episode(body) == (body, None)


@pytest.mark.slow
@pytest.mark.xdist_group("vllm-server")
def test_a_rollout_cut_short_continues_at_its_next_turn_on_a_real_server_with_each_turns_version(server):
    """guess_number (8 turns at most) against the real server, journaled: a rollout at v41, its journal cut to its
    first 2 turns (what a kill after turn 2 leaves), then v42 loaded and the rollout run again in an env worker
    process. Turns 1 and 2 come from the journal (the server is asked only for the later turns), with their tokens and
    log-probs as sampled; turn 3 on is sampled by v42, and the journal records which version sampled each turn."""
    import itertools

    from primerl.app import check
    from primerl.envs.episode_journal import EPISODE
    from primerl.envs.verifiers_env import env_config, env_runner, load_env
    from primerl.envs.workers import EnvWorkers, WorkerRunner
    from primerl.inference.engine_log import SERVED_REQUEST
    from primerl.transport.run_dir import weights_path
    from primerl.utils.wait import wait_until_async
    from tests.served import API_KEY, client_call, publish_perturbed, save_perturbed

    cfg = check(
        ["+experiment=reverse_text", "env=guess_number", "env.args.max_turns=8", f"inference.api_key={API_KEY}"]
    )
    env = load_env(cfg.env)
    runner = env_runner(env, str(server.model_dir), cfg.inference, 1.0, 6, base_url=server.base_url)
    runner.journaled = True
    journals = EpisodeJournals(server.run_dir / "journal-test")
    client_call(server, "load_weights", save_perturbed(server.model_dir, weights_path(server.run_dir, 41), 0.0, 0), 41)

    def served() -> int:
        return len(SERVED_REQUEST.findall(server.log_path.read_bytes()))

    async def rollout(task, journal, by=runner):
        EPISODE.set(str(journal))
        return (await by.run(task))[0]

    def sampled(rollout) -> list[tuple[int, float]]:
        return [(t, lp) for b in rollout.branches for t, m, lp in zip(b.token_ids, b.sampled_mask, b.logprobs) if m]

    def assistant(rollout) -> list[str]:
        return [m["content"] for m in rollout.transcript if m["role"] == "assistant"]

    async def main():
        for index, task in enumerate(itertools.islice(iter(env.taskset), 8)):  # a task whose episode lasts 4+ turns
            journal = journals.path(index, 0)
            first = await rollout(task, journal)
            if len(assistant(first)) >= 4:
                break
        lines = journal.read_bytes().splitlines()
        assert len(lines) == len(assistant(first)) and all(json.loads(line)["version"] == 41 for line in lines)
        journal.write_bytes(b"\n".join(lines[:2]) + b"\n")
        new_weights = publish_perturbed(server, 42, 0.05, seed=2)
        await asyncio.to_thread(client_call, server, "load_weights", new_weights, 42)
        pool = EnvWorkers("guess", env_config(cfg.env), 1, 60, 120, task_type=type(env.taskset).task_type())
        async with pool:  # run again in another process, as after a crash: an env worker reads the journal
            before = served()
            again = await rollout(task, journal, WorkerRunner(pool, runner.ctx, journaled=True))
        live = len(assistant(again)) - 2
        await wait_until_async(lambda: served() >= before + live, "the access lines of the live turns", 10)
        return first, again, lines, before, live, journal

    first, again, lines, before, live, journal = asyncio.run(main())
    assert served() == before + live  # turns 1-2 never reached the server
    assert assistant(again)[:2] == assistant(first)[:2]
    kept = sum(len(json.loads(json.loads(line)["body"])["choices"][0]["token_ids"]) for line in lines[:2])
    assert sampled(again)[:kept] == sampled(first)[:kept]  # the kept turns' tokens and log-probs, as sampled
    versions = [json.loads(line)["version"] for line in journal.read_bytes().splitlines()]
    assert versions == [41, 41] + [42] * live and live >= 1
