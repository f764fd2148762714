//! Builders of msgpack batches for the decoder's and the router view's unit tests.

use rmpv::Value;

/// One msgpack value as bytes.
pub(crate) fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    buf
}

/// A msgpack string.
pub(crate) fn s(x: &str) -> Value {
    Value::from(x)
}

/// A `[ts, events, rank 0]` batch payload.
pub(crate) fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(events),
        Value::from(0),
    ]))
}

/// A minimal tagged-map `BlockStored` of one block, plus `extra` fields.
pub(crate) fn stored_map(extra: Vec<(Value, Value)>) -> Value {
    let mut m = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::from(1)])),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), Value::Array(vec![Value::from(5); 4])),
        (s("block_size"), Value::from(4)),
    ];
    m.extend(extra);
    Value::Map(m)
}
