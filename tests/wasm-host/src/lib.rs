//! A small, stateful proxy-wasm (ABI 0.2.1) host on wasmtime, for testing the built filter
//! without Envoy.
//!
//! It implements the `env.proxy_*` imports a Rust proxy-wasm module uses and simulates the
//! Envoy semantics the filter depends on:
//! - `Pause` from request headers holds them; body callbacks report the cumulative buffered size
//!   while paused; `continue_stream` takes effect after the callback returns;
//! - once request headers have gone upstream, changing them fails with `BadArgument`;
//! - a dispatched call is answered by the test ([`FilterHost::respond_http_call`]), reset
//!   (`on_http_call_response(token, 0, 0, 0)`) or timed out (a 504 local reply, as Envoy does);
//!   calls to clusters not in [`FilterHost::set_clusters`] fail with `BadArgument`;
//! - shared data with CAS, shared queues, metrics, properties, tick period, local replies.
//!
//! Every guest call runs with a fuel budget, so a runaway module traps instead of hanging.

use std::collections::{HashMap, VecDeque};
use std::path::Path;

use wasmtime::{
    Caller, Config, Engine, Extern, Instance, Linker, Module, OptLevel, Store, WasmParams,
    WasmResults,
};

/// Fuel for one guest call: far above any real callback, small enough to stop a loop fast.
const FUEL_PER_CALL: u64 = 5_000_000_000;

/// The table index of a proxy-wasm handle: the host hands out `index + 1` for shared queues and
/// metrics, so 0 names nothing (and a negative id, read as a large `u32`, no entry).
fn slot(id: i32) -> Option<usize> {
    (id as u32).checked_sub(1).map(|i| i as usize)
}

/// proxy-wasm status codes (ABI 0.2.1).
mod status {
    pub const OK: i32 = 0;
    pub const NOT_FOUND: i32 = 1;
    pub const BAD_ARGUMENT: i32 = 2;
    pub const EMPTY: i32 = 7;
    pub const CAS_MISMATCH: i32 = 8;
    pub const INTERNAL_FAILURE: i32 = 10;
}

/// Errors of the test host: loading, linking, traps, or misuse by the test.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// wasmtime failed to compile, link or run the module (traps included).
    #[error("wasm: {0}")]
    Wasm(String),
    /// The module cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// Path of the module.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The module does not export what a proxy-wasm 0.2.1 module must.
    #[error("not a proxy-wasm 0.2.1 module: missing export {0}")]
    MissingExport(&'static str),
    /// `proxy_on_vm_start` returned false.
    #[error("the module rejected VM start")]
    VmStartRejected,
    /// `proxy_on_configure` returned false (bad plugin configuration).
    #[error("the module rejected its plugin configuration")]
    ConfigureRejected,
    /// A callback returned a value that is not a proxy-wasm action.
    #[error("callback returned invalid action {0}")]
    BadAction(i32),
    /// The test used an unknown HTTP context.
    #[error("unknown HTTP context {0}")]
    UnknownContext(u32),
    /// The test answered a call that is not pending.
    #[error("no pending HTTP call with token {0}")]
    UnknownToken(u32),
}

impl From<wasmtime::Error> for HostError {
    fn from(e: wasmtime::Error) -> Self {
        HostError::Wasm(format!("{e:?}"))
    }
}

/// What a callback told the host to do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterAction {
    /// Go on.
    Continue,
    /// Stop iteration (hold headers / buffer body).
    Pause,
}

/// One `proxy_log` call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// 0 trace .. 5 critical.
    pub level: u32,
    /// The message.
    pub message: String,
}

/// One dispatched `proxy_http_call`, waiting for the test to answer it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// Token the module got back.
    pub token: u32,
    /// Context that issued the call (the root context for ticks).
    pub context_id: u32,
    /// Cluster name.
    pub upstream: String,
    /// Request headers (with pseudo-headers) in order.
    pub headers: Vec<(String, String)>,
    /// Request body.
    pub body: Vec<u8>,
    /// Timeout the module asked for.
    pub timeout_ms: u32,
}

impl HttpCall {
    /// First value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One `proxy_send_local_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// Context that replied.
    pub context_id: u32,
    /// HTTP status.
    pub status: u32,
    /// Body.
    pub body: Vec<u8>,
    /// Extra headers.
    pub headers: Vec<(String, String)>,
}

/// A metric the module defined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metric {
    /// 0 counter, 1 gauge, 2 histogram.
    pub kind: u32,
    /// Name given to `define_metric`.
    pub name: String,
    /// Counter/gauge value, or the last histogram sample.
    pub value: i64,
    /// All histogram samples.
    pub samples: Vec<u64>,
}

type HeaderMap = Vec<(String, Vec<u8>)>;

#[derive(Debug, Default)]
struct StreamState {
    request_headers: HeaderMap,
    request_trailers: HeaderMap,
    /// Headers as they went upstream (set once the request is released).
    released_headers: Option<HeaderMap>,
    request_body: Vec<u8>,
    forwarded_request_body: Vec<u8>,
    response_headers: HeaderMap,
    response_trailers: HeaderMap,
    response_headers_released: bool,
    response_body: Vec<u8>,
    forwarded_response_body: Vec<u8>,
    resume_request: bool,
    resume_response: bool,
    resumes: u32,
}

