//! What each replica serves: its models (vLLM `GET /v1/models`: base models and LoRA adapters
//! with their `parent`) and its loaded adapters (the `vllm:lora_requests_info` gauge).
//!
//! Both parsers are pure; the scrape loop fetches and feeds them. A configured `model` /
//! `models` of an endpoint is part of its catalogue even before (or without) polling.

use std::borrow::Cow;

use scorer_core::lora::LoraState;
use scorer_core::pools::ServedModel;

pub use crate::prom::LORA_INFO;
use crate::prom::samples_named;
pub use vllm_wire::models::{ModelsError, parse_models};

/// The catalogue of one endpoint: configured names first, then polled ones not already there.
pub fn merge_catalogue(configured: &[String], polled: Option<&[ServedModel]>) -> Vec<ServedModel> {
    let mut out: Vec<ServedModel> = configured
        .iter()
        .map(|id| ServedModel {
            id: id.clone(),
            parent: None,
            max_model_len: None,
        })
        .collect();
    for m in polled.unwrap_or_default() {
        match out.iter_mut().find(|o| o.id == m.id) {
            Some(o) => {
                o.parent = m.parent.clone();
                o.max_model_len = m.max_model_len;
            }
            None => out.push(m.clone()),
        }
    }
    out
}

fn split_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Reads the newest `vllm:lora_requests_info` series of a `/metrics` body (`None`: absent,
/// which vLLM does until an adapter is used, or malformed).
pub fn parse_lora_info(text: &str) -> Option<LoraState> {
    let mut best: Option<(f64, LoraState)> = None;
    // Only this series' lines are parsed (the scraper reads every page through here).
    for sample in samples_named(text, &[LORA_INFO]) {
        let Ok(sample) = sample else { continue };
        let label = |name: &str| -> Cow<'_, str> {
            sample
                .label(name)
                .ok()
                .flatten()
                .unwrap_or(Cow::Borrowed(""))
        };
        let state = LoraState {
            running: split_list(&label("running_lora_adapters")),
            waiting: split_list(&label("waiting_lora_adapters")),
            max_lora: label("max_lora").trim().parse().unwrap_or(0),
        };
        if best.as_ref().is_none_or(|(t, _)| sample.value >= *t) {
            best = Some((sample.value, state));
        }
    }
    best.map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_names_and_polled_models_merge() {
        let polled = vec![
            ServedModel {
                id: "a".into(),
                parent: None,
                max_model_len: Some(8_192),
            },
            ServedModel {
                id: "a-sql".into(),
                parent: Some("a".into()),
                max_model_len: None,
            },
        ];
        let merged = merge_catalogue(&["a".into(), "alias".into()], Some(&polled));
        let ids: Vec<&str> = merged.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["a", "alias", "a-sql"]);
        assert_eq!(
            merged[0].max_model_len,
            Some(8_192),
            "the polled card's context"
        );
        assert!(merge_catalogue(&[], None).is_empty());
    }

    #[test]
    fn lora_info_newest_series_wins() {
        let text = "# TYPE vllm:lora_requests_info gauge\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 100\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,chat\",waiting_lora_adapters=\"x\"} 200\n";
        let s = parse_lora_info(text).unwrap();
        assert_eq!(s.running, ["sql", "chat"]);
        assert_eq!(s.waiting, ["x"]);
        assert_eq!(s.max_lora, 2);
        assert_eq!(parse_lora_info("vllm:num_requests_running 1\n"), None);
        // A bad max_lora label is read as "no limit known", not an error.
        let s = parse_lora_info(
            "vllm:lora_requests_info{max_lora=\"x\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1\n",
        )
        .unwrap();
        assert_eq!(s, LoraState::default());
    }
}

/// `/metrics` of model pools, session affinity, LoRA adapters and offload tiers, read from the
/// router at scrape time.
#[derive(Debug)]
pub struct FleetFeaturesCollector(pub std::sync::Arc<crate::state::State>);

