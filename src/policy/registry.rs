//! Named policies built from the config: every configured policy, plus each model alone
//! under its own name (`single`), so `--policy <model>` serves that model by itself.

use super::ensemble::MixtureEnsemble;
use super::single::Single;
use super::SharedPolicy;
use crate::config::Config;
use crate::error::ConfigError;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct PolicyRegistry {
    policies: BTreeMap<String, SharedPolicy>,
    default: String,
}

impl PolicyRegistry {
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let mut policies: BTreeMap<String, SharedPolicy> = BTreeMap::new();
        for (i, model) in config.models.iter().enumerate() {
            policies.insert(model.name.clone(), Arc::new(Single::new(&model.name, i)));
        }
        for p in &config.policies {
            let models: Vec<usize> = p
                .models
                .iter()
                .map(|m| config.model_index(m).expect("validated with the config"))
                .collect();
            let invalid = |why: String| ConfigError::Invalid(format!("policies.{}: {why}", p.name));
            let policy: SharedPolicy = match p.kind.as_str() {
                "me" => {
                    Arc::new(MixtureEnsemble::new(&p.name, models, &p.weights).map_err(invalid)?)
                }
                "single" if models.len() == 1 => Arc::new(Single::new(&p.name, models[0])),
                "single" => return Err(invalid("`single` takes exactly one model".into())),
                other => return Err(invalid(format!("unknown kind `{other}` (me, single)"))),
            };
            policies.insert(p.name.clone(), policy);
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
}
