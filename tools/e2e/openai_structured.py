"""Structured outputs of `dflash serve` through the official `openai` client.

Runs every schema of schemas.json (beside this file) as a strict `response_format` json_schema chat, in parallel
and greedy, and checks that each answer parses, validates with `jsonschema` (formats included) and ends with
"stop"; then `json_object`; vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs`; llama.cpp's `json_schema` and GBNF `grammar`; SGLang's `regex`; a streamed json_schema chat,
a constrained completion, seeded sampling, and the 400s for a bad schema and for two constraints at once.

Usage: python openai_structured.py BASE_URL     (or set DFLASH_BASE_URL), e.g. http://127.0.0.1:8000/v1
Set DFLASH_API_KEY when the server was started with --api-key. Exits non-zero when a check fails, after printing
every failed schema with its request and output.
"""

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
from openai import BadRequestError, OpenAI

from e2e_support import CheckFailure, check, base_url_from

SCHEMAS_PATH = Path(__file__).with_name("schemas.json")
MAX_TOKENS = 400  # every schema is bounded well below this, so a "length" finish is a failure
PARALLEL_REQUESTS = 8
SEEDED_SCHEMAS = 8
SEED = 1234
FIELDS_SCHEMA = "person"  # asked under every field name that takes a schema
STREAMED_SCHEMA = "weather"


