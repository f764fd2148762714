#!/usr/bin/env python3
"""Writes a /metrics payload shaped like vLLM 0.33's, for the control plane's scale benchmark.

No GPU here, so no real vLLM to record from. Instead this reads vLLM's own metric definitions
from its wheel (``vllm/v1/metrics/loggers.py``: every ``vllm:*`` gauge, counter and histogram
with its label names; ``vllm/v1/metrics/buckets.py``: every bucket family) and registers the
same metrics with ``prometheus_client`` (what vLLM uses) in a registry that also holds the
default process, platform and GC collectors, as vLLM's does. Each histogram gets a few
observations so its buckets carry counts, and labels get the values vLLM emits for one engine
of one model. The result has vLLM's series, bucket boundaries and label sets, so its size and
parse cost are the real payload's; the values are not a real workload's.

Metrics that vLLM registers only with options off by default (speculative decoding, KV
connectors, the KV-residency histograms of ``kv_cache_metrics``) are left out, as a default
``vllm serve`` leaves them out.

    pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel
    python3 -m venv /tmp/promvenv && /tmp/promvenv/bin/pip install prometheus_client
    /tmp/promvenv/bin/python scripts/vllm_metrics_payload.py \\
        --wheel /tmp/vllmwheel/vllm-0.33.0-*.whl > tests/bench/fixtures/vllm-0.33-metrics.txt

``--render-cost NAMES`` prints instead what rendering the page costs the replica, whole and
restricted to the control plane's series (docs/BENCHMARKS.md has the command).
"""

import argparse
import ast
import glob
import sys
import zipfile

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import gc_collector, platform_collector, process_collector

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MAX_MODEL_LEN = 131072
# Values vLLM gives the extra label of each labelled family (one engine, one model).
EXTRA_LABEL_VALUES = {
    "finished_reason": ["stop", "length", "abort", "error", "repetition"],
    "sleep_state": ["awake", "weights_offloaded", "discard_all"],
    "source": ["local_compute", "local_cache_hit", "external_kv_transfer"],
    "reason": ["capacity", "deferred"],
    "stage": ["waiting", "running"],
    "status": ["ok"],
}
OPTIONAL = ("vllm:kv_block_",)
# Labels of the two info-style gauges, whose label names loggers.py computes at run time:
# `lora_requests_info` (LoRA stats) and `cache_config_info` (CacheConfig.metrics_info(), a
# representative subset of its keys with a default serve's values).
LORA_LABELS = {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}
CACHE_CONFIG_LABELS = {
    "block_size": "16",
    "cache_dtype": "auto",
    "calculate_kv_scales": "False",
    "cpu_offload_gb": "0",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "is_attention_free": "False",
    "kv_sharing_fast_prefill": "False",
    "mamba_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks": "29127",
    "num_gpu_blocks_override": "None",
    "prefix_caching_hash_algo": "sha256",
    "sliding_window": "None",
    "swap_space": "4",
    "engine": "0",
}
GAUGE_VALUES = {"vllm:kv_cache_usage_perc": 0.42, "vllm:num_requests_waiting": 1}


def bucket_families(source):
    """Family name -> bucket tuple, by evaluating buckets.py's literal tuples."""
    tree = ast.parse(source)
    consts = {}
    for node in tree.body:
        target = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        if target and target.endswith("_BUCKETS") and isinstance(value, ast.Tuple):
            consts[target] = tuple(ast.literal_eval(value))
    families = {k.removesuffix("_BUCKETS").lower(): v for k, v in consts.items()}
    tokens, exponent = [], 0
    while True:
        values = [m * 10**exponent for m in (1, 2, 5)]
        tokens += [v for v in values if v <= MAX_MODEL_LEN]
        if values[-1] > MAX_MODEL_LEN:
            break
        exponent += 1
    families["request_tokens"] = tuple(tokens)
    return families


