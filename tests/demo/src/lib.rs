//! `kvroute-demo`'s comparison logic, shared with the precise-mode end-to-end tests.

pub mod precise_compare;
