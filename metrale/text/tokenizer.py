"""Text to token ids and back, loaded from a Hugging Face model directory without ``transformers``.

``Tokenizer.from_dir`` reads the files a model repository ships: ``tokenizer.json`` (run by the
``tokenizers`` library) or, without one, a tiktoken vocabulary ``tiktoken.model`` (converted to a
``tokenizers`` tokenizer, see ``tiktoken_vocab/folder.py``), ``tokenizer_config.json`` (special tokens,
``add_bos_token``, the chat template), ``chat_template.jinja`` (newer repositories keep the template
there; it wins), and the ``eos_token_id`` of ``generation_config.json`` and ``config.json``. Encoding and
decoding behave as ``transformers``' ``AutoTokenizer`` does for the same directory, except that a
tiktoken folder splits text with its family's own pattern, as its release's tokenizer does
(``transformers`` without remote code splits every tiktoken vocabulary with cl100k's).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from metrale.text.chat_templates.render import ChatTemplateError, Message, render_chat
from metrale.text.prompt_bound import max_chars_per_token
from metrale.text.tiktoken_vocab.folder import load_tiktoken_folder
from metrale.text.tiktoken_vocab.ranks import TIKTOKEN_FILE
from metrale.text.tokenizer_files import (
    NAMED_SPECIAL_TOKENS,
    TokenizerError,
    added_token,
    read_chat_template,
    read_config_eos_ids,
    read_json,
    token_content,
)

__all__ = ["Tokenizer", "TokenizerError"]


class Tokenizer:
    """A ``tokenizers`` tokenizer plus what ``tokenizer_config.json`` says about it.

    Special tokens named in the config (``bos_token``, ``eos_token``, ...) are registered as special
    added tokens, as ``transformers`` does, so text containing them encodes to their single id.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str],
        chat_template: str | None = None,
        extra_eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        eos_id = None if self.eos_token is None else self.token_to_id(self.eos_token)
        own_eos_ids = frozenset() if eos_id is None else frozenset({eos_id})
        self.eos_token_ids: frozenset[int] = extra_eos_token_ids | own_eos_ids
        """Ids that end a generation: the config's ``eos_token`` plus the model configs' ``eos_token_id``."""
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(token_id for token_id, token in added.items() if token.special)
        """Ids of every special added token; ``decode`` drops them unless told to keep them."""

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the model directory ``path``; raise ``TokenizerError`` naming a bad file."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        config_path = directory / "tokenizer_config.json"
        config = read_json(config_path) or {}
        if tokenizer_file.is_file():
            backend = _read_backend(tokenizer_file)
            special_tokens = _register_special_tokens(backend, config)
            _configure_backend(backend, config, special_tokens)
        elif (directory / TIKTOKEN_FILE).is_file():
            backend, special_tokens = load_tiktoken_folder(directory, config, config_path)
        else:
            raise TokenizerError(f"{tokenizer_file}: no such file (nor a {TIKTOKEN_FILE})")
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=read_chat_template(directory, config),
            extra_eos_token_ids=read_config_eos_ids(directory),
        )

    def backend_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text: loading it (with the same ``tokenizer_config.json``)
        gives this tokenizer again, whatever files it was first loaded from."""
        return str(self._backend.to_str())

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def vocabulary(self) -> dict[str, int]:
        """Every token (added tokens included) and its id."""
        return dict(self._backend.get_vocab(with_added_tokens=True))

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ``pad_token``, ...) that are set."""
        return dict(self._special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` as one vocabulary entry, or None if it is not one."""
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the post-processor adds (BOS, ...)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_releasing_gil(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``encode``, through the backend's batch call, which releases the GIL while it tokenizes (the
        single-text call holds it): run in a thread, it leaves the event loop free. Same ids as ``encode``."""
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token can cover, or None when no such bound holds (``prompt_bound``)."""
        return max_chars_per_token(self._backend)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The chat as text, rendered by this tokenizer's chat template; raises ``ChatTemplateError``."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_tokens,
            **extra,
        )

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """Token ids of the rendered chat.

        As in ``transformers``, the rendered text is encoded without special tokens: the template owns
        BOS and every other marker, so BOS is never added twice.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)


def _read_backend(tokenizer_file: Path) -> BackendTokenizer:
    try:
        return BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises bare Exception for every parse failure
        raise TokenizerError(f"{tokenizer_file}: not a valid tokenizer ({error})") from error


def _register_special_tokens(backend: BackendTokenizer, config: Mapping[str, Any]) -> dict[str, str]:
    """Add the config's named special tokens to ``backend`` as special tokens; return name -> content."""
    special_tokens: dict[str, str] = {}
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    for name in NAMED_SPECIAL_TOKENS:
        content = token_content(config.get(name))
        if content is None:
            continue
        special_tokens[name] = content
        if content not in known:
            backend.add_special_tokens([added_token(config[name])])
    return special_tokens


def _configure_backend(backend: BackendTokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, str]) -> None:
    """Turn off truncation and padding; if the config sets ``add_bos_token`` or ``add_eos_token``, make
    the post-processor add exactly those (``transformers`` 4 semantics for Llama-style tokenizers;
    ``transformers`` 5 ignores the flags when ``tokenizer.json`` exists). Otherwise the post-processor
    of ``tokenizer.json`` stays as it is."""
    backend.no_truncation()
    backend.no_padding()
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    bos = special_tokens.get("bos_token") if config.get("add_bos_token") else None
    eos = special_tokens.get("eos_token") if config.get("add_eos_token") else None

    def wrapped(sequence: str, type_id: int) -> str:
        return " ".join(f"{part}:{type_id}" for part in (bos, sequence, eos) if part is not None)

    backend.post_processor = processors.TemplateProcessing(
        single=wrapped("$A", 0),
        pair=f"{wrapped('$A', 0)} {wrapped('$B', 1)}",
        special_tokens=[(token, backend.token_to_id(token)) for token in (bos, eos) if token is not None],
    )
