//! The kvroute command line's library: the workload analyzer and its command.
//!
//! - [`analyze`] measures a workload's prefix reuse and replays it on fleet-sim's engine;
//! - [`analyze_cmd`] is the `kvroute analyze` command (also the `kvroute-analyze` binary).

pub mod analyze;
pub mod analyze_cmd;
