//! `/v1/completions` and `/v1/chat/completions`: one generation path for both, answered
//! whole or as server-sent events. Dropping the response (client gone) drops the request
//! handle, which cancels the request and frees its KV.

use super::admission::Slot;
use super::error::ApiError;
use super::logprobs::{self, ChoiceLogprobs};
use super::openai::{
    refuse_unimplemented, ChatCompletionRequest, CompletionRequest, Generation, GenerationOptions,
    Prompt,
};
use super::text::TextStream;
use super::tools::{self, CallText, ToolCallPiece, ToolCalling};
use super::{read_json, AppState};
use crate::constraint::{OutputFormat, RequestGrammar};
use crate::engine::spelling::Spelling;
use crate::engine::tokenizer::ModelTokenizer;
use crate::runtime::{
    EngineTiming, FinishReason, GenerateRequest, InvalidRequest, Prompt as RuntimePrompt,
    RequestEvent, RequestHandle, RoutingStats, RuntimeError,
};
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Which endpoint answers: the object names and the shape of a choice differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Text,
    Chat,
}

/// An endpoint's own body and the generation fields both endpoints share, from one read.
async fn read_request<T: serde::de::DeserializeOwned>(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<(T, GenerationOptions), ApiError> {
    let body: Value = read_json(req, payload, &state.config).await?;
    let parsed = (super::parse(&body)?, super::parse(&body)?);
    refuse_unimplemented(&body)?;
    Ok(parsed)
}

pub async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let received = Instant::now();
    let (request, options): (CompletionRequest, _) = read_request(&state, &req, payload).await?;
    let generation = request.generation(&options, &state.config)?;
    let tokenizer = state.tokenizer()?;
    let parsed = Instant::now();
    let prompt: RuntimePrompt = match &request.prompt {
        Prompt::Text(text) => state.runtime.encode(text)?,
        Prompt::Texts(texts) if texts.len() == 1 => state.runtime.encode(&texts[0])?,
        Prompt::Texts(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "exactly one prompt per request is supported",
            ))
        }
        Prompt::Tokens(ids) => {
            if let Some(bad) = ids
                .iter()
                .find(|&&id| id as usize >= tokenizer.vocab_size())
            {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary"),
                ));
            }
            ids.clone().into()
        }
    };
    let times = HandlerTimes {
        received,
        parse: parsed - received,
        tokenize: parsed.elapsed(),
    };
    run(
        &state,
        Flavor::Text,
        request.model,
        prompt,
        "prompt",
        generation,
        times,
    )
    .await
}

pub async fn chat_completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let received = Instant::now();
    let (request, options): (ChatCompletionRequest, _) =
        read_request(&state, &req, payload).await?;
    let generation = request.generation(&options, &state.config)?;
    let mut messages = request.chat_messages()?;
    if let Some(calling) = &generation.calling {
        calling.show(&mut messages);
    }
    let parsed = Instant::now();
    // Each vocabulary renders the conversation with its own template.
    state.chat_template()?;
    let prompt = state.runtime.render(&messages)?;
    let times = HandlerTimes {
        received,
        parse: parsed - received,
        tokenize: parsed.elapsed(),
    };
    run(
        &state,
        Flavor::Chat,
        request.model,
        prompt,
        "messages",
        generation,
        times,
    )
    .await
}

