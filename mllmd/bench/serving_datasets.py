"""Request sets for the online serving benchmark (`mllmd.bench.serving`).

Two datasets, both seeded:

- `random`: input and output lengths drawn uniformly from `[max(1, int(len * ratio)), len]`, as in
  SGLang's bench_serving (`--random-range-ratio 1` gives fixed lengths).
- `shared-prefix`: `num_groups` long system prefixes; every request uses its group's prefix plus its
  own suffix, so a server with a prefix cache reuses the prefix across the group.

Prompts are built by a `PromptBuilder`: random token ids decoded with a local tokenizer (re-encoded
and trimmed until the text is the asked length), random token ids sent as is (exact lengths;
`/v1/completions` only), or
random English words when no tokenizer is given (lengths approximate: about one token per word).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Lower bound of random token ids: skips the byte-level and most punctuation entries of BPE vocabularies.
TOKEN_ID_LOW = 1000
# Upper bound of random token ids when no tokenizer tells the vocabulary size.
DEFAULT_VOCAB_SIZE = 30000

# Common English words, each one token in the usual BPE vocabularies (with its leading space).
WORDS = (
    "the of and to in is was for that on as with by he at from his an were are which this be or had "
    "not first one their its new after but who they have her she two been other when there all also "
    "into during time may years more would over only city some world can most these later where "
    "game school about many united then under such known people used both year film well him up "
    "could state between made three through while being like part since family number series season "
    "work several early music before government national second until released same each house "
    "group large party back water river team area high system local north south east west village "
    "population became following including major best because different around public company "
    "however against final place found small history began four former within included named based "
    "without total along published another five led day station member life club order common among "
    "main light power field role line point road art book"
).split()


@dataclass
class BenchRequest:
    """One request of a benchmark run.

    `prompt` is a string, a list of token ids (completions with `--token-ids-prompt`) or, for chat,
    the user message; `system` is the chat system message (shared-prefix with `--endpoint chat`).
    `prompt_len` is in tokens (exact with a tokenizer or token ids, else estimated).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    system: str | None = None
    group: int | None = None


class PromptBuilder(Protocol):
    """Builds prompt pieces of a given length in tokens."""

    exact: bool

    def piece(self, n: int, rng: random.Random) -> str | list[int]:
        """A random prompt piece of about `n` tokens."""
        ...

    def join(self, parts: list[str | list[int]]) -> str | list[int]:
        """Concatenate pieces into one prompt."""
        ...

    def count(self, prompt: str | list[int]) -> int:
        """Length of `prompt` in tokens (estimated when `exact` is false)."""
        ...


class WordPromptBuilder:
    """Random English words: about one token per word, so lengths are approximate."""

    exact = False

    def piece(self, n: int, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def join(self, parts: list[str | list[int]]) -> str:
        return " ".join(str(p) for p in parts if p)

    def count(self, prompt: str | list[int]) -> int:
        return len(prompt) if isinstance(prompt, list) else len(prompt.split())


class TokenIdPromptBuilder:
    """Random token ids in `[TOKEN_ID_LOW, vocab_size)`, sent as a list of ints (exact lengths)."""

    exact = True

    def __init__(self, vocab_size: int, special_ids: set[int] | None = None) -> None:
        if vocab_size <= TOKEN_ID_LOW + 1:
            raise ValueError(f"vocab size {vocab_size} is too small for random token ids (>= {TOKEN_ID_LOW})")
        self.vocab_size = vocab_size
        self.special_ids = special_ids or set()

    def _token(self, rng: random.Random) -> int:
        while True:
            t = rng.randrange(TOKEN_ID_LOW, self.vocab_size)
            if t not in self.special_ids:
                return t

    def piece(self, n: int, rng: random.Random) -> list[int]:
        return [self._token(rng) for _ in range(n)]

    def join(self, parts: list[str | list[int]]) -> list[int]:
        return [t for p in parts for t in p]  # type: ignore[misc]

    def count(self, prompt: str | list[int]) -> int:
        return len(prompt)


class TokenizerPromptBuilder:
    """Random token ids decoded to text with a tokenizer; lengths counted by re-encoding the text."""

    exact = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.ids = TokenIdPromptBuilder(int(tokenizer.vocab_size), special)

    def piece(self, n: int, rng: random.Random) -> str:
        """Decode `n` random ids; re-encode and trim or top up a few times so the text is ~`n` tokens."""
        ids = self.ids.piece(n, rng)
        text = self.tokenizer.decode(ids)
        for _ in range(4):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n:
                break
            ids = ids[:n] if len(ids) > n else ids + self.ids.piece(n - len(ids), rng)
            text = self.tokenizer.decode(ids)
        return text

    def join(self, parts: list[str | list[int]]) -> str:
        return "".join(str(p) for p in parts)

    def count(self, prompt: str | list[int]) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(self.tokenizer.encode(prompt, add_special_tokens=False))


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a local folder (never downloads)."""
    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer must be a local folder with tokenizer files: {path}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def make_prompt_builder(
    tokenizer_path: str | None, token_ids: bool, vocab_size: int | None = None
) -> PromptBuilder:
    """The prompt builder for the CLI options `--tokenizer`, `--token-ids-prompt`, `--vocab-size`."""
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    if token_ids:
        special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
        size = vocab_size or (int(tokenizer.vocab_size) if tokenizer is not None else DEFAULT_VOCAB_SIZE)
        return TokenIdPromptBuilder(size, special)
    if tokenizer is not None:
        return TokenizerPromptBuilder(tokenizer)
    return WordPromptBuilder()


def sample_lengths(length: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """`n` lengths uniform in `[max(1, int(length * range_ratio)), length]` (SGLang's convention)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def random_dataset(
    builder: PromptBuilder,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """Requests with random prompts of random input length and random `max_tokens`."""
    rng = random.Random(seed)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt = builder.piece(n_in, rng)
        requests.append(BenchRequest(prompt, builder.count(prompt), n_out))
    return requests


def shared_prefix_dataset(
    builder: PromptBuilder,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool = False,
) -> list[BenchRequest]:
    """`num_prompts` requests spread evenly over `num_groups` shared prefixes, in shuffled order.

    For completions the prompt is prefix + suffix; for chat (`chat=True`) the prefix is the system
    message and the suffix the user message.
    """
    if num_groups < 1:
        raise ValueError(f"--num-groups must be >= 1, got {num_groups}")
    rng = random.Random(seed)
    prefixes = [builder.piece(prefix_len, rng) for _ in range(num_groups)]
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    requests = []
    for i, n_out in enumerate(output_lens):
        group = i % num_groups
        prefix = prefixes[group]
        suffix = builder.piece(suffix_len, rng)
        if chat:
            n_in = builder.count(prefix) + builder.count(suffix)
            requests.append(BenchRequest(suffix, n_in, n_out, system=str(prefix), group=group))
        else:
            prompt = builder.join([prefix, suffix])
            requests.append(BenchRequest(prompt, builder.count(prompt), n_out, group=group))
    rng.shuffle(requests)
    return requests
