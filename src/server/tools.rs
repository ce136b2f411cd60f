//! OpenAI tool calling: `tools` and `tool_choice` validated into the functions a reply must
//! call, the note that shows them to the model, the grammar a call is decoded under, and the
//! generated call turned back into `tool_calls` (whole or streamed).
//!
//! A call is generated as one compact JSON object `{"name":…,"arguments":…}` under a schema
//! that admits exactly the callable functions with their parameter schemas, so the name comes
//! first and the arguments can be streamed as they are written.

use super::error::ApiError;
use super::openai::is_valid_name;
use crate::constraint::OutputFormat;
use crate::engine::chat::ChatMessage;
use serde::Serialize;
use serde_json::{json, Value};

/// A function the model may call, as the request declared it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Function {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON schema.
    pub parameters: Value,
}

/// A chat request whose reply must be a call to one of `functions` (`tool_choice`
/// "required" or a named function).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolCalling {
    pub functions: Vec<Function>,
    /// The index in `tools` of each function, to name a bad schema.
    pub positions: Vec<usize>,
}

/// Reads `tools` and `tool_choice`: `None` when the reply is text (no tools, or
/// `tool_choice` "none").
pub(crate) fn tool_calling(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<Option<ToolCalling>, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(tools)) => tools
            .iter()
            .enumerate()
            .map(|(i, tool)| function(i, tool))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    for (i, f) in tools.iter().enumerate() {
        if tools[..i].iter().any(|g| g.name == f.name) {
            return Err(ApiError::invalid(
                &format!("tools[{i}].function.name"),
                format!("function `{}` is declared twice", f.name),
            ));
        }
    }
    let choice = choice.filter(|c| !c.is_null());
    let all = |tools: Vec<Function>| ToolCalling {
        positions: (0..tools.len()).collect(),
        functions: tools,
    };
    match choice {
        None if tools.is_empty() => Ok(None),
        Some(Value::String(c)) if c == "none" => Ok(None),
        None | Some(Value::String(_)) if tools.is_empty() => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a call but `tools` declares no function",
        )),
        Some(Value::String(c)) if c == "required" => Ok(Some(all(tools))),
        None => Err(ApiError::invalid(
            "tool_choice",
            AUTO_REFUSED.replace("{what}", "`tools` without `tool_choice` means \"auto\""),
        )),
        Some(Value::String(c)) if c == "auto" => Err(ApiError::invalid(
            "tool_choice",
            AUTO_REFUSED.replace("{what}", "`tool_choice` \"auto\""),
        )),
        Some(named @ Value::Object(_)) => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            let (Some("function"), Some(name)) = (named.get("type").and_then(Value::as_str), name)
            else {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": …}}",
                ));
            };
            let Some(position) = tools.iter().position(|f| f.name == name) else {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("`tool_choice` names `{name}`, which `tools` does not declare"),
                ));
            };
            Ok(Some(ToolCalling {
                functions: vec![tools[position].clone()],
                positions: vec![position],
            }))
        }
        Some(_) => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be \"none\", \"auto\", \"required\" or a named function",
        )),
    }
}

/// Why "auto" is refused: the served chat template renders no tools, so the model cannot
/// know it may call one, nor is there a call format to recognise in its text.
const AUTO_REFUSED: &str = "{what}, which needs a chat template that renders tools; the served \
     model's template renders none: set `tool_choice` to \"required\" or a named function, or \
     \"none\"";

/// `tools[i]`, checked field by field.
fn function(i: usize, tool: &Value) -> Result<Function, ApiError> {
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            &format!("tools[{i}].type"),
            "only tools of type \"function\" are supported",
        ));
    }
    let field = format!("tools[{i}].function");
    let Some(spec) = tool.get("function").filter(|f| f.is_object()) else {
        return Err(ApiError::invalid(
            &field,
            format!("`{field}` must be an object with a `name`"),
        ));
    };
    let name = spec.get("name").and_then(Value::as_str).unwrap_or_default();
    if !is_valid_name(name) {
        return Err(ApiError::invalid(
            &format!("{field}.name"),
            format!("`{field}.name` must be 1 to 64 letters, digits, `_` or `-`"),
        ));
    }
    let description = match spec.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{field}.description"),
                format!("`{field}.description` must be a string"),
            ))
        }
    };
    if spec
        .get("strict")
        .is_some_and(|s| !s.is_boolean() && !s.is_null())
    {
        return Err(ApiError::invalid(
            &format!("{field}.strict"),
            format!("`{field}.strict` must be a boolean"),
        ));
    }
    // Arguments are always held to the schema: `strict` false is served as strict.
    let parameters = match spec.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{field}.parameters"),
                format!("`{field}.parameters` must be a JSON schema (an object)"),
            ))
        }
    };
    Ok(Function {
        name: name.to_string(),
        description,
        parameters,
    })
}