/// The field a format that does not compile came from (a schema's own field for
/// `response_format`).
fn format_field(field: &'static str, format: &OutputFormat) -> &'static str {
    match (field, format) {
        ("response_format", OutputFormat::JsonSchema(_)) => "response_format.json_schema.schema",
        (field, _) => field,
    }
}

/// Compiles `format` on a blocking thread: a large schema takes long enough to stall every
/// other connection of this event loop.
async fn compile(
    state: &AppState,
    format: OutputFormat,
) -> Result<Arc<RequestGrammar>, RuntimeError> {
    let runtime = state.runtime.clone();
    web::block(move || runtime.compile(&format))
        .await
        .map_err(|e| RuntimeError::Failed(format!("compiling the output format: {e}")))?
}

/// A compile error as a 400 naming `field`.
fn format_error(field: &str, e: RuntimeError) -> ApiError {
    match e {
        RuntimeError::Invalid(e) => ApiError::invalid(field, e.to_string()),
        e => e.into(),
    }
}

/// The grammar of a tool call. When it does not compile, each function's parameters are
/// compiled alone to name the one at fault.
async fn compile_call(
    state: &AppState,
    calling: &ToolCalling,
) -> Result<Arc<RequestGrammar>, ApiError> {
    let whole = match compile(state, calling.format()).await {
        Ok(grammar) => return Ok(grammar),
        Err(e @ RuntimeError::Invalid(InvalidRequest::OutputFormat(_))) => e,
        Err(e) => return Err(format_error("tools", e)),
    };
    for (function, position) in calling.functions.iter().zip(&calling.positions) {
        let alone = OutputFormat::JsonSchema(function.parameters.clone());
        if let Err(e) = compile(state, alone).await {
            return Err(format_error(
                &format!("tools[{position}].function.parameters"),
                e,
            ));
        }
    }
    Err(format_error("tools", whole))
}

/// Where a request's time went before it reached the runtime.
struct HandlerTimes {
    received: Instant,
    /// Reading, parsing and validating the body.
    parse: Duration,
    /// Rendering the chat template and tokenizing the prompt.
    tokenize: Duration,
}

async fn run(
    state: &AppState,
    flavor: Flavor,
    model: Option<String>,
    prompt: RuntimePrompt,
    prompt_field: &'static str,
    generation: Generation,
    times: HandlerTimes,
) -> Result<HttpResponse, ApiError> {
    // Compiled first: a bad schema is named whatever else is wrong. A call replaces any
    // `response_format`, which shapes only text replies.
    let grammar = match (&generation.calling, generation.format) {
        (Some(calling), _) => Some(("tools", compile_call(state, calling).await?)),
        (None, Some((field, format))) => Some((
            field,
            compile(state, format.clone())
                .await
                .map_err(|e| format_error(format_field(field, &format), e))?,
        )),
        (None, None) => None,
    };
    // The longest reading of the prompt bounds what fits.
    let prompt_len = prompt.longest();
    let limit = state.config.max_prompt_tokens;
    if prompt_len > limit {
        return Err(ApiError::ContextLength {
            prompt: prompt_len,
            limit,
            param: prompt_field,
        });
    }
    let context = state.runtime.context_length();
    let room = context.saturating_sub(prompt_len);
    let (max_tokens_field, max_tokens) = match generation.max_tokens {
        Some((field, n)) => (field, n),
        None if room == 0 && prompt_len > 0 => {
            return Err(ApiError::ContextLength {
                prompt: prompt_len,
                limit: context - 1,
                param: prompt_field,
            })
        }
        // Unasked, as many as fit the context and every model's KV budget (at least one, so
        // a prompt that fills a budget gets the runtime's error naming it).
        None => (
            prompt_field,
            room.min(state.config.max_tokens_limit)
                .min(
                    state
                        .runtime
                        .request_token_limit()
                        .saturating_sub(prompt_len),
                )
                .max(1),
        ),
    };
    let request = state
        .runtime
        .validate(GenerateRequest {
            prompt,
            policy: model.filter(|m| m != "default"),
            max_tokens,
            sampling: generation.sampling,
            timeout: Some(generation.timeout),
            ignore_eos: generation.ignore_eos,
        })
        .map_err(|e| match e {
            RuntimeError::Invalid(InvalidRequest::EmptyPrompt) => {
                ApiError::invalid(prompt_field, "the prompt is empty")
            }
            RuntimeError::Invalid(e @ InvalidRequest::PromptVocabulary { .. }) => {
                ApiError::invalid(prompt_field, e.to_string())
            }
            RuntimeError::Invalid(e) => ApiError::invalid(max_tokens_field, e.to_string()),
            e => e.into(),
        })?;
    let request = match generation.logprobs {
        Some(top) => request
            .with_logprobs(top)
            .map_err(|e| ApiError::invalid("logprobs", e.to_string()))?,
        None => request,
    };
    let request = match grammar {
        Some((field, grammar)) => state
            .runtime
            .constrain(request, grammar)
            .map_err(|e| format_error(field, e))?,
        None => request,
    };
    let prompt_tokens = request.prompt_tokens();
    // Log-probabilities name the served vocabulary's tokens.
    let tokenizer = state.runtime.tokenizer_of(request.vocabulary())?.clone();
    let slot = state.admission.enter().await?;
    let handle = state.runtime.launch(request);
    let handle_rid = handle.rid;
    let reply = Reply {
        flavor,
        id: match flavor {
            Flavor::Text => format!("cmpl-{}", handle.rid),
            Flavor::Chat => format!("chatcmpl-{}", handle.rid),
        },
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model_names: state
            .runtime
            .model_names()
            .iter()
            .map(|s| s.to_string())
            .collect(),
        prompt_tokens,
        include_usage: generation.include_usage,
        tokenizer: tokenizer.clone(),
        logprobs: generation.logprobs.is_some(),
        times,
    };
    let progress = Progress::new(
        handle,
        slot,
        state.runtime.spellings()?,
        generation.stop,
        reply.model_names.len(),
        generation
            .calling
            .map(|_| CallText::new(format!("call_{handle_rid}"))),
    );
    let stall = (state.config.stream_stall_timeout_ms > 0)
        .then(|| Duration::from_millis(state.config.stream_stall_timeout_ms));
    if generation.stream {
        Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(sse(progress, reply, stall)))
    } else {
        respond_whole(progress, reply).await
    }
}

