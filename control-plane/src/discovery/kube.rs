//! Kubernetes endpoint discovery, the pure half: API-server JSON in, endpoint sets out.
//!
//! Everything here is sans-IO so it can be tested against recorded API-server responses:
//! [`PodList`] and [`WatchEvent`] are the subsets of the Kubernetes shapes we read,
//! [`LabelSelector`] is `metav1.LabelSelector` (matching and its `?labelSelector=` query form),
//! [`InferencePool`] reads both the `inference.networking.k8s.io/v1` and the older
//! `inference.networking.x-k8s.io/v1alpha2` shapes, [`PodTracker`] folds a list plus a watch
//! stream into the set of ready pod addresses, and [`LineDecoder`] splits a chunked watch body
//! into JSON lines.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::{DiscoveredEndpoints, EndpointTemplate};

/// Why API-server data could not be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KubeError {
    /// The JSON does not have the expected shape.
    #[error("unexpected API-server JSON ({what}): {reason}")]
    Json {
        /// Which object was being read.
        what: &'static str,
        /// serde's message.
        reason: String,
    },
    /// The watch's resourceVersion is too old (HTTP 410 Gone): list again.
    #[error("watch expired (410 Gone): {0}")]
    Gone(String),
    /// The API server sent an ERROR event other than 410.
    #[error("watch error {code}: {message}")]
    WatchStatus {
        /// `Status.code`.
        code: u16,
        /// `Status.message`.
        message: String,
    },
    /// A selector requirement uses an operator Kubernetes does not define, or lacks values.
    #[error("invalid label selector: {0}")]
    BadSelector(String),
    /// The InferencePool names no selector or no target port.
    #[error("InferencePool {name}: {reason}")]
    BadPool {
        /// The pool's name.
        name: String,
        /// What is missing.
        reason: String,
    },
    /// One watch line exceeded the size limit (a broken or hostile stream).
    #[error("watch line longer than {0} bytes")]
    LineTooLong(usize),
}

fn json_err(what: &'static str) -> impl FnOnce(serde_json::Error) -> KubeError {
    move |e| KubeError::Json {
        what,
        reason: e.to_string(),
    }
}

/// `metav1.ObjectMeta`, the fields discovery needs.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// Object name.
    #[serde(default)]
    pub name: String,
    /// Namespace (empty for cluster-scoped objects and bookmarks).
    #[serde(default)]
    pub namespace: String,
    /// Version for optimistic concurrency and for resuming watches.
    #[serde(default)]
    pub resource_version: String,
    /// Labels matched by selectors.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Set once the pod is terminating: it must stop receiving new requests.
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
}

/// `metav1.ListMeta`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListMeta {
    /// Where a watch that follows this list starts.
    #[serde(default)]
    pub resource_version: String,
}

/// `corev1.PodCondition`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PodCondition {
    /// `Ready`, `ContainersReady`, `PodScheduled`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
}

/// `corev1.PodStatus`, the fields discovery needs.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// `Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`.
    #[serde(default)]
    pub phase: String,
    /// The pod's primary IP, absent until the sandbox has a network.
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
    /// Readiness and friends.
    #[serde(default)]
    pub conditions: Vec<PodCondition>,
}

/// `corev1.Pod`, the fields discovery needs.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Pod {
    /// Name, namespace, labels, resourceVersion, deletionTimestamp.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// Phase, IP, conditions.
    #[serde(default)]
    pub status: PodStatus,
}

impl Pod {
    /// `namespace/name`: the identity a watch event refers to.
    pub fn key(&self) -> String {
        format!("{}/{}", self.metadata.namespace, self.metadata.name)
    }

