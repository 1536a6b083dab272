"""A model's tokenizer and chat template read straight from a cache folder, without transformers.

Importing transformers and building ``AutoConfig``/``AutoTokenizer`` costs 4–5 s of CPU
on a 2-core laptop (its lazy import table walks every model family; ``LlamaConfig``
alone pulls in torch.distributed), which is most of a later start. The tokenizer itself
is the ``tokenizers`` library underneath either way, and a chat template is a Jinja
template. So a later start reads the files transformers wrote into the model's cache
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``, the full
config) with ``tokenizers`` and ``jinja2`` directly: the same tokens, in a tenth of the
time (``tests/core/test_fast_tokenizer.py`` compares both on the default model).

``ChatTokenizer`` offers the part of transformers' tokenizer interface the runtime uses:
calling it (``.input_ids``), ``decode``, ``apply_chat_template``, ``get_vocab``,
``eos_token_id`` and ``chat_template``. Tools that need a real transformers object
(training, the transformers baseline in ``bench``) ask ``transformers_tokenizer``/
``transformers_config`` for one.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

MODEL_CONFIG_FILE = "model_config.json"  # the config's every field (transformers' config.json may omit defaults)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ModelConfig:
    """A model's config as plain attributes (``config.hidden_size``), read from its full
    dictionary; what the runtime reads of a transformers config, without transformers."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig(model_type={getattr(self, 'model_type', None)!r}, hidden_size={getattr(self, 'hidden_size', None)})"


def write_model_config(folder: Path, config: Any) -> None:
    """Store every field of a transformers config (``to_dict``) for ``read_model_config``."""
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(config.to_dict(), default=str, indent=1), encoding="utf-8")


def read_model_config(folder: Path) -> ModelConfig:
    fields = json.loads((folder / MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{folder / MODEL_CONFIG_FILE} is not a model config")
    return ModelConfig(fields)


def transformers_config(config: Any) -> Any:
    """A transformers config for ``config`` (returned as is when it already is one)."""
    if not isinstance(config, ModelConfig):
        return config
    from transformers import AutoConfig

    fields = config.to_dict()
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _compile(template: str) -> Any:
    """A chat template compiled as transformers compiles one: sandboxed, blocks trimmed,
    ``tojson`` that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatTokenizer:
    """The ``tokenizers`` tokenizer of a cache folder and its chat template."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self._tok = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        settings = json.loads((self.folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = self.folder / "chat_template.jinja"
        template = settings.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens = {n: _token_text(settings.get(n)) for n in SPECIAL_TOKEN_NAMES}
        self.clean_up_spaces = bool(settings.get("clean_up_tokenization_spaces", False))
        self._encoding = threading.Lock()  # ``split_special_tokens`` flips a flag of the one tokenizer
        eos = self.special_tokens.get("eos_token")
        self.eos_token = eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    @cached_property
    def _template(self) -> Any:
        return _compile(self.chat_template) if self.chat_template is not None else None

    def __call__(self, text: str, *, add_special_tokens: bool = False, split_special_tokens: bool = False) -> Encoding:
        with self._encoding:
            self._tok.encode_special_tokens = split_special_tokens  # special-token text read as plain text
            try:
                return Encoding(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
            finally:
                self._tok.encode_special_tokens = False

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **extra: Any) -> Any:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens, **extra)
        return self.encode(text) if tokenize else text


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": …}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def transformers_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer for ``tokenizer`` (returned as is when it already is one)."""
    if not isinstance(tokenizer, ChatTokenizer):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer.folder, local_files_only=True)


def can_read(folder: Path) -> bool:
    """The folder holds what ``ChatTokenizer`` and ``read_model_config`` need."""
    return all((folder / name).is_file() for name in (*TOKENIZER_FILES, MODEL_CONFIG_FILE))
