#!/usr/bin/env python3
"""Generate KV-event fixtures with vLLM's own msgspec classes.

The KV-event decoder the control plane and vllm-sim share (control-plane/vllm-wire/src/kv_events/)
is tested on payloads that vLLM's real event classes produced, in both wire encodings vLLM has
shipped:

- ``map``: current vLLM, events are tagged maps ``{"type": "BlockStored", ...}``;
- ``array``: older vLLM (before PR #42892), events are tagged arrays
  ``["BlockStored", block_hashes, parent_block_hash, ...]``;
- ``array_trimmed``: the same arrays with trailing ``None`` fields dropped, as vLLM releases
  that predate the newer optional fields sent them (checked to decode with vLLM's own decoder).

vLLM's source is never copied into this repository. The script reads
``vllm/distributed/kv_events.py`` from a vLLM wheel, keeps only the msgspec ``Struct`` class
definitions (via ``ast``), builds both variants in memory and encodes sample batches. The outputs
are ``<name>.<encoding>.msgpack`` payloads plus ``expected.json``, which states what each payload
must decode to (computed here in Python, independently of the Rust decoder).

Usage (msgspec must be importable, e.g. ``.venv/bin/pip install msgspec``):

    pip download vllm==0.33.0 --no-deps -d /tmp/vllmwheel
    .venv/bin/python scripts/gen_kv_event_fixtures.py /tmp/vllmwheel/vllm-0.33.0-*.whl [OUT]

OUT defaults to ``control-plane/vllm-wire/tests/fixtures/kv_events``, which
``control-plane/vllm-wire/tests/it/kv_events_decode.rs`` reads.
"""

import ast
import json
import pathlib
import sys
import types
import zipfile

import msgspec

SOURCE = "vllm/distributed/kv_events.py"
CLASSES = ["EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"]
U64 = (1 << 64) - 1
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent.parent / "control-plane/vllm-wire/tests/fixtures/kv_events"


def struct_module(source: str, array_like_events: bool) -> types.ModuleType:
    """The event classes of ``source``, optionally with the old ``array_like=True`` events."""
    tree = ast.parse(source)
    keep = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            if node.name == "KVCacheEvent" and array_like_events:
                if not any(k.arg == "array_like" for k in node.keywords):
                    node.keywords.append(ast.keyword(arg="array_like", value=ast.Constant(True)))
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id.startswith("MEDIUM_") for t in node.targets
        ):
            keep.append(node)
    missing = set(CLASSES) - {n.name for n in keep if isinstance(n, ast.ClassDef)}
    if missing:
        sys.exit(f"{SOURCE} lacks {sorted(missing)}: is this a vLLM with KV events?")
    prelude = ast.parse(
        "import msgspec\nfrom typing import Any\n"
        "ExternalBlockHash = bytes | int  # vllm.v1.core.kv_cache_utils\n"
    )
    module = ast.Module(body=prelude.body + keep, type_ignores=[])
    ast.fix_missing_locations(module)
    mod = types.ModuleType("vllm_kv_events_" + ("array" if array_like_events else "map"))
    exec(compile(module, SOURCE, "exec"), mod.__dict__)
    return mod


def engine_hash(h) -> int:
    """What a u64 block hash in an event means, as vLLM's int conversion defines it."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & U64
    return h & U64


def cache_salt(event) -> str | None:
    """The cache salt a block-0 store carries, by the rule the decoder documents: vLLM publishes
    block 0's extra keys untagged (LoRA name, multimodal pairs, salt, prompt-embeds digest), so
    the salt is the last string of ``extra_keys[0]`` once one ``lora_name`` is set aside."""
    if event.parent_block_hash is not None or not event.extra_keys or not event.extra_keys[0]:
        return None
    keys = [k for k in event.extra_keys[0] if isinstance(k, str)]
    if event.lora_name is not None and event.lora_name in keys:
        keys.remove(event.lora_name)
    return keys[-1] if keys and keys[-1] else None


def expect(event) -> dict | None:
    """The normalised event the decoder must produce, or None when it must skip it."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return {"type": kind}
    group = getattr(event, "group_idx", None)
    if group not in (None, 0):
        return None
    medium = (event.medium or "GPU").upper()
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": [engine_hash(h) for h in event.block_hashes], "medium": medium}
    spec = event.kv_cache_spec_kind
    if spec not in (None, "full_attention", "mla_attention", "sink_full_attention"):
        return None
    parent = event.parent_block_hash
    return {
        "type": kind,
        "block_hashes": [engine_hash(h) for h in event.block_hashes],
        "parent_block_hash": None if parent is None else engine_hash(parent),
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_name": event.lora_name,
        "cache_salt": cache_salt(event),
        "medium": medium,
    }