    /// The pod IP when the pod should receive traffic: running, Ready=True, not terminating.
    ///
    /// This is the rule an EndpointSlice controller applies for `ready` endpoints; a pod whose
    /// readiness probe fails (vLLM still loading weights) or that is being deleted is skipped.
    pub fn ready_ip(&self) -> Option<IpAddr> {
        if self.metadata.deletion_timestamp.is_some() || self.status.phase != "Running" {
            return None;
        }
        let ready = self
            .status
            .conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True");
        if !ready {
            return None;
        }
        self.status.pod_ip.as_deref()?.parse().ok()
    }
}

/// `corev1.PodList`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct PodList {
    /// Carries the resourceVersion the following watch starts from.
    #[serde(default)]
    pub metadata: ListMeta,
    /// The pods.
    #[serde(default)]
    pub items: Vec<Pod>,
}

impl PodList {
    /// Parses a `GET .../pods` answer.
    pub fn from_json(bytes: &[u8]) -> Result<Self, KubeError> {
        serde_json::from_slice(bytes).map_err(json_err("PodList"))
    }
}

/// `metav1.Status`, as carried by watch ERROR events.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Status {
    /// HTTP-like code: 410 means the resourceVersion is gone.
    #[serde(default)]
    pub code: u16,
    /// Human-readable reason.
    #[serde(default)]
    pub message: String,
}

/// One line of a watch stream (`metav1.WatchEvent` with a Pod or Status object).
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent {
    /// A pod appeared in the selection.
    Added(Pod),
    /// A pod changed (IP, readiness, deletionTimestamp, labels).
    Modified(Pod),
    /// A pod left the selection or was deleted.
    Deleted(Pod),
    /// Progress marker: only the resourceVersion is meaningful.
    Bookmark(String),
    /// The server ended the watch with a Status.
    Error(Status),
}

#[derive(Deserialize)]
struct RawWatchEvent {
    #[serde(rename = "type")]
    kind: String,
    object: serde_json::Value,
}

impl WatchEvent {
    /// Parses one JSON line of a watch response.
    pub fn from_json(line: &[u8]) -> Result<Self, KubeError> {
        let raw: RawWatchEvent = serde_json::from_slice(line).map_err(json_err("WatchEvent"))?;
        let pod = |v: serde_json::Value| -> Result<Pod, KubeError> {
            serde_json::from_value(v).map_err(json_err("WatchEvent.object (Pod)"))
        };
        Ok(match raw.kind.as_str() {
            "ADDED" => Self::Added(pod(raw.object)?),
            "MODIFIED" => Self::Modified(pod(raw.object)?),
            "DELETED" => Self::Deleted(pod(raw.object)?),
            "BOOKMARK" => Self::Bookmark(pod(raw.object)?.metadata.resource_version),
            "ERROR" => Self::Error(
                serde_json::from_value(raw.object)
                    .map_err(json_err("WatchEvent.object (Status)"))?,
            ),
            other => {
                return Err(KubeError::Json {
                    what: "WatchEvent",
                    reason: format!("unknown event type {other:?}"),
                });
            }
        })
    }
}

/// One `matchExpressions` entry of a `metav1.LabelSelector`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabelSelectorRequirement {
    /// The label key.
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: String,
    /// Values for `In`/`NotIn` (must be empty for `Exists`/`DoesNotExist`).
    #[serde(default)]
    pub values: Vec<String>,
}

/// `metav1.LabelSelector`: which pods are vLLM replicas of this pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    /// Every key must have exactly this value.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    /// Every requirement must hold.
    #[serde(default)]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

impl LabelSelector {
    /// A selector of exact label matches.
    pub fn from_labels(labels: BTreeMap<String, String>) -> Self {
        Self {
            match_labels: labels,
            match_expressions: Vec::new(),
        }
    }

    /// True when the selector selects nothing in particular (it would match every pod).
    pub fn is_empty(&self) -> bool {
        self.match_labels.is_empty() && self.match_expressions.is_empty()
    }