impl ToolCalling {
    /// The grammar of one call: `{"name": <a callable function>, "arguments": <its arguments>}`.
    pub fn format(&self) -> OutputFormat {
        let calls: Vec<Value> = self.functions.iter().map(call_schema).collect();
        let schema = match <[Value; 1]>::try_from(calls) {
            Ok([one]) => one,
            Err(calls) => json!({"anyOf": calls}),
        };
        OutputFormat::JsonSchema(schema)
    }

    /// Shows the callable functions to the model: the served template renders no tools, so
    /// they go into the system message (appended to the client's, or as the first message).
    pub fn show(&self, messages: &mut Vec<ChatMessage>) {
        let listed: Vec<String> = self
            .functions
            .iter()
            .map(|f| serde_json::to_string(f).expect("functions serialize"))
            .collect();
        let note = format!(
            "Functions you can call:\n{}\nReply with one call: {{\"name\":…,\"arguments\":…}}",
            listed.join("\n")
        );
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{note}", first.content);
            }
            _ => messages.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: note,
                },
            ),
        }
    }
}

/// The schema of a call to `f`.
fn call_schema(f: &Function) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": f.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// How a call made in an earlier turn is shown to the model: as the text it would have
/// generated for it.
pub(crate) fn call_as_text(call: &Value) -> Option<String> {
    let function = call.get("function")?;
    let name = function.get("name")?.as_str()?;
    let arguments = function.get("arguments")?.as_str()?;
    let arguments: Value = serde_json::from_str(arguments).ok()?;
    Some(json!({"name": name, "arguments": arguments}).to_string())
}

/// A piece of a call, in OpenAI's `tool_calls` shape (a whole call, or a stream delta).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct ToolCallPiece {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionPiece,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct FunctionPiece {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// Turns the text of a generated call, as it arrives, into `tool_calls` pieces: the call's
/// id, type and name once the name is complete, then its arguments as written. The last
/// character is held back until the end, where the wrapper's closing `}` is dropped.
pub(crate) struct CallText {
    id: String,
    text: String,
    /// Bytes of `text` already handed out as arguments (after the header).
    sent: usize,
    /// Where the arguments start, once the header is complete.
    arguments_at: Option<usize>,
}

impl CallText {
    pub fn new(id: String) -> Self {
        Self {
            id,
            text: String::new(),
            sent: 0,
            arguments_at: None,
        }
    }

    /// The pieces `delta` completes.
    pub fn push(&mut self, delta: &str) -> Vec<ToolCallPiece> {
        self.text.push_str(delta);
        let mut pieces = Vec::new();
        if self.arguments_at.is_none() {
            let Some((name, at)) = header(&self.text) else {
                return pieces;
            };
            self.arguments_at = Some(at);
            self.sent = at;
            pieces.push(ToolCallPiece {
                index: 0,
                id: Some(self.id.clone()),
                kind: Some("function"),
                function: FunctionPiece {
                    name: Some(name),
                    arguments: String::new(),
                },
            });
        }
        let held = self.text.chars().next_back().map_or(0, char::len_utf8);
        let upto = self.text.len() - held;
        if upto > self.sent {
            pieces.push(self.arguments(upto));
        }
        pieces
    }

    /// The rest, at the end of the generation, and whether the call is complete (its text
    /// parses as a whole call).
    pub fn finish(&mut self) -> (Vec<ToolCallPiece>, bool) {
        let complete = serde_json::from_str::<Value>(&self.text)
            .is_ok_and(|v| v.get("name").is_some() && v.get("arguments").is_some());
        if self.arguments_at.is_none() {
            return (Vec::new(), false);
        }
        let upto = if complete {
            self.text.len() - 1
        } else {
            self.text.len()
        };
        let pieces = (upto > self.sent)
            .then(|| self.arguments(upto))
            .into_iter()
            .collect();
        (pieces, complete)
    }

    fn arguments(&mut self, upto: usize) -> ToolCallPiece {
        let arguments = self.text[self.sent..upto].to_string();
        self.sent = upto;
        ToolCallPiece {
            index: 0,
            id: None,
            kind: None,
            function: FunctionPiece {
                name: None,
                arguments,
            },
        }
    }
}

/// The function's name and where its arguments start, once `{"name":"…","arguments":` is
/// complete (the grammar writes it compactly and in this order; names need no escapes).
fn header(text: &str) -> Option<(String, usize)> {
    const OPEN: &str = "{\"name\":\"";
    const ARGUMENTS: &str = "\",\"arguments\":";
    let rest = text.strip_prefix(OPEN)?;
    let end = rest.find('"')?;
    rest[end..]
        .starts_with(ARGUMENTS)
        .then(|| (rest[..end].to_string(), OPEN.len() + end + ARGUMENTS.len()))
}

