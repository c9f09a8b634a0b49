"""SFT data (assistant-only masks, packing) and FSDP2 SFT runs on 1 and 2 gloo ranks."""

import json
import subprocess
import sys

import pytest
import torch
from primerl_reverse_text.texts import demonstration_answers, lcs_ratio, make_texts, prompt_messages
from transformers import AutoModelForCausalLM

from primerl.app import check
from primerl.config.model import TinyArchConfig
from primerl.entrypoints.sft import STOP_WINDOW, assistant_loss_sum, stop_reached
from primerl.model.tiny import build_tiny_model, build_tokenizer
from primerl.sft.cache import data_digest, sft_checkpoint_dir
from primerl.sft.data import IGNORE, PackedBatch, chat_example, conversation_example, load_conversations, pack
from primerl.sft.source import check_demonstrations
from primerl.trainer.logprobs import full_scores, next_tokens
from primerl.utils.errors import ConfigError
from tests.conftest import run_module


def _examples(n: int, seed: int = 0):
    tok = build_tokenizer()
    return tok, [chat_example(tok, prompt_messages(t), t[::-1]) for t in make_texts(seed, n)]


def test_chat_example_masks_only_the_answer():
    tok, (ex,) = _examples(1)
    answer_ids = [i for i, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert tok.decode(answer_ids) == make_texts(0, 1)[0][::-1] + "<|im_end|>"
    assert not any(ex.loss_mask[: ex.loss_mask.index(True)])


def test_conversation_example_masks_every_assistant_message():
    tok = build_tokenizer()
    messages = [
        {"role": "system", "content": "Guess."},
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "8"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "correct"},
    ]
    ex = conversation_example(tok, messages)
    assert tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m]) == "8<|im_end|>12<|im_end|>"
    # the trailing user turn teaches nothing and is left out; the prompt turns are present but unmasked
    assert "correct" not in tok.decode(ex.input_ids) and "higher" in tok.decode(ex.input_ids)
    assert chat_example(tok, messages[:2], "8").input_ids == conversation_example(tok, messages[:3]).input_ids


@pytest.mark.parametrize(
    "line, why",
    [
        ("not json", "line 2 is not JSON"),
        ('{"text": "hi"}', "line 2 has no 'messages' list"),
        ('{"messages": [{"role": "user"}]}', "line 2: every message needs a string 'role' and 'content'"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2 has no assistant message"),
    ],
)
def test_chat_dataset_rows_are_checked(tmp_path, line, why):
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    data = tmp_path / "data.jsonl"
    data.write_text(f"{good}\n{line}\n")
    with pytest.raises(ConfigError) as err:
        load_conversations(str(data))
    assert err.value.key == "sft.data" and why in err.value.message


def test_chat_dataset_from_a_datasets_directory(tmp_path):
    """A `save_to_disk` directory (Dataset or DatasetDict) reads as the same conversations as the same rows in JSONL."""
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "dd")
    expected = load_conversations(str(jsonl))
    check(["+experiment=reverse_text", "env=guess_number", f"sft.data={tmp_path / 'ds'}"])  # a directory is accepted
    assert load_conversations(str(tmp_path / "ds")) == expected == load_conversations(str(tmp_path / "dd"))
    # the SFT cache key covers the directory's contents: the same rows keep it, other rows change it
    key = data_digest(str(tmp_path / "ds"))
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds2")
    assert data_digest(str(tmp_path / "ds2")) == key != data_digest(str(tmp_path / "dd"))
    datasets.Dataset.from_list(rows[:2]).save_to_disk(tmp_path / "ds2")
    assert data_digest(str(tmp_path / "ds2")) != key

    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "no_train")
    datasets.Dataset.from_list([{"text": "hi"}]).save_to_disk(tmp_path / "no_messages")
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "q"}]}]).save_to_disk(tmp_path / "no_answer")
    (tmp_path / "empty").mkdir()
    for name, why in [
        ("no_train", "no 'train' split"),
        ("no_messages", "no 'messages' column"),
        ("no_answer", "row 0 has no assistant message"),
        ("empty", "not a datasets directory"),
        ("missing", "neither a JSONL file nor a datasets directory"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_conversations(str(tmp_path / name))
        assert err.value.key == "sft.data" and why in err.value.message, err.value.message


def test_sft_cache_key_follows_the_generator_version(monkeypatch):
    """A changed demonstration generator (its package's DEMONSTRATIONS_VERSION bumped) trains a new warm-start instead
    of reusing the old; so do other generator options."""
    import primerl_code_lookup
    import primerl_reverse_text

    for experiment, package in (("code_lookup", primerl_code_lookup), ("reverse_text", primerl_reverse_text)):
        cfg = check([f"+experiment={experiment}"])
        before = sft_checkpoint_dir(cfg)
        assert sft_checkpoint_dir(check([f"+experiment={experiment}"])) == before  # stable
        monkeypatch.setattr(package, "DEMONSTRATIONS_VERSION", package.DEMONSTRATIONS_VERSION + 1)
        assert sft_checkpoint_dir(cfg) != before
    cfg = check(["+experiment=reverse_text", "sft.demonstration_args.uppercase_fraction=0.25"])
    assert sft_checkpoint_dir(cfg) != sft_checkpoint_dir(check(["+experiment=reverse_text"]))


def test_pack_invariants():
    tok, examples = _examples(40)
    batch = pack(examples, seq_len=256, pad_id=tok.pad_token_id)
    assert batch.input_ids.shape[1] == 256
    assert batch.num_loss_tokens + batch.labels[:, 0].ne(IGNORE).sum() == sum(sum(e.loss_mask) for e in examples)
    # every sample appears once, contiguous, with positions restarting at 0
    starts = (batch.position_ids == 0).sum().item()
    assert starts >= len(examples)
    flat = [t for row in batch.input_ids.tolist() for t in row]
    packed_text = bytes(t for t in flat if t < 256).decode()
    for ex in examples:
        assert bytes(t for t in ex.input_ids if t < 256).decode() in packed_text
    assert batch.input_ids.shape[0] < len(examples)  # several samples share a row
    with pytest.raises(ValueError, match="does not fit"):
        pack(examples, seq_len=8, pad_id=0)


def test_packed_loss_equals_per_sample_loss(cache_dir):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(cache_dir), TinyArchConfig(), 0))
    tok, examples = _examples(6)

    def loss_sum(batch: PackedBatch) -> torch.Tensor:
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        return assistant_loss_sum(full_scores(logits, next_tokens(batch.input_ids)), batch.labels)

    packed = loss_sum(pack(examples, 256, tok.pad_token_id))
    separate = sum(loss_sum(pack([ex], len(ex.input_ids), tok.pad_token_id)) for ex in examples)
    assert packed.item() == pytest.approx(separate.item(), rel=1e-4)


