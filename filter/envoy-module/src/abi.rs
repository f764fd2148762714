//! The part of Envoy's dynamic-module C ABI this module uses, and safe handles over it.
//!
//! Declared by hand from Envoy's `source/extensions/dynamic_modules/abi/abi.h` (ABI v0.1.0;
//! Envoy 1.40 speaks v0.2.0, which keeps v0.1's functions as they were): only the callbacks
//! kvroute calls, so a change elsewhere in the header cannot break the build. Enums cross the
//! ABI as C `int`s (`u32` here). Everything Envoy hands back (`EnvoyBuffer`, headers) lives
//! until the end of the current hook: the handles below return borrows tied to `&self`, and
//! callers copy what they keep.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::marker::PhantomData;

/// ABI version this module was written against (Envoy only warns on a mismatch).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Bytes owned by Envoy, valid until the end of the current hook.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyBuffer {
    /// First byte (may be null when `length` is 0).
    pub ptr: *const u8,
    /// Length in bytes.
    pub length: usize,
}

/// Bytes owned by the module, lent to Envoy for one call (Envoy copies them).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl EnvoyBuffer {
    /// The null buffer, for Envoy to overwrite.
    const EMPTY: Self = EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    };
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> Self {
        ModuleBuffer {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }

    /// The null buffer (`set_header`'s "remove", `send_response`'s absent details).
    fn null() -> Self {
        ModuleBuffer {
            ptr: std::ptr::null(),
            length: 0,
        }
    }
}

/// A header in Envoy's map, valid until the end of the current hook.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EnvoyHttpHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

impl EnvoyHttpHeader {
    /// The null header, for Envoy to overwrite.
    const EMPTY: Self = EnvoyHttpHeader {
        key_ptr: std::ptr::null(),
        key_length: 0,
        value_ptr: std::ptr::null(),
        value_length: 0,
    };
}

/// A header the module lends to Envoy for one call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ModuleHttpHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

impl ModuleHttpHeader {
    fn of(key: &str, value: &str) -> Self {
        ModuleHttpHeader {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// `envoy_dynamic_module_type_http_header_type`.
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum HeaderMap {
    /// The request's headers.
    Request = 0,
    /// The response's headers.
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum Body {
    /// The request body's chunk of the current body hook.
    ReceivedRequest = 0,
    /// What the filter chain has buffered of the request body so far.
    BufferedRequest = 1,
    /// The response body's chunk of the current body hook.
    ReceivedResponse = 2,
}

/// `envoy_dynamic_module_type_attribute_id` values read here.
const ATTRIBUTE_RESPONSE_CODE: u32 = 15;
const ATTRIBUTE_UPSTREAM_ADDRESS: u32 = 41;
/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
pub const CALLOUT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_metrics_result_Success`.
const METRICS_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_log_level`.
#[derive(Debug, Clone, Copy)]
#[repr(u32)]
pub enum LogLevel {
    /// Informational.
    Info = 2,
    /// Something went wrong but the request was not harmed.
    Warn = 3,
    /// Something went wrong that a person should look at.
    Error = 4,
}

unsafe extern "C" {
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);

    fn envoy_dynamic_module_callback_http_get_headers_size(filter: *mut c_void, map: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: *mut c_void,
        map: u32,
        result: *mut EnvoyHttpHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        map: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        map: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(filter: *mut c_void, body: u32) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: *mut c_void,
        body: u32,
    ) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        body: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: *mut c_void,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status: u32,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: *mut c_void,
        id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter: *mut c_void,
        id: u32,
        result: *mut u64,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: *mut c_void,
        callout_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_record_histogram_value(
        filter: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;

    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: *mut c_void,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        callout_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: *mut c_void,
    ) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
}

/// Writes `message` to Envoy's log under the `dynamic_modules` logger.
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the buffer points at `message`, alive for the call; Envoy copies it.
    unsafe { envoy_dynamic_module_callback_log(level as u32, ModuleBuffer::of(message.as_bytes())) }
}

/// Reads the bytes of an Envoy buffer.
///
/// # Safety
/// `buffer` must come from Envoy in the current hook (or be null with length 0).
pub unsafe fn bytes<'a>(buffer: EnvoyBuffer) -> &'a [u8] {
    if buffer.ptr.is_null() || buffer.length == 0 {
        &[]
    } else {
        // SAFETY: Envoy guarantees `ptr..ptr+length` readable until the hook returns.
        unsafe { std::slice::from_raw_parts(buffer.ptr, buffer.length) }
    }
}

/// The name and value of an Envoy header.
///
/// # Safety
/// `header` must come from Envoy in the current hook.
pub unsafe fn header<'a>(header: &EnvoyHttpHeader) -> (&'a [u8], &'a [u8]) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        (
            bytes(EnvoyBuffer {
                ptr: header.key_ptr,
                length: header.key_length,
            }),
            bytes(EnvoyBuffer {
                ptr: header.value_ptr,
                length: header.value_length,
            }),
        )
    }
}