def samples(m):
    """Sample batches: name -> KVEventBatch. Covers every field shape the decoder accepts."""
    big = (1 << 64) - 2  # above i64::MAX: must stay an unsigned u64
    digest0 = bytes(range(32))
    digest1 = bytes(range(100, 132))
    stored = lambda **kw: m.BlockStored(
        **{"lora_id": None, "medium": "GPU", "lora_name": None, **kw}
    )
    return {
        # Two chained stores, an eviction and a cache reset: the common case.
        "basic": m.KVEventBatch(
            ts=1789095808.83,
            events=[
                stored(block_hashes=[big, 7], parent_block_hash=None,
                       token_ids=list(range(1, 33)), block_size=16),
                stored(block_hashes=[9], parent_block_hash=7,
                       token_ids=list(range(33, 49)), block_size=16,
                       extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"),
                m.BlockRemoved(block_hashes=[9], medium="GPU"),
                m.AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        ),
        # Hashes as 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) and negative i64
        # (vLLM < 0.10.2 used Python's hash()); a CPU-tier store; a LoRA; rank 1.
        "hash_shapes": m.KVEventBatch(
            ts=1.5,
            events=[
                # Block 0 of a salted LoRA request: `[lora, salt]`, then `[lora]` per block.
                stored(block_hashes=[digest0], parent_block_hash=None,
                       token_ids=list(range(16)), block_size=16, lora_id=3, lora_name="sql",
                       extra_keys=[("sql", "tenant-a")]),
                stored(block_hashes=[-5, -(1 << 63)], parent_block_hash=digest0,
                       token_ids=list(range(16, 48)), block_size=16, lora_id=3, lora_name="sql",
                       extra_keys=[("sql",), ("sql",)]),
                stored(block_hashes=[digest1], parent_block_hash=None,
                       token_ids=[100000 + i for i in range(16)], block_size=16, medium="CPU"),
                m.BlockRemoved(block_hashes=[digest1, -5], medium="CPU"),
            ],
            data_parallel_rank=1,
        ),
        # Hybrid model: only group 0 / full attention is indexed; every newer optional field
        # is set; medium absent (None) means GPU; no data_parallel_rank (omitted on the wire).
        "hybrid": m.KVEventBatch(
            ts=2.25,
            events=[
                stored(block_hashes=[11], parent_block_hash=None, token_ids=[5] * 16,
                       block_size=16, medium=None, extra_keys=[("cache_salt",)], group_idx=0,
                       kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                       locality="LOCAL", ownership="tier-a", session_id="s-1",
                       lookahead_token_ids=[[1, 2]]),
                stored(block_hashes=[12], parent_block_hash=None, token_ids=[5] * 16,
                       block_size=16, group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=4096),
                stored(block_hashes=[13], parent_block_hash=None, token_ids=[6] * 16,
                       block_size=16, group_idx=0, kv_cache_spec_kind="mamba"),
                stored(block_hashes=[14], parent_block_hash=None, token_ids=[7] * 16,
                       block_size=16, group_idx=0, kv_cache_spec_kind="mla_attention"),
                m.BlockRemoved(block_hashes=[12], medium="GPU", group_idx=1),
                m.BlockRemoved(block_hashes=[11], medium=None, group_idx=0, locality="LOCAL"),
            ],
        ),
        "empty": m.KVEventBatch(ts=3.0, events=[], data_parallel_rank=0),
    }


def trim(value, mod):
    """Drops the trailing ``None`` optional fields of the batch and of every event array."""
    def required(cls):
        return sum(f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT
                   for f in msgspec.structs.fields(cls))

    def strip(a, keep):
        a = list(a)
        while len(a) > keep and a[-1] is None:
            a.pop()
        return a

    batch = strip(value, required(mod.KVEventBatch))
    # Event arrays start with their tag.
    batch[1] = [strip(e, 1 + required(getattr(mod, e[0]))) for e in batch[1]]
    return batch


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    wheel = pathlib.Path(sys.argv[1])
    out = pathlib.Path(sys.argv[2]) if len(sys.argv) == 3 else DEFAULT_OUT
    source = zipfile.ZipFile(wheel).read(SOURCE).decode()
    out.mkdir(parents=True, exist_ok=True)
    expected = {"generated_from": wheel.name, "fixtures": {}}
    encoder = msgspec.msgpack.Encoder()
    variants = (("map", False, False), ("array", True, False), ("array_trimmed", True, True))
    for encoding, array_like, trimmed in variants:
        mod = struct_module(source, array_like)
        for name, batch in samples(mod).items():
            payload = encoder.encode(batch)
            if trimmed:
                payload = encoder.encode(trim(msgspec.msgpack.decode(payload), mod))
            (out / f"{name}.{encoding}.msgpack").write_bytes(payload)
            # Round-trip through vLLM's own decoder: the fixture is what vLLM itself accepts.
            back = msgspec.msgpack.Decoder(type=mod.KVEventBatch).decode(payload)
            assert back == batch, f"{name}.{encoding}: vLLM's decoder disagrees"
            events = [e for e in map(expect, batch.events) if e is not None]
            expected["fixtures"][f"{name}.{encoding}"] = {
                "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank,
                "events": events,
                "skipped": len(batch.events) - len(events),
            }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected['fixtures'])} fixtures to {out}")


if __name__ == "__main__":
    main()
