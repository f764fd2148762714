//! A shared, cheaply cloned endpoint address.
//!
//! Every decision lists every candidate with its address for explain output. Cloning a
//! `String` per candidate was the largest allocation cost of `Router::route` in profiles, so the
//! router keeps each address once behind an `Arc` and candidates share it.
//!
//! An endpoint is one engine: a vLLM server's `ip:port`, or one data-parallel rank of a server
//! that runs several engines behind one API (`--data-parallel-size`), written
//! `ip:port#dp<rank>` ([`rank_endpoint`], [`split_rank`]). Each rank has its own cache and
//! load, so the router scores and indexes ranks as endpoints of their own; only the edges that
//! talk to the server (the proxy's destination, scrapes, KV-event sockets) split the rank off.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An endpoint's `ip:port`, shared by reference count; reads like a `&str`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EndpointAddress(Arc<str>);

impl EndpointAddress {
    /// The address as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for EndpointAddress {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for EndpointAddress {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for EndpointAddress {
    fn from(s: &str) -> Self {
        Self(Arc::from(s))
    }
}

impl From<String> for EndpointAddress {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl From<EndpointAddress> for String {
    fn from(a: EndpointAddress) -> Self {
        a.0.to_string()
    }
}

impl PartialEq<str> for EndpointAddress {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for EndpointAddress {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl PartialEq<String> for EndpointAddress {
    fn eq(&self, other: &String) -> bool {
        &*self.0 == other.as_str()
    }
}

impl PartialEq<EndpointAddress> for String {
    fn eq(&self, other: &EndpointAddress) -> bool {
        self.as_str() == &*other.0
    }
}

impl PartialEq<EndpointAddress> for &str {
    fn eq(&self, other: &EndpointAddress) -> bool {
        *self == &*other.0
    }
}

impl Serialize for EndpointAddress {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for EndpointAddress {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Self::from)
    }
}

/// What separates a server's `ip:port` from a data-parallel rank in an endpoint's name.
pub const RANK_SEPARATOR: &str = "#dp";

/// The endpoint name of data-parallel rank `rank` of the server at `server` (`ip:port`).
pub fn rank_endpoint(server: &str, rank: u32) -> String {
    format!("{server}{RANK_SEPARATOR}{rank}")
}

/// An endpoint's server address and data-parallel rank: `("10.0.0.5:8000", Some(2))` for
/// `10.0.0.5:8000#dp2`, the whole name and `None` for an endpoint without a rank (or with a
/// suffix that is not a rank number).
pub fn split_rank(endpoint: &str) -> (&str, Option<u32>) {
    // Split at the last `#` (a char search: every routed request splits its endpoints, and a
    // `str` pattern builds a substring searcher each call); a rank's digits hold no `#`.
    let split = endpoint
        .rsplit_once(RANK_SEPARATOR.as_bytes()[0] as char)
        .and_then(|(server, tail)| Some((server, tail.strip_prefix(&RANK_SEPARATOR[1..])?)));
    match split {
        Some((server, rank)) if !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => {
            match rank.parse() {
                Ok(rank) => (server, Some(rank)),
                Err(_) => (endpoint, None),
            }
        }
        _ => (endpoint, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_is_named_after_its_server_and_split_back() {
        let e = rank_endpoint("10.0.0.5:8000", 2);
        assert_eq!(e, "10.0.0.5:8000#dp2");
        assert_eq!(split_rank(&e), ("10.0.0.5:8000", Some(2)));
        assert_eq!(split_rank("[::1]:8000#dp0"), ("[::1]:8000", Some(0)));
        assert_eq!(split_rank("10.0.0.5:8000"), ("10.0.0.5:8000", None));
        assert_eq!(split_rank("10.0.0.5:8000#dp"), ("10.0.0.5:8000#dp", None));
        assert_eq!(split_rank("10.0.0.5:8000#dpx"), ("10.0.0.5:8000#dpx", None));
        assert_eq!(split_rank("a:1#dp99999999999"), ("a:1#dp99999999999", None));
        // The last `#dp` decides, and anything after it must be digits.
        assert_eq!(split_rank("a:1#dp#dp2"), ("a:1#dp", Some(2)));
        assert_eq!(split_rank("a:1#dp1#x"), ("a:1#dp1#x", None));
        assert_eq!(split_rank("a:1#dp1#"), ("a:1#dp1#", None));
    }

    #[test]
    fn reads_compares_and_serialises_like_a_string() {
        let a = EndpointAddress::from("10.0.0.1:8000");
        let b = a.clone();
        assert_eq!(a, b);
        assert!(a == "10.0.0.1:8000");
        assert!(a == *"10.0.0.1:8000");
        let owned = String::from("10.0.0.1:8000");
        assert!(a == owned);
        assert!(owned == a);
        assert_eq!(a.as_str(), "10.0.0.1:8000");
        assert_eq!(a.to_string(), "10.0.0.1:8000");
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, "\"10.0.0.1:8000\"");
        let back: EndpointAddress = serde_json::from_str(&json).unwrap();
        assert_eq!(back, a);
        assert_eq!(format!("{a:?}"), "\"10.0.0.1:8000\"");
    }
}
