"""Incremental detokenization: sampled token ids -> text deltas, and per-token bytes for logprobs.

`IncrementalDetokenizer` wraps the tokenizers library's streaming decoder (`DecodeStream`), which
decodes only the few tokens since the last emitted text, never the whole output. A delta never holds
half of a character: byte-level BPE splits CJK characters and emoji across tokens, and the stream
returns nothing while the decoded text ends in an incomplete UTF-8 sequence (rendered as U+FFFD).
`flush()` releases what is still held back when generation ends (as U+FFFD, like `decode`), so the
deltas plus `flush()` always equal `tokenizer.decode(output_ids)`.

`token_bytes` / `token_text` render one token for OpenAI logprobs (`bytes` and `token` fields).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the output (keeps e.g. SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 8
# Emitted tokens kept as context for flush() and recovery; older ids are dropped.
CONTEXT_TOKENS = 8


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (or the tokenizer itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"need a tokenizers.Tokenizer or a fast Hugging Face tokenizer, got {type(tokenizer).__name__}"
    )


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas (one instance per request).

    `prompt_ids`: the prompt; its last few tokens are decoded as context only (never emitted), so a
    first output token reads as it would after the prompt. A prompt that ends inside a character
    gives no context: the output is then decoded on its own, like `decode(output_ids)`.
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, prompt_ids: Sequence[int] | None = None
    ) -> None:
        self.tokenizer = backend_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        context = self._clean_context(list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # [context..., output ids...]; ids[:_read] produced all their text
        self._read = len(context)
        self._stream = self._new_stream(context)
        self._finished = False
        self.num_tokens = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append sampled token ids; return only the new text ("" while a character is incomplete)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after flush()")
        if not token_ids:
            return ""
        ids = [int(t) for t in token_ids]
        self._ids.extend(ids)
        self.num_tokens += len(ids)
        try:
            text = self._stream.step(self.tokenizer, ids)
        except Exception:  # DecodeStream's "Invalid prefix" (decoders that rewrite earlier text)
            text = self._recover()
        if text is None:
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        """End of the stream: the text of tokens still held back (incomplete bytes become U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        text = self._decode_pending()
        self._read = len(self._ids)
        return text

    @property
    def pending_ids(self) -> list[int]:
        """Ids whose text is still held back (an incomplete character)."""
        return self._ids[self._read :]

    def _new_stream(self, context: list[int]) -> DecodeStream:
        return DecodeStream(ids=context or None, skip_special_tokens=self.skip_special_tokens)

    def _clean_context(self, ids: list[int]) -> list[int]:
        """`ids` if they decode without a trailing incomplete character, else no context at all."""
        if ids and self.tokenizer.decode(ids, self.skip_special_tokens).endswith(REPLACEMENT_CHAR):
            return []
        return ids

    def _advance(self) -> None:
        """Everything added so far has produced its text; trim old context."""
        self._read = len(self._ids)
        if self._read > 4 * CONTEXT_TOKENS:
            del self._ids[: self._read - CONTEXT_TOKENS]
            self._read = CONTEXT_TOKENS

    def _decode_pending(self) -> str:
        """Text of `ids[_read:]`, decoded after a little context (no hold-back)."""
        if self._read == len(self._ids):
            return ""
        start = max(0, self._read - CONTEXT_TOKENS)
        base = self.tokenizer.decode(self._ids[start : self._read], self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[start:], self.skip_special_tokens)
        if full.startswith(base):
            return full[len(base) :]
        return self.tokenizer.decode(self._ids[self._read :], self.skip_special_tokens)

    def _recover(self) -> str | None:
        """Restart the stream from the last emitted context and replay the held-back ids."""
        context = self._clean_context(self._ids[max(0, self._read - CONTEXT_TOKENS) : self._read])
        self._stream = self._new_stream(context)
        try:
            return self._stream.step(self.tokenizer, self._ids[self._read :])
        except Exception:
            text = self._decode_pending()
            self._stream = self._new_stream(self._clean_context(self._ids[-CONTEXT_TOKENS:]))
            return text


# ---- per-token bytes and strings (OpenAI logprobs) ----------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class _VocabInfo:
    byte_level: bool  # decoder maps GPT-2 byte characters back to bytes
    added: dict[int, str]  # added tokens: id -> literal content


_VOCAB_INFO: dict[int, tuple[Tokenizer, _VocabInfo]] = {}


def _vocab_info(tok: Tokenizer) -> _VocabInfo:
    cached = _VOCAB_INFO.get(id(tok))
    if cached is not None and cached[0] is tok:
        return cached[1]
    decoder = tok.decoder
    info = _VocabInfo(
        byte_level=decoder is not None and b'"ByteLevel"' in bytes(decoder.__getstate__()),
        added={i: t.content for i, t in tok.get_added_tokens_decoder().items()},
    )
    _VOCAB_INFO[id(tok)] = (tok, info)  # holds `tok`, so its id is never reused for another one
    return info


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The raw UTF-8 bytes of one token (OpenAI logprobs' `bytes`); may be an incomplete character.

    Byte-level BPE tokens map back through the GPT-2 byte table; added/special tokens give the UTF-8
    of their content; SentencePiece byte-fallback tokens `<0xNN>` give that byte, other SentencePiece
    pieces their text with `▁` as a space.
    """
    tok = backend_tokenizer(tokenizer)
    info = _vocab_info(tok)
    added = info.added.get(token_id)
    if added is not None:
        return list(added.encode("utf-8"))
    piece = tok.id_to_token(token_id)
    if piece is None:
        return []
    if info.byte_level:
        out: list[int] = []
        for ch in piece:
            b = _UNICODE_TO_BYTE.get(ch)
            if b is None:
                out.extend(ch.encode("utf-8"))
            else:
                out.append(b)
        return out
    m = _BYTE_FALLBACK.fullmatch(piece)
    if m is not None:
        return [int(m.group(1), 16)]
    return list(piece.replace("\u2581", " ").encode("utf-8"))


def token_text(tokenizer: Any, token_id: int, errors: str = "backslashreplace") -> str:
    """The string of one token for OpenAI logprobs' `token` field.

    A token's bytes that are not complete UTF-8 are rendered as `\\xNN` escapes by default (what the
    OpenAI API itself returns, e.g. the first two bytes of "고" give the 8-character string
    `\\xea\\xb3`), so distinct partial tokens stay distinct; `errors="replace"` gives U+FFFD instead.
    Complete characters are always decoded normally.
    """
    return bytes(token_bytes(tokenizer, token_id)).decode("utf-8", errors=errors)
