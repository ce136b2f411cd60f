"""Structured output across every policy and execution mode, through the official client.

Usage (from the repository, with the test venv of scripts/install-test-clients.sh):
    .venv-test/bin/python scripts/structured-sweep.py [--prompts 50] [--config config/default.toml]

For each execution mode (lockstep, standard, async, tokenrouter) it starts `tokenrouter serve`
on the config with that mode, and asks every policy and each model alone for JSON under a
strict schema (`response_format` json_schema, greedy) for each of PROMPTS questions from
data/quality-questions.jsonl, 8 at a time. Every answer must end inside `max_tokens` and
validate (`jsonschema`); the routed policies must hand off inside the JSON; each (policy,
question) must get the same tokens in every mode; and tests/clients/tool_calls.py must pass
against each server. Prints a Markdown table and exits non-zero on any failure.
"""

import argparse
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import jsonschema
import openai

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ["lockstep", "standard", "async", "tokenrouter"]
ROUTED = ["r2r", "citer", "rstitch", "colm", "me"]
# The schema of `bench routing --json-schema` and the client tests.
SCHEMA = json.loads((ROOT / "config/schemas/answer.json").read_text())
# Room for the longest answer the schema admits, escapes included: none ends on the limit.
MAX_TOKENS = 320


def start_server(binary, config, mode, workdir):
    text = re.sub(r'(?m)^mode = ".*"$', f'mode = "{mode}"', config.read_text())
    path = workdir / f"{mode}.toml"
    path.write_text(text)
    log = open(workdir / f"{mode}.log", "w+")
    process = subprocess.Popen(
        [binary, "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    for _ in range(600):
        log.seek(0)
        found = re.search(r"listening on (http://\S+)", log.read())
        if found:
            return process, found.group(1)
        if process.poll() is not None:
            raise SystemExit(f"the {mode} server exited: see {log.name}")
        subprocess.run(["sleep", "0.1"])
    raise SystemExit(f"the {mode} server did not start")


def ask(client, policy, question):
    chat = client.chat.completions.create(
        model=policy,
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": question},
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        seed=1,
        logprobs=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        },
    )
    choice = chat.choices[0]
    error = None
    if choice.finish_reason != "stop":
        error = f"finish {choice.finish_reason}"
    else:
        try:
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            error = str(e).splitlines()[0]
    routing = chat.model_extra["routing"]
    return {
        "text": choice.message.content,
        "tokens": [t.token for t in choice.logprobs.content],
        "error": error,
        "handoffs": routing["handoffs"],
        "count": chat.usage.completion_tokens,
    }


def sweep(url, policies, questions):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    jobs = [(p, i) for p in policies for i in range(len(questions))]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = pool.map(lambda job: ask(client, job[0], questions[job[1]]), jobs)
        return dict(zip(jobs, answers))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--config", default="config/default.toml")
    parser.add_argument("--binary", default=str(ROOT / "target/release/tokenrouter"))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    config = (ROOT / args.config).resolve()
    model_names = re.findall(r'(?m)^name = "(.*)"$', config.read_text().split("[runtime]")[0])
    policies = ROUTED + model_names
    lines = (ROOT / "data/quality-questions.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines[: args.prompts]]

    results, failures = {}, []
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.modes.split(","):
            process, url = start_server(args.binary, config, mode, pathlib.Path(workdir))
            try:
                results[mode] = sweep(url, policies, questions)
                tools = subprocess.run(
                    [sys.executable, str(ROOT / "tests/clients/tool_calls.py"), url,
                     ",".join(policies)],
                    capture_output=True,
                    text=True,
                )
                if tools.returncode != 0:
                    failures.append(f"{mode}: tool calls: {tools.stdout}{tools.stderr}")
            finally:
                process.terminate()
                process.wait()

    modes = list(results)
    print(f"{len(questions)} questions, `response_format` json_schema (strict), greedy\n")
    print("| mode | policy | valid / asked | tokens | handoffs / 100 tokens | same tokens as "
          f"`{modes[0]}` |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in modes:
        for policy in policies:
            answers = [results[mode][(policy, i)] for i in range(len(questions))]
            valid = sum(a["error"] is None for a in answers)
            tokens = sum(a["count"] for a in answers)
            handoffs = sum(a["handoffs"] for a in answers)
            same = sum(
                a["tokens"] == results[modes[0]][(policy, i)]["tokens"]
                for i, a in enumerate(answers)
            )
            print(f"| {mode} | {policy} | {valid} / {len(answers)} | {tokens} | "
                  f"{100 * handoffs / max(tokens, 1):.1f} | {same} / {len(answers)} |")
            for i, a in enumerate(answers):
                if a["error"]:
                    failures.append(f"{mode} {policy} {questions[i]!r}: {a['error']}: {a['text']!r}")
                if same < len(answers) and a["tokens"] != results[modes[0]][(policy, i)]["tokens"]:
                    failures.append(f"{mode} {policy} {questions[i]!r}: tokens differ from "
                                    f"{modes[0]}: {a['text']!r}")
    for mode in modes:
        routed = sum(a["handoffs"] for (p, _), a in results[mode].items() if p in ROUTED)
        if routed == 0:
            failures.append(f"{mode}: no handoff inside the JSON")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
