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

    /// The template a model ships, with its own bos/eos strings.
    pub fn for_model(tokenizer: &ModelTokenizer) -> EngineResult<Self> {
        let source = tokenizer
            .chat_template
            .as_deref()
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
