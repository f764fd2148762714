//! Block-hash lists on the wire: a JSON array of integers, or one base64 string of the hashes'
//! little-endian bytes.
//!
//! A decision names every block of its prompt (800 for a 200 KB one). Every copy that decides
//! locally sends its decisions on each sync tick and reads every other router's, and parsing
//! 800 twenty-digit JSON numbers cost a copy more than much of the decision did. As base64 the
//! message is half the bytes (`filter`'s `request_path` example prints the sync bytes a
//! request) and decodes without per-digit work; writing it costs about what it did (serde_json
//! scans the string it writes).
//!
//! Readers take either form, so a message from an older writer still reads. Writers use the
//! array unless told otherwise: [`crate::sync::to_json`] writes a sync message with its lists in
//! base64 towards a peer that said it reads them (`SyncRequest::compact_hashes`,
//! `SyncResponse::compact_hashes`). Route calls, feedback and the replicas' shared stream keep
//! the array.

use std::cell::Cell;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;

thread_local! {
    /// Whether lists are written as base64 on this thread right now ([`compact`]).
    static COMPACT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `serialise` with every block-hash list written as one base64 string. Serialisation is
/// synchronous, so the switch covers exactly the messages built inside; it is restored on the
/// way out, also by a panic. Callers outside go through `sync::to_json`, the one place that
/// decides when a peer gets base64.
pub(crate) fn compact<R>(serialise: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COMPACT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(COMPACT.with(|c| c.replace(true)));
    serialise()
}

/// Writes `hashes` as an array, or as base64 inside [`compact`].
pub(crate) fn serialize<S: Serializer>(hashes: &[u64], s: S) -> Result<S::Ok, S::Error> {
    if COMPACT.with(Cell::get) {
        let mut bytes = Vec::with_capacity(hashes.len() * 8);
        for h in hashes {
            bytes.extend_from_slice(&h.to_le_bytes());
        }
        s.serialize_str(&STANDARD.encode(bytes))
    } else {
        s.collect_seq(hashes)
    }
}

/// Reads either form.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    d.deserialize_any(HashListVisitor)
}

struct HashListVisitor;

impl<'de> Visitor<'de> for HashListVisitor {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of block hashes or a base64 string of their little-endian bytes")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        // The hint comes from the message: trust it only so far.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(h) = seq.next_element()? {
            out.push(h);
        }
        Ok(out)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Vec<u64>, E> {
        let bytes = STANDARD
            .decode(s)
            .map_err(|e| E::custom(format_args!("block hashes: {e}")))?;
        if bytes.len() % 8 != 0 {
            return Err(E::invalid_length(bytes.len(), &"a multiple of 8 bytes"));
        }
        Ok(bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::compact;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Holder {
        #[serde(with = "super")]
        hashes: Vec<u64>,
    }

    fn holder() -> Holder {
        Holder {
            hashes: vec![0, 1, u64::MAX, 0x0123_4567_89ab_cdef, 1 << 63],
        }
    }

    #[test]
    fn an_array_unless_asked_for_base64() {
        let plain = serde_json::to_string(&holder()).unwrap();
        assert_eq!(
            plain,
            r#"{"hashes":[0,1,18446744073709551615,81985529216486895,9223372036854775808]}"#
        );
        let small = compact(|| serde_json::to_string(&holder()).unwrap());
        assert!(small.starts_with(r#"{"hashes":""#), "{small}");
        assert!(small.len() < plain.len());
        // The switch ends with the closure.
        assert_eq!(serde_json::to_string(&holder()).unwrap(), plain);
    }

    #[test]
    fn both_forms_read_back_the_same_list() {
        for text in [
            serde_json::to_string(&holder()).unwrap(),
            compact(|| serde_json::to_string(&holder()).unwrap()),
        ] {
            assert_eq!(serde_json::from_str::<Holder>(&text).unwrap(), holder());
        }
        let empty = Holder { hashes: vec![] };
        let text = compact(|| serde_json::to_string(&empty).unwrap());
        assert_eq!(text, r#"{"hashes":""}"#);
        assert_eq!(serde_json::from_str::<Holder>(&text).unwrap(), empty);
    }

    #[test]
    fn a_bad_list_is_an_error_not_a_panic() {
        for bad in [
            r#"{"hashes":"!!!!"}"#,
            r#"{"hashes":"AAAA"}"#, // 3 bytes: not whole hashes
            r#"{"hashes":[1,-2]}"#,
            r#"{"hashes":[1.5]}"#,
            r#"{"hashes":7}"#,
            r#"{"hashes":{"a":1}}"#,
        ] {
            assert!(serde_json::from_str::<Holder>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_switch_is_restored_after_a_panic() {
        let caught = std::panic::catch_unwind(|| compact(|| panic!("serialiser failed")));
        assert!(caught.is_err());
        assert!(serde_json::to_string(&holder()).unwrap().contains('['));
    }
}
