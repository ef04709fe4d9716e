"""End-to-end test of `dflash serve`'s Responses API (`POST /v1/responses`) through the official `openai` client's
`client.responses.create`: whole and streamed answers (exact event order), input items and instructions, a
structured format checked with jsonschema, a forced function call and its output, and the stateless refusals.

Usage: python openai_responses.py BASE_URL MODEL     e.g. http://127.0.0.1:8000/v1 dflash-e2e
Set DFLASH_API_KEY when the server was started with --api-key. Exits non-zero on the first failed check.
"""

import json
import os
import sys

import jsonschema
import openai
from openai import OpenAI

from e2e_support import CheckFailure, check

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def whole(client, model):
    response = client.responses.create(model=model, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0)
    check(response.object == "response" and response.id.startswith("resp_"), f"whole: {response.id!r}")
    check(response.model == model, f"whole: model {response.model!r}")
    check(response.status in ("completed", "incomplete"), f"whole: status {response.status!r}")
    check(len(response.output) == 1 and response.output[0].type == "message", f"whole: output {response.output}")
    check(bool(response.output_text.strip()), "whole: empty output_text")
    usage = response.usage
    check(usage.input_tokens > 0 and 1 <= usage.output_tokens <= MAX_TOKENS, f"whole: usage {usage}")
    check(usage.total_tokens == usage.input_tokens + usage.output_tokens, f"whole: usage {usage}")
    if response.status == "incomplete":
        check(response.incomplete_details.reason == "max_output_tokens", f"whole: {response.incomplete_details}")
    return response


def streamed(client, model, reference):
    events = list(client.responses.create(model=model, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    check([event.sequence_number for event in events] == list(range(len(events))), "stream: sequence numbers")
    closing = "response.completed" if reference.status == "completed" else "response.incomplete"
    deltas = kinds.count("response.output_text.delta")
    expected = (["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"] + ["response.output_text.delta"] * deltas
                + ["response.output_text.done", "response.content_part.done", "response.output_item.done", closing])
    check(kinds == expected, f"stream: events {kinds}")
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    # Greedy, one request at a time: the stream and the whole answer agree.
    check(text == reference.output_text, f"stream: {text!r} != whole {reference.output_text!r}")
    final = events[-1].response
    check(final.output_text == text and final.status == reference.status, f"stream: final {final}")
    check(final.usage.output_tokens == reference.usage.output_tokens, "stream: output_tokens differ")


def items_and_instructions(client, model):
    response = client.responses.create(
        model=model, temperature=0, max_output_tokens=MAX_TOKENS, instructions="Answer in one word.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    check(bool(response.output_text.strip()), "items: empty output_text")
    check(response.instructions == "Answer in one word.", f"items: instructions {response.instructions!r}")


def structured(client, model):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    response = client.responses.create(model=model, temperature=0, max_output_tokens=64, text={"format": fmt},
                                       input="Name a large city and its population as JSON.")
    check(response.status == "completed", f"structured: status {response.status!r}")
    jsonschema.validate(json.loads(response.output_text), CITY_SCHEMA)


def tool_round_trip(client, model):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model=model, temperature=0, max_output_tokens=64, tools=[WEATHER_TOOL],
                                       tool_choice=forced, input=[question])
    calls = [item for item in response.output if item.type == "function_call"]
    check(len(calls) == 1 and calls[0].name == "get_weather", f"tools: output {response.output}")
    check(isinstance(json.loads(calls[0].arguments).get("city"), str), f"tools: arguments {calls[0].arguments!r}")
    check(calls[0].call_id.startswith("call_"), f"tools: call_id {calls[0].call_id!r}")
    events = list(client.responses.create(model=model, temperature=0, max_output_tokens=64, tools=[WEATHER_TOOL],
                                          tool_choice=forced, input=[question], stream=True))
    done = [event.arguments for event in events if event.type == "response.function_call_arguments.done"]
    check(done == [calls[0].arguments], f"tools stream: arguments {done}")
    history = [question,
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 degrees."}]
    answer = client.responses.create(model=model, temperature=0, max_output_tokens=MAX_TOKENS, tools=[WEATHER_TOOL],
                                     input=history)
    check(answer.usage.input_tokens > response.usage.input_tokens, "tools: the output did not reach the prompt")


def refusals(client, model):
    try:
        client.responses.create(model=model, input="hi", previous_response_id="resp_123")
    except openai.BadRequestError as error:
        check(error.body.get("param") == "previous_response_id", f"refusals: {error.body}")
    else:
        raise CheckFailure("refusals: previous_response_id was accepted")
    response = client.responses.create(model=model, input="hi", max_output_tokens=2, store=True)
    check(response.store is False, f"refusals: store {response.store!r}: nothing is kept")


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    base_url, model = argv[1].rstrip("/"), argv[2]
    base_url = base_url if base_url.endswith("/v1") else base_url + "/v1"
    api_key = os.environ.get("DFLASH_API_KEY", "no-key")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    reference = whole(client, model)
    print(f"whole:  {reference.status}, {reference.usage.input_tokens}+{reference.usage.output_tokens} tokens: "
          f"{reference.output_text!r}")
    streamed(client, model, reference)
    items_and_instructions(client, model)
    structured(client, model)
    tool_round_trip(client, model)
    refusals(client, model)
    print(f"openai responses test passed against {base_url} (model {model})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except CheckFailure as failure:
        print(f"openai responses test FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
