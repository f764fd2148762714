#!/usr/bin/env python3
"""Check vllm-sim's KV events and metric names against vLLM 0.33's own code.

vLLM's source is never copied into this repository: the script reads three files from a vLLM
wheel (a zip) in memory and keeps only what it needs, via Python's ``ast``:

- ``vllm/distributed/kv_events.py``: the msgspec ``Struct`` event classes (``EventBatch``,
  ``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``),
  plus ``ExternalBlockHash`` from ``vllm/v1/core/kv_cache_utils.py``. They run on their own with
  ``msgspec``. A second copy gets ``array_like=True`` on ``KVCacheEvent``: the positional
  encoding vLLM used before PR #42892 (~0.23).
- ``vllm/v1/metrics/loggers.py``: every ``vllm:*`` metric the Prometheus stat logger registers,
  with its type.
- the protocol classes of the agent APIs and of errors (``openai/responses/protocol.py``,
  ``anthropic/protocol.py``, ``serve/engine/protocol.py``, ``serve/tokenize/protocol.py``): their
  fields, in order. The Responses output items and stream events are classes of the ``openai``
  SDK, read the same way from an openai wheel (``--openai-wheel``; ``pip download openai
  --no-deps -d /tmp/openaiwheel``), if one is given.

It writes and checks, the KV-event fixtures 1-3 into ``--out`` (default
``control-plane/vllm-wire/tests/fixtures/vllm/``, beside the codec both the control plane and
vllm-sim use) and the simulator's fixtures 4-6 into ``--metrics-out`` (default
``tests/vllm-sim/fixtures/vllm/``):

1. ``vllm_events.{map,array}.msgpack`` + ``vllm_events.json``: payloads ENCODED by vLLM's
   classes, and what they must decode to. ``control-plane/vllm-wire/tests/it/vllm_compat.rs``
   decodes them with the shared decoder (``vllm_wire::kv_events::decode_batch``).
2. ``vllm_sim_shape.msgpack`` + ``vllm_sim_shape.json``: the events a vLLM 0.33 GPU block pool
   publishes for a small scenario (fields set exactly as ``BlockPool`` sets them), encoded by
   vLLM. The Rust tests encode the same events with the shared encoder (vllm-wire) and from the
   simulator's engine events (``tests/vllm-sim/tests/it/vllm_compat.rs``), and require the bytes
   to be identical.
3. ``sim_capture/*.msgpack``: batches CAPTURED from a live ``vllm-sim`` (``--capture``, needs
   pyzmq), DECODED here with vLLM's own ``msgspec`` decoder (strict types) and re-encoded: the
   bytes must be identical, so vLLM itself could not tell our events from its own.
4. ``metric_names.txt``: ``name<TAB>type`` of every metric vLLM 0.33 registers; each metric of
   the captured ``sim_metrics.txt`` page must be there with the same type. The vLLM metrics the
   simulator does not export are listed.
5. ``agent_fields.json``: the wire fields of each class (``AGENT_SCHEMA`` says how vLLM dumps
   it: every field, or only the set ones), the Responses event types and the Anthropic ones.
   ``tests/vllm-sim/tests/it/vllm_compat.rs`` checks a live simulator's answers against it.
6. ``agent_capture.json``: Responses, Messages, count_tokens, error and detokenize answers (JSON
   and SSE) CAPTURED from a live ``vllm-sim`` (``--capture`` or ``--capture-agents``, which
   needs no pyzmq), checked against 5.
7. With ``--metrics-route``: vLLM's own ``/metrics`` routing
   (``vllm/entrypoints/serve/instrumentator/metrics.py``, run under FastAPI) ignores ``name[]``
   on ``/metrics`` and honours it on ``/metrics/``, which the control plane's scrapes rely on;
   with ``--capture``/``--capture-agents``, vllm-sim must answer both paths the same way.
8. When the prefix cache takes a block (``vllm/v1/core/kv_cache_manager.py``):
   ``KVCacheManager.allocate_slots`` must call ``cache_blocks`` for the tokens it schedules,
   so a block is found by any request admitted after it is scheduled, before it is computed.
   vllm-sim's engine caches at the same point (``Engine::cache_scheduled``).
9. How long a request may be (``vllm/entrypoints/serve/utils/api_utils.py``): ``get_max_tokens``
   must refuse only an input longer than ``max_model_len`` and clamp the output to
   ``max_model_len - input_length``, as vllm-sim's ``Engine::add_request`` does (a prompt whose
   ``max_tokens`` overruns the context is served, not refused).

Usage (msgspec, and pyzmq for --capture, in .venv):

    pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel
    .venv/bin/pip install msgspec pyzmq
    cargo build -p vllm-sim
    .venv/bin/python scripts/check_vllm_compat.py --capture target/debug/vllm-sim

or, for the agent APIs alone: ``--capture-agents target/debug/vllm-sim``.

Without ``--capture`` the committed captures are checked again. Exit status 1 on any mismatch.
"""

import argparse
import ast
import contextlib
import glob
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.error
import urllib.request
import zipfile

import msgspec

