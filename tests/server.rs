//! The HTTP server on tiny random models (a real child process on loopback): OpenAI shapes,
//! the bad-input table, hot swap under load, SIGHUP reload, disconnects freeing KV, and the
//! dashboards naming only metrics the server exports.

mod common;

use common::server::{
    dashboard_exprs, metric_sum, samples, stream_events, write_tiny_config, Server, ADMIN_TOKEN,
};
use serde_json::{json, Value};
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

fn start(dir: &Path) -> Server {
    Server::start(&write_tiny_config(dir, 0.0))
}

fn chat_body(model: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the weather in the city"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 7,
        "stream": stream,
    })
}

#[test]
fn completions_and_chat_answer_in_openai_shape_with_routing_and_usage() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let (status, body) = server.post("/v1/chat/completions", &chat_body("me", 12, false));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "me");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let usage = &body["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion), "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + completion
    );
    let routing = &body["routing"];
    assert_eq!(routing["policy"], "me");
    let per_model: u64 = routing["tokens_per_model"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(per_model, completion);

    // The same request streamed: a role chunk, deltas, one finish chunk, then [DONE]; the
    // concatenated deltas equal the whole answer (greedy).
    let events = stream_events(&server, "/v1/chat/completions", &chat_body("me", 12, true));
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        body["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"],
        body["choices"][0]["finish_reason"]
    );
    assert_eq!(last["usage"], body["usage"]);

    // Plain completions, from text and from token ids, with `stop`.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"model": "large", "prompt": "the city", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["routing"]["tokens_per_model"]["small"], 0);
    let text = body["choices"][0]["text"].as_str().unwrap().to_string();
    let (status, by_ids) = server.post(
        "/v1/completions",
        &json!({"model": "large", "prompt": [71, 72, 73], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{by_ids}");
    assert_eq!(by_ids["usage"]["prompt_tokens"], 3);
    if let Some(stop) = text.chars().nth(3).filter(|c| !c.is_whitespace()) {
        let (_, stopped) = server.post(
            "/v1/completions",
            &json!({"model": "large", "prompt": "the city", "max_tokens": 8, "temperature": 0,
                    "stop": stop.to_string()}),
        );
        let cut = stopped["choices"][0]["text"].as_str().unwrap();
        assert!(
            text.starts_with(cut) && !cut.contains(stop),
            "{cut:?} vs {text:?}"
        );
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    }

    // /v1/models lists both models and both policies, marking the default.
    let (status, models) = server.call("GET", "/v1/models", None, None);
    assert_eq!(status, 200);
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    for id in ["large", "small", "me", "r2r"] {
        assert!(ids.contains(&id), "{ids:?}");
    }
    let entry = |id: &str| {
        let data = models["data"].as_array().unwrap();
        data.iter().find(|m| m["id"] == id).unwrap().clone()
    };
    let r2r = entry("r2r");
    assert_eq!(r2r["policy"]["learned_router"], false);
    assert_eq!(r2r["policy"]["models"], json!(["small", "large"]));
    assert_eq!(entry("me")["default"], true);
}

/// `logprobs` in both endpoints' shapes, whole and streamed: one entry per completion token,
/// each a log-probability with the most likely alternatives first (greedy: the token is the
/// first of them), the entropy and token ids as extensions; and the `Server-Timing` header.
#[test]
fn logprobs_come_back_in_openai_shapes_whole_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let mut body = chat_body("r2r", 6, false);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(
        content.len() as u64,
        whole["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let logprobs: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(logprobs.windows(2).all(|w| w[0] >= w[1]), "{entry}");
        assert!(logprobs.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-4);
        assert_eq!(top[0]["token_id"], entry["token_id"], "{entry}");
        assert_eq!(top[0]["logprob"], entry["logprob"], "{entry}");
        assert!(entry["entropy"].as_f64().unwrap() >= 0.0, "{entry}");
        assert_eq!(
            entry["bytes"],
            json!(entry["token"].as_str().unwrap().as_bytes())
        );
    }
    // Streamed: the chunks' entries together are the whole answer's.
    body["stream"] = json!(true);
    let events = stream_events(&server, "/v1/chat/completions", &body);
    let streamed: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, content);

    // Legacy completions: parallel arrays, `logprobs` the number of alternatives.
    let (status, text) = server.post(
        "/v1/completions",
        &json!({"model": "large", "prompt": "the city", "max_tokens": 5, "temperature": 0,
                "logprobs": 2}),
    );
    assert_eq!(status, 200, "{text}");
    let logprobs = &text["choices"][0]["logprobs"];
    for field in [
        "tokens",
        "token_logprobs",
        "top_logprobs",
        "text_offset",
        "token_ids",
        "entropies",
    ] {
        assert_eq!(
            logprobs[field].as_array().unwrap().len(),
            5,
            "{field}: {text}"
        );
    }
    let offsets: Vec<u64> = logprobs["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    // Without the field, no log-probabilities (and no work for them).
    let (_, plain) = server.post(
        "/v1/completions",
        &json!({"prompt": "the city", "max_tokens": 2}),
    );
    assert!(plain["choices"][0]["logprobs"].is_null(), "{plain}");

    let response = ureq::post(&server.url("/v1/completions"))
        .send_string(&json!({"prompt": "the city", "max_tokens": 2}).to_string())
        .unwrap();
    let timing = response.header("server-timing").unwrap().to_string();
    for part in ["parse", "tokenize", "queue", "prefix", "compute", "total"] {
        assert!(timing.contains(&format!("{part};dur=")), "{timing}");
    }
}

/// One row of the bad-input table: a request and the status and `param` it must get.
struct Case {
    method: &'static str,
    path: &'static str,
    token: Option<&'static str>,
    body: String,
    status: u16,
    param: Option<&'static str>,
}

impl Case {
    fn new(
        method: &'static str,
        path: &'static str,
        token: Option<&'static str>,
        body: impl Into<String>,
        status: u16,
        param: Option<&'static str>,
    ) -> Self {
        let body = body.into();
        Self {
            method,
            path,
            token,
            body,
            status,
            param,
        }
    }
}

#[test]
fn tool_calls_come_back_in_openai_shapes_whole_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), 0.0);
    let text = std::fs::read_to_string(&config).unwrap();
    // The functions' note makes the prompt longer than the bad-input table's limit.
    let text = text.replace("max_prompt_tokens = 200", "max_prompt_tokens = 450");
    std::fs::write(&config, text).unwrap();
    let server = Server::start(&config);
    // The tiny models' tokens are mostly single bytes: short names keep a call short.
    let mut body = chat_body("r2r", 80, false);
    body["tools"] = json!([
        {"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "time"}},
    ]);
    body["tool_choice"] = json!("required");
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
    assert!(choice["message"]["content"].is_null(), "{whole}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    let name = call["function"]["name"].as_str().unwrap();
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    match name {
        "weather" => assert!(["c", "f"].contains(&arguments["unit"].as_str().unwrap())),
        "time" => assert!(arguments.is_object(), "{arguments}"),
        other => panic!("called {other}"),
    }

    body["stream"] = json!(true);
    let events = stream_events(&server, "/v1/chat/completions", &body);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(
        calls[0]["function"]["name"], name,
        "the first piece names the function"
    );
    assert!(calls[1..]
        .iter()
        .all(|c| c["function"].get("name").is_none()));
    let streamed: String = calls
        .iter()
        .map(|c| c["function"]["arguments"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, call["function"]["arguments"].as_str().unwrap());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // The call and its result, sent back, are a conversation the server continues in text.
    let mut next = chat_body("r2r", 4, false);
    next["messages"] = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21 degrees"},
    ]);
    let (status, answer) = server.post("/v1/chat/completions", &next);
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );

    // A named function is the one called.
    body["stream"] = json!(false);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "time"}});
    let (status, named) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{named}");
    let call = &named["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "time", "{named}");
}

