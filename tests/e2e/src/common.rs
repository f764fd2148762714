//! What every area's tests share: locating the tools, the fleets they start, the requests they
//! send and the control-plane state they read. One copy here, so a fix to (say) how a fleet is
//! started or how a test is bounded reaches every area at once.

use std::future::Future;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvroute_harness::loadgen::{StreamOutcome, stream_chat};
use kvroute_harness::{Fleet, FleetConfig, HttpClient, HttpResponse, REPLICA_HEADER, Tools};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use serde_json::{Value, json};

/// The tools every fleet needs; a missing one fails the test with the reason.
pub fn tools() -> Tools {
    Tools::locate().unwrap_or_else(|e| panic!("{e}"))
}

/// A kvroute fleet of `replicas` serving `model` with one Envoy worker (one filter VM, so the
/// filter's per-worker state is the whole state): what every area starts from before its own
/// settings.
pub fn fleet_config(name: &str, replicas: usize, model: &str) -> FleetConfig {
    let mut cfg = FleetConfig::new(name);
    cfg.replicas = replicas;
    cfg.model = model.to_string();
    cfg.envoy_concurrency = 1;
    cfg
}

/// The two forms of kvroute in front of a fleet: the wasm filter in Envoy's HTTP chain, and the
/// control plane as an Endpoint Picker behind Envoy's `ext_proc` filter (no wasm). Behavioural
/// tests run in both ([`both_forms!`]): the same request machine and router decide in each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The proxy-wasm filter (route calls to the control plane).
    Filter,
    /// The control plane's Endpoint Picker (issue #21).
    Picker,
}

impl Form {
    /// Sets `cfg` up for this form.
    pub fn apply(self, cfg: &mut FleetConfig) {
        cfg.picker = self == Form::Picker;
    }
}

/// Declares a behavioural test `async fn NAME(form: Form)` as two tests, `NAME::filter` and
/// `NAME::picker`, so both forms meet the same assertions (`cargo test -- NAME` runs both).
macro_rules! both_forms {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn filter() {
                super::$name($crate::common::Form::Filter).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn picker() {
                super::$name($crate::common::Form::Picker).await;
            }
        }
    )+};
}
pub(crate) use both_forms;

/// Starts `cfg`; a fleet that does not come up fails the test with the reason.
pub async fn start_fleet(cfg: FleetConfig, tools: &Tools) -> Fleet {
    let name = cfg.name.clone();
    Fleet::start(cfg, tools)
        .await
        .unwrap_or_else(|e| panic!("starting fleet {name}: {e}"))
}

/// A fleet of [`fleet_config`] with `configure`'s settings on top, started with the located
/// [`tools`]: how most tests begin, written once.
pub async fn start_configured(
    name: &str,
    replicas: usize,
    model: &str,
    configure: impl FnOnce(&mut FleetConfig),
) -> Fleet {
    let mut cfg = fleet_config(name, replicas, model);
    configure(&mut cfg);
    start_fleet(cfg, &tools()).await
}

/// Held by the tests that start the most processes at once (several Envoys and control planes)
/// and by the ones whose assertions depend on the engines' real-time pace (precise mode's live
/// prediction): two of them side by side on 2 cores slow each other's simulated engines enough
/// to move what they measure.
pub static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs a test body under `limit`: a hang fails the test (libtest names it) instead of stalling
/// the whole binary.
pub async fn bounded<F: Future<Output = ()>>(limit: Duration, body: F) {
    if tokio::time::timeout(limit, body).await.is_err() {
        panic!("the test did not finish within {limit:?}");
    }
}

/// Deterministic filler text of `n` words (the simulator counts a word as a token), the same
/// for the same seed.
pub fn words(seed: u64, n: usize) -> String {
    kvroute_harness::loadgen::words(&mut SmallRng::seed_from_u64(seed), n)
}

/// A non-streaming chat request of one user message.
pub fn user_chat(model: &str, content: &str, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    })
}

