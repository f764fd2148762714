//! `kvroute`: the operator's command line.
//!
//! `kvroute analyze <trace>` measures a workload before deploying kvroute: how much of its prompt
//! is reusable, and what round robin and kvroute make of it on a simulated fleet.

use clap::{Parser, Subcommand};
use kvroute_cli::analyze_cmd::{self, AnalyzeArgs};

/// The kvroute command line.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about = "kvroute's operator tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prefix-sharing potential of a workload, and what round robin and kvroute make of it on a
    /// simulated vLLM fleet.
    Analyze(AnalyzeArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Analyze(args) => analyze_cmd::run(args),
    }
}
