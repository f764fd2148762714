//! The event hooks Envoy calls (`envoy_dynamic_module_on_*`): each turns raw pointers into
//! [`Module`] / [`Filter`] references and [`Stream`] handles, and runs the safe code in
//! [`crate::module`] behind `catch_unwind`, so a bug fails the request open instead of
//! unwinding into Envoy (which would abort it).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::abi::{self, ABI_VERSION, CALLOUT_SUCCESS, ConfigHandle, EnvoyBuffer, EnvoyHttpHeader};
use crate::module::{Filter, Module, Verdict};

/// `Continue` in every status enum.
const CONTINUE: u32 = 0;
/// `StopIteration` (headers, trailers) and `StopIterationAndBuffer` (body).
const HOLD: u32 = 1;

fn verdict(v: Verdict) -> u32 {
    match v {
        Verdict::Continue => CONTINUE,
        Verdict::Hold => HOLD,
    }
}

/// Runs `f`, logging a panic and returning `fallback` instead.
fn guarded<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        abi::log(
            abi::LogLevel::Error,
            &format!("kvroute: panic in {what}; the request goes on unrouted"),
        );
        fallback
    })
}

/// Runs `f` on the stream's filter and a handle on Envoy's side of it, behind [`guarded`];
/// `fallback` when there is no filter.
fn on_stream<T: Copy>(
    what: &str,
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    fallback: T,
    f: impl FnOnce(&mut Filter, &mut abi::Stream<'_>) -> T,
) -> T {
    guarded(what, fallback, || {
        // SAFETY: both are the pointers Envoy passed to the hook being run, used only within
        // it.
        let (filter, mut stream) = unsafe { (filter(filter_ptr), abi::Stream::new(envoy)) };
        filter.map_or(fallback, |filter| f(filter, &mut stream))
    })
}

/// # Safety
/// `ptr` must be a pointer [`envoy_dynamic_module_on_http_filter_new`] returned and not yet
/// destroyed; Envoy calls one stream's hooks from one thread, one at a time.
unsafe fn filter<'a>(ptr: *const c_void) -> Option<&'a mut Filter> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { (ptr as *mut Filter).as_mut() }
}

/// # Safety
/// `ptr` must be a pointer [`envoy_dynamic_module_on_http_filter_config_new`] returned and not
/// yet destroyed.
unsafe fn module<'a>(ptr: *const c_void) -> Option<&'a Module> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { (ptr as *const Module).as_ref() }
}

/// # Safety
/// `headers` must point at `n` headers Envoy passed to the current hook (or be null).
unsafe fn headers<'a>(headers: *const EnvoyHttpHeader, n: usize) -> Vec<(&'a [u8], &'a [u8])> {
    if headers.is_null() || n == 0 {
        return Vec::new();
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        std::slice::from_raw_parts(headers, n)
            .iter()
            .map(|h| abi::header(h))
            .collect()
    }
}

/// # Safety
/// `chunks` must point at `n` buffers Envoy passed to the current hook (or be null).
unsafe fn chunks<'a>(chunks: *const EnvoyBuffer, n: usize) -> Vec<&'a [u8]> {
    if chunks.is_null() || n == 0 {
        return Vec::new();
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        std::slice::from_raw_parts(chunks, n)
            .iter()
            .map(|b| abi::bytes(*b))
            .collect()
    }
}

/// The ABI version this module speaks.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    ABI_VERSION.as_ptr()
}

/// A filter configuration: the JSON in `filter_config` (the wasm filter's plugin
/// configuration). Null rejects the configuration.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    envoy: *mut c_void,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guarded("config_new", std::ptr::null(), || {
        // SAFETY: Envoy passes its configuration pointer and a buffer valid for this call.
        let (envoy, config) = unsafe { (ConfigHandle::new(envoy), abi::bytes(config)) };
        match Module::new(envoy, config) {
            Ok(module) => Box::into_raw(Box::new(module)) as *const c_void,
            Err(e) => {
                abi::log(abi::LogLevel::Error, &format!("kvroute: {e}"));
                std::ptr::null()
            }
        }
    })
}

/// Frees a `T` this module gave Envoy (a configuration, a stream's filter).
///
/// # Safety
/// `ptr` is null or came from `Box::into_raw` of a `Box<T>`, and is freed once.
unsafe fn free<T>(what: &str, ptr: *const c_void) {
    if !ptr.is_null() {
        // SAFETY: forwarded from the caller's contract.
        guarded(what, (), || drop(unsafe { Box::from_raw(ptr as *mut T) }));
    }
}

