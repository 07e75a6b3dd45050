"""assets.py: deterministic offline build, torchtitan can read the result, bad files are named."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import assets
from harness.assets import DATA, FILES, TOKENIZER, TOKENIZER_CONFIG, AssetError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("built")
    assets.build(root)
    return root


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A private copy of the built assets, free to damage."""
    root = tmp_path / "copy"
    shutil.copytree(built, root)
    return root


def test_build_is_byte_identical(built, tmp_path):
    # A fresh process, so nothing (hash seeds, thread pools) is shared with the first build.
    subprocess.run(
        [sys.executable, "-c", f"from harness import assets; assets.build({str(tmp_path)!r})"], cwd=REPO, check=True, timeout=120
    )
    for f in FILES:
        assert (tmp_path / f).read_bytes() == (built / f).read_bytes(), f


def test_torchtitan_tokenizer_round_trips(built):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(built / "tokenizer"))
    assert tok.get_vocab_size() == assets.vocab_size(built) == 2048
    assert tok.bos_id is not None and tok.eos_id is not None and tok.bos_id != tok.eos_id
    docs = [json.loads(line)["text"] for line in (built / DATA).read_text().splitlines()]
    assert docs == assets.pydoc_docs()
    samples = [d for d in docs if d.startswith(" ")][:3] + [d for d in docs if "\n   " in d][:3] + docs[:2]
    samples += ["  two leading spaces\n\n\tand a tab, trailing space \n", "naïve “quotes” — ß°…"]
    for text in samples:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert max(ids) < 2048
        assert tok.decode(ids[1:-1]) == text


def test_torchtitan_dataset_reads_it_offline(built, tmp_path, monkeypatch):
    import datasets
    import torch
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    # Keep the Arrow cache that load_dataset writes out of the user's home.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    tok = HuggingFaceTokenizer(str(built / "tokenizer"))
    firsts = []
    for rank in range(2):
        ds = HuggingFaceTextDataset("c4_test", str(built / "c4_test"), tok, seq_len=64, dp_rank=rank, dp_world_size=2)
        samples = list(ds)
        assert len(samples) > 100
        x, label = samples[0]
        assert x["input"].dtype == label.dtype == torch.long
        assert x["input"].shape == label.shape == (64,)
        assert x["input"][0] == tok.bos_id
        assert (x["input"][1:] == label[:-1]).all()  # labels are the inputs shifted by one
        firsts.append(x["input"])
    assert not (firsts[0] == firsts[1]).all()


def _damage(root: Path, path: Path, content: str) -> None:
    (root / path).write_text(content)


@pytest.mark.parametrize(
    "path, content, complaint",
    [
        (TOKENIZER, None, "not a tokenizer"),  # truncated
        (DATA, '{"text": "fine"}\n{"url": "x"}\n', 'line 2 has no string field "text"'),
        (DATA, '{"text": "fine"}\nnot json\n', "line 2 is not JSON"),
        (DATA, '{"text": 3}\n', 'line 1 has no string field "text"'),
        (DATA, "", "holds no documents"),
        (TOKENIZER_CONFIG, json.dumps({"bos_token": assets.BOS}), "no eos_token"),
        (TOKENIZER_CONFIG, json.dumps({"bos_token": assets.BOS, "eos_token": "<|eot_id|>"}), "not in"),
        (TOKENIZER_CONFIG, "[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_file_is_named(copy, path, content, complaint):
    if content is None:
        content = (copy / path).read_text()[:5000]
    _damage(copy, path, content)
    with pytest.raises(AssetError) as e:
        assets.check(copy)
    msg = str(e.value)
    assert str(copy / path) in msg and complaint in msg and "harness.assets" in msg


@pytest.mark.parametrize("path", FILES)
def test_missing_file_is_named(copy, path):
    (copy / path).unlink()
    with pytest.raises(AssetError, match="missing") as e:
        assets.check(copy)
    assert str(copy / path) in str(e.value)


def test_vocab_larger_than_model(built):
    assets.check(built, vocab_size=2048)
    with pytest.raises(AssetError, match="2048 tokens but the model's embedding has only 1000 rows") as e:
        assets.check(built, vocab_size=1000)
    assert str(built / TOKENIZER) in str(e.value)


def test_torchtitan_style_config(copy):
    # torchtitan's test tokenizer names its BOS/EOS only in added_tokens_decoder (ids past
    # the vocab) and also declares a pad token; HuggingFaceTokenizer adds all three.
    config = {
        "added_tokens_decoder": {
            "128000": {"content": "<|bos|>", "special": True},
            "128001": {"content": "<|eos|>", "special": True},
        },
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
    }
    _damage(copy, TOKENIZER_CONFIG, json.dumps(config))
    with (copy / DATA).open("a") as f:  # C4 lines carry extra fields
        f.write(json.dumps({"text": "more", "url": "https://example.com", "timestamp": "2019"}) + "\n")
    assets.check(copy, vocab_size=2051)
    assert assets.vocab_size(copy) == 2051
    with pytest.raises(AssetError, match="2051 tokens"):
        assets.check(copy, vocab_size=2048)

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assert HuggingFaceTokenizer(str(copy / "tokenizer")).get_vocab_size() == 2051


def test_ensure_builds_once(tmp_path):
    logged = []
    assert assets.ensure(tmp_path, log=logged.append) is True
    assert len(logged) == 1 and "built c4_test/ and tokenizer/" in logged[0]
    assert all((tmp_path / f).is_file() for f in FILES)
    assert assets.ensure(tmp_path, log=logged.append) is False
    assert len(logged) == 1


def test_ensure_refuses_bad_assets(copy):
    _damage(copy, DATA, "garbage\n")
    with pytest.raises(AssetError, match="not JSON"):
        assets.ensure(copy, log=pytest.fail)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.assets", *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_cli_builds_then_leaves_alone(tmp_path):
    first = _cli("--root", str(tmp_path))
    assert first.returncode == 0, first.stderr
    assert "wrote" in first.stdout and "288 documents" in first.stdout and "vocab size 2048" in first.stdout
    before = {f: (tmp_path / f).stat().st_mtime_ns for f in FILES}
    second = _cli("--root", str(tmp_path))
    assert second.returncode == 0 and "left alone" in second.stdout
    assert before == {f: (tmp_path / f).stat().st_mtime_ns for f in FILES}
    third = _cli("--root", str(tmp_path), "--force")
    assert third.returncode == 0 and "wrote" in third.stdout


def test_cli_torchtitan_source_offline(tmp_path):
    # Route the download through a closed local port, so the test is offline even on a
    # machine that is not: it must fail fast, say what to do, and write nothing.
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env["https_proxy"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"
    r = subprocess.run(
        [sys.executable, "-m", "harness.assets", "--source", "torchtitan", "--root", str(tmp_path)],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "cannot reach https://raw.githubusercontent.com/pytorch/torchtitan/v0.2.2/tests/assets/" in r.stderr
    assert "this machine is offline; use --source pydoc (default)" in r.stderr
    assert not any((tmp_path / f).exists() for f in FILES)
