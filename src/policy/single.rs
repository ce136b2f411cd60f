//! `single`: one model serves alone; the baseline every routing policy is compared with.

use super::{
    ModelIdx, PolicyInfo, PolicyKind, RequestInfo, Route, RoutingPolicy, RoutingState, StepView,
};

pub struct Single {
    name: String,
    model: [ModelIdx; 1],
}

impl Single {
    pub fn new(name: impl Into<String>, model: ModelIdx) -> Self {
        Self {
            name: name.into(),
            model: [model],
        }
    }
}

impl RoutingPolicy for Single {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> PolicyInfo {
        PolicyInfo {
            name: self.name.clone(),
            kind: PolicyKind::Single,
            models: self.model.to_vec(),
            learned_router: false,
            rule: "one model serves alone".into(),
            threshold: None,
        }
    }

    fn models(&self) -> &[ModelIdx] {
        &self.model
    }

    fn entry(&self, _req: &RequestInfo) -> ModelIdx {
        self.model[0]
    }

    fn route_batch(&self, reqs: &[&RoutingState], _steps: &[StepView]) -> Vec<Route> {
        vec![Route::Stay; reqs.len()]
    }
}