/// What one request produced so far, as text.
struct Progress {
    handle: RequestHandle,
    /// Held until the response ends (or the client leaves).
    _slot: Slot,
    text: TextStream,
    /// Per model, what each token of its vocabulary spells.
    spellings: Vec<Arc<Spelling>>,
    tokens_per_model: Vec<usize>,
    /// Changes of writing model between consecutive tokens: the handoff count when a stop
    /// sequence ends the request before the runtime reports its own.
    model_changes: usize,
    last_model: Option<usize>,
    /// Log-probabilities of tokens not yet sent (when asked for).
    logprobs: Vec<logprobs::Entry>,
    /// Characters of text the client has been sent.
    sent_chars: usize,
    /// The call being written, when the reply must be a tool call.
    call: Option<CallText>,
    launched: Instant,
    /// Turning tokens into text.
    detokenize: Duration,
    /// Set when the runtime reports the end: where the request's time in the models went,
    /// and the wall time from launch to that report.
    engine: Option<(EngineTiming, Duration)>,
    /// When the stream last handed its client a chunk.
    last_read: Instant,
    /// Set when the client stopped reading for this long and the request was cancelled.
    stalled: Option<Duration>,
}

/// One step of a generation, as the client sees it.
enum Outcome {
    Delta(String),
    /// The end: remaining text, why, and the routing statistics.
    Done(String, FinishReason, RoutingStats),
    Failed(ApiError),
}

impl Progress {
    fn new(
        handle: RequestHandle,
        slot: Slot,
        spellings: Vec<Arc<Spelling>>,
        stop: Vec<String>,
        models: usize,
        call: Option<CallText>,
    ) -> Self {
        Self {
            handle,
            _slot: slot,
            text: TextStream::new(stop),
            spellings,
            tokens_per_model: vec![0; models],
            model_changes: 0,
            last_model: None,
            logprobs: Vec::new(),
            sent_chars: 0,
            call,
            launched: Instant::now(),
            detokenize: Duration::ZERO,
            engine: None,
            last_read: Instant::now(),
            stalled: None,
        }
    }

    async fn next(&mut self) -> Outcome {
        match self.handle.events.recv().await {
            Some(RequestEvent::Token {
                id,
                model,
                logprobs,
                ..
            }) => {
                if let Some(logprobs) = logprobs.filter(|_| !self.text.stopped()) {
                    self.logprobs
                        .push(logprobs::Entry::new(id, logprobs, self.sent_chars));
                }
                if self.last_model.is_some_and(|m| m != model) {
                    self.model_changes += 1;
                }
                self.last_model = Some(model);
                if let Some(n) = self.tokens_per_model.get_mut(model) {
                    *n += 1;
                }
                let started = Instant::now();
                let bytes = self.spellings.get(model).map_or(&[][..], |s| s.bytes(id));
                let delta = self.text.push(bytes);
                self.detokenize += started.elapsed();
                self.sent_chars += delta.chars().count();
                if self.text.stopped() {
                    self.handle.cancel();
                    let stats = RoutingStats {
                        tokens_per_model: self.tokens_per_model.clone(),
                        handoffs: self.model_changes,
                    };
                    return Outcome::Done(delta, FinishReason::Stop, stats);
                }
                Outcome::Delta(delta)
            }
            Some(RequestEvent::Finished {
                reason,
                stats,
                timing,
                ..
            }) => {
                self.engine = Some((timing, self.launched.elapsed()));
                Outcome::Done(self.text.finish(), reason, stats)
            }
            Some(RequestEvent::Failed { message, kind }) => {
                Outcome::Failed(RuntimeError::failed(kind, message).into())
            }
            None => Outcome::Failed(ApiError::Unavailable(
                "the runtime stopped before the request finished".into(),
            )),
        }
    }

