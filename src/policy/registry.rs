//! Named policies built from the config: every configured policy, plus each model alone
//! under its own name (`single`), so `--policy <model>` serves that model by itself.

use super::ensemble::MixtureEnsemble;
use super::learned::{CiterRouter, DeferralHead, HiddenScorer, R2rRouter};
use super::one_token::OneTokenHandoff;
use super::r2r::R2r;
use super::rstitch::RStitch;
use super::single::Single;
use super::{ModelIdx, PolicyError, PolicyKind, SharedPolicy};
use crate::config::{Config, PolicyConfig};
use crate::error::ConfigError;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub struct PolicyRegistry {
    policies: BTreeMap<String, SharedPolicy>,
    /// The configured policies' entries: what another process builds the same policy from.
    specs: BTreeMap<String, Arc<PolicyConfig>>,
    default: String,
}

impl PolicyRegistry {
    /// `hidden_sizes[i]` is model i's hidden size, against which learned routers are checked.
    pub fn from_config(config: &Config, hidden_sizes: &[usize]) -> Result<Self, ConfigError> {
        let mut policies: BTreeMap<String, SharedPolicy> = BTreeMap::new();
        for (i, model) in config.models.iter().enumerate() {
            policies.insert(model.name.clone(), Arc::new(Single::new(&model.name, i)));
        }
        let mut specs = BTreeMap::new();
        for p in &config.policies {
            policies.insert(p.name.clone(), build(config, p, hidden_sizes)?);
            specs.insert(p.name.clone(), Arc::new(p.clone()));
        }
        let default = config
            .runtime
            .default_policy
            .clone()
            .or_else(|| config.policies.first().map(|p| p.name.clone()))
            .unwrap_or_else(|| config.models[0].name.clone());
        Ok(Self {
            policies,
            specs,
            default,
        })
    }

    /// The config entry `name` was built from (`None` for a model served alone).
    pub fn spec(&self, name: &str) -> Option<Arc<PolicyConfig>> {
        self.specs.get(name).cloned()
    }

    /// Builds a policy from an entry another process sent, against this process's config:
    /// every model it names must be configured here.
    pub fn build_spec(
        config: &Config,
        spec: &PolicyConfig,
        hidden_sizes: &[usize],
    ) -> Result<SharedPolicy, ConfigError> {
        if let Some(unknown) = spec.models.iter().find(|m| config.model_index(m).is_none()) {
            return Err(ConfigError::Invalid(format!(
                "policies.{}.models: unknown model `{unknown}`",
                spec.name
            )));
        }
        build(config, spec, hidden_sizes)
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

/// Loads a learned router from a file for a model of the given hidden size.
type LoadScorer = fn(&Path, usize) -> Result<Box<dyn HiddenScorer>, PolicyError>;

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
    let pair = || -> Result<[ModelIdx; 2], ConfigError> {
        match models[..] {
            [slm, llm] if slm != llm => Ok([slm, llm]),
            _ => Err(invalid(format!(
                "`{}` routes between exactly two different models",
                p.kind
            ))),
        }
    };
    if p.router.is_some() && !p.kind.takes_router() {
        return Err(invalid(format!("`{}` takes no router weights", p.kind)));
    }
    if p.threshold.is_some_and(|t| !t.is_finite()) {
        return Err(invalid("threshold must be a finite number".into()));
    }
    // Loads the learned router of the pair's small model, when the config names one.
    let router = |load: LoadScorer| {
        let small = pair()?[0];
        p.router
            .as_deref()
            .map(|path| load(path, hidden_sizes[small]))
            .transpose()
            .map_err(|e| invalid(e.to_string()))
    };
    let policy: SharedPolicy = match p.kind {
        PolicyKind::Me => Arc::new(
            MixtureEnsemble::new(&p.name, models, &p.weights)
                .map_err(|e| invalid(e.to_string()))?,
        ),
        PolicyKind::Single => match models[..] {
            [model] => Arc::new(Single::new(&p.name, model)),
            _ => return Err(invalid("`single` takes exactly one model".into())),
        },
        PolicyKind::R2r => {
            let [slm, llm] = pair()?;
            let router = p
                .router
                .as_deref()
                .map(|path| R2rRouter::load(path, hidden_sizes[slm]))
                .transpose()
                .map_err(|e| invalid(e.to_string()))?;
            Arc::new(R2r::new(&p.name, slm, llm, p.threshold, router))
        }
        PolicyKind::Citer => Arc::new(OneTokenHandoff::citer(
            &p.name,
            pair()?,
            p.threshold,
            router(|path, hidden| Ok(Box::new(CiterRouter::load(path, hidden)?)))?,
        )),
        PolicyKind::Colm => Arc::new(OneTokenHandoff::colm(
            &p.name,
            pair()?,
            p.threshold,
            router(|path, hidden| Ok(Box::new(DeferralHead::load(path, hidden)?)))?,
        )),
        PolicyKind::Rstitch => {
            let [slm, llm] = pair()?;
            Arc::new(RStitch::new(&p.name, slm, llm, p.threshold))
        }
    };
    Ok(policy)
}
