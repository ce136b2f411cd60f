#!/usr/bin/env bash
# llama.cpp's reading of Gemma 3 270M, written as the fixture tests/gemma3.rs compares against:
# greedy tokens (64 after each of the prompts below; the chat one rendered with Gemma's
# template as `generate --chat` does) and the token ids of varied texts (multilingual, code,
# numbers, emoji, whitespace runs, markup). llama.cpp runs from .venv-llama
# (scripts/llama-cpp-venv.sh); not part of CI, which reads the committed fixture.
#
#   bash scripts/gemma3-llama-cpp.sh [out=tests/fixtures/gemma3-llama-cpp.json]
# Prompts are chosen where both engines' greedy paths run 64 tokens without a near tie:
# elsewhere the two part where the top two logits lie within their rounding (docs/models.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-tests/fixtures/gemma3-llama-cpp.json}"
bash scripts/fetch-gemma3.sh
source scripts/llama-cpp-venv.sh
.venv-llama/bin/python - models/gemma-3-270m-q4_k_m.gguf "$out" "$LLAMA_CPP_BUILD" <<'PY'
import json, sys
import llama_cpp
from llama_cpp import llama_cpp as capi

path, out, build = sys.argv[1:]
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=2, verbose=False)
chat = "<start_of_turn>user\nWhat is the capital of Japan?<end_of_turn>\n<start_of_turn>model\n"
prompts = [
    chat,
    "Paris is the capital of",
    "Wikipedia is a free online encyclopedia",
    "Héllo wörld — naïve café 🎉 1234567 東京は",
]
texts = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "Tabs\tand\t\tnewlines\n\n\nand\r\nwindows line ends",
    "def add(a, b):\n    return a + b  # sum\n",
    "fn main() { println!(\"{}\", 1 << 20); }",
    "3.14159 2718281828 1,000,000 -42 0x1F 1e-9",
    "emoji: 🎉🚀👩‍👩‍👧‍👦 🇯🇵 ❤️",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Русский текст, Ελληνικά, עברית, العربية",
    "Ünïcödé àccénts: façade, Zürich, São Paulo",
    "<div class=\"x\">markup</div><br/>",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "mixed   multiple    spaces and\u00a0no-break\u200bzero-width",
    "a" * 40 + " " + "ab" * 20,
    "https://example.com/path?query=1&b=2#frag",
    "\u2581 already a visible space \u2581\u2581",
    "byte fallback: \U0001f9ec \U0002a6d6 \u0b85",
    "",
]
generations = []
for prompt in prompts:
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    generated = []
    for t in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        if capi.llama_vocab_is_eog(llm._model.vocab, t) or len(generated) == 64:
            break
        generated.append(t)
    generations.append({"prompt": prompt, "prompt_tokens": tokens, "tokens": generated})
tokenizations = [
    {"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in texts
]
with open(out, "w") as f:
    json.dump({"llama_cpp": build, "generations": generations, "tokenizations": tokenizations},
              f, ensure_ascii=False, indent=1)
    f.write("\n")
print(f"wrote {out}: {len(generations)} generations, {len(tokenizations)} tokenizations")
PY