impl StreamState {
    fn release_request(&mut self) {
        if self.released_headers.is_none() {
            self.released_headers = Some(self.request_headers.clone());
        }
        let body = std::mem::take(&mut self.request_body);
        self.forwarded_request_body.extend_from_slice(&body);
    }
}

#[derive(Debug, Default)]
struct CallResponse {
    headers: HeaderMap,
    body: Vec<u8>,
    trailers: HeaderMap,
}

/// The host side of the store: everything the imports read and write.
#[derive(Debug, Default)]
pub struct HostState {
    plugin_config: Vec<u8>,
    vm_config: Vec<u8>,
    now_ns: u64,
    logs: Vec<LogEntry>,
    tick_period_ms: u32,
    active_context: u32,
    streams: HashMap<u32, StreamState>,
    call_response: Option<CallResponse>,
    pending_calls: Vec<HttpCall>,
    next_token: u32,
    clusters: Option<Vec<String>>,
    shared_data: HashMap<String, (Vec<u8>, u32)>,
    queues: Vec<(String, VecDeque<Vec<u8>>)>,
    metrics: Vec<Metric>,
    properties: HashMap<Vec<u8>, Vec<u8>>,
    local_responses: Vec<LocalResponse>,
    done_calls: u32,
}

impl HostState {
    fn stream(&mut self) -> Option<&mut StreamState> {
        let id = self.active_context;
        self.streams.get_mut(&id)
    }

    /// The header map of `map_type` for the active context; `None` when it does not exist now.
    /// `writable` is false for maps that already went on (Envoy refuses edits then).
    fn map(&mut self, map_type: i32) -> Option<(&mut HeaderMap, bool)> {
        if map_type == 6 || map_type == 7 {
            let call = self.call_response.as_mut()?;
            return Some((
                if map_type == 6 {
                    &mut call.headers
                } else {
                    &mut call.trailers
                },
                false,
            ));
        }
        let stream = self.stream()?;
        match map_type {
            0 => {
                let writable = stream.released_headers.is_none();
                Some((&mut stream.request_headers, writable))
            }
            1 => Some((&mut stream.request_trailers, true)),
            2 => {
                let writable = !stream.response_headers_released;
                Some((&mut stream.response_headers, writable))
            }
            3 => Some((&mut stream.response_trailers, true)),
            _ => None,
        }
    }

    /// Runs `edit` on header map `map_type` when the module may still write it, answering
    /// `BAD_ARGUMENT` for a missing or read-only map: what every header-map setter does.
    fn edit_map(&mut self, map_type: i32, edit: impl FnOnce(&mut HeaderMap)) -> i32 {
        match self.map(map_type) {
            Some((map, true)) => {
                edit(map);
                status::OK
            }
            _ => status::BAD_ARGUMENT,
        }
    }