/// `envoy_dynamic_module_callback_http_filter{,_config}_http_callout`.
type CalloutFn = unsafe extern "C" fn(
    *mut c_void,
    *mut u64,
    ModuleBuffer,
    *mut ModuleHttpHeader,
    usize,
    ModuleBuffer,
    u64,
) -> u32;
/// `envoy_dynamic_module_callback_http_filter{,_config}_{increment_counter,record_histogram_value}`.
type MetricFn = unsafe extern "C" fn(*mut c_void, usize, *mut ModuleBuffer, usize, u64) -> u32;
/// `envoy_dynamic_module_callback_http_filter_config_define_{counter,histogram}`.
type DefineFn =
    unsafe extern "C" fn(*mut c_void, ModuleBuffer, *mut ModuleBuffer, usize, *mut usize) -> u32;

/// Starts a one-shot call with `start`; its id, or `None` when Envoy could not start it
/// (unknown cluster, no healthy host, missing pseudo-headers).
///
/// # Safety
/// `raw` must be the pointer `start` takes, valid for this call on its thread.
unsafe fn callout(
    start: CalloutFn,
    raw: *mut c_void,
    cluster: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout_ms: u64,
) -> Option<u64> {
    let mut headers: Vec<ModuleHttpHeader> = headers
        .iter()
        .map(|(k, v)| ModuleHttpHeader::of(k, v))
        .collect();
    let mut id = 0u64;
    // SAFETY: the caller vouches for `raw`; every buffer is alive for the call, and Envoy
    // writes the id only into `id`.
    let result = unsafe {
        start(
            raw,
            &mut id,
            ModuleBuffer::of(cluster.as_bytes()),
            headers.as_mut_ptr(),
            headers.len(),
            ModuleBuffer::of(body),
            timeout_ms,
        )
    };
    (result == CALLOUT_INIT_SUCCESS).then_some(id)
}

/// Adds `value` to metric `id` with `update` (no labels); a refused update is not worth more
/// than the count.
///
/// # Safety
/// `raw` must be the pointer `update` takes, valid for this call on its thread.
unsafe fn update_metric(update: MetricFn, raw: *mut c_void, id: Option<usize>, value: u64) {
    if let Some(id) = id {
        // SAFETY: the caller vouches for `raw`; no labels.
        let _ = unsafe { update(raw, id, std::ptr::null_mut(), 0, value) };
    }
}

/// Defines metric `name` with `define` (no labels); `None` when Envoy refused.
///
/// # Safety
/// `raw` must be the configuration pointer, on the main thread.
unsafe fn define_metric(define: DefineFn, raw: *mut c_void, name: &str) -> Option<usize> {
    let mut id = 0usize;
    // SAFETY: the caller vouches for `raw`; `id` is a valid place to write.
    let result = unsafe {
        define(
            raw,
            ModuleBuffer::of(name.as_bytes()),
            std::ptr::null_mut(),
            0,
            &mut id,
        )
    };
    (result == METRICS_SUCCESS).then_some(id)
}

/// `n` entries Envoy writes with `fill` into an array the module allocates (empty when there
/// are none or Envoy could not give them).
///
/// # Safety
/// `fill` must write at most `n` entries through the pointer it is given.
unsafe fn filled<T: Copy>(n: usize, empty: T, fill: impl FnOnce(*mut T) -> bool) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    let mut out = vec![empty; n];
    if fill(out.as_mut_ptr()) {
        out
    } else {
        Vec::new()
    }
}

/// One HTTP stream's filter in Envoy, for the duration of one hook call. Not `Send`: Envoy's
/// stream callbacks may only be called from the stream's worker, inside its hooks.
#[derive(Debug)]
pub struct Stream<'hook> {
    raw: *mut c_void,
    _hook: PhantomData<&'hook mut ()>,
}

