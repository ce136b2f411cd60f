"""The official `openai` Python client against a running tokenrouter server.

Usage: python openai_client.py BASE_URL POLICY[,POLICY...]
Runs chat and completion calls, streaming and not, for each policy; checks the parsed
objects carry text, usage and routing; prints one JSON summary line; exits non-zero on any
failure.
"""

import json
import sys

import openai

base_url, policies = sys.argv[1], sys.argv[2].split(",")
client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
summary = []


def check(condition, what):
    if not condition:
        raise SystemExit(f"check failed: {what}")


listed = {m.id for m in client.models.list().data}
check(set(policies) <= listed, f"/v1/models lists {policies}: {sorted(listed)}")

messages = [{"role": "user", "content": "What is the capital of Japan?"}]
for policy in policies:
    chat = client.chat.completions.create(
        model=policy, messages=messages, max_tokens=12, temperature=0, seed=1
    )
    text = chat.choices[0].message.content
    check(chat.object == "chat.completion", "chat object")
    check(text and text.strip(), f"{policy}: chat text")
    check(chat.usage.completion_tokens > 0, "chat usage")
    check(
        chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens,
        "usage adds up",
    )
    routing = chat.model_extra["routing"]
    check(routing["policy"] == policy, "routing names the policy")
    check(
        sum(routing["tokens_per_model"].values()) == chat.usage.completion_tokens,
        "tokens per model add up to the completion",
    )

    stream = client.chat.completions.create(
        model=policy,
        messages=messages,
        max_tokens=12,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    streamed = "".join(pieces)
    check(streamed == text, f"{policy}: streamed {streamed!r} == whole {text!r}")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, "stream usage")
    check(finish in ("stop", "length"), "stream finish reason")

    completion = client.completions.create(
        model=policy, prompt="The capital of France is", max_tokens=8, temperature=0, seed=1
    )
    ctext = completion.choices[0].text
    check(completion.object == "text_completion" and ctext, f"{policy}: completion text")
    check(completion.usage.prompt_tokens > 0, "completion usage")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=policy,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            seed=1,
            stream=True,
        )
        if c.choices
    )
    check(streamed == ctext, f"{policy}: streamed completion {streamed!r} == {ctext!r}")
    summary.append({"policy": policy, "chat": text, "completion": ctext, "routing": routing})

try:
    client.chat.completions.create(model="no-such-policy", messages=messages)
    raise SystemExit("an unknown model must fail")
except openai.NotFoundError as e:
    check(e.status_code == 404, "unknown model is 404")

print(json.dumps({"openai": openai.__version__, "results": summary}))
