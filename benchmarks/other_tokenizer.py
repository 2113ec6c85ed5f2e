"""The tokenizer of a model other than Kimi K3, for the endpoint benchmark against its server.

`vllm bench serve` takes any Hugging Face tokenizer; so does `k3-bench --openai URL --tokenizer-checkpoint DIR` when
DIR holds another model's `tokenizer.json` (with its `config.json` and `tokenizer_config.json` when present):
any kind the `tokenizers` library reads (byte-level BPE, SentencePiece-style BPE or Unigram, WordPiece), with or
without a bos token. Such a model has no Kimi chat format, so the benchmark's prompts are plain text of exactly
the asked number of tokens, after the model's bos when it has one (what `vllm bench serve`'s random dataset
sends to /v1/completions). Kimi K3's own tokenizer (inference/model/tokenizer.py) is used whenever the
directory is a Kimi K3 checkpoint.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

TOKENIZER_FILE = "tokenizer.json"


class OtherModelTokenizerError(ValueError):
    """The directory holds no tokenizer the benchmark can read."""


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise OtherModelTokenizerError(f"{path} cannot be read as JSON: {error}") from None
    return value if isinstance(value, dict) else {}


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class OtherModelTokenizer:
    """What the benchmark asks of a tokenizer (encode, decode, vocabulary size, eos and stop ids), read from a
    Hugging Face model directory. `chat_format` is False: prompts go out without a chat template."""

    chat_format = False

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.exists():
            raise OtherModelTokenizerError(f"{directory} has no {TOKENIZER_FILE} (a Hugging Face tokenizer)")
        try:
            self._tokenizer = RustTokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 (tokenizers raises plain Exception on a bad file)
            raise OtherModelTokenizerError(f"{path} is not a tokenizers file: {error}") from None
        config = _read_json(directory / "config.json")
        config = config.get("text_config") or config
        settings = _read_json(directory / "tokenizer_config.json")
        self.special_tokens = {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items()
                               if t.special}
        self.vocab_size = max(int(config.get("vocab_size") or 0), self._tokenizer.get_vocab_size(True))
        self.bos_id = self._id_of(_token_name(settings.get("bos_token")), config.get("bos_token_id"))
        self.eos_id = self._id_of(_token_name(settings.get("eos_token")), config.get("eos_token_id"))
        eos = config.get("eos_token_id")
        self.stop_ids = frozenset(({self.eos_id} if self.eos_id is not None else set())
                                  | set(eos if isinstance(eos, list) else []))

    def _id_of(self, name: str | None, configured) -> int | None:
        if name is not None and self._tokenizer.token_to_id(name) is not None:
            return self._tokenizer.token_to_id(name)
        if isinstance(configured, list):
            configured = configured[0] if configured else None
        return configured if isinstance(configured, int) else None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_frame(self) -> tuple[list[int], int]:
        """(the tokens around a prompt's content, where the content goes): the bos alone, or nothing."""
        frame = [self.bos_id] if self.bos_id is not None else []
        return frame, len(frame)
