"""Tokenizers: the built-in byte-level one, and a local Hugging Face tokenizer (`tokenizer.json`, with
its `tokenizer_config.json` special tokens and chat template) when `tokenizers` is installed."""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from d9d.data.datasets.chat_template import CHAT_INSTALL_HINT, Message, assistant_spans, render_chat
from d9d.data.datasets.tokenizer_files import tokenizer_files_at
from d9d.data.errors import TokenizerError

__all__ = ["ByteTokenizer", "ChatTokenizer", "Tokenizer", "load_tokenizer"]

#: The named special tokens of a tokenizer_config.json, as transformers' `special_tokens_map` has them.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """Turns text into token ids and back; `eos_id` (if any) separates documents when packing."""

    @property
    def name(self) -> str:
        """A short description stored with token files ("byte", or the tokenizer file's path)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (every id is below it)."""
        ...

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-document token, or None to concatenate documents without a separator."""
        ...

    def encode(self, text: str) -> np.ndarray | Sequence[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`."""
        ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A `Tokenizer` with a chat template: what `SFTDataset` needs for `{"messages": [...]}` samples."""

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template, None when the tokenizer has none."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False
    ) -> list[int]:
        """Token ids of the rendered conversation (as transformers' `apply_chat_template`)."""
        ...

    def encode_chat(self, messages: Sequence[Message]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the conversation and a bool mask of the tokens in assistant turns."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus an end-of-document token (256): no files, no training."""

    @property
    def name(self) -> str:
        """Always "byte"."""
        return "byte"

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values and the end-of-document token."""
        return 257

    @property
    def eos_id(self) -> int:
        """256."""
        return 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as uint16 ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of the byte ids; other ids (end-of-document) become newlines."""
        array = np.asarray(ids, dtype=np.int64)
        data = np.where(array < 256, array, ord("\n")).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class _HFTokenizer:
    """A local Hugging Face tokenizer behind the `ChatTokenizer` protocol.

    The vocabulary comes from tokenizer.json; the named special tokens and the chat template from the
    tokenizer_config.json next to it (and chat_template.jinja, which wins, as in transformers). Without
    a config the end-of-document token is guessed from common names (`<|endoftext|>`, `</s>`, ...).
    """

    def __init__(
        self, path: Path, tokenizer: Any, special_tokens: dict[str, str], chat_template: str | None
    ) -> None:
        self._path = path
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens
        self._chat_template = chat_template
        for name, token in special_tokens.items():
            if tokenizer.token_to_id(token) is None:
                raise TokenizerError(
                    f"{path.parent / 'tokenizer_config.json'} names {name}={token!r}, which {path} does not hold; "
                    "add it to tokenizer.json's added_tokens or fix the config"
                )
        eos = special_tokens.get("eos_token")
        if eos is not None:
            self._eos_id: int | None = tokenizer.token_to_id(eos)
        else:
            self._eos_id = next(
                (i for t in _EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None), None
            )

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        """Id of the config's `bos_token`, None without one."""
        return self._special_id("bos_token")

    @property
    def pad_id(self) -> int | None:
        """Id of the config's `pad_token`, None without one."""
        return self._special_id("pad_token")

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens of the config ({"eos_token": "<|im_end|>", ...}); templates see them."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def files(self) -> dict[str, Path]:
        """Its tokenizer.json and the tokenizer files beside it (`d9d.data.DeclaresTokenizerFiles`)."""
        return tokenizer_files_at(self._path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_with_special_tokens(self, text: str) -> np.ndarray:
        """Token ids of `text` with the special tokens tokenizer.json's post-processor adds (BOS, ...),
        as transformers' `tokenizer(text)`; TRL tokenizes plain-text preference pairs this way."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=True).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, in one call of the Rust tokenizer (its own threads, when allowed)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids]))

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text under the chat template."""
        return render_chat(
            self._require_template(),
            messages,
            self._special_tokens,
            add_generation_prompt=add_generation_prompt,
        )

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False
    ) -> list[int]:
        """Token ids of the rendered conversation, without added special tokens (as transformers)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_chat(self, messages: Sequence[Message]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the conversation and a mask of the tokens that overlap an assistant turn.

        The ids equal `apply_chat_template(messages)`; a token counts as assistant when its characters
        overlap the text that an assistant message adds (see `assistant_spans`).
        """
        text, spans = assistant_spans(self._require_template(), messages, self._special_tokens)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        if spans:
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            for start, end in spans:
                mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ids, mask

    def _special_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    def _require_template(self) -> str:
        if self._chat_template is None:
            raise TokenizerError(
                f"the tokenizer {self._path.parent} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); add one, or use prompt/completion samples"
            )
        return self._chat_template

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        loaded = load_tokenizer(state["path"])
        assert isinstance(loaded, _HFTokenizer)
        self.__dict__.update(loaded.__dict__)

    def __repr__(self) -> str:
        return f"load_tokenizer({str(self._path)!r})"


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a local Hugging Face tokenizer: a folder with tokenizer.json (or that file itself).

    A tokenizer_config.json in the same folder supplies the special tokens (`bos_token`,
    `eos_token`, `pad_token`, ...) and the `chat_template`; a chat_template.jinja file there takes
    precedence over the config's template, as in transformers. The result is a `ChatTokenizer`.
    Needs the optional `tokenizers` package (and `jinja2` to render chat templates); d9d-data does
    not depend on them.

    Raises:
        TokenizerError: a file is missing or malformed, or `tokenizers` is not installed.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(
            f"no tokenizer file at {file}; pass the path of a local tokenizer.json (or a folder holding "
            "one), or use the built-in byte-level tokenizer (tokenizer=None)"
        )
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            f"reading {file} needs the optional `tokenizers` package, which is not installed; "
            f"{CHAT_INSTALL_HINT}, or use the built-in byte-level tokenizer (tokenizer=None)"
        ) from None
    try:
        loaded = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerError(f"{file} is not a valid tokenizer.json: {exc}") from exc
    special_tokens, chat_template = _read_config(file.parent)
    return _HFTokenizer(file, loaded, special_tokens, chat_template)


def _read_config(folder: Path) -> tuple[dict[str, str], str | None]:
    """Named special tokens and chat template of a tokenizer folder (empty and None without a config)."""
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{config_file} is not valid JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_file} must hold a JSON object, got {type(config).__name__}")
    special_tokens: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # a serialized AddedToken: {"content": "<|im_end|>", ...}
            value = value.get("content")
        if value is not None:
            if not isinstance(value, str):
                raise TokenizerError(f"{config_file}: {name} must be a string, got {value!r}")
            special_tokens[name] = value
    template: Any = config.get("chat_template")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    elif isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" not in named:
            raise TokenizerError(
                f"{config_file} has named chat templates {sorted(map(str, named))} but none called 'default'; "
                "name one 'default' (or write it to chat_template.jinja)"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{config_file}: chat_template must be a string, got {type(template).__name__}")
    return special_tokens, template


def resolve_tokenizer(tokenizer: "Tokenizer | str | os.PathLike[str] | None") -> Tokenizer:
    """A tokenizer object from None (byte-level), a path (a tokenizer folder or tokenizer.json) or itself."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, str | os.PathLike):
        return load_tokenizer(tokenizer)
    return tokenizer
