"""Chat and completion details of `dflash serve` through the official `openai` client: an assistant prefill
continued in place, `n` choices with a seed, `logit_bias`, `echo` and `suffix`, and the served model names.

Usage: python openai_chat_details.py BASE_URL [ALIAS...]     e.g. http://127.0.0.1:8000/v1 dflash-e2e smol-alias
ALIAS: the server's --served-model-name values, in order (none: the alias checks are skipped).
Set DFLASH_API_KEY when the server was started with --api-key. Exits non-zero on the first failed check.
"""

import json
import os
import sys
import urllib.request

from openai import NotFoundError, OpenAI

from e2e_support import CheckFailure, check, base_url_from

COUNT_PROMPT = "Count from 1 to 10, separated by commas."


def server_call(base_url, route, body):
    """POSTs `body` to one of the server's vLLM routes beside /v1 (/tokenize, /detokenize)."""
    request = urllib.request.Request(base_url[: -len("/v1")] + route, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if os.environ.get("DFLASH_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['DFLASH_API_KEY']}")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def tokenize(base_url, text):
    return server_call(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def detokenize(base_url, ids):
    return server_call(base_url, "/detokenize", {"tokens": ids})["prompt"]


def chat(client, model, messages, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=messages, **kwargs)


def check_prefill_continues(client, model):
    messages = [{"role": "user", "content": COUNT_PROMPT}, {"role": "assistant", "content": "1, 2, 3, 4,"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    reply = chat(client, model, messages, extra_body=extra).choices[0].message.content
    check(reply.lstrip().startswith("5"), f"the prefill was not continued in place: {reply!r}")
    closed = chat(client, model, messages, extra_body={"add_generation_prompt": False}).choices[0].message.content
    check(closed.lstrip().startswith("5"), f"add_generation_prompt false did not continue the prefill: {closed!r}")
    fresh = chat(client, model, messages).choices[0].message.content
    check(not fresh.lstrip().startswith("5,"), f"without continue_final_message a new turn starts: {fresh!r}")
    both = {"continue_final_message": True, "add_generation_prompt": True}
    try:
        chat(client, model, messages, extra_body=both)
        check(False, "continue_final_message with add_generation_prompt was accepted")
    except Exception as error:  # the client raises BadRequestError
        check(getattr(error, "status_code", None) == 400, f"expected 400, got {error!r}")


def check_n_choices(client, model):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    sampled = {"temperature": 1.0, "seed": 42, "max_tokens": 24}
    several = chat(client, model, messages, n=3, **sampled)
    check([c.index for c in several.choices] == [0, 1, 2], f"choice indexes {[c.index for c in several.choices]}")
    one = chat(client, model, messages, **sampled).choices[0].message.content
    check(several.choices[0].message.content == one, "choice 0 differs from the n=1 answer with the same seed")
    texts = {c.message.content for c in several.choices}
    check(len(texts) > 1, f"three seeded choices were all the same: {texts}")
    single_usage = chat(client, model, messages, **sampled).usage
    check(several.usage.prompt_tokens == single_usage.prompt_tokens, "the prompt is not counted once")
    check(several.usage.completion_tokens > single_usage.completion_tokens, "completion tokens are not summed")
    streamed = {}
    for chunk in chat(client, model, messages, n=3, stream=True, **sampled):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    check(sorted(streamed) == [0, 1, 2], f"streamed choice indexes {sorted(streamed)}")
    for choice in several.choices:
        check(streamed[choice.index] == choice.message.content, f"streamed choice {choice.index} differs")


def check_logit_bias(client, model, base_url):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    forced = tokenize(base_url, " banana")[0]
    reply = chat(client, model, messages, max_tokens=3, logit_bias={str(forced): 100}).choices[0].message.content
    expected = detokenize(base_url, [forced] * 3)
    check(reply.strip() == expected.strip(), f"logit_bias +100 did not force {expected!r}: {reply!r}")
    plain = chat(client, model, messages, max_tokens=4).choices[0].message.content
    first = tokenize(base_url, plain)[0]
    banned = chat(client, model, messages, max_tokens=4, logit_bias={str(first): -100}).choices[0].message.content
    check(tokenize(base_url, banned)[:1] != [first], f"the banned token {first} still starts {banned!r}")


def check_echo_and_suffix(client, model, base_url):
    prompt = "The capital of France is"
    text = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True).choices[0].text
    check(text.startswith(prompt) and len(text) > len(prompt), f"echo: {text!r}")
    has_fim = len(tokenize(base_url, "<fim_prefix>")) == 1
    try:
        infill = client.completions.create(model=model, prompt="def add(a, b):", suffix="\n    return c", max_tokens=8)
        check(has_fim, f"suffix was accepted by a model without fill-in-the-middle tokens: {infill!r}")
    except Exception as error:  # the client raises BadRequestError
        check(not has_fim, f"suffix was refused by a model with fill-in-the-middle tokens: {error!r}")
        check(getattr(error, "status_code", None) == 400 and "suffix" in str(error), f"suffix refusal: {error!r}")


def check_aliases(client, aliases):
    listed = [m.id for m in client.models.list().data]
    check(listed == aliases, f"/v1/models lists {listed}, expected {aliases}")
    for alias in aliases:
        check(client.models.retrieve(alias).id == alias, f"/v1/models/{alias}")
        reply = chat(client, alias, [{"role": "user", "content": "Hi"}], max_tokens=2)
        check(reply.model == aliases[0], f"asked as {alias}, answered as {reply.model}")
    try:
        chat(client, "no-such-model", [{"role": "user", "content": "Hi"}], max_tokens=2)
        check(False, "an unknown model was accepted")
    except NotFoundError:
        pass


def main(argv):
    base_url = base_url_from(argv, __doc__)
    aliases = argv[2:]
    client = OpenAI(base_url=base_url, api_key=os.environ.get("DFLASH_API_KEY", "none"), max_retries=0)
    model = client.models.list().data[0].id
    try:
        check_prefill_continues(client, model)
        check_n_choices(client, model)
        check_logit_bias(client, model, base_url)
        check_echo_and_suffix(client, model, base_url)
        if aliases:
            check_aliases(client, aliases)
    except CheckFailure as failure:
        print(f"chat details check failed: {failure}", file=sys.stderr)
        return 1
    print(f"chat details passed against {base_url} (model {model})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