    /// Rejects operators Kubernetes does not know and value lists that contradict them.
    pub fn validate(&self) -> Result<(), KubeError> {
        for r in &self.match_expressions {
            match (r.operator.as_str(), r.values.is_empty()) {
                ("In" | "NotIn", false) | ("Exists" | "DoesNotExist", true) => {}
                ("In" | "NotIn", true) => {
                    return Err(KubeError::BadSelector(format!(
                        "{} {} needs values",
                        r.key, r.operator
                    )));
                }
                ("Exists" | "DoesNotExist", false) => {
                    return Err(KubeError::BadSelector(format!(
                        "{} {} takes no values",
                        r.key, r.operator
                    )));
                }
                (op, _) => {
                    return Err(KubeError::BadSelector(format!(
                        "{}: unknown operator {op:?}",
                        r.key
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether a pod with these labels is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.get(&r.key);
                match r.operator.as_str() {
                    "In" => value.is_some_and(|v| r.values.contains(v)),
                    "NotIn" => value.is_none_or(|v| !r.values.contains(v)),
                    "Exists" => value.is_some(),
                    "DoesNotExist" => value.is_none(),
                    _ => false,
                }
            })
    }

    /// The `labelSelector` query value (`a=b,c in (d,e),!f`), not yet percent-encoded.
    pub fn to_query(&self) -> String {
        let mut parts: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        for r in &self.match_expressions {
            let mut values = r.values.clone();
            values.sort();
            parts.push(match r.operator.as_str() {
                "In" => format!("{} in ({})", r.key, values.join(",")),
                "NotIn" => format!("{} notin ({})", r.key, values.join(",")),
                "Exists" => r.key.clone(),
                _ => format!("!{}", r.key),
            });
        }
        parts.join(",")
    }
}

/// What discovery needs from an InferencePool: its pod selector and the serving port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferencePool {
    /// Pool name.
    pub name: String,
    /// Which pods serve the pool.
    pub selector: LabelSelector,
    /// The model server port on those pods (the first target port).
    pub target_port: u16,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPool {
    #[serde(default)]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: RawPoolSpec,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawPoolSpec {
    /// v1: `{matchLabels: {...}}`; v1alpha2: a plain label map.
    #[serde(default)]
    selector: Option<serde_json::Value>,
    /// v1: `[{number: 8000}]`.
    #[serde(default)]
    target_ports: Vec<RawPort>,
    /// v1alpha2.
    #[serde(default)]
    target_port_number: Option<u16>,
}

#[derive(Deserialize)]
struct RawPort {
    number: u16,
}

impl InferencePool {
    /// Parses a `GET .../inferencepools/{name}` answer (v1 or v1alpha2).
    pub fn from_json(bytes: &[u8]) -> Result<Self, KubeError> {
        let raw: RawPool = serde_json::from_slice(bytes).map_err(json_err("InferencePool"))?;
        let name = raw.metadata.name;
        let bad = |reason: &str| KubeError::BadPool {
            name: name.clone(),
            reason: reason.to_string(),
        };
        let selector = match raw.spec.selector {
            None => return Err(bad("spec.selector is missing")),
            Some(v) if v.get("matchLabels").is_some() || v.get("matchExpressions").is_some() => {
                serde_json::from_value::<LabelSelector>(v).map_err(|e| bad(&e.to_string()))?
            }
            Some(v) => LabelSelector::from_labels(
                serde_json::from_value(v).map_err(|e| bad(&e.to_string()))?,
            ),
        };
        if selector.is_empty() {
            return Err(bad("spec.selector is empty (it would select every pod)"));
        }
        selector.validate()?;
        let target_port = raw
            .spec
            .target_ports
            .first()
            .map(|p| p.number)
            .or(raw.spec.target_port_number)
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("spec.targetPorts / spec.targetPortNumber is missing"))?;
        Ok(Self {
            name,
            selector,
            target_port,
        })
    }
}

/// Pod label carrying a replica's prefill/decode role (llm-d's convention).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// Folds a pod list and the watch events after it into the current endpoint set.
///
/// Keyed by `namespace/name`, so a pod that is re-created with a new IP replaces its old address,
/// and a DELETED event for an unknown pod is harmless. The selector is re-checked on every event
/// because a MODIFIED pod can change labels and leave the pool.
#[derive(Debug, Clone)]
pub struct PodTracker {
    selector: LabelSelector,
    template: EndpointTemplate,
    pods: BTreeMap<String, Pod>,
    resource_version: String,
}

/// What one watch event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The endpoint set may have changed (compare [`PodTracker::endpoints`]).
    Changed,
    /// Only the resourceVersion moved.
    Progress,
}

impl PodTracker {
    /// Tracks pods matching `selector`; `template` turns a ready pod's IP into an endpoint.
    pub fn new(selector: LabelSelector, template: EndpointTemplate) -> Self {
        Self {
            selector,
            template,
            pods: BTreeMap::new(),
            resource_version: String::new(),
        }
    }

    /// Replaces everything with a fresh list (after start, a 410, or a dropped watch).
    pub fn reset(&mut self, list: PodList) {
        self.pods.clear();
        for pod in list.items {
            if self.selector.matches(&pod.metadata.labels) {
                self.pods.insert(pod.key(), pod);
            }
        }
        self.resource_version = list.metadata.resource_version;
    }

    /// Applies one watch event; `Err(Gone)` means list again, other errors mean re-watch.
    pub fn apply(&mut self, event: WatchEvent) -> Result<Applied, KubeError> {
        match event {
            WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                self.note_version(&pod);
                if self.selector.matches(&pod.metadata.labels) {
                    self.pods.insert(pod.key(), pod);
                } else {
                    self.pods.remove(&pod.key());
                }
                Ok(Applied::Changed)
            }
            WatchEvent::Deleted(pod) => {
                self.note_version(&pod);
                self.pods.remove(&pod.key());
                Ok(Applied::Changed)
            }
            WatchEvent::Bookmark(rv) => {
                if !rv.is_empty() {
                    self.resource_version = rv;
                }
                Ok(Applied::Progress)
            }
            WatchEvent::Error(status) if status.code == 410 => Err(KubeError::Gone(status.message)),
            WatchEvent::Error(status) => Err(KubeError::WatchStatus {
                code: status.code,
                message: status.message,
            }),
        }
    }

    fn note_version(&mut self, pod: &Pod) {
        if !pod.metadata.resource_version.is_empty() {
            self.resource_version = pod.metadata.resource_version.clone();
        }
    }

    /// Where the next watch resumes.
    pub fn resource_version(&self) -> &str {
        &self.resource_version
    }

    /// Ready pods as endpoints, keyed by canonical `ip:port` (what Envoy's override_host matches),
    /// with the prefill/decode role of their `llm-d.ai/role` label.
    pub fn endpoints(&self) -> DiscoveredEndpoints {
        self.pods
            .values()
            .filter_map(|pod| Some((pod, pod.ready_ip()?)))
            .flat_map(|(pod, ip)| {
                let role = pod
                    .metadata
                    .labels
                    .get(ROLE_LABEL)
                    .and_then(|v| scorer_core::disagg::EndpointRole::from_label(v));
                self.template
                    .endpoints(ip, &pod.key())
                    .into_iter()
                    .map(move |e| (e.address.clone(), super::DiscoveredEndpoint { role, ..e }))
            })
            .collect()
    }

    /// Names of tracked pods, ready or not (for logs and tests).
    pub fn pod_names(&self) -> BTreeSet<String> {
        self.pods.keys().cloned().collect()
    }
}

/// Splits a chunked watch body into complete lines, bounding how much one line may buffer.
#[derive(Debug)]
pub struct LineDecoder {
    buf: Vec<u8>,
    max_line: usize,
}

impl LineDecoder {
    /// A decoder refusing lines longer than `max_line` bytes.
    pub fn new(max_line: usize) -> Self {
        Self {
            buf: Vec::new(),
            max_line,
        }
    }

