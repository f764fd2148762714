//! `kvroute-analyze`: the same command as `kvroute analyze`, under the name scripts already use.

use clap::Parser as _;
use kvroute_cli::analyze_cmd::{self, AnalyzeArgs};

fn main() -> anyhow::Result<()> {
    analyze_cmd::run(AnalyzeArgs::parse())
}
