"""Chat templates: find, compile and render a checkpoint's Jinja chat template as transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoinfer.errors import CheckpointError, RequestError


class _TemplateRaised(Exception):
    """What `raise_exception(...)` in a template raises; rendering turns it into a RequestError."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt;
    # transformers replaces it with plain json.dumps, and the models were trained on that.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to mark assistant text for
    training masks. Inference only needs the body rendered, so the tag passes it through."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def find_hf_chat_template(path: Path, tokenizer_config: dict) -> str | None:
    """The chat template of a HF checkpoint directory, or None when it has none."""
    # transformers 5 saves the template to its own file; older configs carry it inline.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or (next(iter(by_name.values())) if len(by_name) == 1 else None)
    return template if isinstance(template, str) else None


@lru_cache(maxsize=32)
def compile_chat_template(template: str, source: str = "chat template") -> jinja2.Template:
    """The compiled template (cached: a pure function of the template text).

    `source` names where the template came from (a file) for the error of a template that does
    not compile, which is a broken checkpoint, not a bad request.
    """
    # The same environment transformers builds: templates come from checkpoints, so they run
    # sandboxed; trim_blocks/lstrip_blocks change the whitespace of the output, so they must match.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(source, f"the chat template does not compile: {e.message} "
                                      f"(template line {e.lineno})") from e


# Appended to the final message when it is continued, to find where its text ends once rendered
# (the trailing space tells whether the template trims the message, as transformers tells it).
_CONTINUE_TAG = "<<nanoinfer: the final message continues here>> "


def render_chat_template(template: str | jinja2.Template, messages: list[dict], /, *,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """The prompt text for `messages`, rendered as transformers' `apply_chat_template(...,
    tokenize=False)` would. `extra` reaches the template as variables (`tools`, `documents`,
    `enable_thinking`, other special tokens, ...). `continue_final_message`: the text ends
    inside the last message, right after its content, so that the model continues it (a
    prefilled reply); it excludes `add_generation_prompt`.

    A template that rejects the conversation (`raise_exception`, e.g. roles out of order) or fails
    on it (a message without `content`) raises RequestError naming the problem.
    """
    compiled = compile_chat_template(template) if isinstance(template, str) else template
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError(f"chat messages must be a list of dicts, got {messages!r:.200}")
    if "messages" in extra:  # (a request's chat_template_kwargs may hold any name)
        raise RequestError("chat_template_kwargs may not set `messages`: the conversation is the request's messages",
                           param="chat_template_kwargs")
    if continue_final_message:
        if add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt are both true: the prompt can end "
                               "inside the final message or open a new one, not both (set add_generation_prompt "
                               "to false)", param="continue_final_message")
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise RequestError("continue_final_message needs a final message with text content to continue",
                               param="continue_final_message")
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
    # transformers always defines these, so `{% if tools is not none %}` sees None, not Undefined.
    variables: dict[str, Any] = {"tools": None, "documents": None, **extra}
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **variables)
        return _cut_at_continue_tag(text) if continue_final_message else text
    except _TemplateRaised as e:
        raise RequestError(f"the chat template rejected the conversation: {e}") from None
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError,
            ValueError) as e:
        raise RequestError(f"the chat template failed on these messages: "
                           f"{type(e).__name__}: {e}") from e


def _cut_at_continue_tag(text: str) -> str:
    """The rendered text up to the final message's end (transformers' rule: a template that
    trims the message's trailing space trims it here too)."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not render the final message's content, "
                           "so there is nothing to continue", param="continue_final_message")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
