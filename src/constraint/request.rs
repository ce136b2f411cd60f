//! One request's grammar state across the models it visits: a matcher per vocabulary, and
//! the bytes the request has committed, which a matcher that fell behind consumes first.

use super::format::{FormatError, OutputFormat};
use super::vocabulary::Vocabulary;
use crate::engine::{TokenFilter, TokenMask};
use crate::policy::ModelIdx;
use llguidance::Matcher;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct RequestGrammar {
    state: Mutex<State>,
}

struct State {
    /// Per model index, which matcher serves its vocabulary.
    matcher_of_model: Vec<usize>,
    matchers: Vec<VocabularyMatcher>,
    /// The bytes of every token the request committed, in order.
    committed: Vec<u8>,
    /// What went wrong in a matcher: the request fails with it.
    error: Option<String>,
}

struct VocabularyMatcher {
    vocabulary: Arc<Vocabulary>,
    matcher: Matcher,
    /// How many bytes of `committed` it has consumed.
    consumed: usize,
}

impl std::fmt::Debug for RequestGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("RequestGrammar")
            .field("committed_bytes", &state.committed.len())
            .field("error", &state.error)
            .finish()
    }
}

impl RequestGrammar {
    /// A fresh state for `format`; `vocabularies` gives each model index its vocabulary
    /// (models sharing one `Arc` share a matcher).
    pub fn new(
        format: &OutputFormat,
        vocabularies: &[Arc<Vocabulary>],
    ) -> Result<Self, FormatError> {
        let mut matchers: Vec<VocabularyMatcher> = Vec::new();
        let mut matcher_of_model = Vec::with_capacity(vocabularies.len());
        for vocabulary in vocabularies {
            let index = match matchers
                .iter()
                .position(|m| Arc::ptr_eq(&m.vocabulary, vocabulary))
            {
                Some(index) => index,
                None => {
                    let matcher = Matcher::new(Ok(format.parser(vocabulary)?));
                    if let Some(message) = matcher.get_error() {
                        return Err(FormatError { message });
                    }
                    matchers.push(VocabularyMatcher {
                        vocabulary: vocabulary.clone(),
                        matcher,
                        consumed: 0,
                    });
                    matchers.len() - 1
                }
            };
            matcher_of_model.push(index);
        }
        Ok(Self {
            state: Mutex::new(State {
                matcher_of_model,
                matchers,
                committed: Vec::new(),
                error: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tokens `model` may produce next (only end-of-sequence once the grammar is
    /// complete, or after an error).
    pub fn mask(&self, model: ModelIdx) -> TokenMask {
        let mut state = self.lock();
        let state = &mut *state;
        let m = &mut state.matchers[state.matcher_of_model[model]];
        let mask = catch_up(m, &state.committed).and_then(|()| {
            m.matcher
                .compute_mask_or_eos()
                .map_err(|e| format!("structured output: {e}"))
        });
        // The trie knows one end-of-sequence id; every id that ends the request goes with it.
        let (words, ends) = match mask {
            Ok(vob) => {
                let trie_eos = m.vocabulary.env().tok_trie().eos_token();
                (vob.as_slice().to_vec(), vob.is_allowed(trie_eos))
            }
            Err(message) => {
                state.error.get_or_insert(message);
                (Vec::new(), true)
            }
        };
        let mut mask = TokenMask::from_words(words);
        if ends {
            mask.allow(m.vocabulary.eos().iter().copied());
        }
        mask
    }

    /// Advances by `token`, which `model` produced and the request committed (not an
    /// end-of-sequence). Err when the grammar does not accept it.
    pub fn commit(&self, model: ModelIdx, token: u32) -> Result<(), String> {
        let mut state = self.lock();
        let state = &mut *state;
        let m = &mut state.matchers[state.matcher_of_model[model]];
        let result = catch_up(m, &state.committed).and_then(|()| {
            m.matcher
                .consume_token(token)
                .map_err(|e| format!("structured output: token {token} leaves the grammar: {e}"))
        });
        state
            .committed
            .extend_from_slice(&m.vocabulary.token_bytes(token));
        m.consumed = state.committed.len();
        if let Err(message) = &result {
            state.error.get_or_insert(message.clone());
        }
        result
    }

    /// The error a matcher met, if any.
    pub fn error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    /// The bytes committed so far.
    #[cfg(test)]
    pub fn committed(&self) -> Vec<u8> {
        self.lock().committed.clone()
    }
}

/// Consumes the committed bytes `m` has not seen, tokenized in its own vocabulary (they came
/// from a model of another one).
fn catch_up(m: &mut VocabularyMatcher, committed: &[u8]) -> Result<(), String> {
    if m.consumed == committed.len() {
        return Ok(());
    }
    let tokens = m.vocabulary.env().tokenize_bytes(&committed[m.consumed..]);
    m.consumed = committed.len();
    m.matcher
        .consume_tokens(&tokens)
        .map_err(|e| format!("structured output: catching up on a handoff: {e}"))
}

/// A request's grammar as one model's step sees it.
#[derive(Debug)]
struct GrammarFilter {
    grammar: Arc<RequestGrammar>,
    model: ModelIdx,
}

impl RequestGrammar {
    /// What model `model`'s step masks this request's row by.
    pub fn filter(self: &Arc<Self>, model: ModelIdx) -> Arc<dyn TokenFilter> {
        Arc::new(GrammarFilter {
            grammar: self.clone(),
            model,
        })
    }
}

impl TokenFilter for GrammarFilter {
    fn allowed(&self) -> TokenMask {
        self.grammar.mask(self.model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// The ASCII vocabulary, and in the "wide" one multi-byte pieces that cut JSON at other
    /// places.
    fn vocabulary(wide: bool) -> Arc<Vocabulary> {
        let pieces: &[&str] = if wide {
            &[
                "{\"", "\":", "\",\"", "\"}", "name", "age", "tags", "true", "false", "null", "12",
                "345", "\",", ",\"", "[\"", "\"]", "ab", "yes", "no", "é", "😀",
            ]
        } else {
            &[]
        };
        super::super::vocabulary_for_tests(pieces)
    }

    fn allowed(mask: &TokenMask, vocabulary: &Vocabulary) -> Vec<u32> {
        let size = vocabulary.env().tok_trie().vocab_size() as u32;
        (0..size).filter(|&t| mask.allows(t)).collect()
    }

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["yes", "no"]}, "maxItems": 3}
            },
            "required": ["name", "age", "tags"],
            "additionalProperties": false
        })
    }

    fn valid_under_schema(text: &str) -> bool {
        let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text) else {
            return false;
        };
        let name = object.get("name").and_then(Value::as_str);
        let age = object.get("age").and_then(Value::as_u64);
        let tags = object.get("tags").and_then(Value::as_array);
        object.len() == 3
            && name.is_some_and(|n| n.chars().count() <= 6)
            && age.is_some_and(|a| a <= 999)
            && tags.is_some_and(|t| t.len() <= 3 && t.iter().all(|v| v == "yes" || v == "no"))
    }

    /// Decodes under the grammar with `choose` picking among the allowed tokens, the model
    /// that produces each token given by `model_at`; returns the committed text.
    fn decode(
        grammar: &RequestGrammar,
        vocabularies: &[Arc<Vocabulary>],
        mut model_at: impl FnMut(usize) -> ModelIdx,
        mut choose: impl FnMut(&[u32]) -> usize,
    ) -> String {
        for step in 0..4000 {
            let model = model_at(step);
            let mask = grammar.mask(model);
            let options = allowed(&mask, &vocabularies[model]);
            assert!(!options.is_empty(), "a mask allows something");
            let token = options[choose(&options)];
            if token == 0 {
                assert_eq!(grammar.error(), None);
                return String::from_utf8(grammar.committed()).expect("UTF-8 output");
            }
            grammar
                .commit(model, token)
                .expect("a token the mask allowed is accepted");
        }
        panic!("the grammar never ended");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Whatever the draws and wherever the request moves between two models of
        /// different vocabularies, every allowed token keeps the output inside the grammar,
        /// and the output ends valid.
        #[test]
        fn masks_keep_the_output_in_the_schema_across_vocabularies(
            draws in proptest::collection::vec(any::<u32>(), 400),
            switches in proptest::collection::vec(any::<bool>(), 400),
        ) {
            let vocabularies = vec![vocabulary(false), vocabulary(true)];
            let format = OutputFormat::JsonSchema(schema());
            let grammar = RequestGrammar::new(&format, &vocabularies).expect("compiles");
            let mut model = 0;
            let mut draw = draws.iter().cycle();
            let text = decode(
                &grammar,
                &vocabularies,
                |step| {
                    if switches[step % switches.len()] {
                        model = 1 - model;
                    }
                    model
                },
                // Prefer ending tokens rarely, so outputs are not all minimal.
                |options| *draw.next().unwrap() as usize % options.len(),
            );
            prop_assert!(valid_under_schema(&text), "{text}");
        }
    }

    /// Schemas of the kinds clients send: strings, integers, booleans and enums as leaves,
    /// arrays and objects (some properties required, no others allowed) around them.
    fn random_schema() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            (0u64..6).prop_map(|n| json!({"type": "string", "maxLength": n})),
            (-50i64..50, 0i64..200).prop_map(
                |(lo, span)| json!({"type": "integer", "minimum": lo, "maximum": lo + span})
            ),
            Just(json!({"type": "boolean"})),
            proptest::collection::btree_set("[a-z]{1,4}", 1..4)
                .prop_map(|words| json!({"enum": words.into_iter().collect::<Vec<_>>()})),
        ];
        leaf.prop_recursive(2, 12, 3, |inner| {
            prop_oneof![
                (inner.clone(), 0u64..4)
                    .prop_map(|(items, n)| json!({"type": "array", "items": items, "maxItems": n})),
                proptest::collection::vec((inner, any::<bool>()), 1..4).prop_map(|properties| {
                    let names = (0..properties.len()).map(|i| format!("p{i}"));
                    let required: Vec<String> = names
                        .clone()
                        .zip(&properties)
                        .filter(|(_, (_, required))| *required)
                        .map(|(name, _)| name)
                        .collect();
                    let properties: serde_json::Map<String, Value> = names
                        .zip(properties)
                        .map(|(name, (schema, _))| (name, schema))
                        .collect();
                    json!({"type": "object", "properties": properties, "required": required,
                           "additionalProperties": false})
                }),
            ]
        })
    }

    /// Whether `value` conforms to a schema `random_schema` made (an oracle apart from
    /// llguidance, for that subset of JSON Schema).
    fn conforms(value: &Value, schema: &Value) -> bool {
        if let Some(words) = schema.get("enum").and_then(Value::as_array) {
            return words.contains(value);
        }
        let number = |key: &str| schema[key].as_i64().expect("bound");
        match schema["type"].as_str().expect("typed") {
            "string" => value
                .as_str()
                .is_some_and(|s| s.chars().count() as i64 <= number("maxLength")),
            // JSON's `-0` is an integer (zero) that serde_json reads as a float.
            "integer" => value
                .as_i64()
                .or_else(|| value.as_f64().filter(|f| *f == 0.0).map(|_| 0))
                .is_some_and(|n| (number("minimum")..=number("maximum")).contains(&n)),
            "boolean" => value.is_boolean(),
            "array" => value.as_array().is_some_and(|items| {
                items.len() as i64 <= number("maxItems")
                    && items.iter().all(|v| conforms(v, &schema["items"]))
            }),
            "object" => value.as_object().is_some_and(|object| {
                let properties = schema["properties"].as_object().expect("properties");
                let required = schema["required"].as_array().expect("required");
                required
                    .iter()
                    .all(|k| object.contains_key(k.as_str().expect("name")))
                    && object
                        .iter()
                        .all(|(k, v)| properties.get(k).is_some_and(|s| conforms(v, s)))
            }),
            other => panic!("no such type {other}"),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Over random schemas, both vocabularies and random moves between them: no token a
        /// mask allows leaves the grammar, and every output that ends conforms to its schema.
        #[test]
        fn masks_keep_random_schemas_across_vocabularies(
            schema in random_schema(),
            draws in proptest::collection::vec(any::<u32>(), 64),
            switches in proptest::collection::vec(any::<bool>(), 64),
        ) {
            let vocabularies = vec![vocabulary(false), vocabulary(true)];
            let format = OutputFormat::JsonSchema(schema.clone());
            let grammar = RequestGrammar::new(&format, &vocabularies).expect("compiles");
            let mut model = 0;
            let mut draw = draws.iter().cycle();
            let mut switch = switches.iter().cycle();
            let text = decode(
                &grammar,
                &vocabularies,
                |_| {
                    if *switch.next().unwrap() {
                        model = 1 - model;
                    }
                    model
                },
                |options| *draw.next().unwrap() as usize % options.len(),
            );
            let value: Value = serde_json::from_str(&text).expect("JSON");
            prop_assert!(conforms(&value, &schema), "{text} under {schema}");
        }
    }

    #[test]
    fn models_sharing_a_vocabulary_share_one_matcher() {
        let shared = vocabulary(true);
        let grammar =
            RequestGrammar::new(&OutputFormat::JsonObject, &[shared.clone(), shared.clone()])
                .expect("compiles");
        // Each model in turn, always the shortest way out.
        let byte = super::super::ascii_token;
        let ending = [0, byte(b'}'), byte(b'"'), byte(b':')];
        let text = decode(
            &grammar,
            &[shared.clone(), shared],
            |step| step % 2,
            |options| {
                let first_ending = ending
                    .iter()
                    .find_map(|&e| options.iter().position(|&t| t == e));
                first_ending.unwrap_or(0)
            },
        );
        assert_eq!(text, "{}");
    }

    #[test]
    fn a_token_outside_the_grammar_is_refused_and_recorded() {
        let vocabularies = vec![vocabulary(false)];
        let grammar =
            RequestGrammar::new(&OutputFormat::JsonObject, &vocabularies).expect("compiles");
        let letter_a = super::super::ascii_token(b'a');
        assert!(!grammar.mask(0).allows(letter_a));
        assert!(grammar.commit(0, letter_a).is_err());
        assert!(grammar.error().is_some());
        // After an error only the end is allowed.
        assert_eq!(allowed(&grammar.mask(0), &vocabularies[0]), vec![0]);
    }

    #[test]
    fn a_choice_allows_exactly_its_strings() {
        let vocabularies = vec![vocabulary(true)];
        let format = OutputFormat::Choice(vec!["yes".into(), "no (.*)".into()]);
        for pick in 0..4 {
            let grammar = RequestGrammar::new(&format, &vocabularies).expect("compiles");
            let text = decode(
                &grammar,
                &vocabularies,
                |_| 0,
                |options| pick % options.len(),
            );
            assert!(text == "yes" || text == "no (.*)", "{text}");
        }
    }

    #[test]
    fn an_unsupported_schema_fails_to_compile_with_a_reason() {
        let format = OutputFormat::JsonSchema(json!({"type": "object", "$ref": "#/nowhere"}));
        let error = RequestGrammar::new(&format, &[vocabulary(false)]).expect_err("refused");
        assert!(!error.message.is_empty());
    }
}