impl Stream<'_> {
    /// Wraps the `filter_envoy_ptr` of the current hook.
    ///
    /// # Safety
    /// `raw` must be the `filter_envoy_ptr` Envoy passed to the hook being run, and the value
    /// must not outlive that hook.
    pub unsafe fn new(raw: *mut c_void) -> Self {
        Stream {
            raw,
            _hook: PhantomData,
        }
    }

    /// Every header of `map` (empty when Envoy has none to give).
    pub fn headers(&self, map: HeaderMap) -> Vec<(&[u8], &[u8])> {
        // SAFETY: `raw` is this hook's filter; the entries live until the hook returns (bound
        // to `&self`).
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.raw, map as u32);
            filled(n, EnvoyHttpHeader::EMPTY, |out| {
                envoy_dynamic_module_callback_http_get_headers(self.raw, map as u32, out)
            })
            .iter()
            .map(|h| header(h))
            .collect()
        }
    }

    /// The first value of header `name` in `map`.
    pub fn header(&self, map: HeaderMap, name: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: `raw` is this hook's filter; `out` is a valid place for Envoy to write.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.raw,
                map as u32,
                ModuleBuffer::of(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy filled `out` in this hook.
        (found && !out.ptr.is_null()).then(|| unsafe { bytes(out) })
    }

    /// Sets header `name` of `map` to `value` (`None` removes it). False when Envoy refused.
    pub fn set_header(&mut self, map: HeaderMap, name: &str, value: Option<&str>) -> bool {
        let value = value.map_or_else(ModuleBuffer::null, |v| ModuleBuffer::of(v.as_bytes()));
        // SAFETY: `raw` is this hook's filter; the buffers are alive for the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.raw,
                map as u32,
                ModuleBuffer::of(name.as_bytes()),
                value,
            )
        }
    }

    /// Bytes in `body`.
    pub fn body_size(&self, body: Body) -> usize {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.raw, body as u32) }
    }

    /// The slices of `body`, in order.
    pub fn body_chunks(&self, body: Body) -> Vec<&[u8]> {
        // SAFETY: as in `headers`.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.raw, body as u32);
            filled(n, EnvoyBuffer::EMPTY, |out| {
                envoy_dynamic_module_callback_http_get_body_chunks(self.raw, body as u32, out)
            })
            .into_iter()
            .map(|b| bytes(b))
            .collect()
        }
    }

    /// True when the chunk of this body hook is the body an earlier filter buffered whole.
    pub fn received_is_buffered_request_body(&self) -> bool {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.raw) }
    }

    /// Answers the request locally.
    pub fn send_response(&mut self, status: u16, headers: &[(String, String)], body: &[u8]) {
        let mut raw: Vec<ModuleHttpHeader> = headers
            .iter()
            .map(|(k, v)| ModuleHttpHeader::of(k, v))
            .collect();
        // SAFETY: `raw` is this hook's filter; headers and body are alive for the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.raw,
                u32::from(status),
                raw.as_mut_ptr(),
                raw.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::null(),
            )
        }
    }

    /// The stream's response code (`response.code`), once there is one.
    pub fn response_code(&self) -> Option<u16> {
        let mut code = 0u64;
        // SAFETY: `raw` is this hook's filter; `code` is a valid place to write.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.raw,
                ATTRIBUTE_RESPONSE_CODE,
                &mut code,
            )
        };
        if ok {
            u16::try_from(code).ok().filter(|c| *c > 0)
        } else {
            None
        }
    }

    /// The last upstream attempt's `host:port` (`upstream.address`).
    pub fn upstream_address(&self) -> Option<String> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: `raw` is this hook's filter; `out` is a valid place to write.
        let ok = unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.raw,
                ATTRIBUTE_UPSTREAM_ADDRESS,
                &mut out,
            )
        };
        // SAFETY: Envoy filled `out` in this hook.
        let value = if ok { unsafe { bytes(out) } } else { &[] };
        (!value.is_empty())
            .then(|| String::from_utf8(value.to_vec()).ok())
            .flatten()
    }

    /// Lets a paused request go on.
    pub fn continue_decoding(&mut self) {
        // SAFETY: `raw` is this hook's filter.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.raw) }
    }

    /// Starts a call whose answer comes to this stream's `http_callout_done`; its id, or `None`
    /// when Envoy could not start it (unknown cluster, no healthy host).
    pub fn callout(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Option<u64> {
        // SAFETY: `raw` is this hook's filter.
        unsafe {
            callout(
                envoy_dynamic_module_callback_http_filter_http_callout,
                self.raw,
                cluster,
                headers,
                body,
                timeout_ms,
            )
        }
    }

    /// Adds 1 to counter `id` (defined on this stream's configuration).
    pub fn bump(&mut self, id: Option<usize>) {
        // SAFETY: `raw` is this hook's filter.
        unsafe {
            update_metric(
                envoy_dynamic_module_callback_http_filter_increment_counter,
                self.raw,
                id,
                1,
            )
        }
    }

    /// Records `value` on histogram `id`.
    pub fn record(&mut self, id: Option<usize>, value: u64) {
        // SAFETY: `raw` is this hook's filter.
        unsafe {
            update_metric(
                envoy_dynamic_module_callback_http_filter_record_histogram_value,
                self.raw,
                id,
                value,
            )
        }
    }
}