KV_EVENTS = "vllm/distributed/kv_events.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
LOGGERS = "vllm/v1/metrics/loggers.py"
KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"
API_UTILS = "vllm/entrypoints/serve/utils/api_utils.py"
CLASSES = ["EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEventBatch"]
ROOT = pathlib.Path(__file__).resolve().parent.parent
FAILURES: list[str] = []


def fail(msg: str) -> None:
    FAILURES.append(msg)
    print(f"FAIL: {msg}")


# ---------------------------------------------------------------------------------------------
# vLLM's event classes


def external_block_hash(utils_source: str) -> ast.stmt:
    """The ``ExternalBlockHash`` alias as vLLM defines it (``bytes | int`` in 0.33)."""
    for node in ast.parse(utils_source).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash":
            return ast.Assign(targets=[ast.Name("ExternalBlockHash", ast.Store())], value=node.value)
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "ExternalBlockHash" for t in node.targets
        ):
            return node
    sys.exit(f"{KV_CACHE_UTILS} defines no ExternalBlockHash")


def event_classes(source: str, alias: ast.stmt, array_like: bool) -> types.ModuleType:
    """vLLM's event Structs; with ``array_like`` the events use the old positional encoding."""
    keep: list[ast.stmt] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            if node.name == "KVCacheEvent" and array_like:
                node.keywords = [k for k in node.keywords if k.arg != "array_like"]
                node.keywords.append(ast.keyword(arg="array_like", value=ast.Constant(True)))
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", "").startswith("MEDIUM_") for t in node.targets
        ):
            keep.append(node)
    missing = set(CLASSES) - {n.name for n in keep if isinstance(n, ast.ClassDef)}
    if missing:
        sys.exit(f"{KV_EVENTS} lacks {sorted(missing)}")
    prelude = ast.parse("import msgspec\nfrom typing import Any\n").body
    module = ast.Module(body=prelude + [alias] + keep, type_ignores=[])
    ast.fix_missing_locations(module)
    mod = types.ModuleType("vllm_kv_events_array" if array_like else "vllm_kv_events")
    exec(compile(module, KV_EVENTS, "exec"), mod.__dict__)
    return mod


