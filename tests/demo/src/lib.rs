//! `kvroute-demo`'s comparison logic, shared with the end-to-end tests (precise mode, agents).

pub mod agent;
pub mod precise_compare;