/// A streaming chat request whose final chunk carries `usage` (the cached tokens the tests
/// compare with the router's view).
pub fn stream_chat_body(model: &str, messages: &[Value], max_tokens: u32) -> Value {
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// `method url` with `headers` and `body`, the whole answer read; a transport error fails the
/// test (naming `fleet`'s logs). The status is the caller's to check.
pub async fn request(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
    timeout: Duration,
    fleet: &Fleet,
) -> HttpResponse {
    client
        .request(method, url, headers, body, timeout)
        .await
        .unwrap_or_else(|e| panic!("{method} {url}: {e} ({})", fleet.describe()))
}

/// POSTs `body` to `{base}/v1/chat/completions` and reads the whole answer ([`request`]).
pub async fn post_chat(
    client: &HttpClient,
    base: &str,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
    fleet: &Fleet,
) -> HttpResponse {
    let url = format!("{base}/v1/chat/completions");
    request(
        client,
        "POST",
        &url,
        headers,
        Some(body.to_string()),
        timeout,
        fleet,
    )
    .await
}

/// POSTs JSON `body` to `url` (any API's path) and reads the whole answer, asserting a 200;
/// a failure names `fleet`'s logs.
pub async fn post_json_ok(
    client: &HttpClient,
    fleet: &Fleet,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> HttpResponse {
    let r = client
        .post_json(url, body, timeout)
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e} ({})", fleet.describe()));
    assert_eq!(r.status, 200, "{url}: {} ({})", r.body, fleet.describe());
    r
}

/// [`post_chat`] through `fleet`'s Envoy with `fleet`'s client, which is what most tests send.
pub async fn chat_through(
    fleet: &Fleet,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> HttpResponse {
    post_chat(fleet.client(), &fleet.url(), body, headers, timeout, fleet).await
}

/// [`post_chat`] through `fleet`'s Envoy, asserting a 200.
pub async fn chat_ok(
    client: &HttpClient,
    fleet: &Fleet,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> HttpResponse {
    let resp = post_chat(client, &fleet.url(), body, headers, timeout, fleet).await;
    assert_eq!(resp.status, 200, "{} ({})", resp.body, fleet.describe());
    resp
}

/// The control plane's admin base URL (`http://host:port`).
pub fn cp_admin(fleet: &Fleet) -> String {
    let cp = fleet.control_plane.as_ref().expect("kvroute topology");
    format!("http://{}", cp.admin_address)
}

/// The body of `GET {control plane admin}{path}`.
pub async fn cp_get(fleet: &Fleet, path: &str) -> String {
    let url = format!("{}{path}", cp_admin(fleet));
    fleet
        .client()
        .get(&url, Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"))
        .body
}

/// The decision id in an `x-kvroute-decision` header value (`id=...; ...`), when it has one.
pub fn decision_id(header: &str) -> Option<&str> {
    header.split("; ").find_map(|kv| kv.strip_prefix("id="))
}

/// The control plane's `/debug/decisions/{id}` record of the decision that routed `resp` (an
/// explained response: it carries `x-kvroute-decision`).
pub async fn explained_decision(fleet: &Fleet, resp: &HttpResponse) -> Value {
    let decision = resp.header("x-kvroute-decision").unwrap_or_default();
    let id = decision_id(decision).unwrap_or_else(|| panic!("no id in {decision:?}"));
    let body = cp_get(fleet, &format!("/debug/decisions/{id}")).await;
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("decision {id}: {e}: {body}"))
}

/// The control plane's `/metrics` text; a control plane that does not answer 200 fails the
/// test.
pub async fn cp_metrics(fleet: &Fleet) -> String {
    fleet
        .control_plane_metrics()
        .await
        .expect("kvroute topology")
        .unwrap_or_else(|e| panic!("control-plane metrics: {e} ({})", fleet.describe()))
}

/// The sample of per-endpoint gauge `name` for `endpoint`, if exported.
pub fn endpoint_value(text: &str, name: &str, endpoint: &str) -> Option<f64> {
    let prefix = format!("{name}{{endpoint=\"{endpoint}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// The replica that served a streamed answer; it must be one of `fleet`'s.
pub fn replica_of(out: &StreamOutcome, fleet: &Fleet) -> String {
    let replica = out
        .replica
        .clone()
        .unwrap_or_else(|| panic!("response without x-vllm-sim-replica ({})", fleet.describe()));
    let server = scorer_core::address::split_rank(&replica).0.to_string();
    assert!(
        fleet.replica_addresses().contains(&server),
        "unknown replica {replica} ({})",
        fleet.describe()
    );
    replica
}

/// Asserts that `out` was served by `expected` from at least 1,000 cached prompt tokens: a
/// turn that followed its conversation's blocks. `what` names the expectation on failure.
pub fn assert_followed_cache(out: &StreamOutcome, fleet: &Fleet, expected: &str, what: &str) {
    assert_eq!(
        replica_of(out, fleet),
        expected,
        "{what} ({})",
        fleet.describe()
    );
    assert!(
        out.cached_tokens.unwrap_or(0) >= 1_000,
        "{what}: {:?} cached tokens reused",
        out.cached_tokens
    );
}

/// The replica that served a complete answer, from its `x-vllm-sim-replica` header.
pub fn replica_header(resp: &HttpResponse) -> String {
    resp.header(REPLICA_HEADER)
        .unwrap_or_else(|| panic!("no {REPLICA_HEADER} in {:?}", resp.headers))
        .to_string()
}

/// POSTs `fault` to a replica's `/sim/fault`, asserting it took it.
pub async fn set_sim_fault(client: &HttpClient, replica: &str, fault: &Value) {
    let url = format!("http://{replica}/sim/fault");
    let r = client
        .request(
            "POST",
            &url,
            &[],
            Some(fault.to_string()),
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    assert_eq!(r.status, 200, "{url} {fault}: {}", r.body);
}

/// One streamed request, its stream included (generous: the machine may be busy).
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(30);

/// A multi-turn conversation with its own long system prompt (so conversations share no
/// prefix): each turn appends a user message and, once answered, the assistant's reply, so the
/// next turn's prompt extends the cached one.
pub struct Conversation {
    /// The model (or LoRA adapter) every turn asks for.
    pub model: &'static str,
    user_words: usize,
    /// The history so far, system prompt first.
    pub messages: Vec<Value>,
    /// Seeds the system prompt and, with the turn, each user message.
    pub seed: u64,
    /// User messages asked so far.
    pub turn: usize,
    /// vLLM's `cache_salt`, sent with every turn when set.
    pub cache_salt: Option<String>,
}

impl Conversation {
    /// A conversation for `model` whose system prompt has `system_words` words and whose user
    /// messages have `user_words`.
    pub fn new(
        model: &'static str,
        seed: u64,
        system_words: usize,
        user_words: usize,
    ) -> Conversation {
        let system = format!("Conversation {seed}. {}", words(seed, system_words));
        Conversation {
            model,
            user_words,
            messages: vec![json!({"role": "system", "content": system})],
            seed,
            turn: 0,
            cache_salt: None,
        }
    }

    /// Appends the next user message (seeded by the conversation and the turn); returns the
    /// streamed request body for it.
    pub fn ask(&mut self, max_tokens: u32) -> Value {
        let user_seed = self.seed * 1_000 + self.turn as u64 + 1;
        self.ask_seeded(user_seed, max_tokens)
    }

    /// [`Conversation::ask`] with the user message's seed given.
    pub fn ask_seeded(&mut self, user_seed: u64, max_tokens: u32) -> Value {
        self.turn += 1;
        let user = words(user_seed, self.user_words);
        self.messages.push(json!({"role": "user", "content": user}));
        let mut body = stream_chat_body(self.model, &self.messages, max_tokens);
        if let Some(salt) = &self.cache_salt {
            body["cache_salt"] = json!(salt);
        }
        body
    }

    /// Streams `body` to `base_url` (Envoy, or a replica directly) and appends the answer to
    /// the history; a failed request fails the test.
    pub async fn send(
        &mut self,
        client: &HttpClient,
        fleet: &Fleet,
        base_url: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> StreamOutcome {
        let out = stream_chat(client, base_url, body, headers, STREAM_TIMEOUT)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "conversation {} turn {} via {base_url}: {e} ({})",
                    self.seed,
                    self.turn,
                    fleet.describe()
                )
            });
        self.messages
            .push(json!({"role": "assistant", "content": out.text.clone()}));
        out
    }

    /// The next turn through `fleet`'s Envoy: [`Conversation::ask`] then
    /// [`Conversation::send`].
    pub async fn turn(
        &mut self,
        client: &HttpClient,
        fleet: &Fleet,
        max_tokens: u32,
        headers: &[(&str, &str)],
    ) -> StreamOutcome {
        let body = self.ask(max_tokens);
        self.send(client, fleet, &fleet.url(), &body, headers).await
    }
}

/// Control-plane settings for precise mode tokenising prompts through the replicas' render
/// API (the simulator's word tokenizer).
pub fn remote_tokenizer() -> Value {
    json!({
        "precise": {"tokenizer": "remote", "remote_api": "render", "tokenize_timeout_ms": 2000}
    })
}

/// The precise router's settings: speculative entries of routed requests live `ttl_ms`
/// (short, so that a test sees the events alone decide), and the queue model knows the
/// replicas run the H100 profile at 5x speed, 50 prefill tokens a millisecond.
pub fn precise_router(ttl_ms: u64) -> Value {
    json!({
        "precise": {"speculative_ttl_ms": ttl_ms},
        "scoring": {"prefill_tokens_per_ms": 50.0},
    })
}

/// Polls the control plane's metrics until `ok` holds on them and returns that text; after
/// `timeout` the test fails with the last text seen.
pub async fn wait_cp_metrics(
    fleet: &Fleet,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&str) -> bool,
) -> String {
    fleet
        .wait_for_control_plane_metrics(what, timeout, ok)
        .await
        .unwrap_or_else(|e| panic!("{e} ({})", fleet.describe()))
}

/// Waits (at most `timeout`) until the control plane reports every engine's KV-event stream
/// live (each replica's, or each data-parallel rank's): precise scoring trusts an endpoint
/// only from then on.
pub async fn wait_events_live(fleet: &Fleet, timeout: Duration) {
    let addresses = fleet.engine_addresses();
    wait_cp_metrics(fleet, "every KV-event stream live", timeout, |m| {
        addresses
            .iter()
            .all(|a| endpoint_value(m, "kvroute_endpoint_events_live", a) == Some(1.0))
    })
    .await;
}

/// A tool's stdout then its stderr, as one text: what a check reads and a failure shows of
/// tools that report on either stream.
pub fn output_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a tool with a deadline (killed past it, which fails the test); returns its output.
/// Both pipes are drained while it runs, so a tool that writes more than a pipe buffer (a
/// dumped DOM, a validation report) cannot block on its own output.
pub fn run_bounded(mut cmd: Command, what: &str, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    // Drain pipes on threads so a chatty tool cannot block on a full pipe.
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut b);
        b
    });
    let err_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut b);
        b
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the tool") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    }
}