    /// Feeds one body chunk; returns every line it completed (without the newline, blank lines
    /// skipped).
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, KubeError> {
        let mut lines = Vec::new();
        let mut rest = chunk;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            self.buf.extend_from_slice(&rest[..i]);
            rest = &rest[i + 1..];
            let line = std::mem::take(&mut self.buf);
            if line.len() > self.max_line {
                return Err(KubeError::LineTooLong(self.max_line));
            }
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push(line);
            }
        }
        self.buf.extend_from_slice(rest);
        if self.buf.len() > self.max_line {
            return Err(KubeError::LineTooLong(self.max_line));
        }
        Ok(lines)
    }

    /// The unterminated tail when the stream ends (a last event without a newline).
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let line = std::mem::take(&mut self.buf);
        (!line.iter().all(u8::is_ascii_whitespace)).then_some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD_LIST: &str = include_str!("testdata/podlist.json");
    const WATCH_CHURN: &str = include_str!("testdata/watch-churn.jsonl");
    const POOL_V1: &str = include_str!("testdata/inferencepool-v1.json");
    const POOL_V1ALPHA2: &str = include_str!("testdata/inferencepool-v1alpha2.json");

    fn template(kv_events_port: Option<u16>) -> EndpointTemplate {
        EndpointTemplate {
            port: 8000,
            kv_events_port,
            kv_events_replay_port: kv_events_port.map(|p| p + 1),
            model: Some("llama3".into()),
            data_parallel_size: None,
        }
    }

    fn vllm_selector() -> LabelSelector {
        LabelSelector::from_labels([("app".to_string(), "vllm-llama3".to_string())].into())
    }

    fn addresses(set: &DiscoveredEndpoints) -> Vec<&str> {
        set.keys().map(String::as_str).collect()
    }

    #[test]
    fn pod_list_keeps_only_ready_selected_pods() {
        let list = PodList::from_json(POD_LIST.as_bytes()).unwrap();
        assert_eq!(list.metadata.resource_version, "4711");
        assert_eq!(list.items.len(), 5);
        let mut t = PodTracker::new(vllm_selector(), template(Some(5557)));
        t.reset(list);
        // vllm-2 is still loading (Ready=False), vllm-3 is Pending without an IP, the
        // prometheus pod carries other labels.
        assert_eq!(
            t.pod_names().into_iter().collect::<Vec<_>>(),
            vec![
                "llm/vllm-llama3-0",
                "llm/vllm-llama3-1",
                "llm/vllm-llama3-2",
                "llm/vllm-llama3-3"
            ]
        );
        let eps = t.endpoints();
        assert_eq!(addresses(&eps), vec!["10.244.1.17:8000", "10.244.2.9:8000"]);
        let e = &eps["10.244.1.17:8000"];
        crate::discovery::assert_publishes_on(e, "10.244.1.17");
        assert_eq!(e.model.as_deref(), Some("llama3"));
        assert_eq!(e.name.as_deref(), Some("llm/vllm-llama3-0"));
        assert_eq!(t.resource_version(), "4711");
    }

    /// The recorded stream: vllm-2 turns ready, vllm-0 is deleted (terminating, then gone),
    /// vllm-0 comes back with a new IP, a bookmark, vllm-1 is relabelled out of the pool, and
    /// finally the server expires the watch with 410.
    #[test]
    fn the_llm_d_role_label_gives_the_endpoint_its_role() {
        let mut list: serde_json::Value = serde_json::from_str(POD_LIST).unwrap();
        for item in list["items"].as_array_mut().unwrap() {
            if item["metadata"]["name"] == "vllm-llama3-0" {
                item["metadata"]["labels"][ROLE_LABEL] = "prefill".into();
            }
        }
        let mut t = PodTracker::new(vllm_selector(), template(None));
        t.reset(PodList::from_json(list.to_string().as_bytes()).unwrap());
        let roles: Vec<_> = t
            .endpoints()
            .into_values()
            .map(|e| (e.name.unwrap(), e.role))
            .collect();
        assert!(
            roles.contains(&(
                "llm/vllm-llama3-0".into(),
                Some(scorer_core::disagg::EndpointRole::Prefill)
            )),
            "{roles:?}"
        );
        assert!(
            roles.iter().filter(|(_, r)| r.is_none()).count() >= 1,
            "{roles:?}"
        );
    }

    #[test]
    fn watch_with_pod_churn() {
        let mut t = PodTracker::new(vllm_selector(), template(None));
        t.reset(PodList::from_json(POD_LIST.as_bytes()).unwrap());
        let mut decoder = LineDecoder::new(1 << 20);
        // Feed the stream in awkward chunks, as a chunked HTTP body arrives.
        let mut lines = Vec::new();
        for chunk in WATCH_CHURN.as_bytes().chunks(37) {
            lines.extend(decoder.push(chunk).unwrap());
        }
        lines.extend(decoder.finish());
        let mut history = vec![addresses(&t.endpoints()).join(" ")];
        let mut outcome = None;
        for line in lines {
            match t.apply(WatchEvent::from_json(&line).unwrap()) {
                Ok(Applied::Changed) => history.push(addresses(&t.endpoints()).join(" ")),
                Ok(Applied::Progress) => {}
                Err(e) => {
                    outcome = Some(e);
                    break;
                }
            }
        }
        assert_eq!(
            history,
            vec![
                "10.244.1.17:8000 10.244.2.9:8000",
                // vllm-2 becomes Ready.
                "10.244.1.17:8000 10.244.2.9:8000 10.244.3.4:8000",
                // vllm-0 gets a deletionTimestamp: out at once, before its DELETED event.
                "10.244.2.9:8000 10.244.3.4:8000",
                "10.244.2.9:8000 10.244.3.4:8000",
                // vllm-0 re-created: scheduled without IP, then running but not ready, then ready.
                "10.244.2.9:8000 10.244.3.4:8000",
                "10.244.2.9:8000 10.244.3.4:8000",
                "10.244.1.23:8000 10.244.2.9:8000 10.244.3.4:8000",
                // vllm-1's labels change: it leaves the pool.
                "10.244.1.23:8000 10.244.3.4:8000",
            ]
        );
        assert_eq!(t.resource_version(), "4790");
        assert!(matches!(outcome, Some(KubeError::Gone(_))), "{outcome:?}");
    }

    #[test]
    fn watch_event_errors_are_typed() {
        let e = WatchEvent::from_json(
            br#"{"type":"ERROR","object":{"kind":"Status","code":500,"message":"boom"}}"#,
        )
        .unwrap();
        let mut t = PodTracker::new(vllm_selector(), template(None));
        assert_eq!(
            t.apply(e),
            Err(KubeError::WatchStatus {
                code: 500,
                message: "boom".into()
            })
        );
        assert!(WatchEvent::from_json(b"{not json").is_err());
        let unknown = WatchEvent::from_json(br#"{"type":"SHRUGGED","object":{}}"#).unwrap_err();
        assert!(unknown.to_string().contains("SHRUGGED"), "{unknown}");
        assert!(WatchEvent::from_json(br#"{"type":"ADDED","object":{"metadata":7}}"#).is_err());
    }

    #[test]
    fn ipv6_pods_get_bracketed_addresses() {
        let pod: Pod = serde_json::from_str(
            r#"{"metadata":{"name":"v6","namespace":"llm","labels":{"app":"vllm-llama3"}},
                "status":{"phase":"Running","podIP":"fd00:10:244::5",
                          "conditions":[{"type":"Ready","status":"True"}]}}"#,
        )
        .unwrap();
        let mut t = PodTracker::new(vllm_selector(), template(Some(5557)));
        t.apply(WatchEvent::Added(pod)).unwrap();
        let eps = t.endpoints();
        assert_eq!(addresses(&eps), vec!["[fd00:10:244::5]:8000"]);
        assert_eq!(
            eps["[fd00:10:244::5]:8000"].kv_events.as_deref(),
            Some("tcp://[fd00:10:244::5]:5557")
        );
    }

    #[test]
    fn selectors_match_and_render_like_kubectl() {
        let s: LabelSelector = serde_json::from_str(
            r#"{"matchLabels":{"app":"vllm"},
                "matchExpressions":[{"key":"tier","operator":"In","values":["gpu","big"]},
                                    {"key":"canary","operator":"DoesNotExist"},
                                    {"key":"zone","operator":"NotIn","values":["b"]},
                                    {"key":"model","operator":"Exists"}]}"#,
        )
        .unwrap();
        s.validate().unwrap();
        assert_eq!(
            s.to_query(),
            "app=vllm,tier in (big,gpu),!canary,zone notin (b),model"
        );
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(s.matches(&labels(&[("app", "vllm"), ("tier", "gpu"), ("model", "x")])));
        assert!(!s.matches(&labels(&[("app", "vllm"), ("tier", "cpu"), ("model", "x")])));
        assert!(!s.matches(&labels(&[
            ("app", "vllm"),
            ("tier", "gpu"),
            ("model", "x"),
            ("canary", "1")
        ])));
        assert!(!s.matches(&labels(&[
            ("app", "vllm"),
            ("tier", "gpu"),
            ("model", "x"),
            ("zone", "b")
        ])));
        assert!(!s.matches(&labels(&[("app", "vllm"), ("tier", "gpu")])));
        for bad in [
            r#"{"matchExpressions":[{"key":"a","operator":"In"}]}"#,
            r#"{"matchExpressions":[{"key":"a","operator":"Exists","values":["x"]}]}"#,
            r#"{"matchExpressions":[{"key":"a","operator":"Like","values":["x"]}]}"#,
        ] {
            let s: LabelSelector = serde_json::from_str(bad).unwrap();
            assert!(s.validate().is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<LabelSelector>(r#"{"matchLabel":{}}"#).is_err());
    }

    #[test]
    fn inference_pools_of_both_api_versions() {
        let v1 = InferencePool::from_json(POOL_V1.as_bytes()).unwrap();
        assert_eq!(v1.name, "vllm-llama3");
        assert_eq!(v1.target_port, 8000);
        assert_eq!(v1.selector.to_query(), "app=vllm-llama3");
        let old = InferencePool::from_json(POOL_V1ALPHA2.as_bytes()).unwrap();
        assert_eq!(old.target_port, 8000);
        assert_eq!(old.selector, v1.selector);
        let no_selector = br#"{"metadata":{"name":"p"},"spec":{"targetPorts":[{"number":1}]}}"#;
        assert!(
            InferencePool::from_json(no_selector)
                .unwrap_err()
                .to_string()
                .contains("selector")
        );
        let empty = br#"{"metadata":{"name":"p"},"spec":{"selector":{"matchLabels":{}},"targetPorts":[{"number":1}]}}"#;
        assert!(InferencePool::from_json(empty).is_err());
        let no_port = br#"{"metadata":{"name":"p"},"spec":{"selector":{"matchLabels":{"a":"b"}}}}"#;
        assert!(
            InferencePool::from_json(no_port)
                .unwrap_err()
                .to_string()
                .contains("targetPorts")
        );
    }

    #[test]
    fn line_decoder_bounds_memory() {
        let mut d = LineDecoder::new(8);
        assert_eq!(d.push(b"abc\n\n de").unwrap(), vec![b"abc".to_vec()]);
        assert_eq!(d.push(b"f\nxy").unwrap(), vec![b" def".to_vec()]);
        assert_eq!(d.finish(), Some(b"xy".to_vec()));
        assert_eq!(d.finish(), None);
        assert_eq!(d.push(b"123456789"), Err(KubeError::LineTooLong(8)));
    }
}