    fn buffer(&mut self, buffer_type: i32) -> Option<&mut Vec<u8>> {
        match buffer_type {
            0 => self.stream().map(|s| &mut s.request_body),
            1 => self.stream().map(|s| &mut s.response_body),
            4 => self.call_response.as_mut().map(|c| &mut c.body),
            6 => Some(&mut self.vm_config),
            7 => Some(&mut self.plugin_config),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Guest memory helpers.

fn memory(caller: &mut Caller<'_, HostState>) -> wasmtime::Result<wasmtime::Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => wasmtime::bail!("module exports no memory"),
    }
}

fn read(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (start, len) = (ptr as u32 as usize, len as u32 as usize);
    match mem.data(&*caller).get(start..start.saturating_add(len)) {
        Some(bytes) => Ok(bytes.to_vec()),
        None => wasmtime::bail!("guest passed out-of-bounds memory {start}+{len}"),
    }
}

fn read_string(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let mem = memory(caller)?;
    let start = ptr as u32 as usize;
    match mem
        .data_mut(&mut *caller)
        .get_mut(start..start.saturating_add(bytes.len()))
    {
        Some(dst) => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        None => wasmtime::bail!("guest passed out-of-bounds return pointer {start}"),
    }
}

/// Writes a getter's result at `ptr` and answers `OK`, as every getter that succeeds does.
fn answer(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<i32> {
    write(caller, ptr, bytes)?;
    Ok(status::OK)
}

/// [`return_bytes`], answering `OK`: how the getters of variable-length values succeed.
fn answer_bytes(
    caller: &mut Caller<'_, HostState>,
    bytes: &[u8],
    ret_ptr: i32,
    ret_size: i32,
) -> wasmtime::Result<i32> {
    return_bytes(caller, bytes, ret_ptr, ret_size)?;
    Ok(status::OK)
}

/// Copies `bytes` into guest memory allocated with the module's `malloc` and writes the
/// pointer and size to the return slots.
fn return_bytes(
    caller: &mut Caller<'_, HostState>,
    bytes: &[u8],
    ret_ptr: i32,
    ret_size: i32,
) -> wasmtime::Result<()> {
    let alloc = ["malloc", "proxy_on_memory_allocate"]
        .into_iter()
        .find_map(|name| caller.get_export(name).and_then(Extern::into_func));
    let Some(alloc) = alloc else {
        wasmtime::bail!("module exports no allocator (malloc)")
    };
    let len = i32::try_from(bytes.len())?;
    let ptr = alloc.typed::<i32, i32>(&*caller)?.call(&mut *caller, len)?;
    if ptr == 0 && len != 0 {
        wasmtime::bail!("guest allocator failed for {len} bytes");
    }
    write(caller, ptr, bytes)?;
    write(caller, ret_ptr, &ptr.to_le_bytes())?;
    write(caller, ret_size, &len.to_le_bytes())
}

/// proxy-wasm map serialization: count, (key len, value len)*, then NUL-terminated pairs.
pub fn serialize_map<K: AsRef<[u8]>, V: AsRef<[u8]>>(map: &[(K, V)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(map.len() as u32).to_le_bytes());
    for (k, v) in map {
        out.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in map {
        out.extend_from_slice(k.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

/// Inverse of [`serialize_map`]; `None` on malformed input.
pub fn deserialize_map(bytes: &[u8]) -> Option<HeaderMap> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let u32_at = |i: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?) as usize)
    };
    let n = u32_at(0)?;
    let mut p = 4usize.checked_add(n.checked_mul(8)?)?;
    let mut map = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        let (klen, vlen) = (u32_at(4 + i * 8)?, u32_at(8 + i * 8)?);
        let key = bytes.get(p..p + klen)?;
        p += klen + 1;
        let value = bytes.get(p..p + vlen)?;
        p += vlen + 1;
        map.push((String::from_utf8(key.to_vec()).ok()?, value.to_vec()));
    }
    Some(map)
}

/// Header pairs as the host keeps them: names lowercased, values as bytes.
fn lowercase_map(pairs: &[(&str, &str)]) -> HeaderMap {
    pairs
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.as_bytes().to_vec()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The imports.

fn link(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    // Registers the `env` import `$name`: proxy-wasm passes the host state's caller first and
    // then `i32`s (an argument of another type says so), so each import states only its
    // arguments' names and body.
    macro_rules! host_fn {
        (@ty) => { i32 };
        (@ty $ty:ty) => { $ty };
        ($name:literal, |$c:pat_param $(, $arg:ident $(: $ty:ty)?)*| $body:expr) => {
            linker.func_wrap(
                "env",
                $name,
                |$c: Caller<'_, HostState> $(, $arg: host_fn!(@ty $($ty)?))*| $body,
            )?
        };
    }
    host_fn!("proxy_log", |mut c, level, ptr, len| {
        let message = read_string(&mut c, ptr, len)?;
        c.data_mut().logs.push(LogEntry {
            level: level as u32,
            message,
        });
        Ok(status::OK)
    });
    host_fn!("proxy_get_log_level", |mut c, ret| {
        answer(&mut c, ret, &0u32.to_le_bytes())
    });
    host_fn!("proxy_get_current_time_nanoseconds", |mut c, ret| {
        let now = c.data().now_ns;
        answer(&mut c, ret, &now.to_le_bytes())
    });
    host_fn!("proxy_set_tick_period_milliseconds", |mut c, ms| {
        c.data_mut().tick_period_ms = ms as u32;
        status::OK
    });
    host_fn!(
        "proxy_get_buffer_bytes",
        |mut c, kind, start, max, ret_ptr, ret_size| {
            let Some(buffer) = c.data_mut().buffer(kind) else {
                return Ok(status::NOT_FOUND);
            };
            let start = (start as u32 as usize).min(buffer.len());
            let end = start.saturating_add(max as u32 as usize).min(buffer.len());
            let bytes = buffer[start..end].to_vec();
            answer_bytes(&mut c, &bytes, ret_ptr, ret_size)
        }
    );
    host_fn!(
        "proxy_set_buffer_bytes",
        |mut c, kind, start, size, ptr, len| {
            let bytes = read(&mut c, ptr, len)?;
            let Some(buffer) = c.data_mut().buffer(kind) else {
                return Ok(status::NOT_FOUND);
            };
            let start = (start as u32 as usize).min(buffer.len());
            let end = start.saturating_add(size as u32 as usize).min(buffer.len());
            buffer.splice(start..end, bytes);
            Ok(status::OK)
        }
    );
    host_fn!(
        "proxy_get_header_map_pairs",
        |mut c, kind, ret_ptr, ret_size| {
            let Some((map, _)) = c.data_mut().map(kind) else {
                return Ok(status::NOT_FOUND);
            };
            let bytes = serialize_map(map);
            answer_bytes(&mut c, &bytes, ret_ptr, ret_size)
        }
    );
    host_fn!("proxy_set_header_map_pairs", |mut c, kind, ptr, len| {
        let bytes = read(&mut c, ptr, len)?;
        let Some(new) = deserialize_map(&bytes) else {
            return Ok(status::BAD_ARGUMENT);
        };
        Ok(c.data_mut().edit_map(kind, |map| {
            *map = new
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect();
        }))
    });
    host_fn!(
        "proxy_get_header_map_value",
        |mut c, kind, kptr, klen, ret_ptr, ret_size| {
            let key = read_string(&mut c, kptr, klen)?;
            let Some((map, _)) = c.data_mut().map(kind) else {
                return Ok(status::NOT_FOUND);
            };
            let Some(value) = map
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(&key))
                .map(|(_, v)| v.clone())
            else {
                return Ok(status::NOT_FOUND);
            };
            answer_bytes(&mut c, &value, ret_ptr, ret_size)
        }
    );
    host_fn!(
        "proxy_remove_header_map_value",
        |mut c, kind, kptr, klen| {
            let key = read_string(&mut c, kptr, klen)?;
            Ok(c.data_mut().edit_map(kind, |map| {
                map.retain(|(k, _)| !k.eq_ignore_ascii_case(&key));
            }))
        }
    );
    host_fn!(
        "proxy_replace_header_map_value",
        |mut c, kind, kptr, klen, vptr, vlen| {
            let key = read_string(&mut c, kptr, klen)?.to_ascii_lowercase();
            let value = read(&mut c, vptr, vlen)?;
            Ok(c.data_mut()
                .edit_map(kind, |map| match map.iter().position(|(k, _)| *k == key) {
                    Some(i) => {
                        map[i].1 = value;
                        let mut seen = 0;
                        map.retain(|(k, _)| {
                            seen += usize::from(*k == key);
                            *k != key || seen == 1
                        });
                    }
                    None => map.push((key, value)),
                }))
        }
    );
    host_fn!(
        "proxy_add_header_map_value",
        |mut c, kind, kptr, klen, vptr, vlen| {
            let key = read_string(&mut c, kptr, klen)?.to_ascii_lowercase();
            let value = read(&mut c, vptr, vlen)?;
            Ok(c.data_mut().edit_map(kind, |map| map.push((key, value))))
        }
    );
    host_fn!(
        "proxy_get_property",
        |mut c, pptr, plen, ret_ptr, ret_size| {
            let path = read(&mut c, pptr, plen)?;
            let value = match c.data().properties.get(&path).cloned() {
                Some(value) => value,
                // As Envoy: the active stream's response code, an int64 in host byte order,
                // once response headers were sent.
                None if path == b"response\0code" => {
                    let Some(code) = c.data_mut().stream().and_then(|s| {
                        let (_, v) = s.response_headers.iter().find(|(k, _)| k == ":status")?;
                        std::str::from_utf8(v).ok()?.parse::<i64>().ok()
                    }) else {
                        return Ok(status::NOT_FOUND);
                    };
                    code.to_le_bytes().to_vec()
                }
                None => return Ok(status::NOT_FOUND),
            };
            answer_bytes(&mut c, &value, ret_ptr, ret_size)
        }
    );
    host_fn!("proxy_set_property", |mut c, pptr, plen, vptr, vlen| {
        let path = read(&mut c, pptr, plen)?;
        let value = read(&mut c, vptr, vlen)?;
        c.data_mut().properties.insert(path, value);
        Ok(status::OK)
    });
    host_fn!(
        "proxy_get_shared_data",
        |mut c, kptr, klen, ret_ptr, ret_size, ret_cas| {
            let key = read_string(&mut c, kptr, klen)?;
            let Some((value, cas)) = c.data().shared_data.get(&key).cloned() else {
                return Ok(status::NOT_FOUND);
            };
            return_bytes(&mut c, &value, ret_ptr, ret_size)?;
            answer(&mut c, ret_cas, &cas.to_le_bytes())
        }
    );
    host_fn!(
        "proxy_set_shared_data",
        |mut c, kptr, klen, vptr, vlen, cas| {
            let key = read_string(&mut c, kptr, klen)?;
            let value = read(&mut c, vptr, vlen)?;
            let data = &mut c.data_mut().shared_data;
            let current = data.get(&key).map_or(0, |(_, cas)| *cas);
            if cas != 0 && cas as u32 != current {
                return Ok(status::CAS_MISMATCH);
            }
            data.insert(key, (value, current.wrapping_add(1).max(1)));
            Ok(status::OK)
        }
    );
    host_fn!(
        "proxy_register_shared_queue",
        |mut c, nptr, nlen, ret_id| {
            let name = read_string(&mut c, nptr, nlen)?;
            let queues = &mut c.data_mut().queues;
            let id = match queues.iter().position(|(n, _)| *n == name) {
                Some(i) => i,
                None => {
                    queues.push((name, VecDeque::new()));
                    queues.len() - 1
                }
            } as u32
                + 1;
            answer(&mut c, ret_id, &id.to_le_bytes())
        }
    );
    host_fn!(
        "proxy_resolve_shared_queue",
        |mut c, _vptr, _vlen, nptr, nlen, ret_id| {
            let name = read_string(&mut c, nptr, nlen)?;
            let Some(i) = c.data().queues.iter().position(|(n, _)| *n == name) else {
                return Ok(status::NOT_FOUND);
            };
            answer(&mut c, ret_id, &(i as u32 + 1).to_le_bytes())
        }
    );
    host_fn!("proxy_enqueue_shared_queue", |mut c, id, vptr, vlen| {
        let value = read(&mut c, vptr, vlen)?;
        match slot(id).and_then(|i| c.data_mut().queues.get_mut(i)) {
            Some((_, q)) => {
                q.push_back(value);
                Ok(status::OK)
            }
            None => Ok(status::NOT_FOUND),
        }
    });
    host_fn!(
        "proxy_dequeue_shared_queue",
        |mut c, id, ret_ptr, ret_size| {
            let item = match slot(id).and_then(|i| c.data_mut().queues.get_mut(i)) {
                Some((_, q)) => q.pop_front(),
                None => return Ok(status::NOT_FOUND),
            };
            let Some(item) = item else {
                return Ok(status::EMPTY);
            };
            answer_bytes(&mut c, &item, ret_ptr, ret_size)
        }
    );
    host_fn!("proxy_continue_stream", |mut c, kind| {
        let Some(stream) = c.data_mut().stream() else {
            return status::NOT_FOUND;
        };
        match kind {
            0 => stream.resume_request = true,
            1 => stream.resume_response = true,
            _ => return status::BAD_ARGUMENT,
        }
        status::OK
    });
    host_fn!("proxy_close_stream", |_c, _kind| status::OK);
    host_fn!(
        "proxy_send_local_response",
        |mut c, code, _dptr, _dlen, bptr, blen, hptr, hlen, _grpc| {
            let body = read(&mut c, bptr, blen)?;
            let headers = deserialize_map(&read(&mut c, hptr, hlen)?).unwrap_or_default();
            let state = c.data_mut();
            state.local_responses.push(LocalResponse {
                context_id: state.active_context,
                status: code as u32,
                body,
                headers: headers
                    .into_iter()
                    .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                    .collect(),
            });
            Ok(status::OK)
        }
    );
    host_fn!(
        "proxy_http_call",
        |mut c, uptr, ulen, hptr, hlen, bptr, blen, _tptr, _tlen, timeout_ms, ret_token| {
            let upstream = read_string(&mut c, uptr, ulen)?;
            let Some(headers) = deserialize_map(&read(&mut c, hptr, hlen)?) else {
                return Ok(status::BAD_ARGUMENT);
            };
            let body = read(&mut c, bptr, blen)?;
            let headers: Vec<(String, String)> = headers
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect();
            let has = |name: &str| headers.iter().any(|(k, v)| k == name && !v.is_empty());
            let state = c.data_mut();
            let known = state
                .clusters
                .as_ref()
                .is_none_or(|cs| cs.contains(&upstream));
            // Envoy refuses calls to unknown clusters and calls missing a required pseudo-header.
            if !known || !has(":method") || !has(":path") || !has(":authority") || timeout_ms < 0 {
                return Ok(status::BAD_ARGUMENT);
            }
            state.next_token += 1;
            let token = state.next_token;
            let context_id = state.active_context;
            state.pending_calls.push(HttpCall {
                token,
                context_id,
                upstream,
                headers,
                body,
                timeout_ms: timeout_ms as u32,
            });
            answer(&mut c, ret_token, &token.to_le_bytes())
        }
    );
    host_fn!("proxy_set_effective_context", |mut c, id| {
        c.data_mut().active_context = id as u32;
        status::OK
    });
    host_fn!(
        "proxy_call_foreign_function",
        |_c, _n, _nl, _a, _al, _rp, _rs| { status::NOT_FOUND }
    );
    // gRPC callouts are not simulated: starting one fails like a host without gRPC support.
    host_fn!("proxy_grpc_call", |_c,
                                 _up,
                                 _ul,
                                 _sv,
                                 _sl,
                                 _me,
                                 _ml,
                                 _md,
                                 _mdl,
                                 _msg,
                                 _msgl,
                                 _timeout,
                                 _ret| {
        status::INTERNAL_FAILURE
    });
    host_fn!(
        "proxy_grpc_stream",
        |_c, _up, _ul, _sv, _sl, _me, _ml, _md, _mdl, _ret| { status::INTERNAL_FAILURE }
    );
    host_fn!("proxy_grpc_send", |_c, _t, _p, _l, _e| {
        status::NOT_FOUND
    });
    host_fn!("proxy_grpc_cancel", |_c, _t| status::NOT_FOUND);
    host_fn!("proxy_grpc_close", |_c, _t| status::NOT_FOUND);
    host_fn!("proxy_get_status", |mut c, ret_code, ret_ptr, ret_size| {
        write(&mut c, ret_code, &0u32.to_le_bytes())?;
        answer_bytes(&mut c, b"", ret_ptr, ret_size)
    });
    host_fn!("proxy_done", |mut c| {
        c.data_mut().done_calls += 1;
        status::OK
    });
    host_fn!("proxy_define_metric", |mut c, kind, nptr, nlen, ret_id| {
        let name = read_string(&mut c, nptr, nlen)?;
        if !(0..=2).contains(&kind) {
            return Ok(status::BAD_ARGUMENT);
        }
        let metrics = &mut c.data_mut().metrics;
        let index = match metrics.iter().position(|m| m.name == name) {
            Some(i) => i,
            None => {
                metrics.push(Metric {
                    kind: kind as u32,
                    name,
                    value: 0,
                    samples: Vec::new(),
                });
                metrics.len() - 1
            }
        };
        answer(&mut c, ret_id, &(index as u32 + 1).to_le_bytes())
    });
    host_fn!("proxy_increment_metric", |mut c, id, offset: i64| {
        let Some(metric) = slot(id).and_then(|i| c.data_mut().metrics.get_mut(i)) else {
            return status::NOT_FOUND;
        };
        // Envoy: counters only go up; histograms cannot be incremented.
        if (metric.kind == 0 && offset < 0) || metric.kind == 2 {
            return status::BAD_ARGUMENT;
        }
        metric.value += offset;
        status::OK
    });
    host_fn!("proxy_record_metric", |mut c, id, value: i64| {
        let Some(metric) = slot(id).and_then(|i| c.data_mut().metrics.get_mut(i)) else {
            return status::NOT_FOUND;
        };
        metric.value = value;
        if metric.kind == 2 {
            metric.samples.push(value as u64);
        }
        status::OK
    });
    host_fn!("proxy_get_metric", |mut c, id, ret| {
        let value = match slot(id).and_then(|i| c.data().metrics.get(i)) {
            Some(m) => m.value as u64,
            None => return Ok(status::NOT_FOUND),
        };
        answer(&mut c, ret, &value.to_le_bytes())
    });
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The driver.

/// A loaded filter with one root context, driven by the test.
pub struct FilterHost {
    store: Store<HostState>,
    instance: Instance,
    root_context_id: u32,
    next_context_id: u32,
}

/// A compiled module, reusable across [`FilterHost`]s (compiling is the slow part).
#[derive(Clone)]
pub struct FilterModule {
    engine: Engine,
    module: Module,
}

impl FilterModule {
    /// Compiles a module from a `.wasm` file.
    pub fn from_file(path: &Path) -> Result<Self, HostError> {
        let bytes = std::fs::read(path).map_err(|source| HostError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    /// Compiles a module from bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HostError> {
        let mut config = Config::new();
        config.consume_fuel(true);
        config.cranelift_opt_level(OptLevel::None);
        let engine = Engine::new(&config)?;
        let module = Module::new(&engine, bytes)?;
        Ok(FilterModule { engine, module })
    }

    /// `(module, name)` of every import, e.g. `("env", "proxy_log")`.
    pub fn imports(&self) -> Vec<(String, String)> {
        self.module
            .imports()
            .map(|i| (i.module().to_owned(), i.name().to_owned()))
            .collect()
    }

    /// Names of every export.
    pub fn exports(&self) -> Vec<String> {
        self.module.exports().map(|e| e.name().to_owned()).collect()
    }

    /// Instantiates the module and brings up its root context like Envoy does: `_initialize`,
    /// context create, `proxy_on_vm_start`, `proxy_on_configure` with `plugin_config`.
    pub fn start(&self, plugin_config: &[u8]) -> Result<FilterHost, HostError> {
        for export in [
            "proxy_abi_version_0_2_1",
            "memory",
            "malloc",
            "proxy_on_context_create",
        ] {
            if !self.exports().iter().any(|e| e == export) {
                return Err(HostError::MissingExport(export));
            }
        }
        let mut linker = Linker::new(&self.engine);
        link(&mut linker)?;
        let state = HostState {
            plugin_config: plugin_config.to_vec(),
            now_ns: 1_000_000_000_000,
            ..HostState::default()
        };
        let mut store = Store::new(&self.engine, state);
        store.set_fuel(FUEL_PER_CALL)?;
        let instance = linker.instantiate(&mut store, &self.module)?;
        let mut host = FilterHost {
            store,
            instance,
            root_context_id: 1,
            next_context_id: 2,
        };
        if host
            .instance
            .get_func(&mut host.store, "_initialize")
            .is_some()
        {
            host.call::<(), ()>("_initialize", 0, ())?;
        }
        let root = host.root_context_id;
        host.call::<(i32, i32), ()>("proxy_on_context_create", root, (root as i32, 0))?;
        let vm_config_len = host.store.data().vm_config.len() as i32;
        if host.call::<(i32, i32), i32>("proxy_on_vm_start", root, (root as i32, vm_config_len))?
            == 0
        {
            return Err(HostError::VmStartRejected);
        }
        let config_len = plugin_config.len() as i32;
        if host.call::<(i32, i32), i32>("proxy_on_configure", root, (root as i32, config_len))? == 0
        {
            return Err(HostError::ConfigureRejected);
        }
        Ok(host)
    }
}

impl FilterHost {
    fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        name: &str,
        context: u32,
        params: P,
    ) -> Result<R, HostError> {
        let func = self
            .instance
            .get_typed_func::<P, R>(&mut self.store, name)?;
        self.store.set_fuel(FUEL_PER_CALL)?;
        self.store.data_mut().active_context = context;
        let result = func.call(&mut self.store, params);
        self.store.data_mut().call_response = None;
        self.apply_resumes();
        Ok(result?)
    }

    /// Envoy applies `continue_stream` after the VM call returns.
    fn apply_resumes(&mut self) {
        for stream in self.store.data_mut().streams.values_mut() {
            if std::mem::take(&mut stream.resume_request) {
                stream.resumes += 1;
                stream.release_request();
            }
            if std::mem::take(&mut stream.resume_response) {
                stream.response_headers_released = true;
                let body = std::mem::take(&mut stream.response_body);
                stream.forwarded_response_body.extend_from_slice(&body);
            }
        }
    }

    fn action(code: i32) -> Result<FilterAction, HostError> {
        match code {
            0 => Ok(FilterAction::Continue),
            1 => Ok(FilterAction::Pause),
            other => Err(HostError::BadAction(other)),
        }
    }

    fn stream_mut(&mut self, context: u32) -> Result<&mut StreamState, HostError> {
        self.store
            .data_mut()
            .streams
            .get_mut(&context)
            .ok_or(HostError::UnknownContext(context))
    }

    fn stream(&self, context: u32) -> Result<&StreamState, HostError> {
        self.store
            .data()
            .streams
            .get(&context)
            .ok_or(HostError::UnknownContext(context))
    }

    /// The root context's id.
    pub fn root_context_id(&self) -> u32 {
        self.root_context_id
    }

    /// Host time in milliseconds since the epoch (starts at 1e9 ms).
    pub fn now_ms(&self) -> u64 {
        self.store.data().now_ns / 1_000_000
    }

    /// Moves the host clock forward.
    pub fn advance_ms(&mut self, ms: u64) {
        self.store.data_mut().now_ns += ms * 1_000_000;
    }

    /// Restricts `dispatch_http_call` to these cluster names (others get `BadArgument`).
    pub fn set_clusters(&mut self, clusters: &[&str]) {
        self.store.data_mut().clusters = Some(clusters.iter().map(|c| (*c).to_owned()).collect());
    }

    /// Sets a property readable with `get_property` (e.g. `["upstream", "address"]`).
    pub fn set_property(&mut self, path: &[&str], value: &[u8]) {
        self.store
            .data_mut()
            .properties
            .insert(path.join("\0").into_bytes(), value.to_vec());
    }

    /// Creates an HTTP context (a new request) and returns its id.
    pub fn new_stream(&mut self) -> Result<u32, HostError> {
        let id = self.next_context_id;
        self.next_context_id += 1;
        self.store
            .data_mut()
            .streams
            .insert(id, StreamState::default());
        self.call::<(i32, i32), ()>(
            "proxy_on_context_create",
            id,
            (id as i32, self.root_context_id as i32),
        )?;
        Ok(id)
    }

    /// Delivers request headers. `Continue` releases them upstream.
    pub fn send_request_headers(
        &mut self,
        context: u32,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<FilterAction, HostError> {
        self.stream_mut(context)?.request_headers = lowercase_map(headers);
        let n = headers.len();
        self.deliver_to_stream("proxy_on_request_headers", context, n, end_of_stream, |s| {
            if s.released_headers.is_none() {
                s.released_headers = Some(s.request_headers.clone());
            }
        })
    }

    /// Delivers a request body chunk. While the filter pauses, chunks accumulate and the
    /// callback sees the cumulative size; `Continue` releases headers and body.
    pub fn send_request_body(
        &mut self,
        context: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<FilterAction, HostError> {
        let stream = self.stream_mut(context)?;
        stream.request_body.extend_from_slice(chunk);
        let size = stream.request_body.len();
        self.deliver_to_stream("proxy_on_request_body", context, size, end_of_stream, |s| {
            s.release_request()
        })
    }

    /// Delivers request trailers (the body ended without an end-of-stream body chunk).
    pub fn send_request_trailers(
        &mut self,
        context: u32,
        trailers: &[(&str, &str)],
    ) -> Result<FilterAction, HostError> {
        self.stream_mut(context)?.request_trailers = lowercase_map(trailers);
        let n = trailers.len() as i32;
        let action =
            Self::action(self.call("proxy_on_request_trailers", context, (context as i32, n))?)?;
        if action == FilterAction::Continue {
            self.stream_mut(context)?.release_request();
        }
        Ok(action)
    }

    /// Delivers upstream response headers.
    pub fn send_response_headers(
        &mut self,
        context: u32,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> Result<FilterAction, HostError> {
        self.stream_mut(context)?.response_headers = lowercase_map(headers);
        let n = headers.len();
        self.deliver_to_stream(
            "proxy_on_response_headers",
            context,
            n,
            end_of_stream,
            |s| s.response_headers_released = true,
        )
    }

    /// Delivers a response body chunk (cumulative while the filter pauses).
    pub fn send_response_body(
        &mut self,
        context: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<FilterAction, HostError> {
        let stream = self.stream_mut(context)?;
        stream.response_body.extend_from_slice(chunk);
        let size = stream.response_body.len();
        self.deliver_to_stream(
            "proxy_on_response_body",
            context,
            size,
            end_of_stream,
            |s| {
                let body = std::mem::take(&mut s.response_body);
                s.forwarded_response_body.extend_from_slice(&body);
            },
        )
    }

    /// Runs a stream callback that takes `(context, size, end_of_stream)` (headers: their
    /// count; body: the bytes buffered so far) and, when the filter answers `Continue`, lets
    /// `released` apply what Envoy would then pass on (headers or a body going up or down).
    fn deliver_to_stream(
        &mut self,
        callback: &str,
        context: u32,
        size: usize,
        end_of_stream: bool,
        released: impl FnOnce(&mut StreamState),
    ) -> Result<FilterAction, HostError> {
        let params = (context as i32, size as i32, i32::from(end_of_stream));
        let action = Self::action(self.call(callback, context, params)?)?;
        if action == FilterAction::Continue {
            released(self.stream_mut(context)?);
        }
        Ok(action)
    }

    /// Ends the stream: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`. Calls it issued and
    /// that are still pending are cancelled, as Envoy does.
    pub fn finish_stream(&mut self, context: u32) -> Result<(), HostError> {
        self.stream(context)?;
        let id = context as i32;
        self.call::<i32, i32>("proxy_on_done", context, id)?;
        self.call::<i32, ()>("proxy_on_log", context, id)?;
        self.call::<i32, ()>("proxy_on_delete", context, id)?;
        let state = self.store.data_mut();
        state.streams.remove(&context);
        state.pending_calls.retain(|c| c.context_id != context);
        Ok(())
    }

    /// Fires the root context's tick.
    pub fn tick(&mut self) -> Result<(), HostError> {
        let root = self.root_context_id;
        self.call::<i32, ()>("proxy_on_tick", root, root as i32)
    }

    /// The tick period the module asked for (0 = none).
    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// Calls dispatched and not yet answered, oldest first.
    pub fn pending_http_calls(&self) -> &[HttpCall] {
        &self.store.data().pending_calls
    }

    fn take_call(&mut self, token: u32) -> Result<HttpCall, HostError> {
        let calls = &mut self.store.data_mut().pending_calls;
        let i = calls
            .iter()
            .position(|c| c.token == token)
            .ok_or(HostError::UnknownToken(token))?;
        Ok(calls.remove(i))
    }

    fn deliver(
        &mut self,
        call: &HttpCall,
        response: Option<CallResponse>,
    ) -> Result<(), HostError> {
        let (nh, nb, nt) = response.as_ref().map_or((0, 0, 0), |r| {
            (
                r.headers.len() as i32,
                r.body.len() as i32,
                r.trailers.len() as i32,
            )
        });
        self.store.data_mut().call_response = response;
        let params = (call.context_id as i32, call.token as i32, nh, nb, nt);
        self.call("proxy_on_http_call_response", call.context_id, params)
    }

    /// Answers a pending call with `status`, extra headers and a body.
    pub fn respond_http_call(
        &mut self,
        token: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError> {
        let call = self.take_call(token)?;
        let mut map: HeaderMap = vec![(":status".into(), status.to_string().into_bytes())];
        map.extend(lowercase_map(headers));
        let response = CallResponse {
            headers: map,
            body: body.to_vec(),
            trailers: Vec::new(),
        };
        self.deliver(&call, Some(response))
    }

    /// Resets a pending call: `on_http_call_response(token, 0, 0, 0)`.
    pub fn reset_http_call(&mut self, token: u32) -> Result<(), HostError> {
        let call = self.take_call(token)?;
        self.deliver(&call, None)
    }

    /// Times out a pending call: Envoy answers with a local 504 reply.
    pub fn time_out_http_call(&mut self, token: u32) -> Result<(), HostError> {
        self.advance_ms(u64::from(
            self.pending_http_calls()
                .iter()
                .find(|c| c.token == token)
                .map_or(0, |c| c.timeout_ms),
        ));
        self.respond_http_call(
            token,
            504,
            &[("content-type", "text/plain")],
            b"upstream request timeout",
        )
    }

    /// Whether the request went upstream (headers released by `Continue` or a resume).
    pub fn request_released(&self, context: u32) -> Result<bool, HostError> {
        Ok(self.stream(context)?.released_headers.is_some())
    }

    /// How many times the module resumed the request with `continue_stream`.
    pub fn request_resumes(&self, context: u32) -> Result<u32, HostError> {
        Ok(self.stream(context)?.resumes)
    }

    /// A header as it went upstream (`None` if absent or not released yet).
    pub fn upstream_request_header(
        &self,
        context: u32,
        name: &str,
    ) -> Result<Option<String>, HostError> {
        let stream = self.stream(context)?;
        Ok(stream.released_headers.as_ref().and_then(|h| {
            h.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        }))
    }

    /// The request body that went upstream so far.
    pub fn upstream_request_body(&self, context: u32) -> Result<Vec<u8>, HostError> {
        Ok(self.stream(context)?.forwarded_request_body.clone())
    }

    /// Local replies the module sent.
    pub fn local_responses(&self) -> &[LocalResponse] {
        &self.store.data().local_responses
    }

    /// Everything the module logged.
    pub fn logs(&self) -> &[LogEntry] {
        &self.store.data().logs
    }

    /// A metric by name.
    pub fn metric(&self, name: &str) -> Option<&Metric> {
        self.store.data().metrics.iter().find(|m| m.name == name)
    }

    /// A shared-data value and its CAS.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.store.data().shared_data.get(key).cloned()
    }

    /// Size of the module's linear memory in bytes (wasm memory only grows), so a benchmark
    /// can measure what requests held in flight cost the filter.
    pub fn memory_bytes(&mut self) -> usize {
        match self.instance.get_export(&mut self.store, "memory") {
            Some(wasmtime::Extern::Memory(m)) => m.data_size(&self.store),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_serialization_round_trips() {
        let map = vec![
            (":method".to_string(), b"POST".to_vec()),
            ("x".to_string(), Vec::new()),
        ];
        assert_eq!(deserialize_map(&serialize_map(&map)), Some(map));
        assert_eq!(deserialize_map(&[]), Some(vec![]));
        assert_eq!(
            deserialize_map(&[1, 0, 0, 0, 9, 0, 0, 0]),
            None,
            "truncated input is an error"
        );
    }

    #[test]
    fn header_setters_edit_only_maps_still_writable() {
        let mut state = HostState {
            active_context: 2,
            ..HostState::default()
        };
        state.streams.insert(2, StreamState::default());
        let add = |map: &mut HeaderMap| map.push(("x".into(), b"1".to_vec()));
        assert_eq!(state.edit_map(0, add), status::OK);
        assert_eq!(state.edit_map(3, add), status::OK);
        assert_eq!(state.edit_map(5, add), status::BAD_ARGUMENT, "no such map");
        assert_eq!(
            state.edit_map(6, add),
            status::BAD_ARGUMENT,
            "no call answer"
        );
        let stream = state.streams.get_mut(&2).unwrap();
        stream.release_request();
        stream.response_headers_released = true;
        assert_eq!(state.edit_map(0, add), status::BAD_ARGUMENT, "released");
        assert_eq!(state.edit_map(2, add), status::BAD_ARGUMENT, "released");
        let stream = &state.streams[&2];
        assert_eq!(
            stream.request_headers,
            vec![("x".to_string(), b"1".to_vec())]
        );
        assert_eq!(stream.response_trailers.len(), 1);
        assert!(stream.response_headers.is_empty());
    }

    #[test]
    fn handles_are_one_based() {
        assert_eq!(slot(1), Some(0));
        assert_eq!(slot(3), Some(2));
        assert_eq!(slot(0), None);
    }
}
