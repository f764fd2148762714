//! A proxy-wasm HTTP filter that does nothing, built with the same SDK as kvroute's filter.
//!
//! Envoy enters the VM for every callback of every request (context create, request headers
//! and body, response headers and body, done, log, delete) and each returns at once. The bench
//! runs it in front of the same replica as plain Envoy and as kvroute's filter, so what the
//! wasm filter machinery itself costs per request (V8 entries, Envoy's proxy-wasm contexts)
//! is measured apart from what kvroute does inside the VM. Built for wasm32 only; on other
//! targets the crate is empty.

#[cfg(target_arch = "wasm32")]
mod filter {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{ContextType, LogLevel};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Noop) });
    }}

    /// The root context and every request context alike: no state, every callback the SDK's
    /// default (continue).
    struct Noop;

    impl Context for Noop {}

    impl RootContext for Noop {
        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Noop))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    impl HttpContext for Noop {}
}
