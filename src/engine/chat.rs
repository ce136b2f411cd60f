//! Chat prompts rendered from the template the model ships (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json`), with minijinja and Python-style string methods.

use super::tokenizer::ModelTokenizer;
use crate::error::{EngineError, EngineResult};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const TEMPLATE_NAME: &str = "chat";

/// Gemma 3's chat template (as its instruction-tuned checkpoints ship it, less the leading
/// `{{ bos_token }}`: encoding adds the BOS): a system message is prefixed to the first user
/// turn, the assistant's role is `model`. Pretrained Gemma files (Gemma 3 270M's
/// `gemma3-270m`) ship no template; their tokens for turns exist all the same.
const GEMMA_TEMPLATE: &str = "\
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}";

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> EngineResult<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The template a model ships (Gemma's turns where a Gemma file ships none), with its own
    /// bos/eos strings.
    pub fn for_model(tokenizer: &ModelTokenizer) -> EngineResult<Self> {
        let gemma_turns = || {
            ["<start_of_turn>", "<end_of_turn>"]
                .iter()
                .all(|t| tokenizer.inner.token_to_id(t).is_some())
                .then_some(GEMMA_TEMPLATE)
        };
        let source = tokenizer
            .chat_template
            .as_deref()
            .or_else(gemma_turns)
            .ok_or_else(|| EngineError::ChatTemplate("the model ships no chat template".into()))?;
        let text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id))
                .unwrap_or_default()
        };
        Self::new(
            source,
            text(tokenizer.bos),
            text(tokenizer.eos.first().copied()),
        )
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> EngineResult<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_python_style_templates_and_raises() {
        let source = "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no') }}{% endif %}\
            <{{ m.role }}>{{ m.content.strip() }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let t = ChatTemplate::new(source, "<s>".into(), "</s>".into()).unwrap();
        let out = t.render(&[ChatMessage::user("  hi  ")], true).unwrap();
        assert_eq!(out, "<user>hi</s><assistant>");
        let bad = ChatMessage {
            role: "bad".into(),
            content: String::new(),
        };
        assert!(t
            .render(&[bad], false)
            .unwrap_err()
            .to_string()
            .contains("no"));
    }
}
