"""Tokenizers: one interface, two implementations.

- `ByteTokenizer`: ids 0..255 are the UTF-8 bytes; bos, eos and pad sit at the config's ids and the chat
  role tokens at the lowest free ids above 255; every other id is a reserved special. Used by the tiny
  test models (vocab 256 + specials).
- `TiktokenTokenizer`: the release's byte-level BPE, read from `tiktoken.model` in a checkpoint directory
  (one "base64(token bytes) rank" pair per line) and run by `tiktoken.Encoding`. Special tokens take the
  ids above the BPE ranks: their names come from `tokenizer_config.json` (`added_tokens_decoder`, HF style)
  when the checkpoint ships one, else from the config's bos/eos/pad ids and default role tokens.

`load_tokenizer(checkpoint_dir_or_None, config)` picks the BPE when `tiktoken.model` is present.

Text given to `encode` is always plain text: a special token's name inside it encodes as ordinary text, so
user content can never forge a role or end-of-turn token. Special ids only come from `apply_chat_template`
(or `add_bos`).

Chat format (Kimi style): each message is `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`, where the
role token is im_system, im_user or im_assistant; the generation prompt is
`<|im_assistant|>assistant<|im_middle|>`. Generation stops at eos or `<|im_end|>` (`stop_ids`).
"""
from __future__ import annotations

import base64
import codecs
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from inference.model.config import ModelConfig

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
ROLE_TOKENS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT}
CHAT_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)

# Pre-tokenisation split of the Kimi BPE: runs of Han characters; words with an optional leading
# non-letter and English contractions; numbers of up to three digits; punctuation runs; whitespace.
# A "pat_str" entry in tokenizer_config.json overrides it.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


class TokenizerError(ValueError):
    """Bad tokenizer files, ids outside the vocabulary, or malformed chat messages."""


class Tokenizer:
    """Shared logic; subclasses provide the ordinary-token codec (`_encode_text`, `_ordinary_bytes`)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, special_tokens: dict[str, int]):
        self.vocab_size, self.bos_id, self.eos_id, self.pad_id = vocab_size, bos_id, eos_id, pad_id
        self.special_tokens = dict(special_tokens)  # name -> id
        self._special_names = {i: name for name, i in special_tokens.items()}
        if len(self._special_names) != len(self.special_tokens):
            raise TokenizerError("two special token names share one id")
        for name in CHAT_TOKENS:
            if name not in self.special_tokens:
                raise TokenizerError(f"the tokenizer has no {name} token, which the chat format needs")
        for i in (bos_id, eos_id, pad_id):
            if i not in self._special_names:
                raise TokenizerError(f"id {i} (bos/eos/pad) is not a special token")

    # -- subclass hooks
    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def _ordinary_bytes(self, ids: Sequence[int]) -> bytes:
        raise NotImplementedError

    # -- interface
    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_names

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes an ordinary token stands for; None for a special token."""
        self._check_id(token_id)
        return None if token_id in self._special_names else self._ordinary_bytes([token_id])

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id, self.special_tokens[IM_END]})

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        ids = self._encode_text(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        decoder = IncrementalDecoder(self, skip_special_tokens)
        return decoder.push_many(ids) + decoder.flush()

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, add_bos: bool = False
    ) -> list[int]:
        """Token ids of a conversation: role token, role name, im_middle, content, im_end per message."""
        s = self.special_tokens
        ids = [self.bos_id] if add_bos else []
        for k, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TokenizerError(f"message {k} is not a dict with 'role' and 'content'")
            role, content = message.get("role"), message.get("content")
            if role not in ROLE_TOKENS:
                raise TokenizerError(f"message {k} has role {role!r}; use one of {sorted(ROLE_TOKENS)}")
            if not isinstance(content, str):
                raise TokenizerError(f"message {k} content must be a string, got {type(content).__name__}")
            ids += [s[ROLE_TOKENS[role]], *self._encode_text(role), s[IM_MIDDLE], *self._encode_text(content),
                    s[IM_END]]
        if add_generation_prompt:
            ids += [s[IM_ASSISTANT], *self._encode_text("assistant"), s[IM_MIDDLE]]
        return ids

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")


class IncrementalDecoder:
    """Token ids in, text out, piece by piece: bytes of a character split across tokens are held back
    until the character is complete (invalid UTF-8 becomes U+FFFD, exactly as `decode` would give)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        tok = self.tokenizer
        tok._check_id(token_id)
        name = tok._special_names.get(token_id)
        if name is None:
            return self._utf8.decode(tok._ordinary_bytes([token_id]))
        # A special token ends any pending partial character (it becomes U+FFFD).
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text if self.skip_special_tokens else text + name

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(int(i)) for i in ids)

    def flush(self) -> str:
        """End of stream: pending bytes of an unfinished character come out as U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        return bool(self._utf8.getstate()[0])