def test_sloppy_demonstrations_are_reversals_some_in_capitals():
    texts = make_texts(0, 2000)
    clean = demonstration_answers(texts, 0.0, seed=0)
    assert clean == [t[::-1] for t in texts]
    sloppy = demonstration_answers(texts, 0.5, seed=0)
    capitals = [a for a in sloppy if a.isupper()]
    assert all(a.lower() == t[::-1] for a, t in zip(sloppy, texts))
    assert 900 < len(capitals) < 1100  # seeded, so the same answers every run
    assert sloppy == demonstration_answers(texts, 0.5, seed=0) != demonstration_answers(texts, 0.5, seed=1)
    assert lcs_ratio(capitals[0], capitals[0].lower()[::-1]) == 0.0  # the reward is case-sensitive


def test_stop_loss_compares_the_mean_of_the_last_window():
    assert not stop_reached([0.1] * (STOP_WINDOW - 1), 0.2)  # too few steps for a mean
    assert stop_reached([9.0] * 10 + [0.2] * STOP_WINDOW, 0.2)  # only the last window counts, and "at most"
    assert not stop_reached([0.1] * (STOP_WINDOW - 1) + [5.2], 0.2)  # mean 0.202
    assert not stop_reached([0.0] * 100, None)


def test_lcs_ratio():
    assert lcs_ratio("cba", "abc") == 1.0
    assert lcs_ratio("", "abc") == 0.0
    assert lcs_ratio(" cxa\n", "abc") == pytest.approx(2 * 2 / 6)


@pytest.mark.slow
def test_sft_one_rank_equals_two_ranks(tmp_path):
    args = ["+experiment=reverse_text", "sft.steps=4", "sft.batch_size=8", "sft.warmup_steps=2"]
    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"np{nproc}"
        result = run_module(
            "primerl.entrypoints.sft",
            *args,
            f"cache_dir={out}/cache",
            f"hydra.run.dir={out}",
            f"ledger.store_dir={tmp_path}/ledger",
            torchrun=nproc,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = json.loads((out / "sft_metrics.json").read_text())
        assert metrics["world_size"] == nproc
        assert (out / "cache" / "sft").is_dir()
        losses[nproc] = metrics["losses"]
        assert "sft:" in result.stderr  # the progress bar
        assert json.loads((out / "ledger.json").read_text())["run_id"]  # standalone SFT keeps an MLflow record
    assert len(losses[1]) == 4
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[1]), rtol=1e-4, atol=1e-5)
    assert losses[1][-1] < losses[1][0]


