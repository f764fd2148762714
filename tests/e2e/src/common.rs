//! What every area's tests share: locating the tools, and the fleets they start.

use kvroute_harness::Tools;

/// The tools every fleet needs; a missing one fails the test with the reason.
pub fn tools() -> Tools {
    Tools::locate().unwrap_or_else(|e| panic!("{e}"))
}