/// Envoy's side of one filter configuration (`filter_config_envoy_ptr`): used on the main
/// thread only (configuration hooks, config-scheduled events, config callouts).
#[derive(Debug, Clone, Copy)]
pub struct ConfigHandle {
    raw: *mut c_void,
}

// SAFETY: the pointer is only dereferenced by Envoy, and the module calls it only from the
// main thread's hooks (`on_http_filter_config_*`); holding it elsewhere is just a number.
unsafe impl Send for ConfigHandle {}
// SAFETY: as above.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// Wraps the `filter_config_envoy_ptr` of a configuration hook.
    ///
    /// # Safety
    /// `raw` must be the pointer Envoy passed to `on_http_filter_config_new`; it is valid until
    /// the configuration is destroyed.
    pub unsafe fn new(raw: *mut c_void) -> Self {
        ConfigHandle { raw }
    }

    /// Defines a counter; `None` when Envoy refused.
    pub fn define_counter(&self, name: &str) -> Option<usize> {
        // SAFETY: main thread, configuration hook.
        unsafe {
            define_metric(
                envoy_dynamic_module_callback_http_filter_config_define_counter,
                self.raw,
                name,
            )
        }
    }

    /// Defines a histogram; `None` when Envoy refused.
    pub fn define_histogram(&self, name: &str) -> Option<usize> {
        // SAFETY: main thread, configuration hook.
        unsafe {
            define_metric(
                envoy_dynamic_module_callback_http_filter_config_define_histogram,
                self.raw,
                name,
            )
        }
    }

    /// Adds 1 to counter `id` outside any stream.
    pub fn bump(&self, id: Option<usize>) {
        // SAFETY: main thread (config-scheduled event or config callout answer).
        unsafe {
            update_metric(
                envoy_dynamic_module_callback_http_filter_config_increment_counter,
                self.raw,
                id,
                1,
            )
        }
    }

    /// Starts a call whose answer comes to `on_http_filter_config_http_callout_done`.
    pub fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Option<u64> {
        // SAFETY: main thread.
        unsafe {
            callout(
                envoy_dynamic_module_callback_http_filter_config_http_callout,
                self.raw,
                cluster,
                headers,
                body,
                timeout_ms,
            )
        }
    }

    /// A scheduler that posts events to this configuration on the main thread, from any
    /// thread; `None` when Envoy gave none.
    pub fn scheduler(&self) -> Option<Scheduler> {
        // SAFETY: main thread, configuration hook.
        let raw =
            unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.raw) };
        (!raw.is_null()).then_some(Scheduler { raw })
    }
}

/// Envoy's config scheduler: [`Scheduler::commit`] runs `on_http_filter_config_scheduled` on
/// the main thread. Deleted on drop.
#[derive(Debug)]
pub struct Scheduler {
    raw: *mut c_void,
}

// SAFETY: the header documents `commit` as callable from any thread, module threads included.
unsafe impl Send for Scheduler {}
// SAFETY: as above.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Posts `event` to the main thread.
    pub fn commit(&self, event: u64) {
        // SAFETY: `raw` came from `scheduler_new` and is deleted only on drop.
        unsafe {
            envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.raw, event)
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: deleted once, after every thread that commits on it has been joined (the
        // owner's drop order).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.raw) }
    }
}
