"""Hugging Face chat templates rendered with jinja2 the way `transformers` renders them.

The environment matches transformers' `apply_chat_template`: a sandbox that cannot change its inputs,
`trim_blocks` and `lstrip_blocks`, the loop-control extension (`break`/`continue`), the globals
`raise_exception`, `strftime_now`, `namespace` and `dict`, a `tojson` filter that keeps non-ASCII
text and does not HTML-escape, the tokenizer's named special tokens (`bos_token`, `eos_token`, ...)
as variables, and the `{% generation %}` block tag (rendered as its body). Templates are untrusted
code from a model repository, hence the sandbox.
"""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from d9d.data.errors import TokenizerError

__all__ = ["CHAT_INSTALL_HINT", "Message", "assistant_spans", "render_chat"]

#: One chat message: {"role": ..., "content": ...} plus whatever else the template reads.
Message = Mapping[str, Any]

#: What to install for chat templates and Hugging Face tokenizer folders.
CHAT_INSTALL_HINT = (
    "install the `chat` extra: `pip install 'd9d-data[chat]'` (in the d9d workspace: "
    "`uv sync --all-packages --extra chat`)"
)

_MIN_JINJA = (3, 1, 6)  # older releases have known sandbox escapes (transformers refuses them too)


def render_chat(
    template: str,
    messages: Sequence[Message],
    special_tokens: Mapping[str, str],
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The text of `messages` under `template`, as `transformers`' `apply_chat_template(tokenize=False)`.

    Raises:
        TokenizerError: jinja2 is missing, the template does not compile, or it raised while rendering
            (e.g. `raise_exception("Conversation roles must alternate")`).
    """
    jinja2 = _import_jinja2()
    compiled = _compile(template)
    # Like transformers: keys whose value is None are dropped (templates test for presence).
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    try:
        return compiled.render(
            **dict(special_tokens),
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template failed on this conversation: {exc}") from exc


def assistant_spans(
    template: str, messages: Sequence[Message], special_tokens: Mapping[str, str]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of its assistant turns.

    A turn's span is what rendering that message appends after the generation prompt (for ChatML:
    the content, `<|im_end|>` and the newline), found by rendering the conversation up to each
    assistant message. That needs a template whose rendering of a prefix of the conversation is a
    prefix of the whole rendering; templates that rewrite earlier turns are refused.

    Raises:
        TokenizerError: the template is not prefix-stable for this conversation.
    """
    full = render_chat(template, messages, special_tokens)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _generation_prompt(template, messages[:i], special_tokens)
        through = render_chat(template, messages[: i + 1], special_tokens)
        if not (through.startswith(before) and full.startswith(through)):
            raise TokenizerError(
                f"cannot tell which tokens belong to assistant message {i}: the chat template renders the "
                "conversation up to it differently from the start of the whole conversation (it rewrites "
                "earlier turns); train on every token (train_on='all') or use a template without that"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _import_jinja2() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
    except ImportError:
        raise TokenizerError(
            f"rendering a chat template needs jinja2, which is not installed; {CHAT_INSTALL_HINT}"
        ) from None
    return jinja2


def _generation_prompt(template: str, messages: Sequence[Message], special_tokens: Mapping[str, str]) -> str:
    """The conversation so far plus the assistant header; "" when the template cannot render no messages."""
    try:
        return render_chat(template, messages, special_tokens, add_generation_prompt=True)
    except TokenizerError:
        if messages:
            raise
        return (
            ""  # many templates read messages[0]; a conversation that opens with the assistant trains on all
        )


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    jinja2 = _import_jinja2()
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _MIN_JINJA:
        raise TokenizerError(
            f"chat templates need jinja2>={'.'.join(map(str, _MIN_JINJA))} (older versions have sandbox "
            f"escapes), found {jinja2.__version__}; upgrade it (`uv pip install -U jinja2`)"
        )

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text in some templates; render the body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 reads a class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class _Namespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore attributes, so a template cannot reach Python internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_attribute(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_attribute(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_attribute(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class _Dict:
        """`dict(...)` and `dict.fromkeys(...)` without exposing the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, namespace=_Namespace, dict=_Dict()
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"the chat template does not compile (line {exc.lineno}): {exc.message}"
        ) from exc