def metric_definitions(source):
    """(kind, name, documentation, extra label, bucket family) for every vllm:* metric."""
    tree = ast.parse(source)
    # Which local variable holds which bucket family: `x = histogram_buckets("family", ...)`.
    var_family = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "histogram_buckets"
            and isinstance(node.targets[0], ast.Name)
        ):
            var_family[node.targets[0].id] = node.value.args[0].value
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        kind = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
        kind = kind.get(node.func.attr)
        if kind is None:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if not isinstance(name, ast.Constant) or not str(name.value).startswith("vllm:"):
            continue
        doc = kw.get("documentation")
        doc = doc.value if isinstance(doc, ast.Constant) and isinstance(doc.value, str) else ""
        extra = None
        labels = kw.get("labelnames")
        if isinstance(labels, ast.BinOp) and isinstance(labels.right, ast.List):
            first = labels.right.elts[0]
            extra = first.value if isinstance(first, ast.Constant) else "reason"
        elif isinstance(labels, ast.List):
            names = [e.value if isinstance(e, ast.Constant) else "reason" for e in labels.elts]
            extra = next((n for n in names if n not in ("model_name", "engine")), None)
            if "engine" not in names:
                extra = ("no_engine", extra)
        family = None
        if isinstance(kw.get("buckets"), ast.Name):
            family = var_family.get(kw["buckets"].id)
        out.append((kind, name.value, doc, extra, family))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", required=True, help="the vllm==0.33.0 wheel (glob allowed)")
    ap.add_argument("--render-cost", metavar="NAMES",
                    help="instead of the page, print what rendering it costs, whole and "
                         "restricted to these comma-separated sample names (the control "
                         "plane's: vllm_wire::prom::SCRAPED_SERIES)")
    args = ap.parse_args()
    wheel = sorted(glob.glob(args.wheel))[0]
    with zipfile.ZipFile(wheel) as z:
        loggers = z.read("vllm/v1/metrics/loggers.py").decode()
        buckets = z.read("vllm/v1/metrics/buckets.py").decode()
    families = bucket_families(buckets)
    registry = CollectorRegistry()
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
    seen = {"vllm:lora_requests_info"}
    lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                 list(LORA_LABELS), registry=registry)
    lora.labels(**LORA_LABELS).set(1)
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 list(CACHE_CONFIG_LABELS), registry=registry)
    info.labels(**CACHE_CONFIG_LABELS).set(1)
    for kind, name, doc, extra, family in metric_definitions(loggers):
        if name in seen or name.startswith(OPTIONAL):
            continue
        seen.add(name)
        no_engine = isinstance(extra, tuple)
        if no_engine:
            extra = extra[1]
        base = ["model_name"] if no_engine else ["model_name", "engine"]
        labelnames = base + ([extra] if extra else [])
        base_values = {"model_name": MODEL, "engine": "0"}
        if kind == "histogram":
            metric = Histogram(
                name,
                doc or name,
                labelnames,
                buckets=families[family],
                registry=registry,
            )
        else:
            cls = Gauge if kind == "gauge" else Counter
            metric = cls(name, doc or name, labelnames, registry=registry)
        values = EXTRA_LABEL_VALUES.get(extra, ["x"]) if extra else [None]
        for v in values:
            labels = {k: base_values[k] for k in base}
            if extra:
                labels[extra] = v
            child = metric.labels(**labels)
            if kind == "histogram":
                top = families[family][-1]
                for x in (top / 1000, top / 50, top / 3):
                    child.observe(x)
            elif kind == "counter":
                child.inc(12345)
            else:
                child.set(GAUGE_VALUES.get(name, 3))
    if args.render_cost:
        render_cost(registry, args.render_cost.split(","))
        return
    sys.stdout.write(generate_latest(registry).decode())


def render_cost(registry, names):
    """Prints what rendering the page costs the replica (vLLM's API server renders it in Python
    on every scrape), whole and restricted to ``names`` as ``/metrics/?name[]=`` restricts it."""
    import time

    def per_render_us(reg):
        best = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                body = generate_latest(reg)
            best.append((time.perf_counter() - t) / 200 * 1e6)
        return sorted(best)[2], len(body)

    whole_us, whole_b = per_render_us(registry)
    small_us, small_b = per_render_us(registry.restricted_registry(names))
    print(f"whole page:      {whole_b:>6} B, {whole_us:8.1f} us CPU per render")
    print(f"restricted page: {small_b:>6} B, {small_us:8.1f} us CPU per render "
          f"({len(names)} sample names)")
    print(f"at one scrape every 100 ms: {whole_us / 1e5:.2%} vs {small_us / 1e5:.2%} of a core")


if __name__ == "__main__":
    main()
