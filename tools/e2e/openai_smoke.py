"""Smoke test of `dflash serve` through the official `openai` client: one whole and one streamed chat.

Usage: python openai_smoke.py BASE_URL     (or set DFLASH_BASE_URL), e.g. http://127.0.0.1:8000/v1
Set DFLASH_API_KEY when the server was started with --api-key. Exits non-zero on the first failed check.
"""

import os
import sys

from openai import OpenAI

from e2e_support import CheckFailure, check, base_url_from

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


def check_usage(usage, where):
    check(usage is not None, f"{where}: no usage")
    check(usage.prompt_tokens > 0, f"{where}: prompt_tokens {usage.prompt_tokens}")
    check(1 <= usage.completion_tokens <= MAX_TOKENS, f"{where}: completion_tokens {usage.completion_tokens}")
    total = usage.prompt_tokens + usage.completion_tokens
    check(usage.total_tokens == total, f"{where}: total_tokens {usage.total_tokens} != {total}")


def whole_chat(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    check(len(response.choices) == 1, f"whole: {len(response.choices)} choices")
    choice = response.choices[0]
    check(choice.message.role == "assistant", f"whole: role {choice.message.role!r}")
    check(bool((choice.message.content or "").strip()), "whole: empty content")
    check(choice.finish_reason in ("stop", "length"), f"whole: finish_reason {choice.finish_reason!r}")
    check_usage(response.usage, "whole")
    if choice.finish_reason == "length":
        check(response.usage.completion_tokens == MAX_TOKENS, "whole: length finish before max_tokens")
    return choice.message.content, choice.finish_reason, response.usage


def streamed_chat(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish_reasons, usage, chunks = [], [], None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            check(not chunk.choices, "stream: the usage chunk carries choices")
            usage = chunk.usage
            continue
        check(usage is None, "stream: a chunk after the usage chunk")
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    text = "".join(pieces)
    check(bool(text.strip()), f"stream: empty content after {chunks} chunks")
    check(len(finish_reasons) == 1, f"stream: finish reasons {finish_reasons}")
    check(finish_reasons[0] in ("stop", "length"), f"stream: finish_reason {finish_reasons[0]!r}")
    check_usage(usage, "stream")
    return text, finish_reasons[0], usage


def main(argv):
    base_url = base_url_from(argv, __doc__)
    api_key = os.environ.get("DFLASH_API_KEY", "no-key")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    models = client.models.list().data
    check(len(models) >= 1, "no models listed")
    model = models[0].id
    text, finish, usage = whole_chat(client, model)
    print(f"whole:  {finish}, {usage.prompt_tokens}+{usage.completion_tokens} tokens: {text!r}")
    streamed, streamed_finish, streamed_usage = streamed_chat(client, model)
    print(f"stream: {streamed_finish}, {streamed_usage.prompt_tokens}+{streamed_usage.completion_tokens} tokens: {streamed!r}")
    # Greedy, one request at a time: both ways give the same answer.
    check(streamed == text, f"greedy stream {streamed!r} != whole {text!r}")
    check(streamed_usage.prompt_tokens == usage.prompt_tokens, "prompt_tokens differ between stream and whole")
    check(streamed_usage.completion_tokens == usage.completion_tokens, "completion_tokens differ")
    print(f"openai smoke test passed against {base_url} (model {model})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except CheckFailure as failure:
        print(f"openai smoke test FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
