"""Chat templates: OpenAI-style messages → one prompt text.

The template comes from the checkpoint (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`), rendered as Hugging Face's `apply_chat_template` does: a sandboxed jinja2
environment with `messages`, `add_generation_prompt=True`, the special tokens
(`bos_token`, `eos_token`, ...), `raise_exception` and `strftime_now`. Without one, a plain
default: "<role>: <content>\\n" per message, then "assistant:".

Tokenising the result: templates usually write the BOS token's text themselves, while the
tokenizer (encoding with special tokens) prepends BOS too; HF avoids the duplicate by
encoding the rendered text without special tokens. The gateway only has `tokenize(text)`
(with special tokens), so `ChatTemplate.text_for_tokenizer` drops the template's leading
BOS text when the tokenizer adds BOS itself: the ids are then the same as HF's.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from common.sampling_params import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
MAX_MESSAGES = 4096


class ChatTemplateError(ValueError):
    """The checkpoint's chat template cannot be loaded or compiled (a start-up error)."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatTemplate:
    """Renders validated messages with a jinja2 template, or the plain default."""

    def __init__(self, source: str | None = None, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = {name: "" for name in SPECIAL_TOKEN_NAMES}
        self.special_tokens.update(special_tokens or {})
        self._render: Callable[..., str] | None = _compile(source) if source is not None else None

    @property
    def bos_token(self) -> str:
        return self.special_tokens["bos_token"]

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ChatTemplate:
        """The checkpoint's template (the default one when it has none)."""
        model_dir = Path(model_dir)
        config = _read_tokenizer_config(model_dir / TOKENIZER_CONFIG_FILE)
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        template_file = model_dir / TEMPLATE_FILE
        source: str | None  # None: the checkpoint has no template
        if template_file.is_file():
            source = template_file.read_text(encoding="utf-8")
        else:
            source = _pick_template(config.get("chat_template"), model_dir / TOKENIZER_CONFIG_FILE)
        return cls(source, special)

    def render(self, messages: Any) -> str:
        """The prompt text for `messages` (validated first), ending with the assistant's
        turn. Raises InvalidRequestError naming the bad field, or param "messages" when
        the template itself refuses the conversation (raise_exception)."""
        validated = validate_messages(messages)
        if self._render is None:
            return "".join(f"{m.role}: {m.content}\n" for m in validated) + "assistant:"
        return self._render([m.as_template_dict() for m in validated], self.special_tokens)

    def text_for_tokenizer(self, rendered: str, tokenizer_adds_bos: bool) -> str:
        """`rendered` without its leading BOS text when the tokenizer prepends BOS anyway
        (see the module docstring)."""
        bos = self.bos_token
        if tokenizer_adds_bos and bos and rendered.startswith(bos):
            return rendered[len(bos):]
        return rendered


def validate_messages(messages: Any) -> list[Message]:
    """OpenAI chat messages → Messages; InvalidRequestError names the first bad field.

    A message is {role: str, content: str | [{type: "text", text: str}, ...]}, with an
    optional `name`; text parts are joined with newlines; an assistant message may have
    null content. Other fields (tool calls...) are ignored.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty array of message objects")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages are accepted")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(where, "must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError(f"{where}.role", "must be a string")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role",
                                  f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(f"{where}.name", "must be a string")
    content = _content_text(f"{where}.content", message.get("content"),
                            nullable=role == "assistant")
    return Message(role, content, name)


def _content_text(where: str, content: Any, nullable: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if nullable:
            return ""
        raise InvalidRequestError(where, "is required")
    if not isinstance(content, list):
        raise InvalidRequestError(where, "must be a string or an array of text parts")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError(f"{where}[{index}]", "must be a text part "
                                      '{"type": "text", "text": ...} (only text is supported)')
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}[{index}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


# ---- jinja -------------------------------------------------------------------------------


def _compile(source: str) -> Callable[[list[dict[str, str]], dict[str, str]], str]:
    """A render function for a template source; ChatTemplateError if it does not compile."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from error

    def render(messages: list[dict[str, str]], special_tokens: dict[str, str]) -> str:
        try:
            return template.render(messages=messages, add_generation_prompt=True, tools=None,
                                   documents=None, **special_tokens)
        except _TemplateRefusal as refusal:
            raise InvalidRequestError("messages", str(refusal)) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError, RecursionError) as error:
            raise InvalidRequestError("messages", "the chat template cannot render these "
                                      f"messages: {type(error).__name__}: {error}") from None

    return render


class _TemplateRefusal(Exception):
    """raise_exception() called by a template (e.g. roles that do not alternate)."""


def _raise_template_exception(message: str) -> None:
    raise _TemplateRefusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps, without jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# ---- checkpoint files ----------------------------------------------------------------------


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ChatTemplateError(f"{path}: unreadable: {error}") from error
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path}: must hold a JSON object")
    return config


def _pick_template(value: Any, path: Path) -> str | None:
    """`chat_template` is a string, or a list of {name, template} (HF's named templates:
    take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
        raise ChatTemplateError(f"{path}: chat_template lists no 'default' template")
    raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates")


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return ""