/// Turn statistics of a phase: turns that followed their predecessor's replica, and the
/// prompt tokens served from cache.
#[derive(Debug, Default, Clone, Copy)]
pub struct Turns {
    /// Follow-up turns served where their predecessor was.
    pub followed: u32,
    /// Follow-up turns.
    pub follow_ups: u32,
    /// Their prompt tokens served from cache.
    pub cached: u64,
    /// Their prompt tokens.
    pub prompt: u64,
}

impl std::fmt::Display for Turns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} turns followed, hit rate {:.3}",
            self.followed,
            self.follow_ups,
            self.hit_rate()
        )
    }
}

impl Turns {
    /// Counts one follow-up turn: whether it was served where its predecessor was, and its
    /// cached and prompt tokens.
    pub fn follow_up(&mut self, followed: bool, cached: u64, prompt: u64) {
        self.follow_ups += 1;
        self.followed += u32::from(followed);
        self.cached += cached;
        self.prompt += prompt;
    }

    /// Adds another phase's (or conversation's) counts.
    pub fn add(&mut self, other: Turns) {
        self.followed += other.followed;
        self.follow_ups += other.follow_ups;
        self.cached += other.cached;
        self.prompt += other.prompt;
    }
    /// Share of follow-up turns that followed their predecessor.
    pub fn follow_rate(&self) -> f64 {
        f64::from(self.followed) / f64::from(self.follow_ups.max(1))
    }
    /// Share of their prompt tokens served from cache.
    pub fn hit_rate(&self) -> f64 {
        self.cached as f64 / self.prompt.max(1) as f64
    }
    /// Fails the test unless the hit rate is at least `floor`.
    pub fn assert_hit_rate(&self, floor: f64, phase: &str, fleet: &Fleet) {
        assert!(
            self.hit_rate() >= floor,
            "{phase}: hit rate {:.3}, below {floor:.3} ({})",
            self.hit_rate(),
            fleet.describe()
        );
    }
    /// Fails the test unless at least `min` of the follow-up turns followed their cache.
    pub fn assert_followed(&self, min: f64, phase: &str, fleet: &Fleet) {
        assert!(
            self.follow_rate() >= min,
            "{phase}: only {}/{} turns followed their cache ({})",
            self.followed,
            self.follow_ups,
            fleet.describe()
        );
    }
}
