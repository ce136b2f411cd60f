//! Gemma 3 270M (the real GGUF, fetched by scripts/fetch-gemma3.sh; skipped with a message
//! when absent, a failure under TOKENROUTER_REQUIRE_MODEL=1) against llama.cpp's reading of the
//! same file, recorded in tests/fixtures/gemma3-llama-cpp.json by scripts/gemma3-llama-cpp.sh.

mod common;
use common::work;

use serde::Deserialize;
use tokenrouter::engine::chat::{ChatMessage, ChatTemplate};
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Executor, SeqId, StepExecutor};

#[derive(Deserialize)]
struct Fixture {
    generations: Vec<Generation>,
    tokenizations: Vec<Tokenization>,
}

#[derive(Deserialize)]
struct Generation {
    prompt: String,
    prompt_tokens: Vec<u32>,
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct Tokenization {
    text: String,
    ids: Vec<u32>,
}

fn fixture() -> Fixture {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gemma3-llama-cpp.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn executor(path: &std::path::Path) -> Executor {
    let mut config = common::model_config("gemma3-270m", path);
    config.threads = 2;
    Executor::load(&config).unwrap()
}

/// Greedy decoding of `prompt` for up to `steps` tokens, stopping at an end of sequence.
fn greedy(executor: &mut Executor, tok: &ModelTokenizer, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < steps {
        let candidate = executor.step(&[work(1, input)]).unwrap()[0].candidate;
        if tok.eos.contains(&candidate) {
            break;
        }
        out.push(candidate);
        input = vec![candidate];
    }
    executor.free(SeqId(1));
    out
}

#[test]
fn tokenizer_splits_varied_texts_as_llama_cpp_and_round_trips() {
    let Some(path) = common::real_gemma3() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    assert_eq!(tok.bos, Some(2));
    assert!(tok.add_bos);
    // `<eos>` and the end of a chat turn both end a generation.
    assert_eq!(tok.eos.iter().copied().collect::<Vec<_>>(), vec![1, 106]);
    for case in fixture().tokenizations {
        let ids = tok.inner.encode(case.text.as_str(), false).unwrap();
        assert_eq!(ids.get_ids(), case.ids, "{:?}", case.text);
        // SentencePiece writes a space as `▁`, so a `▁` in the text reads back as a space.
        let text = case.text.replace('\u{2581}', " ");
        assert_eq!(tok.decode(&case.ids, false).unwrap(), text);
    }
}

#[test]
fn greedy_tokens_equal_llama_cpp_for_64_tokens() {
    let Some(path) = common::real_gemma3() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    let mut executor = executor(&path);
    for case in fixture().generations {
        assert_eq!(tok.encode(&case.prompt).unwrap(), case.prompt_tokens);
        let ours = greedy(&mut executor, &tok, &case.prompt_tokens, 64);
        assert_eq!(ours, case.tokens, "{:?}", case.prompt);
    }
    assert_eq!(executor.kv_usage().used_tokens, 0);
}

#[test]
fn chat_template_renders_gemma_turns() {
    let Some(path) = common::real_gemma3() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    // The file is the pretrained model: no template of its own.
    assert!(tok.chat_template.is_none());
    let template = ChatTemplate::for_model(&tok).unwrap();
    let question = [ChatMessage::user("What is the capital of Japan?")];
    assert_eq!(
        template.render(&question, true).unwrap(),
        fixture().generations[0].prompt
    );
    let with_system = [
        ChatMessage {
            role: "system".into(),
            content: "Answer briefly.".into(),
        },
        ChatMessage::user(" Hi "),
        ChatMessage {
            role: "assistant".into(),
            content: "Hello.".into(),
        },
        ChatMessage::user("Bye"),
    ];
    assert_eq!(
        template.render(&with_system, true).unwrap(),
        "<start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.\
         <end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let not_alternating = [ChatMessage::user("a"), ChatMessage::user("b")];
    assert!(template.render(&not_alternating, true).is_err());
}

/// Ragged rows stepping together, one of them past the 512-token sliding window, decode what
/// each decodes alone.
#[test]
fn batched_equals_alone_past_the_sliding_window() {
    let Some(path) = common::real_gemma3() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    let mut executor = executor(&path);
    let long: String = (0..120)
        .map(|i| format!("Item {i} is on the list. "))
        .collect();
    let prompts: Vec<Vec<u32>> = [
        long.as_str(),
        "Paris is the capital of",
        "Héllo wörld — naïve café 🎉",
        "1, 2, 3, 4,",
    ]
    .iter()
    .map(|p| tok.encode(p).unwrap())
    .collect();
    assert!(prompts[0].len() > 600, "{} tokens", prompts[0].len());
    let all: Vec<(u64, Vec<u32>)> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| (i as u64, p))
        .collect();
    let batched = common::decode_together(&mut executor, &all, 6);
    for (i, seq) in all.iter().enumerate() {
        let alone = common::decode_together(&mut executor, std::slice::from_ref(seq), 6);
        assert_eq!(batched[i], alone[0], "sequence {i}");
    }
    assert_eq!(executor.kv_usage().used_tokens, 0);
}

/// `generate --model gemma3-270m --chat` (a model the default config does not name, served
/// alone) answers with llama.cpp's greedy tokens.
#[test]
fn the_cli_serves_a_model_by_name_with_its_chat_template() {
    if common::real_gemma3().is_none() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["generate", "--model", "gemma3-270m", "--chat"])
        .args(["--prompt", "What is the capital of Japan?"])
        .args(["--max-tokens", "64", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u32> = serde_json::from_value(report["token_ids"].clone()).unwrap();
    assert_eq!(ids, fixture().generations[0].tokens);
    assert_eq!(report["routing"]["tokens_per_model"]["gemma3-270m"], 64);

    let unknown = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["generate", "--model", "no-such-model", "--prompt", "x"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        stderr.contains("no model `no-such-model`") && stderr.contains("gemma3-270m"),
        "{stderr}"
    );
}

/// Over HTTP, whole and streamed: the text of llama.cpp's greedy tokens for the multilingual
/// prompt (CJK, byte-fallback pieces), read from each token's bytes.
#[test]
fn the_server_returns_and_streams_the_text_of_those_tokens() {
    let Some(path) = common::real_gemma3() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    let case = fixture()
        .generations
        .into_iter()
        .find(|g| g.prompt.contains('🎉'))
        .unwrap();
    let expected = tok.decode(&case.tokens, true).unwrap();
    let server = common::server::Server::start(std::path::Path::new("config/gemma3.toml"));
    let body = serde_json::json!({
        "model": "gemma3-270m",
        "prompt": case.prompt,
        "max_tokens": case.tokens.len(),
        "temperature": 0,
    });
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"], expected.as_str());
    assert_eq!(whole["usage"]["completion_tokens"], case.tokens.len());
    let mut streamed = body;
    streamed["stream"] = true.into();
    let text = common::server::stream_text(&server, "/v1/completions", &streamed);
    assert_eq!(text, expected);
}
