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

Chat format: the release's `chat_template` (a Jinja template in `tokenizer_config.json`), rendered as
transformers renders it: a sandboxed Jinja environment with trim_blocks, lstrip_blocks and loop controls, the
`raise_exception`, `strftime_now` and `tojson` helpers, and the variables messages, add_generation_prompt,
bos_token, eos_token and tools. A checkpoint without one gets `KIMI_CHAT_TEMPLATE` (the Kimi format:
`<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per message, `<|im_assistant|>assistant<|im_middle|>`
as the generation prompt). Unlike a plain render-then-tokenize, message contents are kept apart from the
template's text: the template's text may name special tokens, the contents stay plain text. Generation
stops at eos or `<|im_end|>` (`stop_ids`).
"""
from __future__ import annotations

import base64
import codecs
import functools
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


# The Kimi chat format as a Jinja chat template, written into tokenizer_config.json of checkpoints made here
# and used for checkpoints that ship no template.
KIMI_CHAT_TEMPLATE = """\
{%- for message in messages -%}
    {%- if message['role'] not in ['assistant', 'system', 'user'] -%}
        {{- raise_exception('message ' ~ loop.index0 ~ ' has role ' ~ message['role'] | tojson ~
                            "; use one of ['assistant', 'system', 'user']") -}}
    {%- endif -%}
    {%- if message['content'] is not string -%}
        {{- raise_exception('message ' ~ loop.index0 ~ ' content must be a string') -}}
    {%- endif -%}
    <|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


class TokenizerError(ValueError):
    """Bad tokenizer files, ids outside the vocabulary, or malformed chat messages."""


class ChatTemplate:
    """A Jinja chat template compiled as transformers compiles one (sandboxed, trim_blocks, lstrip_blocks,
    raise_exception); `render` returns the text with every message content replaced by a marker, and the
    contents, so that the caller encodes the template's text and the contents differently."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source:
            raise TokenizerError("chat_template must be a non-empty string")

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' tojson: no HTML escaping, unicode kept, json.dumps' layout options
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        # transformers' environment also enables {% break %} / {% continue %} (jinja2.ext.loopcontrols)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as error:
            raise TokenizerError(f"chat_template does not compile: {error}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool, bos_token: str, eos_token: str,
               tools=None) -> tuple[str, str, list[str]]:
        """(text, marker pattern, contents): marker k in the text stands for contents[k]."""
        nonce = secrets.token_hex(8)
        contents: list[str] = []
        masked = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                message = {**message, "content": f"\x00{nonce}:{len(contents)}\x00"}
                contents.append(content)
            masked.append(message)
        try:
            text = self._template.render(messages=masked, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, tools=tools)
        except TokenizerError:
            raise
        except jinja2.TemplateError as error:  # SecurityError included: the sandbox refused something
            raise TokenizerError(f"chat template failed: {error}") from None
        return text, f"\x00{nonce}:(\\d+)\x00", contents


class Tokenizer:
    """Shared logic; subclasses provide the ordinary-token codec (`_encode_text`, `_ordinary_bytes`)."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, special_tokens: dict[str, int],
                 chat_template: str = KIMI_CHAT_TEMPLATE):
        self.vocab_size, self.bos_id, self.eos_id, self.pad_id = vocab_size, bos_id, eos_id, pad_id
        self.special_tokens = dict(special_tokens)  # name -> id
        self.chat_template = ChatTemplate(chat_template)
        self._special_names = {i: name for name, i in special_tokens.items()}
        if len(self._special_names) != len(self.special_tokens):
            raise TokenizerError("two special token names share one id")
        for name in CHAT_TOKENS:
            if name not in self.special_tokens:
                raise TokenizerError(f"the tokenizer has no {name} token, which the chat format needs")
        for i in (bos_id, eos_id, pad_id):
            if i not in self._special_names:
                raise TokenizerError(f"id {i} (bos/eos/pad) is not a special token")

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern:
        """Every special token's name, longest first; compiled on first use (the chat template's text): a byte
        tokenizer for K3's vocabulary names 163,584 of them, seconds to minutes of compiling that a model used by
        token ids never needs."""
        return re.compile("|".join(re.escape(name) for name in sorted(self.special_tokens, key=len, reverse=True)))

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
        self, messages: Sequence[dict], add_generation_prompt: bool = True, add_bos: bool = False, tools=None
    ) -> list[int]:
        """Token ids of a conversation, from the chat template: special-token names in the template's own
        text become special ids; message contents are encoded as plain text wherever the template puts them."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TokenizerError("messages must be a list of dicts with 'role' and 'content'")
        for k, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TokenizerError(f"message {k} is not a dict with 'role' and 'content'")
        text, marker, contents = self.chat_template.render(
            messages, add_generation_prompt, self._special_names[self.bos_id], self._special_names[self.eos_id],
            tools)
        ids = [self.bos_id] if add_bos else []
        parts = re.split(marker, text)  # template text, content index, template text, ...
        for k, part in enumerate(parts):
            if k % 2:
                ids += self._encode_text(contents[int(part)])
            else:
                ids += self._encode_template_text(part)
        return ids

    def _encode_template_text(self, text: str) -> list[int]:
        """The chat template's own text: special-token names are special ids, the rest plain text."""
        ids, start = [], 0
        for match in self._special_pattern.finditer(text):
            ids += self._encode_text(text[start:match.start()]) if match.start() > start else []
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._encode_text(text[start:])
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

    def __init__(self, vocab_size: int, bos_id: int, eos_id: int, pad_id: int,
                 chat_template: str = KIMI_CHAT_TEMPLATE):
        if vocab_size < 256 + 3 + len(CHAT_TOKENS):
            raise TokenizerError(f"a byte tokenizer needs at least {256 + 3 + len(CHAT_TOKENS)} ids, got {vocab_size}")
        specials = _assign_specials(256, vocab_size, bos_id, eos_id, pad_id, {})
        super().__init__(vocab_size, bos_id, eos_id, pad_id, specials, chat_template)

    @classmethod
    def from_config(cls, config: ModelConfig, chat_template: str = KIMI_CHAT_TEMPLATE) -> "ByteTokenizer":
        return cls(config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id, chat_template)

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
        tok_config = read_tokenizer_config(ckpt_dir)
        specials = _assign_specials(len(ranks), config.vocab_size, config.bos_token_id, config.eos_token_id,
                                    config.pad_token_id, _named_specials(tok_config))
        super().__init__(config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id, specials,
                         chat_template_of(tok_config))
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


def read_tokenizer_config(ckpt_dir: str | Path | None) -> dict:
    """`tokenizer_config.json` of a checkpoint directory ({} when there is none)."""
    path = Path(ckpt_dir) / TOKENIZER_CONFIG_FILE if ckpt_dir is not None else None
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def chat_template_of(tokenizer_config: dict) -> str:
    """The template a tokenizer_config.json names: a string, or HF's list of {"name", "template"} (the
    "default" one); KIMI_CHAT_TEMPLATE when it names none."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return KIMI_CHAT_TEMPLATE
    if not isinstance(template, str):
        raise TokenizerError("tokenizer_config.json: chat_template must be a string")
    return template


def tokenizer_config_for(config: ModelConfig) -> dict:
    """What a checkpoint made here ships as tokenizer_config.json: the chat template and the special tokens."""
    tokenizer = ByteTokenizer.from_config(config)
    return {"chat_template": KIMI_CHAT_TEMPLATE, "bos_token": tokenizer._special_names[tokenizer.bos_id],
            "eos_token": tokenizer._special_names[tokenizer.eos_id],
            "pad_token": tokenizer._special_names[tokenizer.pad_id]}


def load_tokenizer(ckpt_dir: str | Path | None, config: ModelConfig) -> Tokenizer:
    """The checkpoint's BPE when it ships `tiktoken.model`, else the byte tokenizer; the chat template of its
    tokenizer_config.json either way."""
    if ckpt_dir is not None and (Path(ckpt_dir) / TIKTOKEN_FILE).exists():
        return TiktokenTokenizer(ckpt_dir, config)
    return ByteTokenizer.from_config(config, chat_template_of(read_tokenizer_config(ckpt_dir)))


__all__ = [
    "Tokenizer",
    "TokenizerError",
    "ChatTemplate",
    "KIMI_CHAT_TEMPLATE",
    "chat_template_of",
    "read_tokenizer_config",
    "tokenizer_config_for",
    "ByteTokenizer",
    "TiktokenTokenizer",
    "IncrementalDecoder",
    "load_tokenizer",
    "read_tiktoken_ranks",
    "KIMI_PATTERN",
    "TIKTOKEN_FILE",
    "TOKENIZER_CONFIG_FILE",
]
