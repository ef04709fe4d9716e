"""End-to-end test of `dflash serve`'s Messages API (`POST /v1/messages`) through the official `anthropic` client:
whole and streamed answers (the client's own event accumulation), token counting, stop sequences, a forced tool call and its
result, and errors in Anthropic's shape.

Usage: python anthropic_messages.py BASE_URL MODEL     e.g. http://127.0.0.1:8000 dflash-e2e
Set DFLASH_API_KEY when the server was started with --api-key (sent as `x-api-key`). Exits non-zero on the first
failed check.
"""

import os
import sys

import anthropic

from e2e_support import CheckFailure, check

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16
# Greedy decoding, so stream and whole agree. Newer clients no longer take `temperature` as an argument; the API
# still reads it from the body.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def ask(client, model, **extra):
    fields = {"model": model, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}], **GREEDY}
    fields.update(extra)
    return fields


def text_of(message):
    return "".join(block.text for block in message.content if block.type == "text")


def whole(client, model):
    message = client.messages.create(**ask(client, model))
    check(message.type == "message" and message.role == "assistant", f"whole: {message.type} / {message.role}")
    check(message.id.startswith("msg_"), f"whole: id {message.id!r}")
    check(message.model == model, f"whole: model {message.model!r}")
    check(len(message.content) == 1 and message.content[0].type == "text", f"whole: content {message.content}")
    check(bool(text_of(message).strip()), "whole: empty text")
    check(message.stop_reason in ("end_turn", "max_tokens"), f"whole: stop_reason {message.stop_reason!r}")
    check(message.stop_sequence is None, f"whole: stop_sequence {message.stop_sequence!r}")
    check(message.usage.input_tokens > 0, f"whole: input_tokens {message.usage.input_tokens}")
    check(1 <= message.usage.output_tokens <= MAX_TOKENS, f"whole: output_tokens {message.usage.output_tokens}")
    return message


def streamed(client, model, reference):
    with client.messages.stream(**ask(client, model)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    # Greedy, one request at a time: the stream and the whole answer agree.
    check(text == text_of(reference), f"stream: {text!r} != whole {text_of(reference)!r}")
    check(text_of(final) == text, "stream: the accumulated message differs from the text deltas")
    check(final.stop_reason == reference.stop_reason, f"stream: stop_reason {final.stop_reason!r}")
    check(final.usage.output_tokens == reference.usage.output_tokens, "stream: output_tokens differ")
    check(final.usage.input_tokens == reference.usage.input_tokens, "stream: input_tokens differ")
    names = [event.type for event in client.messages.create(**ask(client, model), stream=True)]
    check(names[:3] == ["message_start", "content_block_start", "content_block_delta"],
          f"stream: first events {names[:3]}")  # the client drops `ping`
    check(names[-3:] == ["content_block_stop", "message_delta", "message_stop"], f"stream: last events {names[-3:]}")


def stop_sequence(client, model, reference):
    text = text_of(reference)
    words = text.split()
    check(len(words) >= 3, f"stop: the reference answer {text!r} is too short to cut")
    stop = words[2]
    message = client.messages.create(**ask(client, model, stop_sequences=[stop]))
    check(message.stop_reason == "stop_sequence", f"stop: stop_reason {message.stop_reason!r}")
    check(message.stop_sequence == stop, f"stop: stop_sequence {message.stop_sequence!r} != {stop!r}")
    check(text_of(message) == text[: text.find(stop)], f"stop: text {text_of(message)!r}")


def tool_round_trip(client, model):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(model=model, max_tokens=64, **GREEDY, tools=[WEATHER_TOOL],
                                     tool_choice=forced, messages=[question])
    calls = [block for block in message.content if block.type == "tool_use"]
    check(message.stop_reason == "tool_use", f"tools: stop_reason {message.stop_reason!r}")
    check(len(calls) == 1 and calls[0].name == "get_weather", f"tools: content {message.content}")
    check(isinstance(calls[0].input.get("city"), str), f"tools: input {calls[0].input}")
    check(calls[0].id.startswith("toolu_"), f"tools: id {calls[0].id!r}")
    with client.messages.stream(model=model, max_tokens=64, **GREEDY, tools=[WEATHER_TOOL],
                                tool_choice=forced, messages=[question]) as stream:
        final = stream.get_final_message()
    streamed_calls = [block for block in final.content if block.type == "tool_use"]
    check(final.stop_reason == "tool_use", f"tools stream: stop_reason {final.stop_reason!r}")
    check([c.input for c in streamed_calls] == [calls[0].input], f"tools stream: {final.content}")
    result = {"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 24 degrees."}
    answer = client.messages.create(model=model, max_tokens=MAX_TOKENS, **GREEDY, tools=[WEATHER_TOOL],
                                    messages=[question, {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [result]}])
    check(answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"tools: answer {answer.stop_reason!r}")
    check(answer.usage.input_tokens > message.usage.input_tokens, "tools: the result did not reach the prompt")


def errors(client, model):
    cases = [
        (anthropic.BadRequestError, "invalid_request_error",
         lambda: client.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "x"}])),
        (anthropic.BadRequestError, "invalid_request_error",
         lambda: client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])),
        (anthropic.NotFoundError, "not_found_error",
         lambda: client.messages.create(model="no-such-model", max_tokens=8,
                                        messages=[{"role": "user", "content": "x"}])),
    ]
    for error_class, kind, call in cases:
        try:
            call()
        except error_class as error:
            check(error.body.get("type") == "error", f"errors: body {error.body}")
            check(error.body["error"]["type"] == kind, f"errors: body {error.body}")
            continue
        raise CheckFailure(f"errors: expected {error_class.__name__}")


def main(argv):
    if len(argv) < 3:
        raise SystemExit(__doc__)
    base_url, model = argv[1].rstrip("/").removesuffix("/v1"), argv[2]
    api_key = os.environ.get("DFLASH_API_KEY", "no-key")
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    reference = whole(client, model)
    print(f"whole:  {reference.stop_reason}, {reference.usage.input_tokens}+{reference.usage.output_tokens} "
          f"tokens: {text_of(reference)!r}")
    streamed(client, model, reference)
    count = client.messages.count_tokens(model=model, messages=[{"role": "user", "content": PROMPT}])
    check(count.input_tokens == reference.usage.input_tokens, f"count_tokens: {count.input_tokens}")
    stop_sequence(client, model, reference)
    tool_round_trip(client, model)
    errors(client, model)
    print(f"anthropic messages test passed against {base_url} (model {model})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except CheckFailure as failure:
        print(f"anthropic messages test FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
