"""The user docs match the product: every relative link resolves, every primerl command shown in a code block is a
valid config, and every metric key of primerl/metrics.py is documented."""

import json
import re
import shlex
from pathlib import Path

import pytest

from primerl.app import preflight
from primerl.metrics import OrchestratorMetric, TrainerMetric

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.S)
# a command is a config check when it starts one of the Hydra entry points
HYDRA_COMMANDS = re.compile(
    r"^(?:primerl (train|sft|eval|inference|orchestrator|trainer)|python -m primerl\.(train|sft|eval|inference|orchestrator|trainer)|torchrun .*?-m primerl\.entrypoints\.(sft|eval|trainer))\b"
)


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert len(PAGES) >= 10  # README and the topic pages


def shown_commands() -> list[tuple[str, str]]:
    commands = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if HYDRA_COMMANDS.match(line):
                    commands.append((f"{page.name}: {line}", line))
    return commands


def arguments(line: str) -> list[str]:
    """The Hydra arguments of a shown command: after `primerl COMMAND`, or after `-m primerl.<module>`."""
    argv = shlex.split(line)
    return argv[2:] if argv[0] == "primerl" else argv[argv.index("-m") + 2 :]


@pytest.mark.parametrize("line", [command for _, command in shown_commands()], ids=[n for n, _ in shown_commands()])
def test_every_command_shown_is_a_valid_config(line, tmp_path, monkeypatch, capsys):
    """The command line's own check (sweeps expanded), from a directory with the files the examples name."""
    monkeypatch.chdir(tmp_path)
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "demos.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "my-conf" / "launcher").mkdir(parents=True)
    (tmp_path / "my-conf" / "launcher" / "my_cluster.yaml").write_text("name: slurm\npartition: gpu\n")
    args = [a.replace("/path/to/my-conf", str(tmp_path / "my-conf")) for a in arguments(line)]
    try:
        preflight(args)
    except SystemExit as exit:
        pytest.fail(f"{line}: {capsys.readouterr().err.strip()} (exit {exit.code})")


def test_every_metric_key_is_documented():
    page = (ROOT / "docs" / "observability.md").read_text()
    keys = [v for cls in (OrchestratorMetric, TrainerMetric) for k, v in vars(cls).items() if k.isupper()]
    missing = [key for key in keys if f"`{key}`" not in page and key not in page]
    assert len(keys) > 30 and not missing, missing
