//! kvroute proxy-wasm filter (being built).