def schema_format(case):
    return {"type": "json_schema", "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True}}


def messages_for(prompt):
    return [{"role": "user", "content": prompt}]


def validation_error(schema, text):
    """Why `text` is not a JSON document valid for `schema`, or None when it is."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    return "; ".join(f"{list(e.path)}: {e.message}" for e in errors) or None


def schema_chat(client, model, case, sampling):
    """One strict json_schema chat; returns (content, finish_reason)."""
    response = client.chat.completions.create(
        model=model,
        messages=messages_for(case["prompt"]),
        response_format=schema_format(case),
        max_tokens=MAX_TOKENS,
        **sampling,
    )
    choice = response.choices[0]
    return choice.message.content or "", choice.finish_reason


def schema_failure(client, model, case, sampling):
    """A description of how `case` failed (request and output), or None when it passed."""
    try:
        content, finish = schema_chat(client, model, case, sampling)
    except Exception as error:  # the report names every failing schema, whatever went wrong
        return f"{case['name']}: request failed: {error!r}"
    problems = []
    if finish != "stop":
        problems.append(f"finish_reason {finish!r}")
    invalid = validation_error(case["schema"], content)
    if invalid:
        problems.append(invalid)
    if not problems:
        return None
    request = {"prompt": case["prompt"], "schema": case["schema"], **sampling}
    return f"{case['name']}: {', '.join(problems)}\n  request: {json.dumps(request)}\n  output: {content!r}"


def run_suite(client, model, cases, sampling):
    with ThreadPoolExecutor(max_workers=PARALLEL_REQUESTS) as pool:
        failures = list(pool.map(lambda case: schema_failure(client, model, case, sampling), cases))
    return [failure for failure in failures if failure]


def constrained_chat(client, model, prompt, max_tokens=64, **kwargs):
    response = client.chat.completions.create(
        model=model, messages=messages_for(prompt), max_tokens=max_tokens, temperature=0, **kwargs
    )
    choice = response.choices[0]
    return choice.message.content or "", choice.finish_reason


def check_json_object(client, model):
    # Any object is allowed, so the prompt names the keys: the small test model wanders off an open-ended one.
    prompt = 'Reply with a JSON object with two keys, "name" and "age", for a cat.'
    json_object = {"type": "json_object"}
    text, finish = constrained_chat(client, model, prompt, max_tokens=MAX_TOKENS, response_format=json_object)
    check(finish == "stop", f"json_object: finish_reason {finish!r} for {text!r}")
    check(isinstance(json.loads(text), dict), f"json_object: not an object: {text!r}")
    return text


def check_regex_fields(client, model):
    """guided_regex (vLLM) and regex (SGLang) give text the whole pattern matches."""
    pattern = r"[0-9]{3}-[0-9]{4}"
    for field in ("guided_regex", "regex"):
        text, finish = constrained_chat(client, model, "Give a phone number.", extra_body={field: pattern})
        check(finish == "stop", f"{field}: finish_reason {finish!r} for {text!r}")
        check(re.fullmatch(pattern, text) is not None, f"{field}: {text!r} does not match {pattern}")
    return text


def check_choice(client, model):
    choices = ["yes", "no", "maybe"]
    text, finish = constrained_chat(client, model, "Is the sky blue?", extra_body={"guided_choice": choices})
    check(finish == "stop", f"guided_choice: finish_reason {finish!r}")
    check(text in choices, f"guided_choice: {text!r} is not one of {choices}")
    return text


def check_grammars(client, model):
    """A GBNF `grammar` (llama.cpp) and a Lark `guided_grammar` (vLLM) both bound the text to their language."""
    gbnf = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    lark = 'start: "Answer: " WORD\nWORD: /[a-z]{1,10}/'
    cases = [("grammar", gbnf, r"The answer is [0-9]{1,2}\."), ("guided_grammar", lark, r"Answer: [a-z]{1,10}")]
    texts = []
    for field, grammar, language in cases:
        text, finish = constrained_chat(client, model, "What is six plus seven?", extra_body={field: grammar})
        check(finish == "stop", f"{field}: finish_reason {finish!r} for {text!r}")
        check(re.fullmatch(language, text) is not None, f"{field}: {text!r} is outside {language}")
        texts.append(text)
    return texts


def check_schema_fields(client, model, case, answer):
    """The same schema under vLLM's `guided_json` and `structured_outputs.json` and llama.cpp's `json_schema` gives
    the same greedy answer as `response_format` (`answer`, asked alone); `structured_outputs.choice` picks one."""
    fields = {
        "guided_json": case["schema"],
        "structured_outputs": {"json": case["schema"]},
        "json_schema": case["schema"],
    }
    for field, value in fields.items():
        text, finish = constrained_chat(client, model, case["prompt"], max_tokens=MAX_TOKENS, extra_body={field: value})
        check(finish == "stop", f"{field}: finish_reason {finish!r} for {text!r}")
        check(text == answer, f"{field}: {text!r} != response_format's {answer!r}")
    choices = ["north", "south"]
    picked, finish = constrained_chat(
        client, model, "Where do penguins live?", extra_body={"structured_outputs": {"choice": choices}}
    )
    check(finish == "stop" and picked in choices, f"structured_outputs.choice: {picked!r} ({finish!r})")
    return answer


def check_streamed_schema(client, model, case, whole_text):
    stream = client.chat.completions.create(
        model=model,
        messages=messages_for(case["prompt"]),
        response_format=schema_format(case),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    pieces, finish_reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    text = "".join(pieces)
    check(finish_reasons == ["stop"], f"stream: finish reasons {finish_reasons}")
    invalid = validation_error(case["schema"], text)
    check(invalid is None, f"stream: {invalid} in {text!r}")
    # Greedy, with the same grammar: streaming changes only how the answer is delivered.
    check(text == whole_text, f"stream: {text!r} != whole answer {whole_text!r}")
    return text


def check_completion_regex(client, model):
    pattern = r"(19|20)[0-9]{2}"
    response = client.completions.create(
        model=model,
        prompt="The year the war ended was",
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": pattern},
    )
    choice = response.choices[0]
    check(choice.finish_reason == "stop", f"completion: finish_reason {choice.finish_reason!r} for {choice.text!r}")
    check(re.fullmatch(pattern, choice.text) is not None, f"completion: {choice.text!r} does not match {pattern}")
    return choice.text


def check_seeded(client, model, cases):
    """Sampled (temperature 0.8, seeded) output still validates, and the same seed gives the same answer."""
    sampling = {"temperature": 0.8, "seed": SEED}
    failures = run_suite(client, model, cases, sampling)
    check(not failures, "seeded sampling:\n" + "\n".join(failures))
    first, _ = schema_chat(client, model, cases[0], sampling)
    again, _ = schema_chat(client, model, cases[0], sampling)
    check(first == again, f"seeded: the same seed gave {first!r} then {again!r}")
    return len(cases)


def expect_400(client, model, param_choices, where, **kwargs):
    try:
        client.chat.completions.create(model=model, messages=messages_for("Hi"), max_tokens=8, **kwargs)
    except BadRequestError as error:
        body = error.body if isinstance(error.body, dict) else {}
        param = body.get("param")
        check(param in param_choices, f"{where}: 400 names param {param!r}, expected one of {param_choices}")
        return param
    raise CheckFailure(f"{where}: the request was accepted")


def check_refusals(client, model):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}, "strict": True}}
    expect_400(client, model, ["response_format"], "bad schema", response_format=bad_schema)
    unknown_format = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    expect_400(
        client, model, ["response_format"], "unknown format",
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": unknown_format}},
    )
    expect_400(client, model, ["guided_regex"], "bad regex", extra_body={"guided_regex": "([0-9]"})
    expect_400(
        client, model, ["response_format", "guided_regex"], "two constraints",
        response_format={"type": "json_object"}, extra_body={"guided_regex": "[0-9]+"},
    )


def main(argv):
    base_url = base_url_from(argv, __doc__)
    api_key = os.environ.get("DFLASH_API_KEY", "no-key")
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    cases = json.loads(SCHEMAS_PATH.read_text(encoding="utf-8"))
    check(len(cases) >= 50, f"only {len(cases)} schemas in {SCHEMAS_PATH.name}")
    failures = run_suite(client, model, cases, {"temperature": 0})
    for failure in failures:
        print(f"schema FAILED {failure}", file=sys.stderr)
    check(not failures, f"{len(failures)} of {len(cases)} schemas failed")
    print(f"json_object: {check_json_object(client, model)!r}")
    print(f"guided_regex: {check_regex_fields(client, model)!r}")
    print(f"guided_choice: {check_choice(client, model)!r}")
    print(f"grammars: {check_grammars(client, model)!r}")
    by_name = {case["name"]: case for case in cases}
    fields_case, streamed_case = by_name[FIELDS_SCHEMA], by_name[STREAMED_SCHEMA]
    whole, _ = schema_chat(client, model, fields_case, {"temperature": 0})
    print(f"guided_json, structured_outputs, json_schema: {check_schema_fields(client, model, fields_case, whole)!r}")
    whole, _ = schema_chat(client, model, streamed_case, {"temperature": 0})
    print(f"stream: {check_streamed_schema(client, model, streamed_case, whole)!r}")
    print(f"completion guided_regex: {check_completion_regex(client, model)!r}")
    seeded = check_seeded(client, model, cases[:SEEDED_SCHEMAS])
    check_refusals(client, model)
    print(
        f"structured outputs passed: {len(cases)} schemas, all valid and stopped; {seeded} seeded; "
        f"json_object, regex, choice, grammars, schema fields, stream, completion and refusals checked"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except CheckFailure as failure:
        print(f"openai structured-output test FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