    fn completion_tokens(&self) -> usize {
        self.text.tokens()
    }

    /// A `Server-Timing` header value (milliseconds): body parsing, tokenization (prompt and
    /// output), the models' queueing, prefix matching and compute, and the handler's total.
    /// Queueing is the runtime's wall time less its prefix matching and compute; a step
    /// shared by a batch counts whole as compute.
    fn server_timing(&self, times: &HandlerTimes) -> String {
        let (timing, engine) = self.engine.unwrap_or_default();
        let queue = engine.saturating_sub(timing.prefix_match + timing.compute);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "parse;dur={:.3}, tokenize;dur={:.3}, queue;dur={:.3}, prefix;dur={:.3}, \
             compute;dur={:.3}, total;dur={:.3}",
            ms(times.parse),
            ms(times.tokenize + self.detokenize),
            ms(queue),
            ms(timing.prefix_match),
            ms(timing.compute),
            ms(times.received.elapsed()),
        )
    }

    /// The log-probabilities gathered since the last call, when the request asked.
    fn take_logprobs(&mut self, asked: bool) -> Option<Vec<logprobs::Entry>> {
        asked.then(|| std::mem::take(&mut self.logprobs))
    }
}

/// The parts of every response object that do not change during a generation.
struct Reply {
    flavor: Flavor,
    id: String,
    created: u64,
    model_names: Vec<String>,
    prompt_tokens: usize,
    include_usage: bool,
    tokenizer: Arc<ModelTokenizer>,
    /// Whether choices carry `logprobs`.
    logprobs: bool,
    times: HandlerTimes,
}

/// OpenAI's `usage` object.
#[derive(Debug, Clone, Copy, Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

/// The extension every response carries: who wrote the tokens.
#[derive(Debug, Serialize)]
struct Routing<'a> {
    policy: &'a str,
    /// Committed tokens per model, by model name.
    tokens_per_model: BTreeMap<&'a str, usize>,
    handoffs: usize,
}

/// A chat message or a stream delta (the first delta carries the role).
#[derive(Debug, Serialize)]
struct Message<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    /// Null in a tool call.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallPiece>>,
}

/// What a choice carries: text, or (pieces of) a tool call.
enum Body<'a> {
    Text(&'a str),
    Call(Vec<ToolCallPiece>),
}

impl<'a> Body<'a> {
    fn message(self, role: Option<&'static str>) -> Message<'a> {
        match self {
            Body::Text(text) => Message {
                role,
                content: Some(text),
                tool_calls: None,
            },
            Body::Call(pieces) => Message {
                role,
                content: None,
                tool_calls: (!pieces.is_empty()).then_some(pieces),
            },
        }
    }
}

/// Why a choice ended, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Finish {
    Stop,
    Length,
    /// A complete tool call was written.
    ToolCalls,
}

impl From<FinishReason> for Finish {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
        }
    }
}

/// One choice, in the shape of its endpoint.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Choice<'a> {
    Text {
        index: usize,
        text: &'a str,
        logprobs: Option<ChoiceLogprobs>,
        finish_reason: Option<Finish>,
    },
    Message {
        index: usize,
        message: Message<'a>,
        logprobs: Option<ChoiceLogprobs>,
        finish_reason: Option<Finish>,
    },
    Delta {
        index: usize,
        delta: Message<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        logprobs: Option<ChoiceLogprobs>,
        finish_reason: Option<Finish>,
    },
}

/// A whole response or one stream chunk.
#[derive(Debug, Serialize)]
struct Envelope<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    routing: Option<Routing<'a>>,
}

