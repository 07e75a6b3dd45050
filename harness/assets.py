"""Training data and tokenizer for the exercises, built offline.

Two assets live in the repository root, in the layout torchtitan's own tests use:

    c4_test/data.json                   JSON lines, one document per line in field "text"
    tokenizer/tokenizer.json            byte-level BPE, 2048 tokens (the debug model's vocab)
    tokenizer/tokenizer_config.json     names bos_token / eos_token for HuggingFaceTokenizer

By default they are made from text that ships with every Python: the pydoc topics
(`pydoc_data.topics`, the language reference pages behind `help("if")`, PSF licence).
The build is deterministic, so every rank and every machine with the same Python
and tokenizers versions gets byte-identical files. Where a machine is online,
`--source torchtitan` fetches torchtitan's own test assets instead.

    uv run python -m harness.assets [--source pydoc|torchtitan] [--root DIR] [--force]

This module is imported by every rank, so it keeps its imports light: no torch, no
torchtitan, and `tokenizers` only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harness.cli import parse
from harness.errors import FAILED, stop

ROOT = Path(__file__).resolve().parents[1]

DATA = Path("c4_test/data.json")
TOKENIZER = Path("tokenizer/tokenizer.json")
TOKENIZER_CONFIG = Path("tokenizer/tokenizer_config.json")
FILES = (DATA, TOKENIZER, TOKENIZER_CONFIG)

VOCAB_SIZE = 2048  # torchtitan's llama3 debug model has a 2048-row embedding
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# About the mean length of a C4 document: enough documents for the data-parallel
# ranks to get different ones, and a BOS/EOS boundary every few hundred tokens.
DOC_CHARS = 2000

TORCHTITAN_URL = "https://raw.githubusercontent.com/pytorch/torchtitan/v0.2.2/"
DOWNLOAD_TIMEOUT_S = 10

Source = Literal["pydoc", "torchtitan"]


class AssetError(RuntimeError):
    """The data or tokenizer files are missing, unreadable, or do not fit the model."""


# ---------------------------------------------------------------------------------
# building


def build(root: Path = ROOT, source: Source = "pydoc") -> None:
    """(Re)write c4_test/data.json and tokenizer/ under `root` from `source`."""
    root = Path(root)
    if source == "pydoc":
        docs = pydoc_docs()
        data = "".join(json.dumps({"text": d}, sort_keys=True) + "\n" for d in docs).encode()
        tokenizer = _train_tokenizer(docs)
        for d in docs:  # guards against a tokenizers release that stops round-tripping
            if tokenizer.decode(tokenizer.encode(d).ids, skip_special_tokens=False) != d:
                raise AssetError(f"the trained tokenizer does not round-trip this text: {d[:80]!r}")
        config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
        blobs = {
            DATA: data,
            TOKENIZER: (tokenizer.to_str(pretty=True) + "\n").encode(),
            TOKENIZER_CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
        }
    elif source == "torchtitan":
        # Fetch all three before writing any, so a failed download leaves nothing half-replaced.
        blobs = {f: _download(TORCHTITAN_URL + "tests/assets/" + f.as_posix()) for f in FILES}
    else:
        raise ValueError(f"unknown source {source!r}; expected 'pydoc' or 'torchtitan'")
    # Each file is replaced atomically: a concurrent reader sees an old or a new file, never a torn one.
    for f in FILES:
        _write_atomic(root / f, blobs[f])


def pydoc_docs(max_chars: int = DOC_CHARS) -> list[str]:
    """The pydoc topics, sorted by name, cut at paragraph breaks into documents of
    at most `max_chars` characters (a longer single paragraph stays whole)."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        chunk: list[str] = []
        for para in topics[name].split("\n\n"):
            if chunk and len("\n\n".join(chunk + [para])) > max_chars:
                docs.append("\n\n".join(chunk))
                chunk = []
            chunk.append(para)
        docs.append("\n\n".join(chunk))
    return docs