impl prometheus_client::collector::Collector for FleetFeaturesCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::gauge::ConstGauge;

        let f = self.0.fleet_features();
        labelled_counters(
            &mut encoder,
            "sessions",
            "Routed requests with a session key, by result: hit (kept on its replica), miss \
             (new or expired session), broken (moved: replica gone, overloaded or worse)",
            "result",
            [
                ("hit", f.sessions.hits),
                ("miss", f.sessions.misses),
                ("broken", f.sessions.broken),
            ],
        )?;
        ConstGauge::new(f.sessions_remembered as i64).encode(encoder.encode_descriptor(
            "sessions_remembered",
            "Sessions whose replica the router remembers now",
            None,
            MetricType::Gauge,
        )?)?;
        ConstGauge::new(f.session_return_share).encode(encoder.encode_descriptor(
            "session_return_share",
            "Learned share of recent sessions whose second request came within \
             sessions.return_within_ms: what the session-start charge is scaled by",
            None,
            MetricType::Gauge,
        )?)?;
        labelled_counters(
            &mut encoder,
            "stored_responses",
            "Requests naming a stored response (previous_response_id, GET or cancel by id), by \
             result: pinned (sent to the replica that stored it), unknown (no report placed it), \
             unavailable (its replica is not usable now)",
            "result",
            f.stored_responses,
        )?;
        ConstGauge::new(f.stored_responses_remembered as i64)
            .encode(encoder.encode_descriptor(
            "stored_responses_remembered",
            "Response ids whose replica the router remembers now (router.responses.max_entries)",
            None,
            MetricType::Gauge,
        )?)?;
        labelled_counters(
            &mut encoder,
            "unknown_model",
            "Requests for a model no endpoint serves, by action (rejected with 404, passed through)",
            "action",
            [
                ("rejected", f.pools.unknown_model_rejected),
                ("passed", f.pools.unknown_model_passed),
            ],
        )?;
        labelled_counters(
            &mut encoder,
            "context_length",
            "Requests this control plane routed that were longer than some endpoint's context \
             (max_model_len in /v1/models), by action: narrowed (sent only where it fits), \
             exceeded (fits nowhere: routed by load, its prompt credited to no endpoint, since \
             every engine refuses it); proxies deciding locally apply the rule uncounted",
            "action",
            [
                ("narrowed", f.pools.context_narrowed),
                ("exceeded", f.pools.context_exceeded),
            ],
        )?;
        type Getter = fn(&crate::state::EndpointFeatures) -> Option<f64>;
        let per_endpoint: [(&str, &str, Getter); 5] = [
            (
                "endpoint_models",
                "Models (base and LoRA adapters) the endpoint serves, from config and /v1/models",
                |e| e.models.map(|n| n as f64),
            ),
            (
                "endpoint_max_model_len",
                "The longest context the endpoint's /v1/models cards give (max_model_len)",
                |e| e.max_model_len.map(f64::from),
            ),
            (
                "endpoint_lora_running",
                "LoRA adapters of the endpoint's running requests (vllm:lora_requests_info)",
                |e| e.lora_running.map(|n| n as f64),
            ),
            (
                "endpoint_lora_waiting",
                "LoRA adapters of the endpoint's waiting requests (vllm:lora_requests_info)",
                |e| e.lora_waiting.map(|n| n as f64),
            ),
            (
                "endpoint_max_lora",
                "LoRA adapter slots of the endpoint (max_lora of vllm:lora_requests_info)",
                |e| e.max_lora.map(f64::from),
            ),
        ];
        crate::telemetry::endpoint_gauges(
            &mut encoder,
            &f.endpoints,
            |e| &e.address,
            &per_endpoint,
        )?;
        // GPU blocks are `endpoint_precise_blocks`; this adds the offload tiers per endpoint and
        // both tiers fleet-wide, so a dashboard can compare them.
        let snapshot = self.0.snapshot();
        let gpu: usize = snapshot.endpoints.iter().map(|e| e.precise_blocks).sum();
        let offload: usize = f.endpoints.iter().map(|e| e.offload_blocks).sum();
        let mut family = encoder.encode_descriptor(
            "indexed_blocks",
            "Blocks the KV-event index holds fleet-wide, by tier (gpu; offload = CPU or storage)",
            None,
            MetricType::Gauge,
        )?;
        for (tier, v) in [("gpu", gpu), ("offload", offload)] {
            ConstGauge::new(v as i64).encode(family.encode_family(&[("tier", tier)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "endpoint_offload_blocks",
            "Blocks the endpoint's KV events put in a CPU or storage tier",
            None,
            MetricType::Gauge,
        )?;
        for e in &f.endpoints {
            let labels = [("endpoint", e.address.as_str())];
            ConstGauge::new(e.offload_blocks as i64).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Writes one counter family of [`FleetFeaturesCollector`] whose samples differ by one label:
/// a `label=value` sample per `(value, count)` of `samples`, in order.
fn labelled_counters<const N: usize>(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    samples: [(&str, u64); N],
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::MetricType;
    use prometheus_client::metrics::counter::ConstCounter;

    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (value, count) in samples {
        ConstCounter::new(count).encode(family.encode_family(&[(label, value)])?)?;
    }
    Ok(())
}