@pytest.mark.slow
def test_sft_from_a_chat_dataset(tmp_path):
    """A user's JSONL for an env without generated demonstrations: trains; bad input is one line, exit 2."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Guess a number below {n}."},
                {"role": "assistant", "content": str(n // 2)},
                {"role": "user", "content": "correct"},
            ]
        }
        for n in range(4, 20)
    ]
    data = tmp_path / "guesses.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "+experiment=reverse_text",
        "env=guess_number",
        "sft.steps=3",
        "sft.batch_size=4",
        "sft.warmup_steps=1",
        f"cache_dir={tmp_path}/cache",
        f"hydra.run.dir={tmp_path}/out",
        "ledger.enabled=false",
    ]
    result = run_module("primerl.entrypoints.sft", *args, f"sft.data={data}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "sft_metrics.json").read_text())
    assert len(metrics["losses"]) == 3 == metrics["steps"] and metrics["loss_final"] == metrics["losses"][-1]
    assert (tmp_path / "cache" / "sft").is_dir()
    # sft.stop_loss ends it at the first full window whose mean is low enough: here the first
    result = run_module(
        "primerl.entrypoints.sft", *args, f"sft.data={data}", f"sft.steps={STOP_WINDOW + 20}", "sft.stop_loss=100"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "sft_metrics.json").read_text())
    assert metrics["steps"] == len(metrics["losses"]) == STOP_WINDOW
    assert f"stopping at step {STOP_WINDOW}: mean loss of the last {STOP_WINDOW} steps" in result.stdout + result.stderr
    # bad input: one line, exit 2, on the command line (one case; the others by the check SFT runs first)
    result = run_module("primerl.entrypoints.sft", *args, "sft.data=null")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert "sft.data: no demonstrations for env.id=primerl-guess-number" in result.stderr
    for bad, why in (
        ([f"sft.data={tmp_path}/missing.jsonl"], "sft.data: "),
        ([f"sft.data={data}x"], "is neither a JSONL file nor a datasets directory"),
        ([f"sft.data={data}", "sft.seq_len=16"], f"sft.seq_len: {data} conversation 0 is "),
        # options the env's own generator refuses (primerl.envs.demonstrations)
        (
            ["env=reverse_text", "sft.demonstration_args.uppercase_fraction=1.0"],
            "sft.demonstration_args: primerl-reverse-text: uppercase_fraction must be >= 0 and < 1, got 1.0",
        ),
    ):
        with pytest.raises(ConfigError) as refused:
            check_demonstrations(check([*(a for a in args if not a.startswith("hydra.")), *bad]))
        assert why in f"{refused.value.key}: {refused.value.message}"


def test_an_env_without_demonstrations_starts_rl_from_the_base_model(caplog):
    """The driver's decision before anything starts (`primerl.train` with `env.id=primerl-guess-number`, SFT on): no SFT, said
    once. The mixture's case runs through the driver in tests/test_rl_e2e.py."""
    from primerl.launch.supervise import sft_needed

    assert not sft_needed(check(["+experiment=reverse_text", "env=verifiers", "env.id=primerl-guess-number"]))
    assert "no SFT warm-start: no demonstrations for env.id=primerl-guess-number" in caplog.text


def test_the_processes_of_a_run_read_the_drivers_start_model_without_importing_the_env(tmp_path):
    """The driver decides the start model (importing the env's package for its demonstrations hook: verifiers, ~5 s
    on 2 cores) and records it in the run; a process of the run with the same config reads it back without that
    import, and one whose config differs in what the decision depends on decides again."""
    from primerl.launch.start import decide_start_model, prepare_start_model, record_start_model

    overrides = ["+experiment=reverse_text", f"output_dir={tmp_path}"]
    recorded = record_start_model(check(overrides))
    assert recorded == decide_start_model(check(overrides))  # the SFT warm-start's directory
    code = (
        "import sys; from primerl.app import check; from primerl.launch.start import prepare_start_model; "
        f"print(prepare_start_model(check({overrides!r}))); print('primerl_reverse_text' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [recorded, "False"]
    other = check([*overrides, "sft.enabled=false"])
    assert prepare_start_model(other) == decide_start_model(other) != recorded