/// The configuration is gone: stop its tick and free it.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    // SAFETY: `config` came from `config_new`'s `Box::into_raw`; Envoy destroys it once.
    unsafe { free::<Module>("config_destroy", config) }
}

/// A new stream.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _envoy: *mut c_void,
) -> *const c_void {
    guarded("filter_new", std::ptr::null(), || {
        // SAFETY: `config` is a live configuration Envoy created through `config_new`.
        match unsafe { module(config) } {
            Some(module) => Box::into_raw(Box::new(module.new_filter())) as *const c_void,
            None => std::ptr::null(),
        }
    })
}

/// The stream is gone.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *const c_void) {
    // SAFETY: `filter` came from `filter_new`'s `Box::into_raw`; Envoy destroys it once.
    unsafe { free::<Filter>("filter_destroy", filter) }
}

/// Request headers.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(
        "request_headers",
        envoy,
        filter_ptr,
        CONTINUE,
        |filter, stream| verdict(filter.on_request_headers(stream, end_of_stream)),
    )
}

/// A request body chunk.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(
        "request_body",
        envoy,
        filter_ptr,
        CONTINUE,
        |filter, stream| verdict(filter.on_request_body(stream, end_of_stream)),
    )
}

/// Request trailers.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
) -> u32 {
    on_stream(
        "request_trailers",
        envoy,
        filter_ptr,
        CONTINUE,
        |filter, stream| verdict(filter.on_request_trailers(stream)),
    )
}

/// Response headers.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    on_stream(
        "response_headers",
        envoy,
        filter_ptr,
        CONTINUE,
        |filter, stream| {
            filter.on_response_headers(stream);
            CONTINUE
        },
    )
}

/// A response body chunk.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    on_stream(
        "response_body",
        envoy,
        filter_ptr,
        CONTINUE,
        |filter, stream| {
            filter.on_response_body(stream);
            CONTINUE
        },
    )
}

/// Response trailers: nothing to do.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy: *mut c_void,
    _filter: *const c_void,
) -> u32 {
    CONTINUE
}

/// The stream is complete (before access logs): its outcome.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
) {
    on_stream(
        "stream_complete",
        envoy,
        filter_ptr,
        (),
        |filter, stream| filter.on_stream_complete(stream),
    )
}

/// The route call's answer.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy: *mut c_void,
    filter_ptr: *const c_void,
    _callout_id: u64,
    result: u32,
    response_headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    on_stream(
        "http_callout_done",
        envoy,
        filter_ptr,
        (),
        |filter, stream| {
            // SAFETY: the arrays Envoy passed to this hook, used only within it.
            let (headers, body) = unsafe {
                (
                    headers(response_headers, headers_size),
                    chunks(body_chunks, body_chunks_size),
                )
            };
            filter.on_callout_done(stream, result == CALLOUT_SUCCESS, &headers, &body)
        },
    )
}

/// The tick, posted by the tick thread or a request (main thread).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _envoy: *mut c_void,
    config: *const c_void,
    event: u64,
) {
    guarded("config_scheduled", (), || {
        // SAFETY: a live configuration (Envoy stops delivering events once it is destroyed).
        if let Some(module) = unsafe { module(config) } {
            module.on_scheduled(event);
        }
    })
}

/// The answer to the tick's sync or feedback call (main thread).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _envoy: *mut c_void,
    config: *const c_void,
    _callout_id: u64,
    result: u32,
    response_headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    guarded("config_http_callout_done", (), || {
        // SAFETY: a live configuration, and this hook's arrays, used only within it.
        let (Some(module), headers, body) = (
            unsafe { module(config) },
            unsafe { headers(response_headers, headers_size) },
            unsafe { chunks(body_chunks, body_chunks_size) },
        ) else {
            return;
        };
        module.on_callout_done(result == CALLOUT_SUCCESS, &headers, &body);
    })
}

// Hooks Envoy requires of every HTTP filter module that kvroute has no use for: streamed
// callouts (it makes only one-shot calls), per-stream scheduled events and watermarks.

/// Unused: kvroute starts no streamed callout.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers() {}
/// Unused: kvroute starts no streamed callout.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data() {}
/// Unused: kvroute starts no streamed callout.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers() {}
/// Unused: kvroute starts no streamed callout.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete() {}
/// Unused: kvroute starts no streamed callout.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset() {}
/// Unused: kvroute posts no per-stream event.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled() {}
/// Unused: kvroute is not a terminal filter.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark()
{
}
/// Unused: kvroute is not a terminal filter.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark()
{
}
