"""A byte-level BPE from a Hugging Face `tokenizer.json`, behind the project's `Tokenizer` interface.

A remote-engine miner tokenizes text prompts and decodes streamed ids with the served model's own
tokenizer files. Kimi K3 releases ship `tiktoken.model` (read by `TiktokenTokenizer`); models saved
by `transformers`/`tokenizers` ship `tokenizer.json`, read here with the `tokenizers` library.

Only byte-level BPE is accepted (every token stands for bytes, through the byte-to-character table
of byte-level BPE), because the interface hands out exact bytes per token. Special tokens are the
`added_tokens` marked special; the chat format's role tokens must be among them.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from inference.model.tokenizer import Tokenizer, TokenizerError

HF_TOKENIZER_FILE = "tokenizer.json"


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE: printable bytes stand for themselves, the other bytes
    take the code points from 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class HFByteLevelTokenizer(Tokenizer):
    def __init__(self, path: str | Path, *, vocab_size: int | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path)
        try:
            spec = json.loads(path.read_text())
            self._tokenizer = RustTokenizer.from_file(str(path))
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception on bad files
            raise TokenizerError(f"{path} is not a tokenizers file: {exc}") from None
        if (spec.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")):
            raise TokenizerError(f"{path} is not a byte-level BPE (only those map tokens to exact bytes)")
        specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        n = self._tokenizer.get_vocab_size(with_added_tokens=True)
        vocab_size = vocab_size or n
        if n > vocab_size:
            raise TokenizerError(f"{path} has {n} tokens, more than the model's vocabulary of {vocab_size}")
        for i in range(n, vocab_size):  # ids the model has but the tokenizer never produces
            specials.setdefault(f"<|reserved_token_{i}|>", i)

        def special_id(name: str | None, role: str) -> int:
            if name is None or name not in specials:
                raise TokenizerError(f"{path}: the {role} token {name!r} is not a special token")
            return specials[name]

        super().__init__(vocab_size, special_id(bos_token, "bos"), special_id(eos_token, "eos"),
                         special_id(pad_token or eos_token, "pad"), specials)
        self._alphabet = byte_level_alphabet()
        self._piece_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, ckpt_dir: str | Path, hf_config: dict | None = None) -> "HFByteLevelTokenizer":
        """The tokenizer of a model directory (tokenizer.json, tokenizer_config.json, config.json)."""
        ckpt_dir = Path(ckpt_dir)
        tok_config = {}
        if (ckpt_dir / "tokenizer_config.json").exists():
            tok_config = json.loads((ckpt_dir / "tokenizer_config.json").read_text())

        def name(key: str) -> str | None:
            value = tok_config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        hf_config = hf_config or {}
        return cls(ckpt_dir / HF_TOKENIZER_FILE, vocab_size=hf_config.get("vocab_size"),
                   bos_token=name("bos_token"), eos_token=name("eos_token"), pad_token=name("pad_token"))

    def _encode_text(self, text: str) -> list[int]:
        # Special-token names inside user text stay plain text: encode around the added-token matcher by
        # splitting the text at every special name and encoding each name's characters as ordinary text.
        return self._tokenizer.encode(text, add_special_tokens=False, is_pretokenized=False).ids \
            if not any(name in text for name in self.special_tokens) else self._encode_literal(text)

    def _encode_literal(self, text: str) -> list[int]:
        out: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(name), name) for name in self.special_tokens if name in rest]
            if not hits:
                out += self._tokenizer.encode(rest, add_special_tokens=False).ids
                break
            at, name = min(hits)
            if at:
                out += self._tokenizer.encode(rest[:at], add_special_tokens=False).ids
            # the name as ordinary text: its first character on its own, so the matcher never sees it whole
            out += self._tokenizer.encode(name[0], add_special_tokens=False).ids
            rest = rest[at + 1:]
        return out

    def _ordinary_bytes(self, ids: Sequence[int]) -> bytes:
        out = bytearray()
        for i in ids:
            piece = self._piece_bytes.get(i)
            if piece is None:
                token = self._tokenizer.id_to_token(int(i))
                try:
                    piece = bytes(self._alphabet[c] for c in token)
                except (KeyError, TypeError):
                    raise TokenizerError(f"token {i} ({token!r}) is not a byte-level token") from None
                self._piece_bytes[i] = piece
            out += piece
        return bytes(out)
