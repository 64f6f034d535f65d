"""Tool calling for chat completions: `tools` and `tool_choice` to a prompt and a grammar, and
the model's output back to OpenAI's `tool_calls`, whole or streamed.

How a model writes a call depends on what it was trained on; its chat template says which:
- "tags" (Hermes, Qwen 2.5/3, SmolLM3 and the like): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, after optional text. A template that knows nothing of tools (the
  default model's) gets the same convention written into its system message
  (`ToolSetup.messages`), and tool results back as `<tool_response>` user turns.
- "json" (Llama 3.x, Mistral once `[TOOL_CALLS]` is skipped as a special token): the whole
  reply is one JSON object `{"name": ..., "parameters"/"arguments": {...}}`, or an array of
  them, or objects separated by `;`.

`auto` lets the model choose and parses what it wrote; a reply that does not parse stays
text. `required` and a named function constrain the output with structured output (as vLLM
does), so the call always parses: a named function's output is its arguments object, a
required one's a JSON array of {"name", "parameters"} objects, at least one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from nanoinfer.errors import RequestError
from nanoinfer.structured.spec import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Call:
    """A parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def template_style(template: str | None) -> tuple[str, bool]:
    """(style, whether the template renders `tools` itself) for a chat template's text."""
    if template is None or "tools" not in template:
        return "tags", False
    return ("tags" if OPEN in template else "json"), True


# -- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tools change: the messages to render, the template's extra variables,
    the grammar forcing a call (required, named) and how its output is read back."""

    mode: str  # auto | required | named
    style: str  # tags | json
    tools: tuple[dict, ...]  # OpenAI's {"type": "function", "function": {...}} objects
    messages: list[dict]
    template_kwargs: dict
    grammar: GrammarSpec | None  # for required and named
    function: str | None = None  # the named function

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self.style if self.mode == "auto" else self.mode, self.function)


def _functions(tools: Any) -> list[dict]:
    """The function objects of a request's `tools`, checked."""
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of tool objects, got {type(tools).__name__}", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise RequestError(f"tools[{i}].function.name={name!r} is invalid: expected 1-64 letters, digits, "
                               f"_, . or -", param="tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema (an object)", param="tools")
        functions.append({**function, "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise RequestError(f"tools name a function twice: {names}", param="tools")
    return functions


def tool_setup(tools: Any, tool_choice: Any, messages: list[dict], template: str | None,
               parallel: bool = True) -> ToolSetup | None:
    """The request's tool setup (None: no tools, or tool_choice "none", where the model just
    answers); RequestError naming a bad `tools` or `tool_choice`. `parallel` false (OpenAI's
    parallel_tool_calls): a required call is one call."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice in (None, "auto", "required"):
        mode, function = tool_choice or "auto", None
    elif tool_choice == "none":
        return None
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        mode, function = "named", tool_choice["function"].get("name")
        if function not in {f["name"] for f in functions}:
            raise RequestError(f"tool_choice names function {function!r}, which is not among the tools "
                               f"{[f['name'] for f in functions]}", param="tool_choice")
    else:
        raise RequestError(f"tool_choice={tool_choice!r} is invalid: expected 'none', 'auto', 'required' or "
                           f'{{"type": "function", "function": {{"name": ...}}}}', param="tool_choice")
    style, renders_tools = template_style(template)
    openai_tools = tuple({"type": "function", "function": f} for f in functions)
    if renders_tools:
        messages, kwargs = messages, {"tools": list(openai_tools)}
    else:
        messages, kwargs = _with_tags_prompt(messages, functions), {}
    return ToolSetup(mode, style, openai_tools, messages, kwargs,
                     _forcing_grammar(mode, function, functions, parallel), function)


def _forcing_grammar(mode: str, function: str | None, functions: list[dict], parallel: bool) -> GrammarSpec | None:
    if mode == "named":
        return GrammarSpec("json_schema", next(f["parameters"] for f in functions if f["name"] == function))
    if mode == "required":
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "parameters": _placed(f["name"], f["parameters"], defs)},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
        return GrammarSpec("json_schema", {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                           **({} if parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})})
    return None


def _placed(name: str, parameters: dict, defs: dict[str, Any]) -> dict:
    """Function `name`'s parameters schema as it sits inside the schema of all calls. A schema
    with local `$ref`s (pydantic's `#/$defs/Model`, `#` for recursion) points into itself, not
    the wrapper's root: it moves into the wrapper's `defs` as `name`, its own definitions as
    `name.$defs.Key`, and each `$ref` is rewritten to the new place."""
    if not _has_local_ref(parameters):
        return parameters
    body = dict(parameters)
    own = {(section, key) for section in ("$defs", "definitions") if isinstance(body.get(section), dict)
           for key in body[section]}
    moved = {(section, key): body[section][key] for section, key in own}
    for section in ("$defs", "definitions"):
        if section in body and isinstance(body[section], dict):
            del body[section]

    def new_ref(ref: str) -> str:
        tokens = ref[2:].split("/") if ref.startswith("#/") else []
        if len(tokens) >= 2 and tokens[0] in ("$defs", "definitions"):
            if (tokens[0], _unescape(tokens[1])) not in own:
                raise RequestError(f"function {name!r}: $ref {ref!r} points to no definition in its parameters",
                                   param="tools")
            return "/".join(["#/$defs", _escape(f"{name}.{tokens[0]}.{_unescape(tokens[1])}"), *tokens[2:]])
        return "/".join(["#/$defs", _escape(name), *tokens])

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            out["$ref"] = new_ref(node["$ref"])
        return out

    defs[name] = rewrite(body)
    for (section, key), schema in moved.items():
        defs[f"{name}.{section}.{key}"] = rewrite(schema)
    return {"$ref": f"#/$defs/{_escape(name)}"}


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return (isinstance(node.get("$ref"), str) and node["$ref"].startswith("#")) or any(
            _has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _escape(key: str) -> str:  # a JSON pointer's token (RFC 6901)
    return key.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _with_tags_prompt(messages: list[dict], functions: list[dict]) -> list[dict]:
    """The conversation for a template that cannot render tools: the tags convention in the
    system message, earlier calls written as the model would write them, results as user
    turns in `<tool_response>` tags (what Hermes-style templates render)."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    guide = ("You can call functions to help with the user's request. Their signatures, in JSON schema, are "
             f"between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\nTo call a function, reply with a JSON "
             f"object holding its name and arguments between {OPEN} and {CLOSE}, one per call:\n{OPEN}\n"
             f'{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')
    out = []
    if messages and messages[0]["role"] in ("system", "developer"):
        out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{guide}"})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": guide})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                ensure_ascii=False) for c in m["tool_calls"]]
            written = "\n".join(f"{OPEN}\n{call}\n{CLOSE}" for call in calls)
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", written]))})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    return out


