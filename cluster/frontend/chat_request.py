"""The agent parts of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``, tool and
assistant-with-``tool_calls`` messages, reasoning handed back in history, and the template
arguments (``chat_template_kwargs``, ``reasoning_effort``).

Pure functions over JSON-like dicts. The history is returned in the shape chat templates read
(``transformers``' ``apply_chat_template``): tool calls as ``{"type", "id", "function": {"name",
"arguments": dict}}`` (a template writes the arguments itself, e.g. DSML parameters), tool results
as ``{"role": "tool", "content", "tool_call_id", "name"}``, and an assistant's earlier thinking
under both ``reasoning_content`` (Qwen3, GLM) and ``reasoning`` (DeepSeek-V3.2).

``tool_choice: "required"`` and a named function constrain generation with the tools' JSON
schemas (:func:`tool_constraint`, vLLM's approach): a named function generates its arguments JSON;
``required`` generates a JSON array of ``{"name", "parameters"}``; the server wraps either as calls.

Limits: at most :data:`MAX_TOOLS` tools and :data:`MAX_TOOLS_BYTES` bytes of ``tools`` JSON;
every tool has a name and a ``parameters`` JSON schema (``{"type": "object", "properties": {}}``
for a function without parameters). Errors are 400s naming the field (``tools``,
``tool_choice``, ``messages``, ...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from shardserve.cluster.engine.request import StructuredOutputs
from shardserve.cluster.frontend.openai_protocol import bad_request

MAX_TOOLS = 2048
MAX_TOOLS_BYTES = 1 << 20        # 1 MiB of JSON
_NAME = re.compile(r"^[^\s\"'<>{}\[\]`,;|]{1,128}$")
# Arguments a template gets from the server itself: a request may not set them.
_RESERVED_KWARGS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                    "chat_template", "continue_final_message", "return_dict", "return_assistant_tokens_mask"}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(slots=True)
class ChatOptions:
    """The agent settings of one chat request.

    Attributes:
        tools: the request's tools as the template gets them (OpenAI shape); empty = none.
        schemas: function name -> its ``parameters`` schema (type hints for the parsers).
        tool_choice: ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (a named one).
        function: the named function (``tool_choice`` of type function), else None.
        parallel_tool_calls: False = at most one call per answer.
        template_kwargs: extra arguments of the chat template (``thinking``, ``enable_thinking``,
            ``reasoning_effort``, ...).
        include_reasoning: False = drop the thinking from the answer (vLLM's ``include_reasoning``).
    """

    tools: list[dict] = field(default_factory=list)
    schemas: dict[str, dict] = field(default_factory=dict)
    tool_choice: str = "none"
    function: str | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    include_reasoning: bool = True

    @property
    def forced(self) -> bool:
        """A call must be made (``required`` or a named function): generation is constrained."""
        return self.tool_choice in ("required", "function")

    @property
    def thinking(self) -> bool | None:
        """``thinking`` / ``enable_thinking`` as the request set them (None: not set)."""
        for key in ("thinking", "enable_thinking"):
            value = self.template_kwargs.get(key)
            if isinstance(value, bool):
                return value
        return None


def _tool(index: int, tool) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", "tools")
    if tool.get("type", "function") != "function":
        raise bad_request(f"{where}.type {tool.get('type')!r} is not supported (only 'function')", "tools")
    function = tool.get("function")
    if function is None and "name" in tool:           # the Responses API's flat shape
        function = {k: v for k, v in tool.items() if k != "type"}
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object with a 'name' and 'parameters'", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1 to 128 characters without whitespace, quotes or "
                          f"brackets, got {name!r}", "tools")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    schema = function.get("parameters")
    if schema is None:
        raise bad_request(f"{where}.function.parameters is required: the JSON schema of the arguments "
                          "(use {\"type\": \"object\", \"properties\": {}} for a function without parameters)",
                          "tools")
    _check_schema(schema, f"{where}.function.parameters")
    out = {"name": name}
    if function.get("description"):
        out["description"] = function["description"]
    out["parameters"] = schema
    return {"type": "function", "function": out}


def _check_schema(schema, where: str) -> None:
    """A function's ``parameters`` must be a valid JSON schema of an object."""
    from jsonschema import exceptions, validators

    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object, got {type(schema).__name__}", "tools")
    declared = schema.get("type")
    if declared is not None and declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise bad_request(f"{where} must describe an object (the arguments), got type {declared!r}", "tools")
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        raise bad_request(f"{where} is not a valid JSON schema: {exc.message}", "tools") from None
    except Exception as exc:  # noqa: BLE001 - e.g. an unresolvable $schema: still the client's schema
        raise bad_request(f"{where} is not a valid JSON schema: {exc}", "tools") from None


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' holds at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    size = len(json.dumps(tools, ensure_ascii=False).encode())
    if size > MAX_TOOLS_BYTES:
        raise bad_request(f"'tools' is {size} bytes of JSON; at most {MAX_TOOLS_BYTES} bytes are accepted", "tools")
    parsed = [_tool(i, tool) for i, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"'tools' defines the function {duplicate!r} more than once", "tools")
    return parsed


def _tool_choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice!r}",
                              "tool_choice")
        if choice == "required" and not names:
            raise bad_request("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "tool_choice")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else choice.get("name")   # Responses' flat shape
    if not isinstance(name, str):
        raise bad_request("'tool_choice' names no function ('tool_choice.function.name')", "tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {name!r}, which 'tools' does not define "
                          f"(defined: {names[:20]})", "tool_choice")
    return "function", name


def _kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    reserved = sorted(set(kwargs) & _RESERVED_KWARGS)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {reserved} (the server sets them)",
                          "chat_template_kwargs")
    for key in ("thinking", "enable_thinking"):
        if kwargs.get(key) is not None and not isinstance(kwargs[key], bool):
            raise bad_request(f"'chat_template_kwargs.{key}' must be a boolean", "chat_template_kwargs")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {list(_EFFORTS)}, got {effort!r}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def parse_chat_options(body: dict) -> ChatOptions:
    """The agent settings of a chat body (``messages`` are converted by :func:`chat_messages`).

    Raises:
        OpenAIError: 400 naming the first bad field.
    """
    tools = _tools(body)
    names = [tool["function"]["name"] for tool in tools]
    tool_choice, function = _tool_choice(body, names)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    include = body.get("include_reasoning", True)
    if not isinstance(include, bool):
        raise bad_request("'include_reasoning' must be a boolean", "include_reasoning")
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    return ChatOptions(tools, schemas, tool_choice, function, parallel, _kwargs(body), include)