impl Reply {
    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
        }
    }

    fn routing<'a>(&'a self, policy: &'a str, stats: &RoutingStats) -> Routing<'a> {
        Routing {
            policy,
            tokens_per_model: self
                .model_names
                .iter()
                .map(String::as_str)
                .zip(stats.tokens_per_model.iter().copied())
                .collect(),
            handoffs: stats.handoffs,
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.flavor, stream) {
            (Flavor::Text, _) => "text_completion",
            (Flavor::Chat, false) => "chat.completion",
            (Flavor::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A choice carrying `body` (and its tokens' log-probabilities when asked): a message
    /// or delta for chat, plain text otherwise.
    fn choice<'a>(
        &self,
        body: Body<'a>,
        finish: Option<Finish>,
        stream: bool,
        entries: Option<Vec<logprobs::Entry>>,
    ) -> Choice<'a> {
        let index = 0;
        let tokenizer = &self.tokenizer;
        match (self.flavor, stream) {
            (Flavor::Text, _) => Choice::Text {
                index,
                text: match body {
                    Body::Text(text) => text,
                    Body::Call(_) => "",
                },
                logprobs: entries.map(|e| logprobs::text(tokenizer, e)),
                finish_reason: finish,
            },
            (Flavor::Chat, false) => Choice::Message {
                index,
                message: body.message(Some("assistant")),
                logprobs: entries.map(|e| logprobs::chat(tokenizer, e)),
                finish_reason: finish,
            },
            (Flavor::Chat, true) => Choice::Delta {
                index,
                delta: body.message(None),
                logprobs: entries.map(|e| logprobs::chat(tokenizer, e)),
                finish_reason: finish,
            },
        }
    }

    fn envelope<'a>(
        &'a self,
        policy: &'a str,
        stream: bool,
        choices: Vec<Choice<'a>>,
    ) -> Envelope<'a> {
        Envelope {
            id: &self.id,
            object: self.object(stream),
            created: self.created,
            model: policy,
            choices,
            usage: None,
            routing: None,
        }
    }
}

async fn respond_whole(mut progress: Progress, reply: Reply) -> Result<HttpResponse, ApiError> {
    let mut text = String::new();
    loop {
        match progress.next().await {
            Outcome::Delta(delta) => text.push_str(&delta),
            Outcome::Done(rest, reason, stats) => {
                text.push_str(&rest);
                let policy = progress.handle.policy.clone();
                let (body, finish) = match progress.call.as_mut() {
                    None => (Body::Text(&text), reason.into()),
                    Some(call) => {
                        let (pieces, finish) = call_end(call, &text, reason);
                        (Body::Call(tools::merge(pieces)), finish)
                    }
                };
                let entries = progress.take_logprobs(reply.logprobs);
                let choice = reply.choice(body, Some(finish), false, entries);
                let body = Envelope {
                    usage: Some(reply.usage(progress.completion_tokens())),
                    routing: Some(reply.routing(&policy, &stats)),
                    ..reply.envelope(&policy, false, vec![choice])
                };
                return Ok(HttpResponse::Ok()
                    .insert_header(("Server-Timing", progress.server_timing(&reply.times)))
                    .json(body));
            }
            Outcome::Failed(e) => return Err(e),
        }
    }
}

/// The last pieces of a call, given the text still to come; `tool_calls` when the call is
/// complete, else why the generation ended (the arguments are then cut short).
fn call_end(call: &mut CallText, rest: &str, reason: FinishReason) -> (Vec<ToolCallPiece>, Finish) {
    let mut pieces = call.push(rest);
    let (tail, complete) = call.finish();
    pieces.extend(tail);
    let finish = if complete {
        Finish::ToolCalls
    } else {
        reason.into()
    };
    (pieces, finish)
}

fn event(value: &impl Serialize) -> String {
    let json = serde_json::to_string(value).expect("response structs serialize");
    format!("data: {json}\n\n")
}