def jsonable(v):
    """A decoded msgpack value as JSON: bytes become {"bytes": hex}, tuples lists."""
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def describe(event) -> dict:
    """Every field of a vLLM event that the shared decoder (vllm-wire) reports, as JSON."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return {"type": kind}
    out = {"type": kind, "block_hashes": jsonable(event.block_hashes), "medium": event.medium,
           "group_idx": event.group_idx}
    if kind == "BlockStored":
        out.update(parent_block_hash=jsonable(event.parent_block_hash),
                   token_ids=list(event.token_ids), block_size=event.block_size,
                   lora_id=event.lora_id, lora_name=event.lora_name,
                   extra_keys=jsonable(event.extra_keys),
                   kv_cache_spec_kind=event.kv_cache_spec_kind)
    return out


def vllm_made_batch(m):
    """One batch covering every field shape vLLM has published."""
    big = (1 << 64) - 2  # above i64::MAX: a u64 on the wire
    digest = bytes(range(32))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    stored = lambda **kw: m.BlockStored(**{"lora_id": None, "medium": "GPU", "lora_name": None,
                                            **kw})
    return m.KVEventBatch(
        ts=1789095808.83,
        events=[
            stored(block_hashes=[big, 7], parent_block_hash=None, token_ids=list(range(1, 33)),
                   block_size=16, extra_keys=[None, None], group_idx=0),
            stored(block_hashes=[9], parent_block_hash=7, token_ids=list(range(33, 49)),
                   block_size=16, lora_id=1, lora_name="sql-lora", extra_keys=[("sql-lora",)],
                   group_idx=0, kv_cache_spec_kind="full_attention", session_id="s-1"),
            stored(block_hashes=[digest], parent_block_hash=None, token_ids=[5] * 16,
                   block_size=16, medium="CPU", locality="LOCAL"),
            stored(block_hashes=[-5], parent_block_hash=None, token_ids=[6] * 16,
                   block_size=16, medium=None),
            m.BlockRemoved(block_hashes=[9], medium="GPU", group_idx=0),
            m.BlockRemoved(block_hashes=[digest, -5], medium=None),
            m.AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )


def sim_shape_batch(m):
    """What vLLM 0.33's GPU BlockPool publishes for: cache two blocks, extend by one, a LoRA
    request caches a block, a salted request caches two blocks, a salted LoRA request caches
    two, one block is evicted, the cache is reset. Fields are set as
    ``BlockPool._build_block_stored_event`` / ``_emit_block_removed_events`` set them, extra
    keys as ``generate_block_hash_extra_keys`` orders them (LoRA, then the cache salt on block 0
    only) and ``to_event_extra_keys`` untags them."""
    def stored(hashes, parent, tokens, lora=None, salt=None):
        def keys(i):
            k = tuple(x for x in (lora, salt if parent is None and i == 0 else None) if x)
            return k or None
        return m.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16,
            lora_id=None if lora is None else 1, medium="GPU", lora_name=lora,
            extra_keys=[keys(i) for i in range(len(hashes))], group_idx=0,
            session_id=None, lookahead_token_ids=None)
    return m.KVEventBatch(
        ts=1789095808.5,
        events=[
            stored([11, (1 << 64) - 1], None, list(range(32))),
            stored([13], (1 << 64) - 1, list(range(32, 48))),
            stored([21], None, list(range(100, 116)), lora="sql-lora"),
            stored([31, 32], None, list(range(200, 232)), salt="tenant-a"),
            stored([41, 42], None, list(range(300, 332)), lora="sql-lora", salt="tenant-b"),
            m.BlockRemoved(block_hashes=[13], medium="GPU", group_idx=0),
            m.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def write_vllm_made(out: pathlib.Path, mods: dict) -> None:
    encoder = msgspec.msgpack.Encoder()
    expected = {"generated_from": "vllm 0.33.0 " + KV_EVENTS, "encodings": {}}
    for encoding, mod in mods.items():
        batch = vllm_made_batch(mod)
        payload = encoder.encode(batch)
        assert msgspec.msgpack.Decoder(type=mod.KVEventBatch).decode(payload) == batch
        (out / f"vllm_events.{encoding}.msgpack").write_bytes(payload)
        expected["encodings"][encoding] = {
            "file": f"vllm_events.{encoding}.msgpack", "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": [describe(e) for e in batch.events]}
    (out / "vllm_events.json").write_text(json.dumps(expected, indent=1) + "\n")

    batch = sim_shape_batch(mods["map"])
    (out / "vllm_sim_shape.msgpack").write_bytes(encoder.encode(batch))
    shape = {"generated_from": "vllm 0.33.0 " + KV_EVENTS, "ts": batch.ts,
             "data_parallel_rank": batch.data_parallel_rank,
             "events": [describe(e) for e in batch.events]}
    (out / "vllm_sim_shape.json").write_text(json.dumps(shape, indent=1) + "\n")
    print(f"wrote vLLM-made fixtures to {out}")


# ---------------------------------------------------------------------------------------------
# Capturing a live vllm-sim


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body=None, timeout=30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


@contextlib.contextmanager
def running_sim(sim_bin: str, args: list[str], env=None):
    """Runs vllm-sim on a free port of 127.0.0.1 with ``args`` (and ``env``, else this
    process's environment), yields its base URL once ``/health`` answers, and stops it."""
    port = free_port()
    proc = subprocess.Popen([sim_bin, "--host", "127.0.0.1", "--port", str(port), *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 20
        while True:
            try:
                http(base + "/health", timeout=1)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    sys.exit("vllm-sim did not start")
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


PROFILE = """name: compat-capture
model: sim-compat
kv_capacity_tokens: 320
block_size: 16
prefill_tokens_per_s: 1000000
decode_step_s_min: 0.1
decode_step_s_full: 0.1
"""


def capture(sim_bin: str, out: pathlib.Path, metrics_out: pathlib.Path) -> None:
    """Runs a scenario against a live vllm-sim and saves every KV event batch (via the replay
    socket, so none is lost) and the /metrics page."""
    import zmq

    pub, replay = free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(PROFILE)
        profile = f.name
    args = ["--profile", profile,
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
            "--lora-modules", "sql-lora=/adapters/sql"]
    with contextlib.ExitStack() as stack:
        stack.callback(pathlib.Path(profile).unlink, missing_ok=True)
        base = stack.enter_context(running_sim(sim_bin, args))
        words = lambda tag, n: " ".join(f"{tag}{i}" for i in range(n))
        done = lambda prompt, **kw: http(base + "/v1/completions",
                                         {"prompt": prompt, "max_tokens": 1, **kw})
        # Two full blocks, then the same prompt extended: a store with a parent.
        done(words("a", 40))
        done(words("a", 40) + " " + words("b", 20))
        # A LoRA request: lora_id, lora_name, extra_keys.
        done(words("c", 20), model="sql-lora")
        # Identical prompts admitted in the same step compute (and cache) the same blocks.
        blocker = threading.Thread(target=lambda: http(
            base + "/v1/completions", {"prompt": "hold", "max_tokens": 8}))
        blocker.start()
        time.sleep(0.15)
        twins = [threading.Thread(target=done, args=(words("d", 33),)) for _ in range(2)]
        for t in twins:
            t.start()
        for t in twins + [blocker]:
            t.join(30)
        # Pressure: distinct prompts evict cached blocks.
        for k in range(4):
            done(words(f"e{k}x", 90))
        http(base + "/reset_prefix_cache", {})
        (metrics_out / "sim_metrics.txt").write_text(http(base + "/metrics"))
        time.sleep(0.2)

        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        cap = out / "sim_capture"
        cap.mkdir(exist_ok=True)
        for old in cap.glob("*.msgpack"):
            old.unlink()
        n = 0
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                break
            (cap / f"{int.from_bytes(seq, 'big'):03}.msgpack").write_bytes(payload)
            n += 1
        dealer.close(linger=0)
        print(f"captured {n} batches and /metrics from vllm-sim into {out}")


def check_capture(out: pathlib.Path, mod) -> None:
    """Decodes every captured batch with vLLM's own decoder and re-encodes it."""
    files = sorted(glob.glob(str(out / "sim_capture" / "*.msgpack")))
    if not files:
        fail("no captured vllm-sim batches (run with --capture)")
        return
    decoder = msgspec.msgpack.Decoder(type=mod.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    kinds: dict[str, int] = {}
    stored_twice = set()
    seen = set()
    for f in files:
        raw = pathlib.Path(f).read_bytes()
        try:
            batch = decoder.decode(raw)
        except msgspec.ValidationError as e:
            fail(f"{f}: vLLM's decoder rejects it: {e}")
            continue
        if encoder.encode(batch) != raw:
            fail(f"{f}: vLLM re-encodes it differently (field order, omitted defaults or "
                 "integer widths differ)")
        for e in batch.events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
            if isinstance(e, mod.BlockStored):
                if len(e.token_ids) != e.block_size * len(e.block_hashes):
                    fail(f"{f}: token_ids do not fill block_hashes x block_size")
                if e.extra_keys is not None and len(e.extra_keys) != len(e.block_hashes):
                    fail(f"{f}: one extra_keys entry per block expected")
                for h in e.block_hashes:
                    (stored_twice if h in seen else seen).add(h)
    for want in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        if not kinds.get(want):
            fail(f"the capture has no {want} event")
    if not stored_twice:
        fail("the capture shows no duplicate store of identical concurrent blocks")
    print(f"vLLM's decoder read {len(files)} captured batches: {kinds}; "
          f"{len(stored_twice)} hashes stored twice")


# ---------------------------------------------------------------------------------------------
# Metric names

KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram",
         "Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}


def vllm_metric_names(source: str) -> dict[str, str]:
    """``vllm:*`` name -> type, for every metric constructor call in loggers.py (a name given
    through a local variable is resolved within its function)."""
    names: dict[str, str] = {}
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and node.value.value.startswith("vllm:"):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        local[t.id] = node.value.value
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            kind = KINDS.get(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
            if kind is None:
                continue
            for kw in node.keywords:
                if kw.arg != "name":
                    continue
                if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    names[kw.value.value] = kind
                elif isinstance(kw.value, ast.Name) and kw.value.id in local:
                    names[local[kw.value.id]] = kind
    return names


def page_metrics(page: str) -> dict[str, str]:
    """Metric family -> type from a Prometheus text page (counters lose ``_total``)."""
    out = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter" and name.endswith("_total"):
                name = name[: -len("_total")]
            out[name] = kind
    return out


def check_metrics(out: pathlib.Path, vllm: dict[str, str]) -> None:
    page = out / "sim_metrics.txt"
    if not page.exists():
        fail("no captured sim_metrics.txt (run with --capture)")
        return
    ours = page_metrics(page.read_text())
    for name, kind in sorted(ours.items()):
        if name not in vllm:
            fail(f"vllm-sim exports {name}, which vLLM 0.33 does not register")
        elif vllm[name] != kind:
            fail(f"vllm-sim exports {name} as a {kind}, vLLM as a {vllm[name]}")
    print(f"all {len(ours)} vllm-sim metrics are vLLM 0.33 metrics of the same type")
    missing = sorted(set(vllm) - set(ours))
    print(f"vLLM 0.33 metrics vllm-sim does not export ({len(missing)}):")
    for name in missing:
        print(f"  {name} ({vllm[name]})")


# ---------------------------------------------------------------------------------------------
# The agent APIs (Responses, Messages) and the other answers vllm-sim gives

RESPONSES_PROTOCOL = "vllm/entrypoints/openai/responses/protocol.py"
ANTHROPIC_PROTOCOL = "vllm/entrypoints/anthropic/protocol.py"
ENGINE_PROTOCOL = "vllm/entrypoints/serve/engine/protocol.py"
TOKENIZE_PROTOCOL = "vllm/entrypoints/serve/tokenize/protocol.py"

# How each class is dumped on the wire, and which of its fields hold other classes (a list
# field: each element). "all": pydantic's model_dump (every field, those with an `exclude_if`
# omitted when None); "subset": model_dump(exclude_none/exclude_unset), so the keys are some of
# the fields, in field order.
AGENT_SCHEMA = {
    # vllm/entrypoints/openai/responses/protocol.py; api_router.py dumps with model_dump.
    "ResponsesResponse": ("all", RESPONSES_PROTOCOL,
                          {"usage": "ResponseUsage", "output": "ResponseOutputMessage"}),
    "ResponseUsage": ("all", RESPONSES_PROTOCOL,
                      {"input_tokens_details": "InputTokensDetails",
                       "output_tokens_details": "OutputTokensDetails"}),
    "InputTokensDetails": ("all", RESPONSES_PROTOCOL, {}),
    "OutputTokensDetails": ("all", RESPONSES_PROTOCOL, {}),
    # The openai SDK classes vLLM builds its output items and stream events from.
    "ResponseOutputMessage": ("all", "openai", {"content": "ResponseOutputText"}),
    "ResponseOutputText": ("all", "openai", {}),
    "ResponseCreatedEvent": ("all", "openai", {"response": "ResponsesResponse"}),
    "ResponseInProgressEvent": ("all", "openai", {"response": "ResponsesResponse"}),
    "ResponseCompletedEvent": ("all", "openai", {"response": "ResponsesResponse"}),
    "ResponseIncompleteEvent": ("all", "openai", {"response": "ResponsesResponse"}),
    "ResponseOutputItemAddedEvent": ("all", "openai", {"item": "ResponseOutputMessage"}),
    "ResponseOutputItemDoneEvent": ("all", "openai", {"item": "ResponseOutputMessage"}),
    "ResponseContentPartAddedEvent": ("all", "openai", {"part": "ResponseOutputText"}),
    "ResponseContentPartDoneEvent": ("all", "openai", {"part": "ResponseOutputText"}),
    "ResponseTextDeltaEvent": ("all", "openai", {}),
    "ResponseTextDoneEvent": ("all", "openai", {}),
    # vllm/entrypoints/serve/engine/protocol.py: every OpenAI-shaped error.
    "ErrorResponse": ("all", ENGINE_PROTOCOL, {"error": "ErrorInfo"}),
    "ErrorInfo": ("all", ENGINE_PROTOCOL, {}),
    # vllm/entrypoints/anthropic: model_dump(exclude_none=True) / model_dump_json(exclude_unset).
    "AnthropicMessagesResponse": ("subset", ANTHROPIC_PROTOCOL,
                                  {"content": "AnthropicContentBlock", "usage": "AnthropicUsage"}),
    "AnthropicContentBlock": ("subset", ANTHROPIC_PROTOCOL, {}),
    "AnthropicUsage": ("subset", ANTHROPIC_PROTOCOL, {}),
    "AnthropicStreamEvent": ("subset", ANTHROPIC_PROTOCOL,
                             {"message": "AnthropicMessagesResponse", "delta": "AnthropicDelta",
                              "content_block": "AnthropicContentBlock", "usage": "AnthropicUsage",
                              "error": "AnthropicError"}),
    "AnthropicDelta": ("subset", ANTHROPIC_PROTOCOL, {}),
    "AnthropicErrorResponse": ("subset", ANTHROPIC_PROTOCOL, {"error": "AnthropicError"}),
    "AnthropicError": ("subset", ANTHROPIC_PROTOCOL, {}),
    "AnthropicCountTokensResponse": ("subset", ANTHROPIC_PROTOCOL,
                                     {"context_management": "AnthropicContextManagement"}),
    "AnthropicContextManagement": ("subset", ANTHROPIC_PROTOCOL, {}),
    # vllm/entrypoints/serve/tokenize/protocol.py.
    "DetokenizeResponse": ("all", TOKENIZE_PROTOCOL, {}),
}


def pydantic_classes(source: str) -> dict[str, dict]:
    """Every class of a module: its bases, its annotated fields in order, the fields dumped
    only when set (``exclude_if``), and the string of each ``Literal[...]`` ``type``."""
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields, omit, literal = [], [], None
        for st in node.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            name, ann = st.target.id, ast.unparse(st.annotation)
            if name.startswith("_") or name == "model_config" or ann.startswith("ClassVar"):
                continue
            fields.append(name)
            if isinstance(st.value, ast.Call) and any(k.arg == "exclude_if"
                                                      for k in st.value.keywords):
                omit.append(name)
            if name == "type":
                literal = literal_values(st.annotation)
        out[node.name] = {"bases": [ast.unparse(b) for b in node.bases], "fields": fields,
                          "omit_when_none": omit, "type": literal}
    return out


def literal_values(annotation: ast.expr) -> list | None:
    """The values of the first ``Literal[...]`` in an annotation (``Literal[...] | None`` too)."""
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return [ast.literal_eval(e) for e in elts]
    return None


def snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def agent_fields(read, openai_read) -> dict:
    """The fixture the Rust tests and ``check_agents`` use: each class's wire fields."""
    modules = {path: pydantic_classes(read(path)) for path in
               (RESPONSES_PROTOCOL, ANTHROPIC_PROTOCOL, ENGINE_PROTOCOL, TOKENIZE_PROTOCOL)}
    classes, events = {}, {}
    for name, (dump, where, nested) in AGENT_SCHEMA.items():
        if where == "openai":
            if openai_read is None:
                continue
            info = pydantic_classes(openai_read(f"openai/types/responses/{snake(name)}.py"))[name]
        else:
            info = modules[where][name]
        classes[name] = {"dump": dump, "fields": info["fields"],
                         "omit_when_none": info["omit_when_none"], "nested": nested}
        if name.endswith("Event") and where == "openai" and info["type"]:
            events[info["type"][0]] = name
    # vLLM's own subclasses (``ResponseCompletedEvent(OpenAIResponseCompletedEvent)``) keep
    # their base's fields: check that the ones it streams exist and rebind ``response``.
    vllm_events = modules[RESPONSES_PROTOCOL]
    for name in ("ResponseCreatedEvent", "ResponseInProgressEvent", "ResponseCompletedEvent",
                 "ResponseIncompleteEvent"):
        if vllm_events[name]["fields"] != ["response"]:
            fail(f"vLLM's {name} changed: {vllm_events[name]['fields']}")
    anthropic_types = modules[ANTHROPIC_PROTOCOL]["AnthropicStreamEvent"]["type"]
    return {"generated_from": "vllm 0.33.0 " + ", ".join(sorted(set(
                w for _, w, _ in AGENT_SCHEMA.values()) - {"openai"})),
            "classes": classes, "responses_events": events,
            "anthropic_event_types": anthropic_types}


def check_shape(value, cls: str, fields: dict, where: str) -> int:
    """Checks ``value`` against class ``cls`` and its nested classes; returns objects checked."""
    spec = fields["classes"].get(cls)
    if spec is None or not isinstance(value, dict):
        if spec is not None:
            fail(f"{where}: a {cls} must be an object, not {value!r:.80}")
        return 0
    keys, want = list(value), spec["fields"]
    if spec["dump"] == "all":
        expected = [f for f in want if not (f in spec["omit_when_none"] and value.get(f) is None)]
        if keys != expected:
            fail(f"{where}: {cls} keys {keys} != vLLM's {expected}")
    else:
        unknown = [k for k in keys if k not in want]
        if unknown:
            fail(f"{where}: {cls} has no field {unknown}")
        elif keys != sorted(keys, key=want.index):
            fail(f"{where}: {cls} keys {keys} are not in vLLM's field order {want}")
    n = 1
    for field, inner in spec["nested"].items():
        v = value.get(field)
        for i, item in enumerate(v if isinstance(v, list) else [v]):
            if item is not None:
                n += check_shape(item, inner, fields, f"{where}.{field}" +
                                 (f"[{i}]" if isinstance(v, list) else ""))
    return n


# What each captured answer is: (class of a JSON body) or ("sse", family).
AGENT_CAPTURE_KINDS = {
    "responses": "ResponsesResponse",
    "responses_get": "ResponsesResponse",
    "responses_stream": ("sse", "responses"),
    "responses_cancel_finished": "ErrorResponse",
    "responses_unknown_previous": "ErrorResponse",
    "messages": "AnthropicMessagesResponse",
    "messages_stream": ("sse", "anthropic"),
    "messages_count_tokens": "AnthropicCountTokensResponse",
    "messages_unknown_model": "AnthropicErrorResponse",
    "messages_missing_max_tokens": "ErrorResponse",
    "detokenize": "DetokenizeResponse",
}


def check_agents(capture_file: pathlib.Path, fields: dict) -> None:
    """Every captured answer has exactly (OpenAI shapes) or only (Anthropic shapes) the fields
    of vLLM's protocol class, in its order; stream events are framed ``event:``/``data:`` and
    name a type vLLM streams."""
    if not capture_file.exists():
        fail(f"no {capture_file.name} (run with --capture or --capture-agents)")
        return
    capture = json.loads(capture_file.read_text())
    checked = 0
    for name, kind in AGENT_CAPTURE_KINDS.items():
        answer = capture.get(name)
        if answer is None:
            fail(f"the agent capture lacks {name}")
            continue
        if isinstance(kind, str):
            checked += check_shape(answer["body"], kind, fields, name)
            continue
        for i, (event, data) in enumerate(answer["events"]):
            where = f"{name}[{i}] {event}"
            if data.get("type") != event:
                fail(f"{where}: data.type is {data.get('type')!r}")
            if kind[1] == "responses":
                cls = fields["responses_events"].get(event)
                if cls is None and fields["responses_events"]:
                    fail(f"{where}: vLLM streams no such Responses event")
                elif cls is not None:
                    checked += check_shape(data, cls, fields, where)
                if data.get("sequence_number") != i:
                    fail(f"{where}: sequence_number {data.get('sequence_number')} != {i}")
            else:
                if event not in fields["anthropic_event_types"]:
                    fail(f"{where}: vLLM streams no such Messages event")
                checked += check_shape(data, "AnthropicStreamEvent", fields, where)
    print(f"{checked} objects of the agent capture have vLLM 0.33's fields"
          + ("" if fields["responses_events"] else
             " (no openai wheel: output items and Responses events unchecked)"))


def http_answer(url: str, body=None, method=None) -> dict:
    """Status and body (JSON, or the SSE events as [event, data] pairs) of one call."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, ctype, text = r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        status, ctype, text = e.code, e.headers.get("content-type", ""), e.read().decode()
    if ctype.startswith("text/event-stream"):
        events = []
        for frame in filter(None, text.split("\n\n")):
            event, data_line = frame.split("\n", 1)
            events.append([event.removeprefix("event: "),
                           json.loads(data_line.removeprefix("data: "))])
        return {"status": status, "events": events}
    return {"status": status, "body": json.loads(text)}


def capture_agents(sim_bin: str, out: pathlib.Path) -> None:
    """Asks a live vllm-sim (store on) every agent-API answer ``check_agents`` checks."""
    env = dict(os.environ, VLLM_ENABLE_RESPONSES_API_STORE="1")
    with running_sim(sim_bin, ["--model", "sim-compat", "--profile", "fast"], env) as base:
        cap = {}
        turn = {"model": "sim-compat", "instructions": "Be terse.", "input": "list the files",
                "max_output_tokens": 4}
        cap["responses"] = http_answer(base + "/v1/responses", turn)
        rid = cap["responses"]["body"]["id"]
        cap["responses_stream"] = http_answer(base + "/v1/responses", {
            **turn, "input": [{"role": "user", "content": [{"type": "input_text",
                                                            "text": "and now?"}]}],
            "previous_response_id": rid, "stream": True})
        cap["responses_get"] = http_answer(f"{base}/v1/responses/{rid}", method="GET")
        cap["responses_cancel_finished"] = http_answer(f"{base}/v1/responses/{rid}/cancel", {})
        cap["responses_unknown_previous"] = http_answer(base + "/v1/responses", {
            **turn, "previous_response_id": "resp_0000000000000000"})
        msg = {"model": "sim-compat", "max_tokens": 4, "system": "Be terse.",
               "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
               "messages": [{"role": "user", "content": "list the files"}]}
        cap["messages"] = http_answer(base + "/v1/messages", msg)
        cap["messages_stream"] = http_answer(base + "/v1/messages", {**msg, "stream": True})
        cap["messages_count_tokens"] = http_answer(base + "/v1/messages/count_tokens", msg)
        cap["messages_unknown_model"] = http_answer(base + "/v1/messages",
                                                    {**msg, "model": "nope"})
        cap["messages_missing_max_tokens"] = http_answer(
            base + "/v1/messages", {k: v for k, v in msg.items() if k != "max_tokens"})
        cap["detokenize"] = http_answer(base + "/detokenize", {"tokens": [1, 2]})
        (out / "agent_capture.json").write_text(json.dumps(cap, indent=1) + "\n")
        print(f"captured {len(cap)} agent-API answers from vllm-sim into {out}")


# ---------------------------------------------------------------------------------------------


METRICS_ROUTER = "vllm/entrypoints/serve/instrumentator/metrics.py"


def check_metrics_route(read, sim_bin: str | None) -> None:
    """Runs vLLM's own ``attach_router`` (FastAPI, prometheus_client and
    prometheus-fastapi-instrumentator must be installed) and checks what the control plane's
    restricted scrape relies on: ``/metrics`` ignores ``name[]`` and ``/metrics/`` honours it.
    With ``sim_bin``, vllm-sim must answer both paths the same way."""
    import types

    import prometheus_client
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    stub = types.ModuleType("vllm.v1.metrics.prometheus")
    stub.get_prometheus_registry = lambda: prometheus_client.REGISTRY
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.v1", "vllm.v1.metrics", stub.__name__)}
    for name in ("vllm", "vllm.v1", "vllm.v1.metrics"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[stub.__name__] = stub
    try:
        mod = types.ModuleType("vllm_metrics_router")
        exec(compile(read(METRICS_ROUTER), METRICS_ROUTER, "exec"), mod.__dict__)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    gauge = prometheus_client.Gauge("vllm:num_requests_running", "r", ["engine"])
    gauge.labels("0").set(3)
    prometheus_client.Gauge("vllm:num_requests_waiting", "w", ["engine"]).labels("0").set(1)
    app = FastAPI()
    mod.attach_router(app)
    client = TestClient(app)
    query = "name%5B%5D=vllm%3Anum_requests_running"

    def series(text: str) -> set[str]:
        return {line.split("{")[0] for line in text.splitlines()
                if line.startswith("vllm:")}

    vllm = {path: series(client.get(f"{path}?{query}").text) for path in ("/metrics", "/metrics/")}
    if "vllm:num_requests_waiting" not in vllm["/metrics"]:
        fail("vLLM's /metrics honours name[]: the control plane may scrape it directly")
    if vllm["/metrics/"] != {"vllm:num_requests_running"}:
        fail(f"vLLM's /metrics/?name[]= served {sorted(vllm['/metrics/'])}")
    print("vLLM 0.33's /metrics ignores name[]; /metrics/ serves only the named samples")
    if sim_bin:
        with running_sim(sim_bin, []) as base:
            for path in ("/metrics", "/metrics/"):
                got = series(http(f"{base}{path}?{query}"))
                restricted = got == {"vllm:num_requests_running"}
                if restricted != (path == "/metrics/"):
                    fail(f"vllm-sim's {path}?name[]= served {sorted(got)}")
        print("vllm-sim answers /metrics and /metrics/?name[]= as vLLM does")


def check_cache_point(source: str) -> None:
    """Check 8: vLLM caches a request's full blocks when it allocates their slots.

    The engine's prefix-cache timing decides how often a prefix shared by requests arriving
    together is prefilled, so a vLLM release that moved ``cache_blocks`` out of
    ``allocate_slots`` (to after the step, say) would make vllm-sim's fan-out figures wrong.
    """
    tree = ast.parse(source)
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name == "KVCacheManager"):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "allocate_slots":
                calls = [n.func.attr for n in ast.walk(fn)
                         if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
                if "cache_blocks" in calls:
                    print(f"{KV_CACHE_MANAGER}: allocate_slots caches blocks when they are "
                          "scheduled, as vllm-sim's engine does")
                    return
                fail("KVCacheManager.allocate_slots no longer calls cache_blocks: "
                     "vllm-sim's Engine::cache_scheduled caches blocks when they are scheduled")
                return
    fail(f"no KVCacheManager.allocate_slots in {KV_CACHE_MANAGER}")


def check_context_limit(source: str) -> None:
    """Check 9: vLLM clamps the output to the context left and refuses only a longer input.

    Which requests an engine refuses decides how much of a long-prompt trace is served at all
    (and what a router sees come back as a 400), so a vLLM release that refused
    ``prompt + max_tokens > max_model_len`` again would make vllm-sim's refusals wrong.
    """
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "get_max_tokens"):
            continue
        raises_on_long_input = any(
            isinstance(n, ast.If) and ast.unparse(n.test) == "max_model_len < input_length"
            and any(isinstance(b, ast.Raise) for b in n.body)
            for n in ast.walk(fn))
        clamps = any(
            isinstance(n, ast.Assign) and ast.unparse(n.value) == "max_model_len - input_length"
            for n in ast.walk(fn))
        if raises_on_long_input and clamps:
            print(f"{API_UTILS}: get_max_tokens refuses only an input longer than the context "
                  "and clamps the output to what is left, as vllm-sim's engine does")
            return
        fail("get_max_tokens no longer refuses only max_model_len < input_length and clamps "
             "the output to max_model_len - input_length: vllm-sim's Engine::add_request "
             "follows that rule")
        return
    fail(f"no get_max_tokens in {API_UTILS}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_wheel = next(iter(sorted(glob.glob("/tmp/vllmwheel/vllm-0.33.0-*.whl"))), None)
    ap.add_argument("--wheel", default=default_wheel, help="the vllm==0.33.0 wheel")
    ap.add_argument("--out", default=str(ROOT / "control-plane/vllm-wire/tests/fixtures/vllm"),
                    help="KV-event fixture folder")
    ap.add_argument("--metrics-out", default=str(ROOT / "tests/vllm-sim/fixtures/vllm"),
                    help="vllm-sim fixture folder (metric_names.txt, sim_metrics.txt, "
                         "agent_fields.json, agent_capture.json)")
    ap.add_argument("--capture", metavar="VLLM_SIM",
                    help="run this vllm-sim binary and capture its events, /metrics and its "
                         "agent-API answers")
    ap.add_argument("--capture-agents", metavar="VLLM_SIM",
                    help="capture only the agent-API answers (needs no pyzmq)")
    default_openai = next(iter(sorted(glob.glob("/tmp/openaiwheel/openai-*.whl"))), None)
    ap.add_argument("--openai-wheel", default=default_openai,
                    help="an openai SDK wheel (vLLM builds Responses items and events from its "
                         "classes); without it those are not checked")
    ap.add_argument("--metrics-route", action="store_true",
                    help="run vLLM's own /metrics routing (needs fastapi, httpx, "
                         "prometheus_client, prometheus-fastapi-instrumentator and regex) and "
                         "check name[] on /metrics and /metrics/, and vllm-sim's with --capture")
    args = ap.parse_args()
    if not args.wheel:
        sys.exit("no wheel: pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics_out = pathlib.Path(args.metrics_out)
    metrics_out.mkdir(parents=True, exist_ok=True)
    wheel = zipfile.ZipFile(args.wheel)
    read = lambda name: wheel.read(name).decode()
    alias = external_block_hash(read(KV_CACHE_UTILS))
    mods = {"map": event_classes(read(KV_EVENTS), alias, False),
            "array": event_classes(read(KV_EVENTS), alias, True)}

    write_vllm_made(out, mods)
    names = vllm_metric_names(read(LOGGERS))
    header = (f"# Metrics vLLM 0.33.0 registers in {LOGGERS}: name<TAB>type.\n"
              "# Generated by scripts/check_vllm_compat.py; do not edit.\n")
    (metrics_out / "metric_names.txt").write_text(
        header + "".join(f"{n}\t{k}\n" for n, k in sorted(names.items())))
    print(f"wrote {len(names)} vLLM metric names to {metrics_out / 'metric_names.txt'}")

    openai_read = None
    if args.openai_wheel:
        openai_wheel = zipfile.ZipFile(args.openai_wheel)
        openai_read = lambda name: openai_wheel.read(name).decode()
    fields = agent_fields(read, openai_read)
    fields_file = metrics_out / "agent_fields.json"
    if openai_read is None and fields_file.exists():
        # Without the SDK the openai classes cannot be regenerated: keep the committed ones,
        # after checking that vLLM's own classes still read the same.
        committed = json.loads(fields_file.read_text())
        for name, spec in fields["classes"].items():
            if committed["classes"].get(name) != spec:
                fail(f"{fields_file.name} is stale for {name}: regenerate it")
        fields = committed
        print(f"no openai wheel: checking against the committed {fields_file.name}")
    else:
        if openai_read is not None:
            fields["generated_from"] += f" + {pathlib.Path(args.openai_wheel).name}"
        fields_file.write_text(json.dumps(fields, indent=1) + "\n")
        print(f"wrote the fields of {len(fields['classes'])} classes to {fields_file}")

    if args.capture:
        capture(args.capture, out, metrics_out)
    if args.capture or args.capture_agents:
        capture_agents(args.capture or args.capture_agents, metrics_out)
    check_capture(out, mods["map"])
    check_metrics(metrics_out, names)
    check_agents(metrics_out / "agent_capture.json", fields)
    check_cache_point(read(KV_CACHE_MANAGER))
    check_context_limit(read(API_UTILS))
    if args.metrics_route:
        check_metrics_route(read, args.capture or args.capture_agents)
    if FAILURES:
        sys.exit(f"{len(FAILURES)} incompatibilities")
    print("vllm-sim is compatible with vLLM 0.33.0")


if __name__ == "__main__":
    main()
