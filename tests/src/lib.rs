//! kvroute test support: simulator, harness, workloads.