#[test]
fn bad_input_gets_the_right_status_and_an_openai_error_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let chat = "/v1/chat/completions";
    let long_prompt = "the ".repeat(300);
    let huge_body = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(5000));
    #[rustfmt::skip]
    let cases = vec![
        Case::new("POST", chat, None, "{not json", 400, None),
        Case::new("POST", chat, None, "[1, 2]", 400, None),
        Case::new("POST", chat, None, r#"{"messages": "hi"}"#, 400, Some("messages")),
        Case::new("POST", chat, None, r#"{"messages": []}"#, 400, Some("messages")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, 400, Some("messages[0].role")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user"}]}"#, 400, Some("messages[0].content")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#, 400, Some("tool_choice")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}"#, 400, Some("tool_choice")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f b"}}], "tool_choice": "required"}"#, 400, Some("tools[0].function.name")),
        Case::new("POST", chat, None, r##"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "$ref": "#/nowhere"}}}], "tool_choice": "required"}"##, 400, Some("tools[1].function.parameters")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}"#, 400, Some("messages[0].tool_calls")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]}"#, 400, Some("messages[0].tool_calls[0]")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}"#, 400, Some("tools")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}"#, 400, Some("response_format.type")),
        Case::new("POST", chat, None, r##"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "$ref": "#/nowhere"}}}}"##, 400, Some("response_format.json_schema.schema")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": "x", "guided_regex": "a", "ignore_eos": true}"#, 400, Some("guided_regex")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}"#, 400, Some("top_logprobs")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#, 400, Some("top_logprobs")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": 2}"#, 400, Some("logprobs")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": "x", "logprobs": true}"#, 400, Some("logprobs")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": "x", "logprobs": -1}"#, 400, Some("logprobs")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": "x", "top_logprobs": 2}"#, 400, Some("top_logprobs")),
        Case::new("POST", chat, None, r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}"#, 404, Some("model")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}"#, 400, Some("max_tokens")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000}"#, 400, Some("max_tokens")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}"#, 400, Some("max_tokens")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 7}"#, 400, Some("temperature")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "top_p": 0}"#, 400, Some("top_p")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}"#, 400, Some("stop")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "n": 3}"#, 400, Some("n")),
        Case::new("POST", chat, None, r#"{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}"#, 400, Some("stream")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": ""}"#, 400, Some("prompt")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": ["a", "b"]}"#, 400, Some("prompt")),
        Case::new("POST", "/v1/completions", None, r#"{"prompt": [99999999]}"#, 400, Some("prompt")),
        Case::new("POST", "/v1/completions", None, r#"{"max_tokens": 3}"#, 400, None),
        Case::new("POST", "/v1/completions", None, format!(r#"{{"prompt": "{long_prompt}"}}"#), 400, Some("prompt")),
        Case::new("POST", "/v1/completions", None, huge_body, 413, None),
        Case::new("GET", "/v1/completions", None, "", 405, None),
        Case::new("GET", "/v2/nothing", None, "", 404, None),
        Case::new("GET", "/admin/policy", None, "", 401, None),
        Case::new("GET", "/admin/policy", Some("wrong-token"), "", 401, None),
        Case::new("PUT", "/admin/policy", Some("wrong-token"), r#"{"default": "r2r"}"#, 401, None),
        Case::new("GET", "/admin/stats", None, "", 401, None),
        Case::new("PUT", "/admin/policy", Some(ADMIN_TOKEN), r#"{"default": "nope"}"#, 400, None),
        Case::new("PUT", "/admin/policy", Some(ADMIN_TOKEN), r#"{"policies": {"r2r": {"threshold": "high"}}}"#, 400, Some("policies.r2r.threshold")),
        Case::new("PUT", "/admin/policy", Some(ADMIN_TOKEN), r#"{"policies": {"r2r": {"kind": "magic"}}}"#, 400, Some("policies.r2r.kind")),
        Case::new("PUT", "/admin/policy", Some(ADMIN_TOKEN), r#"{"policies": {"new": {"threshold": 1}}}"#, 400, None),
        Case::new("PUT", "/admin/policy", Some(ADMIN_TOKEN), r#"{"surprise": 1}"#, 400, None),
    ];
    for Case {
        method,
        path,
        token,
        body,
        status,
        param,
    } in &cases
    {
        let body = (!body.is_empty()).then_some(body.as_str());
        let (got, answer) = server.call(method, path, *token, body);
        let what = format!("{method} {path} {body:?}");
        assert_eq!(got, *status, "{what}: {answer}");
        let error = &answer["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {answer}"
        );
        assert!(error["type"].is_string(), "{what}: {answer}");
        assert!(
            error.get("code").is_some() && error.get("param").is_some(),
            "{what}: {answer}"
        );
        if let Some(param) = param {
            assert_eq!(error["param"], *param, "{what}: {answer}");
        }
    }
    let (_, answer) = server.call(
        "PUT",
        "/admin/policy",
        Some(ADMIN_TOKEN),
        Some(r#"{"policies": {"r2r": {"kind": "magic"}}}"#),
    );
    let message = answer["error"]["message"].as_str().unwrap();
    for name in ["magic", "r2r", "citer", "rstitch", "colm", "me", "single"] {
        assert!(message.contains(&format!("`{name}`")), "{name}: {message}");
    }
    // Default values of the fields the server does not implement are accepted.
    let (status, answer) = server.post(
        chat,
        &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": [],
                "tool_choice": "none", "logprobs": false, "response_format": {"type": "text"},
                "functions": [], "parallel_tool_calls": true}),
    );
    assert_eq!(status, 200, "{answer}");
    // The failed swaps changed nothing, and the token never reached the log.
    let (_, policy) = server.call("GET", "/admin/policy", Some(ADMIN_TOKEN), None);
    assert_eq!(policy["default"], "me");
    assert_eq!(policy["policies"]["r2r"]["threshold"], 0.0);
    assert_eq!(
        metric_sum(&server.metrics(), "tokenrouter_policy_swaps_total"),
        0.0
    );
    assert!(!server.log.lock().unwrap().contains(ADMIN_TOKEN));
    let (status, health) = server.call("GET", "/health", None, None);
    assert_eq!((status, &health["status"]), (200, &json!("ok")));
    let (status, _) = server.post("/v1/chat/completions", &chat_body("r2r", 4, false));
    assert_eq!(status, 200);
}

/// Which models wrote a finished stream's tokens (from its final chunk).
fn writers(events: &[String]) -> Result<Vec<String>, String> {
    if events.last().map(String::as_str) != Some("[DONE]") {
        return Err(format!("no [DONE]: {events:?}"));
    }
    let last: Value = serde_json::from_str(&events[events.len() - 2]).map_err(|e| e.to_string())?;
    if last.get("error").is_some() || last["choices"][0]["finish_reason"].is_null() {
        return Err(format!("did not finish: {last}"));
    }
    Ok(last["routing"]["tokens_per_model"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, n)| n.as_u64() != Some(0))
        .map(|(name, _)| name.clone())
        .collect())
}

#[test]
fn policy_swaps_under_load_drop_nothing_and_requests_keep_their_starting_policy() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let swaps_before = metric_sum(&server.metrics(), "tokenrouter_policy_swaps_total");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..16 {
            scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut body = chat_body("r2r", 24, true);
                    body["ignore_eos"] = json!(true);
                    let events = stream_events(&server, "/v1/chat/completions", &body);
                    results.lock().unwrap().push(writers(&events));
                }
            });
        }
        for i in 0..20 {
            std::thread::sleep(Duration::from_millis(60));
            // Alternate r2r between "the large model writes everything" and "the small one
            // does", and the default policy with it.
            let (threshold, default) = if i % 2 == 0 {
                (1e6, "r2r")
            } else {
                (0.0, "me")
            };
            let (status, answer) = server.put_policy(&json!({
                "default": default,
                "policies": {"r2r": {"threshold": threshold}},
            }));
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["default"], default);
        }
        std::thread::sleep(Duration::from_millis(60));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let results = results.into_inner().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for result in &results {
        let writers = result
            .as_ref()
            .unwrap_or_else(|e| panic!("a request failed: {e}"));
        assert!(
            writers.len() <= 1,
            "one request saw two versions of r2r: {writers:?}"
        );
        seen.extend(writers.iter().cloned());
    }
    assert_eq!(
        seen.len(),
        2,
        "both versions served requests ({} requests)",
        results.len()
    );
    let swaps = metric_sum(&server.metrics(), "tokenrouter_policy_swaps_total") - swaps_before;
    assert_eq!(swaps, 20.0);
}

#[test]
fn sighup_reloads_policies_from_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), 0.0);
    let server = Server::start(&config);
    write_tiny_config(dir.path(), 2.5);
    let status = std::process::Command::new("kill")
        .args(["-HUP", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    loop {
        let (_, policy) = server.call("GET", "/admin/policy", Some(ADMIN_TOKEN), None);
        if policy["policies"]["r2r"]["threshold"] == 2.5 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "not reloaded: {policy}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    server.wait_for_log("SIGHUP: policies reloaded");
}

#[test]
fn client_disconnect_mid_stream_cancels_and_frees_kv() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    for _ in 0..3 {
        let response = ureq::post(&server.url("/v1/completions"))
            .send_string(
                &json!({"model": "me", "prompt": "the city", "max_tokens": 256, "stream": true,
                        "ignore_eos": true})
                .to_string(),
            )
            .unwrap();
        let mut reader = response.into_reader();
        let mut first = [0u8; 64];
        reader.read_exact(&mut first).unwrap();
        assert!(first.starts_with(b"data: "));
        drop(reader);
    }
    server.wait_for_metrics("KV freed after disconnects", |text| {
        let kv: Vec<f64> = samples(text, "tokenrouter_kv_tokens_used")
            .map(|(_, v)| v)
            .collect();
        kv.len() == 2
            && kv.iter().all(|&v| v == 0.0)
            && samples(text, "tokenrouter_requests_total")
                .any(|(labels, v)| labels.contains("cancelled") && v == 3.0)
    });
    let (_, health) = server.call("GET", "/health", None, None);
    assert_eq!(health["live_requests"], 0);
}

#[test]
fn every_metric_a_dashboard_names_is_exported() {
    let exprs = dashboard_exprs("tokenrouter.json");
    assert!(exprs.len() >= 12, "{exprs:?}");
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let (status, _) = server.post("/v1/chat/completions", &chat_body("me", 8, false));
    assert_eq!(status, 200);
    server.put_policy(&json!({"default": "me"}));
    let text = server.metrics();
    let exported: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap())
        .collect();
    for expr in &exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("tokenrouter_"))
        {
            assert!(
                exported.contains(name),
                "`{name}` (in {expr}) is not in /metrics"
            );
        }
    }
}
