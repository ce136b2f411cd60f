"""Structured output through the official `openai` Python client.

Usage: python structured_output.py BASE_URL POLICY[,POLICY...] PROMPTS
For every policy and each of PROMPTS questions, asks for JSON under a strict schema (chat,
`response_format` json_schema), streaming and not, and a JSON object on /v1/completions; every
complete answer must parse and validate (`jsonschema`). Prints one JSON summary line; exits
non-zero on any failure.
"""

import json
import pathlib
import sys

import jsonschema
import openai

base_url, policies, prompts = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

# The schema `bench routing --json-schema` and scripts/structured-sweep.py use too.
ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "config/schemas/answer.json").read_text())
QUESTIONS = [
    "What is the capital of Japan?",
    "Name a primary colour.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is 7 times 8?",
    "Which planet is closest to the Sun?",
    "What language is spoken in Brazil?",
]
MAX_TOKENS = 96


def check(condition, what):
    if not condition:
        raise SystemExit(f"check failed: {what}")


def validated(text, finish, what, schema=SCHEMA):
    """A complete answer parses and validates; one cut by the length limit is reported."""
    if finish == "length":
        return False
    check(finish == "stop", f"{what}: finish {finish}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"check failed: {what}: not JSON ({e}): {text!r}")
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise SystemExit(f"check failed: {what}: {e.message}: {text!r}")
    return True


response_format = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
}
results = []
for policy in policies:
    complete = handoffs = 0
    for question in QUESTIONS[:prompts]:
        messages = [
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": question},
        ]
        request = dict(
            model=policy,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            seed=1,
            response_format=response_format,
        )
        chat = client.chat.completions.create(**request)
        text, finish = chat.choices[0].message.content, chat.choices[0].finish_reason
        complete += validated(text, finish, f"{policy}: {question}")
        handoffs += chat.model_extra["routing"]["handoffs"]

        stream = client.chat.completions.create(**request, stream=True)
        pieces, streamed_finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                streamed_finish = choice.finish_reason or streamed_finish
        streamed = "".join(pieces)
        check(streamed == text, f"{policy}: streamed {streamed!r} == whole {text!r}")
        check(streamed_finish == finish, f"{policy}: streamed finish {streamed_finish}")

    completion = client.completions.create(
        model=policy,
        prompt="A JSON object describing Tokyo:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    object_complete = validated(
        completion.choices[0].text,
        completion.choices[0].finish_reason,
        f"{policy}: completions json_object",
        schema={"type": "object"},
    )
    results.append(
        {
            "policy": policy,
            "complete": complete,
            "asked": prompts,
            "handoffs": handoffs,
            "object_complete": object_complete,
        }
    )

try:
    client.chat.completions.create(
        model=policies[0],
        messages=[{"role": "user", "content": "hi"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": {"type": "object", "$ref": "#/nowhere"}},
        },
    )
    raise SystemExit("check failed: an unresolvable schema was accepted")
except openai.BadRequestError as e:
    param = e.body.get("param") if isinstance(e.body, dict) else None
    check(param == "response_format.json_schema.schema", f"the 400 names the schema: {e.body}")

print(json.dumps({"results": results}))
