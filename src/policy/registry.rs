//! Named policies built from the config: every configured policy, plus each model alone
//! under its own name (`single`), so `--policy <model>` serves that model by itself.

use super::citer::Citer;
use super::colm::CoLlm;
use super::ensemble::MixtureEnsemble;
use super::learned::{CiterRouter, DeferralHead, R2rRouter};
use super::r2r::R2r;
use super::rstitch::RStitch;
use super::single::Single;
use super::{ModelIdx, SharedPolicy};
use crate::config::{Config, PolicyConfig};
use crate::error::ConfigError;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct PolicyRegistry {
    policies: BTreeMap<String, SharedPolicy>,
    default: String,
}

impl PolicyRegistry {
    /// `hidden_sizes[i]` is model i's hidden size, against which learned routers are checked.
    pub fn from_config(config: &Config, hidden_sizes: &[usize]) -> Result<Self, ConfigError> {
        let mut policies: BTreeMap<String, SharedPolicy> = BTreeMap::new();
        for (i, model) in config.models.iter().enumerate() {
            policies.insert(model.name.clone(), Arc::new(Single::new(&model.name, i)));
        }
        for p in &config.policies {
            policies.insert(p.name.clone(), build(config, p, hidden_sizes)?);
        }
        let default = config
            .runtime
            .default_policy
            .clone()
            .or_else(|| config.policies.first().map(|p| p.name.clone()))
            .unwrap_or_else(|| config.models[0].name.clone());
        Ok(Self { policies, default })
    }

    pub fn get(&self, name: &str) -> Option<SharedPolicy> {
        self.policies.get(name).cloned()
    }

    pub fn default_policy(&self) -> SharedPolicy {
        self.policies[&self.default].clone()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.policies.keys().map(String::as_str)
    }

    pub fn all(&self) -> impl Iterator<Item = &SharedPolicy> {
        self.policies.values()
    }
}

fn build(
    config: &Config,
    p: &PolicyConfig,
    hidden_sizes: &[usize],
) -> Result<SharedPolicy, ConfigError> {
    let invalid = |why: String| ConfigError::Invalid(format!("policies.{}: {why}", p.name));
    let models: Vec<ModelIdx> = p
        .models
        .iter()
        .map(|m| config.model_index(m).expect("validated with the config"))
        .collect();
    let pair = || -> Result<(ModelIdx, ModelIdx), ConfigError> {
        match models[..] {
            [slm, llm] if slm != llm => Ok((slm, llm)),
            _ => Err(invalid(format!(
                "`{}` routes between exactly two different models",
                p.kind
            ))),
        }
    };
    let router_path = |kind: &str| -> Result<Option<&std::path::Path>, ConfigError> {
        match (&p.router, kind) {
            (Some(path), "r2r" | "citer" | "colm") => Ok(Some(path.as_path())),
            (Some(_), _) => Err(invalid(format!("`{kind}` takes no router weights"))),
            (None, _) => Ok(None),
        }
    };
    if p.threshold.is_some_and(|t| !t.is_finite()) {
        return Err(invalid("threshold must be a finite number".into()));
    }
    let policy: SharedPolicy = match p.kind.as_str() {
        "me" => Arc::new(MixtureEnsemble::new(&p.name, models, &p.weights).map_err(invalid)?),
        "single" if models.len() == 1 => Arc::new(Single::new(&p.name, models[0])),
        "single" => return Err(invalid("`single` takes exactly one model".into())),
        "r2r" => {
            let (slm, llm) = pair()?;
            let router = router_path("r2r")?
                .map(|path| R2rRouter::load(path, hidden_sizes[slm]))
                .transpose()
                .map_err(invalid)?;
            Arc::new(R2r::new(&p.name, slm, llm, p.threshold, router))
        }
        "citer" => {
            let (slm, llm) = pair()?;
            let router = router_path("citer")?
                .map(|path| CiterRouter::load(path, hidden_sizes[slm]))
                .transpose()
                .map_err(invalid)?;
            Arc::new(Citer::new(&p.name, slm, llm, p.threshold, router))
        }
        "rstitch" => {
            let (slm, llm) = pair()?;
            router_path("rstitch")?;
            Arc::new(RStitch::new(&p.name, slm, llm, p.threshold))
        }
        "colm" => {
            let (base, assistant) = pair()?;
            let head = router_path("colm")?
                .map(|path| DeferralHead::load(path, hidden_sizes[base]))
                .transpose()
                .map_err(invalid)?;
            Arc::new(CoLlm::new(&p.name, base, assistant, p.threshold, head))
        }
        other => {
            return Err(invalid(format!(
                "unknown kind `{other}` (r2r, citer, rstitch, colm, me, single)"
            )))
        }
    };
    Ok(policy)
}
