"""Tool calling through the official `openai` client against `dflash serve`.

A required or named `tool_choice` is forced through a grammar, so its call must parse and its arguments must
validate against the tool's schema, whole and streamed. With `tool_choice: "auto"` the model may or may not call;
only the shape of the answer is checked.

Usage: python openai_tools.py BASE_URL     (or set DFLASH_BASE_URL), e.g. http://127.0.0.1:8000/v1
Set DFLASH_API_KEY when the server was started with --api-key. Exits non-zero on the first failed check.
"""

import json
import os
import sys

import jsonschema
import openai
from openai import OpenAI

from e2e_support import CheckFailure, check, base_url_from

MAX_TOKENS = 96
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_call(name, arguments, where, expected_name=None):
    """A call names an offered tool (the expected one, if given) and its arguments validate against its schema."""
    check(name in SCHEMAS, f"{where}: unknown function {name!r}")
    if expected_name is not None:
        check(name == expected_name, f"{where}: called {name!r}, not {expected_name!r}")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as error:
        raise CheckFailure(f"{where}: arguments are not JSON ({error}): {arguments!r}") from error
    try:
        jsonschema.validate(parsed, SCHEMAS[name])
    except jsonschema.ValidationError as error:
        raise CheckFailure(f"{where}: arguments {parsed} break the schema: {error.message}") from error
    return parsed


def forced_whole(client, model, tool_choice, where):
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = response.choices[0]
    check(choice.finish_reason == "tool_calls", f"{where}: finish_reason {choice.finish_reason!r}")
    calls = choice.message.tool_calls or []
    check(len(calls) >= 1, f"{where}: no tool calls; content {choice.message.content!r}")
    expected = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    for call in calls:
        check(call.type == "function", f"{where}: call type {call.type!r}")
        check(call.id.startswith("call_"), f"{where}: call id {call.id!r}")
        check_call(call.function.name, call.function.arguments, where, expected)
    return calls


def forced_streamed(client, model, tool_choice, where):
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )
    calls, finish_reason = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                check(call["id"] is None, f"{where}: call {delta.index} got a second id")
                call["id"] = delta.id
            if delta.function and delta.function.name:
                call["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                call["arguments"] += delta.function.arguments
        finish_reason = choice.finish_reason or finish_reason
    check(finish_reason == "tool_calls", f"{where}: finish_reason {finish_reason!r}")
    check(sorted(calls) == list(range(len(calls))) and calls, f"{where}: call indexes {sorted(calls)}")
    expected = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    for index, call in calls.items():
        check(bool(call["id"]), f"{where}: call {index} has no id")
        check_call(call["name"], call["arguments"], f"{where} call {index}", expected)
    return calls


def auto_answer_is_well_formed(client, model):
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = response.choices[0]
    check(choice.finish_reason in ("stop", "length", "tool_calls"), f"auto: finish_reason {choice.finish_reason!r}")
    calls = choice.message.tool_calls or []
    check((choice.finish_reason == "tool_calls") == bool(calls), f"auto: {choice.finish_reason!r} with {len(calls)} calls")
    check(calls or isinstance(choice.message.content, str), "auto: neither content nor calls")
    for call in calls:
        check_call(call.function.name, call.function.arguments, "auto")
    return "calls" if calls else "text"


def history_round_trip(client, model, call):
    """The forced call and a tool result sent back: the model answers the conversation."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    response = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=32, temperature=0
    )
    choice = response.choices[0]
    check(choice.message.tool_calls is None, "history: calls despite tool_choice none")
    check(isinstance(choice.message.content, str), "history: no content")
    check(choice.finish_reason in ("stop", "length"), f"history: finish_reason {choice.finish_reason!r}")


def unknown_choice_is_refused(client, model):
    try:
        client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "launch_rockets"}},
        )
    except openai.BadRequestError as error:
        check(error.param == "tool_choice", f"refusal: param {error.param!r}")
        return
    raise CheckFailure("refusal: a tool_choice naming no offered tool was accepted")


def main(argv):
    client = OpenAI(base_url=base_url_from(argv, __doc__), api_key=os.environ.get("DFLASH_API_KEY", "unused"))
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = forced_whole(client, model, named, "named")
    forced_whole(client, model, "required", "required")
    forced_streamed(client, model, named, "named stream")
    forced_streamed(client, model, "required", "required stream")
    auto = auto_answer_is_well_formed(client, model)
    history_round_trip(client, model, calls[0])
    unknown_choice_is_refused(client, model)
    print(f"tools: forced calls parse and validate (named: {calls[0].function.arguments}); auto answered with {auto}")


if __name__ == "__main__":
    try:
        main(sys.argv)
    except CheckFailure as failure:
        print(f"FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