/// The SSE body: a role chunk (chat), one chunk per text delta, a final chunk with the
/// finish reason, usage and routing, an optional usage-only chunk, then `[DONE]`. With a
/// `stall` limit, a watchdog cancels the request when its client stops reading (see
/// `watch_for_stall`).
fn sse(
    progress: Progress,
    reply: Reply,
    stall: Option<Duration>,
) -> impl futures_util::Stream<Item = Result<Bytes, actix_web::Error>> {
    let policy = progress.handle.policy.clone();
    let first = (reply.flavor == Flavor::Chat).then(|| {
        let choice = Choice::Delta {
            index: 0,
            delta: Body::Text("").message(Some("assistant")),
            logprobs: None,
            finish_reason: None,
        };
        event(&reply.envelope(&policy, true, vec![choice]))
    });
    let shared = Rc::new(tokio::sync::Mutex::new(progress));
    if let Some(stall) = stall {
        actix_web::rt::spawn(watch_for_stall(Rc::downgrade(&shared), stall));
    }
    let state = (Some(shared), reply, first);
    futures_util::stream::unfold(state, move |(shared, reply, first)| {
        let policy = policy.clone();
        async move {
            if let Some(first) = first {
                return Some((Ok(Bytes::from(first)), (shared, reply, None)));
            }
            let shared = shared?;
            let (out, more) = next_chunk(&mut *shared.lock().await, &reply, &policy).await;
            let next = more.then_some(shared);
            Some((Ok(Bytes::from(out)), (next, reply, None)))
        }
    })
}

/// The stream's next chunk, and whether more follow.
async fn next_chunk(progress: &mut Progress, reply: &Reply, policy: &str) -> (String, bool) {
    if let Some(stalled) = progress.stalled {
        let error = ApiError::DeadlineExceeded(format!(
            "the client read nothing for {} ms while tokens waited: the request was cancelled",
            stalled.as_millis()
        ));
        return (event(&error.body()) + "data: [DONE]\n\n", false);
    }
    let out = loop {
        match progress.next().await {
            Outcome::Delta(delta) if delta.is_empty() => continue,
            Outcome::Delta(delta) => {
                let body = match progress.call.as_mut() {
                    None => Body::Text(&delta),
                    Some(call) => match call.push(&delta) {
                        pieces if pieces.is_empty() => continue,
                        pieces => Body::Call(pieces),
                    },
                };
                let entries = progress.take_logprobs(reply.logprobs);
                let chunk = event(&reply.envelope(
                    policy,
                    true,
                    vec![reply.choice(body, None, true, entries)],
                ));
                progress.last_read = Instant::now();
                return (chunk, true);
            }
            Outcome::Done(rest, reason, stats) => {
                let usage = reply.usage(progress.completion_tokens());
                let (body, finish) = match progress.call.as_mut() {
                    None => (Body::Text(&rest), reason.into()),
                    Some(call) => {
                        let (pieces, finish) = call_end(call, &rest, reason);
                        (Body::Call(pieces), finish)
                    }
                };
                let entries = progress.take_logprobs(reply.logprobs);
                let last = Envelope {
                    usage: Some(usage),
                    routing: Some(reply.routing(policy, &stats)),
                    ..reply.envelope(
                        policy,
                        true,
                        vec![reply.choice(body, Some(finish), true, entries)],
                    )
                };
                let mut out = event(&last);
                if reply.include_usage {
                    let usage_only = Envelope {
                        usage: Some(usage),
                        ..reply.envelope(policy, true, Vec::new())
                    };
                    out.push_str(&event(&usage_only));
                }
                break out;
            }
            Outcome::Failed(e) => break event(&e.body()),
        }
    };
    (out + "data: [DONE]\n\n", false)
}

/// Cancels a streamed request whose client stopped reading: once the client's socket buffer
/// is full the stream is no longer polled, so tokens wait unread; after `stall` of that the
/// request is treated like a disconnect (its KV freed on every model). A stream being read
/// holds its lock (or has nothing waiting), so a slow but reading client is never cut off.
async fn watch_for_stall(progress: Weak<tokio::sync::Mutex<Progress>>, stall: Duration) {
    let mut ticks = actix_web::rt::time::interval((stall / 4).max(Duration::from_millis(10)));
    loop {
        ticks.tick().await;
        // Gone: the response ended or the client disconnected.
        let Some(progress) = progress.upgrade() else {
            return;
        };
        let Ok(mut progress) = progress.try_lock() else {
            continue;
        };
        if progress.handle.events.is_empty() || progress.last_read.elapsed() < stall {
            continue;
        }
        tracing::debug!(
            rid = %progress.handle.rid,
            "the client stopped reading its stream: cancelled"
        );
        progress.handle.cancel();
        progress.stalled = Some(stall);
        return;
    }
}