# -- messages -------------------------------------------------------------------------------------

def _text(content, where: str, allow_none: bool) -> str:
    if content is None:
        if not allow_none:
            raise bad_request(f"{where}.content is required", "messages")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # content parts: text only (OpenAI's and the Responses API's)
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)   # vLLM's rule (chat_utils: text parts joined by newlines)
    raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{at} must be {{\"type\": \"function\", \"id\": ..., \"function\": {{\"name\", "
                              "\"arguments\"}}}}", "messages")
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise bad_request(f"{at}.function.arguments is not valid JSON", "messages") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments must be a JSON object", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{at}.id must be a string", "messages")
        out.append({"type": "function", "id": call_id or f"call_{j}",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages -> the history a chat template reads (see the module docstring).

    Roles: ``system`` (``developer`` too), ``user``, ``assistant`` (``content`` "", null or absent
    when it has ``tool_calls``; earlier thinking in ``reasoning_content`` or ``reasoning``) and
    ``tool`` (content a string or text parts; ``tool_call_id`` and ``name`` kept).

    Raises:
        OpenAIError: 400 (param ``messages``) naming the first bad message.
    """
    if messages is None:
        raise bad_request("'messages' is a required property", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a 'role'", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"{where}.role {message['role']!r} is not supported", "messages")
        if role != "assistant" and message.get("content") is None:
            raise bad_request(f"{where}.content is required for role {message['role']!r}", "messages")
        entry = {"role": role, "content": _text(message.get("content"), where, role == "assistant")}
        if role == "assistant":
            if message.get("tool_calls"):
                entry["tool_calls"] = _tool_calls(message["tool_calls"], where)
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request(f"{where}.reasoning_content must be a string", "messages")
                entry["reasoning_content"] = entry["reasoning"] = reasoning
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    if not isinstance(message[key], str):
                        raise bad_request(f"{where}.{key} must be a string", "messages")
                    entry[key] = message[key]
        chat.append(entry)
    return chat


# -- constrained calls ----------------------------------------------------------------------------

def tool_constraint(options: ChatOptions) -> StructuredOutputs | None:
    """The output constraint that makes a call (None unless ``tool_choice`` forces one): a named
    function's ``parameters`` schema, or for ``required`` an array of ``{"name", "parameters"}``
    (one item at most without ``parallel_tool_calls``). Each tool's ``$defs`` move to the root, so
    ``$ref`` inside a tool's schema still resolves. The JSON is compact (no optional whitespace):
    small models otherwise can emit whitespace until ``max_tokens``."""
    if options.tool_choice == "function":
        return StructuredOutputs.json_schema(options.schemas[options.function], disable_any_whitespace=True)
    if options.tool_choice != "required":
        return None
    defs, items = {}, []
    for index, (name, schema) in enumerate(options.schemas.items()):
        prefix = f"t{index}"
        hoisted = _rebase(schema, prefix, defs)
        defs[prefix] = hoisted
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": {"$ref": f"#/$defs/{prefix}"}},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not options.parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputs.json_schema(schema, disable_any_whitespace=True)


def _rebase(schema, prefix: str, defs: dict):
    """``schema`` with its ``$defs`` / ``definitions`` moved into ``defs`` (as ``{prefix}_{name}``)
    and every local ``$ref`` rewritten to point there."""
    def ref(target: str) -> str:
        for key in ("#/$defs/", "#/definitions/"):
            if target.startswith(key):
                return f"#/$defs/{prefix}_{target[len(key):]}"
        if target == "#":
            return f"#/$defs/{prefix}"
        return f"#/$defs/{prefix}{target[1:]}" if target.startswith("#/") else target

    def walk(node, top: bool):
        if isinstance(node, list):
            return [walk(item, False) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if top and key in ("$defs", "definitions") and isinstance(value, dict):
                for name, sub in value.items():
                    defs[f"{prefix}_{name}"] = walk(sub, False)
            elif key == "$ref" and isinstance(value, str):
                out[key] = ref(value)
            elif key == "$schema" and top:
                continue
            else:
                out[key] = walk(value, False)
        return out

    return walk(schema, True)