/// One whole call from its pieces (for a response that is not streamed).
pub(crate) fn merge(pieces: Vec<ToolCallPiece>) -> Vec<ToolCallPiece> {
    let mut whole: Option<ToolCallPiece> = None;
    for piece in pieces {
        match &mut whole {
            None => whole = Some(piece),
            Some(call) => call.function.arguments.push_str(&piece.function.arguments),
        }
    }
    whole.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(body: &Value) -> Result<Option<ToolCalling>, ApiError> {
        tool_calling(body.get("tools"), body.get("tool_choice"))
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}})
    }

    fn field_of(body: Value) -> String {
        match of(&body).unwrap_err() {
            ApiError::InvalidRequest { param, .. } => param.unwrap(),
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn choices_select_the_callable_functions() {
        let time = json!({"type": "function", "function": {"name": "now"}});
        let tools = json!([weather(), time]);
        let required = of(&json!({"tools": tools, "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        assert_eq!(required.functions.len(), 2);
        assert_eq!(
            required.functions[1].parameters,
            json!({"type": "object", "properties": {}})
        );
        let named = json!({"type": "function", "function": {"name": "now"}});
        let one = of(&json!({"tools": tools, "tool_choice": named}))
            .unwrap()
            .unwrap();
        assert_eq!(
            (one.functions[0].name.as_str(), one.positions[0]),
            ("now", 1)
        );
        for text in [
            json!({}),
            json!({"tools": [], "tool_choice": "none"}),
            json!({"tools": tools, "tool_choice": "none"}),
        ] {
            assert_eq!(of(&text).unwrap(), None, "{text}");
        }
    }

    #[test]
    fn bad_tools_name_their_field() {
        let cases = [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [{"type": "code"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                json!({"tools": [weather(), {"type": "function", "function": {"name": "a b"}}]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [weather(), weather()], "tool_choice": "required"}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
                "tools[0].function.parameters",
            ),
            (json!({"tools": [weather()]}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": "auto"}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": 1}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}}),
                "tool_choice.function.name",
            ),
        ];
        for (body, field) in cases {
            assert_eq!(field_of(body.clone()), field, "{body}");
        }
    }

    #[test]
    fn functions_join_the_system_message() {
        let calling = of(&json!({"tools": [weather()], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let mut messages = vec![ChatMessage::user("Weather in Oslo?")];
        calling.show(&mut messages);
        assert_eq!(messages[0].role, "system");
        assert!(messages[0].content.contains("\"name\":\"get_weather\""));
        let mut with_system = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage::user("Weather in Oslo?"),
        ];
        calling.show(&mut with_system);
        assert_eq!(with_system.len(), 2);
        assert!(with_system[0].content.starts_with("Be brief.\n\n"));
    }

    #[test]
    fn the_grammar_writes_the_name_first_and_only_callable_names() {
        use crate::constraint::{ascii_token, vocabulary_for_tests, RequestGrammar};
        let time = json!({"type": "function", "function": {"name": "now"}});
        let calling = of(&json!({"tools": [weather(), time], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let grammar = RequestGrammar::new(&calling.format(), &[vocabulary_for_tests(&[])]).unwrap();
        for byte in br#"{""#.iter().copied() {
            grammar.commit(0, ascii_token(byte)).unwrap();
        }
        let mask = grammar.mask(0);
        assert!(mask.allows(ascii_token(b'n')) && !mask.allows(ascii_token(b'a')));
        for byte in br#"name":""#.iter().copied() {
            grammar.commit(0, ascii_token(byte)).unwrap();
        }
        let mask = grammar.mask(0);
        let firsts: Vec<u8> = (0..=127u8)
            .filter(|&b| mask.allows(ascii_token(b)))
            .collect();
        assert_eq!(firsts, b"gn", "the callable names' first letters");
    }

    #[test]
    fn a_call_streams_its_header_then_its_arguments() {
        let text = r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#;
        for split in 1..text.len() {
            let mut call = CallText::new("call_1".into());
            let mut pieces = call.push(&text[..split]);
            pieces.extend(call.push(&text[split..]));
            let (rest, complete) = call.finish();
            pieces.extend(rest);
            assert!(complete);
            assert_eq!(pieces[0].function.name.as_deref(), Some("get_weather"));
            assert_eq!(pieces[0].id.as_deref(), Some("call_1"));
            assert!(pieces[1..].iter().all(|p| p.id.is_none()));
            let whole = merge(pieces);
            assert_eq!(whole[0].function.arguments, r#"{"city":"Oslo"}"#, "{split}");
        }
    }

    #[test]
    fn a_cut_call_keeps_what_was_written() {
        let mut call = CallText::new("call_1".into());
        let mut pieces = call.push(r#"{"name":"get_weather","arguments":{"city":"Os"#);
        let (rest, complete) = call.finish();
        pieces.extend(rest);
        assert!(!complete);
        assert_eq!(merge(pieces)[0].function.arguments, r#"{"city":"Os"#);
        let mut nameless = CallText::new("call_2".into());
        assert!(nameless.push(r#"{"name":"get_we"#).is_empty());
        assert_eq!(nameless.finish(), (Vec::new(), false));
    }

    #[test]
    fn earlier_calls_read_back_as_generated_text() {
        let call = json!({"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}});
        assert_eq!(
            call_as_text(&call).unwrap(),
            r#"{"name":"f","arguments":{"a":1}}"#
        );
    }
}