def _train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: decode(encode(text)) gives back every byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,  # counts the specials and the 256 byte symbols too
        special_tokens=[BOS, EOS],
        # All 256 bytes, so text the corpus never showed still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise AssetError(f"BPE training gave {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def _download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r:
            return r.read()
    except urllib.error.HTTPError as e:  # reached the server, which said no
        raise AssetError(f"cannot download {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError) as e:  # DNS failure, refused, timed out
        reason = getattr(e, "reason", e)
        raise AssetError(f"cannot reach {url} ({reason}): this machine is offline; use --source pydoc (default)") from e


def _write_atomic(path: Path, blob: bytes) -> None:
    # Each writer uses its own temp name and os.replace is atomic, so ranks building
    # at the same time never leave a torn file, only one of several identical ones.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------
# checking


def _fix(root: Path, missing: bool = False) -> str:
    cmd = "uv run python -m harness.assets" + ("" if root == ROOT else f" --root {root}")
    if missing:
        return f"run `{cmd}`"
    return f"delete {root / 'c4_test'}/ and {root / 'tokenizer'}/ and run `{cmd}` (or `{cmd} --force`)"


def _token_name(config: dict, key: str) -> str | None:
    # HF configs give a special token either as a string or as {"content": ...}.
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_tokenizer(root: Path):
    """The tokenizer as torchtitan's HuggingFaceTokenizer ends up with it (the special
    tokens its config declares are added), and that config."""
    from tokenizers import AddedToken, Tokenizer

    path, config_path = root / TOKENIZER, root / TOKENIZER_CONFIG
    for p in (path, config_path):
        if not p.is_file():
            raise AssetError(f"{p}: missing; fix: {_fix(root, missing=True)}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise AssetError(f"{path}: not a tokenizer the tokenizers library can load ({e}); fix: {_fix(root)}") from e
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise AssetError(f"{config_path}: not valid JSON ({e}); fix: {_fix(root)}") from e
    if not isinstance(config, dict):
        raise AssetError(f"{config_path}: expected a JSON object, got {type(config).__name__}; fix: {_fix(root)}")

    declared = {
        _token_name(config, k)
        for k in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
    }
    decoder = config.get("added_tokens_decoder") or {}
    listed = {v["content"] for v in decoder.values() if isinstance(v, dict) and isinstance(v.get("content"), str)}
    vocab = tok.get_vocab(with_added_tokens=True)
    for key in ("bos_token", "eos_token"):
        name = _token_name(config, key)
        if name is None:
            raise AssetError(
                f"{config_path}: declares no {key}, so torchtitan cannot mark document boundaries; fix: {_fix(root)}"
            )
        if name not in vocab and name not in listed:
            raise AssetError(
                f"{config_path}: {key} {name!r} is not in {path}'s vocabulary "
                f"(the two files come from different tokenizers?); fix: {_fix(root)}"
            )
    # Specials the config names but the vocab lacks get fresh ids, growing the vocab.
    new = sorted((declared | listed) - set(vocab) - {None})
    tok.add_special_tokens([AddedToken(t, special=True) for t in new])
    return tok, config


def check(root: Path = ROOT, vocab_size: int | None = None) -> None:
    """Raise AssetError, naming the file, the problem and the fix, unless the data and
    tokenizer under `root` are usable (and the vocab fits `vocab_size` rows, if given)."""
    root = Path(root)
    data = root / DATA
    if not data.is_file():
        raise AssetError(f"{data}: missing; fix: {_fix(root, missing=True)}")
    lines = 0
    try:
        with data.open(encoding="utf-8") as f:
            for lines, line in enumerate(f, 1):
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    raise AssetError(f"{data}: line {lines} is not JSON ({e}); fix: {_fix(root)}") from e
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise AssetError(f'{data}: line {lines} has no string field "text"; fix: {_fix(root)}')
    except UnicodeDecodeError as e:
        raise AssetError(f"{data}: not UTF-8 text ({e}); fix: {_fix(root)}") from e
    if lines == 0:
        raise AssetError(f"{data}: holds no documents; fix: {_fix(root)}")

    tok, _ = _load_tokenizer(root)
    n = tok.get_vocab_size()
    if vocab_size is not None and n > vocab_size:
        fix = f"fix: give the model a vocab_size of at least {n}"
        if vocab_size >= VOCAB_SIZE:  # the default tokenizer would fit
            fix += f", or switch to the default {VOCAB_SIZE}-token tokenizer: {_fix(root)}"
        raise AssetError(
            f"{root / TOKENIZER}: has {n} tokens but the model's embedding has only {vocab_size} rows, "
            f"so some token ids would index past it; {fix}"
        )


def vocab_size(root: Path = ROOT) -> int:
    """The number of token ids the tokenizer under `root` can produce, as torchtitan loads it."""
    tok, _ = _load_tokenizer(Path(root))
    return tok.get_vocab_size()


def ensure(root: Path = ROOT, log: Callable[[str], object] = print) -> bool:
    """Build the assets if any file is missing (logging one line), then check them.
    Returns whether it built."""
    root = Path(root)
    built = not all((root / f).is_file() for f in FILES)
    if built:
        build(root)
        log(
            f"assets: built c4_test/ and tokenizer/ in {root} from Python {platform.python_version()}'s "
            "pydoc topics (first use)"
        )
    check(root)
    return built


# ---------------------------------------------------------------------------------
# command line


def describe(root: Path = ROOT) -> str:
    """What the assets under `root` hold: paths, sizes and hashes, documents, characters, tokens."""
    root = Path(root)
    tok, config = _load_tokenizer(root)
    texts = [json.loads(line)["text"] for line in (root / DATA).read_text(encoding="utf-8").splitlines()]
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    lines = []
    for f in FILES:
        blob = (root / f).read_bytes()
        lines.append(f"  {root / f}  {len(blob):,} bytes  sha256 {hashlib.sha256(blob).hexdigest()}")
    bos, eos = _token_name(config, "bos_token"), _token_name(config, "eos_token")
    lines.append(
        f"  {len(texts):,} documents, {sum(map(len, texts)):,} characters, {tokens:,} tokens "
        f"({tokens + 2 * len(texts):,} with BOS/EOS); vocab size {tok.get_vocab_size()}, "
        f"bos {bos!r} = {tok.token_to_id(bos)}, eos {eos!r} = {tok.token_to_id(eos)}"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class Args:
    """Build the training data (c4_test/) and tokenizer (tokenizer/)."""

    source: Source = "pydoc"
    """pydoc: build offline from Python's pydoc topics; torchtitan: download torchtitan v0.2.2's test assets."""
    root: Path = ROOT
    """Directory that gets c4_test/ and tokenizer/."""
    force: bool = False
    """Rebuild even if valid assets are already there."""


def main(args: Args) -> None:
    root = args.root.resolve()
    try:
        if not args.force and all((root / f).is_file() for f in FILES):
            check(root)
            print(f"assets: valid c4_test/ and tokenizer/ already in {root}; left alone (--force rebuilds)")
        else:
            build(root, args.source)
            origin = f"Python {platform.python_version()}'s pydoc topics" if args.source == "pydoc" else TORCHTITAN_URL
            check(root)
            print(f"assets: wrote c4_test/ and tokenizer/ in {root} from {origin}")
        print(describe(root))
    except AssetError as e:
        stop(str(e), FAILED)


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.assets"))


if __name__ == "__main__":
    cli()
