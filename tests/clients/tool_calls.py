"""Tool calls through the official `openai` Python client.

Usage: python tool_calls.py BASE_URL POLICY[,POLICY...]
For every policy: a required call among two functions (whole and streamed, which must agree),
a named call, and the call's result sent back for a text answer. Every complete call's
arguments must parse and validate against its function's parameters (`jsonschema`). Prints
one JSON summary line; exits non-zero on any failure.
"""

import json
import sys

import jsonschema
import openai

base_url, policies = sys.argv[1], sys.argv[2].split(",")
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "get_time": {
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": PARAMETERS[name]},
    }
    for name, description in [
        ("get_weather", "The current weather in a city"),
        ("get_time", "The current time in a timezone"),
    ]
]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check(condition, what):
    if not condition:
        raise SystemExit(f"check failed: {what}")


def validated_call(call, what):
    check(call.type == "function", f"{what}: type {call.type}")
    check(call.function.name in PARAMETERS, f"{what}: name {call.function.name}")
    try:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        raise SystemExit(f"check failed: {what}: {e}: {call.function.arguments!r}")
    return arguments


results = []
for policy in policies:
    request = dict(
        model=policy,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        seed=1,
    )
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    check(choice.finish_reason == "tool_calls", f"{policy}: finish {choice.finish_reason}")
    check(choice.message.content is None, f"{policy}: content {choice.message.content!r}")
    call = choice.message.tool_calls[0]
    arguments = validated_call(call, f"{policy}: required")

    name, streamed, ids, finish = None, [], set(), None
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for piece in c.delta.tool_calls or []:
                ids.add(piece.id) if piece.id else None
                name = piece.function.name or name
                streamed.append(piece.function.arguments or "")
    check(name == call.function.name, f"{policy}: streamed name {name}")
    check("".join(streamed) == call.function.arguments, f"{policy}: streamed arguments")
    check(len(ids) == 1 and finish == "tool_calls", f"{policy}: stream ids {ids}, {finish}")

    named = client.chat.completions.create(
        **{**request, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    named_call = named.choices[0].message.tool_calls[0]
    check(named_call.function.name == "get_time", f"{policy}: named {named_call.function.name}")
    validated_call(named_call, f"{policy}: named")

    answer = client.chat.completions.create(
        model=policy,
        messages=MESSAGES
        + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    text = answer.choices[0].message.content
    check(isinstance(text, str) and text, f"{policy}: the answer after the result: {text!r}")
    results.append(
        {
            "policy": policy,
            "name": call.function.name,
            "arguments": arguments,
            "handoffs": whole.model_extra["routing"]["handoffs"],
        }
    )

try:
    client.chat.completions.create(model=policies[0], messages=MESSAGES, tools=TOOLS)
    raise SystemExit("check failed: tool_choice auto was accepted")
except openai.BadRequestError as e:
    param = e.body.get("param") if isinstance(e.body, dict) else None
    check(param == "tool_choice", f"the 400 names tool_choice: {e.body}")

print(json.dumps({"results": results}))
