//! Learned routers for the pair served here: traces from the two models (`collect`) and
//! routers trained on them (`train`), saved where `policy::learned` loads them.

pub mod collect;
pub mod train;