# -- the model's output ------------------------------------------------------------------------


def _call(obj: Any, key: str = "arguments") -> Call | None:
    """A call from one parsed JSON object, if it is one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # (some models write the arguments as a JSON string)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tags(text: str) -> tuple[str | None, list[Call]]:
    """`<tool_call>` blocks: (the text before the first, the calls). A block whose JSON does not
    parse leaves the whole reply text; a last block left open at the end is read if complete."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in re.findall(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text[start:], re.DOTALL):
        try:
            call = _call(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].strip() or None, calls


def parse_json(text: str) -> tuple[str | None, list[Call]]:
    """A reply that is a call object, an array of them, or objects separated by `;`."""
    body = text.strip()
    if not body.startswith(("{", "[")):
        return text, []
    try:
        parsed = json.loads(body)
        objs = parsed if isinstance(parsed, list) else [parsed]
    except ValueError:
        try:
            objs = [json.loads(part) for part in body.split(";")]
        except ValueError:
            return text, []
    calls = [_call(o, "parameters") for o in objs]
    return (None, calls) if calls and all(calls) else (text, [])


class ToolCallParser:
    """One choice's reply read as it streams: `feed` text deltas, then `finish`; each returns
    (text for `content`, calls complete so far). Text that may still turn out to be a call
    is held back: a possible start of `<tool_call>` (tags), a reply that opens with `{` or
    `[` (json: read whole at the end). `mode` is a style for auto, else required or named."""

    def __init__(self, mode: str, function: str | None = None):
        self.mode, self.function = mode, function
        self.buffer = ""
        self.in_calls = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.buffer += text
        if self.mode == "tags":
            return self._feed_tags()
        if self.mode == "json" and not self.in_calls:
            head = self.buffer.lstrip()
            if head and not head.startswith(("{", "[")):
                out, self.buffer, self.mode = self.buffer, "", "text"
                return out, []
            self.in_calls = bool(head)
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", []  # (json, required, named: the whole reply is read at the end)

    def _feed_tags(self) -> tuple[str, list[Call]]:
        if not self.in_calls:
            at = self.buffer.find(OPEN)
            if at < 0:  # hold back what could begin the tag
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if OPEN.startswith(self.buffer[-k:])), 0)
                out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return out, []
            text, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at:], True
        else:
            text = ""
        calls = []
        while (end := self.buffer.find(CLOSE)) >= 0:
            _, parsed = parse_tags(self.buffer[:end + len(CLOSE)])
            if not parsed:  # not a call after all: it, and the rest of the reply, is text
                out, self.buffer, self.mode = text + self.buffer, "", "text"
                return out, calls
            calls += parsed
            self.buffer = self.buffer[end + len(CLOSE):].lstrip()
        return text, calls

    def finish(self) -> tuple[str, list[Call]]:
        """The rest, once the reply is complete. (Streamed text already sent stays sent: a
        tags reply whose block does not parse ends with that block as text.)"""
        rest, self.buffer = self.buffer, ""
        if self.mode == "named":
            return "", [Call(self.function, rest)] if rest else []
        if self.mode == "required":
            try:
                calls = [_call(o, "parameters") for o in json.loads(rest)]
            except (ValueError, TypeError):
                calls = []
            return ("", [c for c in calls if c]) if calls and all(calls) else (rest, [])
        if self.mode == "json":
            content, calls = parse_json(rest)
            return content or "", calls
        if self.mode == "tags" and self.in_calls:
            content, calls = parse_tags(rest)
            return ("", calls) if calls else (rest, [])
        return rest, []


def parse_reply(setup: ToolSetup, text: str) -> tuple[str | None, list[Call]]:
    """A whole reply: (content, calls)."""
    parser = setup.parser()
    content, calls = parser.feed(text)
    more, later = parser.finish()
    content = (content + more).strip() if calls or later else content + more
    return content or None, calls + later
