"""Config composition of every experiment and group option, and one-line errors for bad input."""

from pathlib import Path

import pytest

from primerl.config.cli import CONF_DIR, check, format_config_error
from primerl.config.errors import ConfigError
from primerl.config.validate import resolve_dp_shard
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


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("env", "verifiers"):
        overrides.append("env.id=some-env")
    if (group, option) == ("parallelism", "fsdp2_ep"):
        overrides.append("model=tiny_moe")
    check(overrides)


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        (["trainer.lr=1e-5"], "trainer.lr", "allowed keys: seq_len"),
        (["trainer.seq_len=long"], "trainer.seq_len", "could not be converted to Integer"),
        (["model.source=bogus"], "model.source", "expected one of [tiny, hub, path]"),
        (["model=gpt9"], "model=gpt9", "available: qwen3_0_6b, tiny"),
        (["orchestrator.batch_size=30"], "orchestrator.batch_size", "not divisible by orchestrator.group_size=8"),
        (["orchestrator.async_level=-1"], "orchestrator.async_level", "must be >= 0"),
        (["inference.host=0.0.0.0"], "inference.api_key", "not a loopback address"),
        (["parallelism=fsdp2_ep"], "parallelism.ep", "needs a MoE model"),
        (["model=tiny_moe", "parallelism.ep=3"], "parallelism.ep", "must divide model.arch.num_experts=4"),
        (["env=verifiers"], "env.id", "is required"),
        (["model.source=path"], "model.path", "required when model.source=path"),
        (["model.source=path", "model.path=/no/such/model"], "model.path", "not a Hugging Face model directory"),
        (["trainer.checkpoint_every=0"], "trainer.checkpoint_every", "must be >= 1"),
        (
            ["parallelism=fsdp2_cp", "trainer.seq_len=511", "inference.max_model_len=256"],
            "trainer.seq_len",
            "511 is not divisible by parallelism.cp=2",
        ),
        (["sft.seq_len=4096"], "sft.seq_len", "exceeds model.arch.max_position_embeddings"),
        (["sft.uppercase_fraction=1.0"], "sft.uppercase_fraction", "must be in [0, 1), got 1.0"),
        (["launcher.name=k8s"], "launcher.name", "is not one of [local, slurm]"),
        (["launcher.trainer_nodes=2"], "launcher.trainer_nodes", "need launcher=slurm"),
        (["launcher=slurm", "launcher.time_limit_min=1"], "launcher.signal_delay_s", "not shorter than the time limit"),
        (["launcher=slurm", "inference=vllm_pd"], "inference.pd.enabled", "not placed by launcher=slurm"),
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
    result = run_module("primerl.sft", *args, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(expected), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_inference_refuses_gpu_only_settings_on_cpu():
    result = run_module("primerl.inference", "inference=vllm_fp8", "inference.device=cpu", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "primerl: config error: inference.quantization: fp8 weights need a CUDA GPU (Ada/Hopper); not on CPU"
    )


def test_hydra_flags_with_values_are_not_overrides():
    from primerl.config.cli import overrides_in

    assert overrides_in(["--cfg", "job", "-p", "trainer", "seed=1", "-m", "a=1,2"]) == ["seed=1", "a=1,2"]
    result = run_module("primerl.sft", "+experiment=reverse_text", "--cfg", "job", timeout=120)
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