def _assign_specials(
    first_free: int, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, named: dict[int, str]
) -> dict[str, int]:
    """Special tokens for ids first_free..vocab_size-1: given names, then bos/eos/pad and chat tokens, the
    rest reserved."""
    names = dict(named)
    for i, default in ((bos_id, BOS), (eos_id, EOS), (pad_id, PAD)):
        if not first_free <= i < vocab_size:
            raise TokenizerError(
                f"special id {i} (bos/eos/pad) must lie in {first_free}..{vocab_size - 1}, above the ordinary tokens"
            )
        names.setdefault(i, default)
    free = (i for i in range(first_free, vocab_size) if i not in names)
    for token in CHAT_TOKENS:
        if token not in names.values():
            i = next(free, None)
            if i is None:
                raise TokenizerError(f"vocabulary of {vocab_size} has no room for the chat token {token}")
            names[i] = token
    for i in range(first_free, vocab_size):
        names.setdefault(i, f"<|reserved_token_{i}|>")
    return {name: i for i, name in sorted(names.items())}


class ByteTokenizer(Tokenizer):
    """ids 0..255 = bytes; the ids above are special tokens."""

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
        if vocab_size < 256 + 3 + len(CHAT_TOKENS):
            raise TokenizerError(f"a byte tokenizer needs at least {256 + 3 + len(CHAT_TOKENS)} ids, got {vocab_size}")
        specials = _assign_specials(256, vocab_size, bos_id, eos_id, pad_id, {})
        super().__init__(vocab_size, bos_id, eos_id, pad_id, specials)

    @classmethod
    def from_config(cls, config: ModelConfig) -> "ByteTokenizer":
        return cls(config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id)

    def _encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _ordinary_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes(ids)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as exc:
            raise TokenizerError(f"{path}:{lineno} is not 'base64-token rank': {exc}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def _named_specials(tokenizer_config: dict) -> dict[int, str]:
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    named = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not isinstance(content, str):
            raise TokenizerError(f"added_tokens_decoder[{key}] has no string content")
        named[int(key)] = content
    return named


class TiktokenTokenizer(Tokenizer):
    """The release BPE (`tiktoken.model`) with special tokens above the ranks."""

    def __init__(self, ckpt_dir: str | Path, config: ModelConfig):
        import tiktoken

        ckpt_dir = Path(ckpt_dir)
        ranks = read_tiktoken_ranks(ckpt_dir / TIKTOKEN_FILE)
        if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
            raise TokenizerError(f"{ckpt_dir / TIKTOKEN_FILE} must hold all 256 single bytes")
        if len(ranks) >= config.vocab_size:
            raise TokenizerError(f"{len(ranks)} BPE ranks leave no room for specials in a vocab of {config.vocab_size}")
        tok_config = {}
        if (ckpt_dir / TOKENIZER_CONFIG_FILE).exists():
            tok_config = json.loads((ckpt_dir / TOKENIZER_CONFIG_FILE).read_text())
        specials = _assign_specials(len(ranks), config.vocab_size, config.bos_token_id, config.eos_token_id,
                                    config.pad_token_id, _named_specials(tok_config))
        super().__init__(config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id, specials)
        self._encoding = tiktoken.Encoding(
            name=f"{config.model_id}-bpe",
            pat_str=tok_config.get("pat_str", KIMI_PATTERN),
            mergeable_ranks=ranks,
            special_tokens=specials,
        )

    def _encode_text(self, text: str) -> list[int]:
        # disallowed_special=() makes special-token names inside text plain text.
        return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def _ordinary_bytes(self, ids: Sequence[int]) -> bytes:
        return self._encoding.decode_bytes(list(ids))


def load_tokenizer(ckpt_dir: str | Path | None, config: ModelConfig) -> Tokenizer:
    """The checkpoint's BPE when it ships `tiktoken.model`, else the byte tokenizer."""
    if ckpt_dir is not None and (Path(ckpt_dir) / TIKTOKEN_FILE).exists():
        return TiktokenTokenizer(ckpt_dir, config)
    return ByteTokenizer.from_config(config)


__all__ = [
    "Tokenizer",
    "TokenizerError",
    "ByteTokenizer",
    "TiktokenTokenizer",
    "IncrementalDecoder",
    "load_tokenizer",
    "read_tiktoken_ranks",
    "KIMI_PATTERN",
    "TIKTOKEN_FILE",
    "TOKENIZER_CONFIG_FILE",
]
