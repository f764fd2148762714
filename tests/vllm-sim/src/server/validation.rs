//! Request-body validation errors as a vLLM 0.33 server renders them.
//!
//! FastAPI validates a body against the endpoint's pydantic model before the handler runs, and
//! vLLM's `validation_exception_handler`
//! (`vllm/entrypoints/serve/exception_handling/handlers/validation.py`) answers 400 in the
//! OpenAI error shape whatever the endpoint (so `/v1/messages` too): `type` `"Bad Request"`,
//! `param` the first error's location (`body.max_tokens`), and a message listing each pydantic
//! error as the Python dict `str()` prints, its `input` summarised (`_summarize_error_input`):
//!
//! ```text
//! 1 validation error:
//!   {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required', 'input': '<dict of 3 items>'}
//! ```
//!
//! Only the errors a client commonly meets are modelled: a missing field, a wrong JSON type
//! for a string, list or integer field, a `field_validator`'s `ValueError`, a body that is not
//! a JSON object, and malformed JSON (whose `ctx` says `Expecting value` where Python's
//! decoder may word it otherwise).

use axum::http::StatusCode;
use serde_json::{Map, Value};

use super::ApiError;

/// At most this many errors are listed (`_MAX_REPORTED_ERRORS`).
const MAX_REPORTED_ERRORS: usize = 10;
/// A string `input` is cut after this many characters (`_MAX_ERROR_INPUT_CHARS`).
const MAX_INPUT_CHARS: usize = 200;
/// One rendered error is cut after this many characters (`_MAX_ERROR_CHARS`).
const MAX_ERROR_CHARS: usize = 1000;

/// One pydantic error (`ValidationError.errors()` without its URL, as FastAPI keeps it).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FieldError {
    kind: &'static str,
    loc: String,
    msg: String,
    input: String,
    /// The `ctx` dict already rendered, e.g. `{'error': ValueError('...')}`.
    ctx: Option<String>,
}

impl FieldError {
    /// A required field is absent; pydantic reports the enclosing object as the input.
    pub(super) fn missing(field: &str, body: &Map<String, Value>) -> Self {
        Self {
            kind: "missing",
            loc: format!("body.{field}"),
            msg: "Field required".into(),
            input: format!("<dict of {} items>", body.len()),
            ctx: None,
        }
    }

    /// A `field_validator` raised `ValueError(message)` for `value`.
    pub(super) fn value_error(field: &str, message: &str, value: &Value) -> Self {
        Self::about(
            field,
            "value_error",
            format!("Value error, {message}"),
            value,
            Some(format!("{{'error': ValueError({})}}", py_str(message))),
        )
    }

    /// A `Literal[...]` field got another value; `expected` lists the choices as pydantic does
    /// (`'user', 'assistant' or 'system'`).
    pub(super) fn literal(field: &str, expected: &str, value: &Value) -> Self {
        Self::about(
            field,
            "literal_error",
            format!("Input should be {expected}"),
            value,
            Some(format!("{{'expected': {}}}", py_str(expected))),
        )
    }

    /// This error, found inside `prefix` (a field of `body.messages.0` for `messages.0`).
    pub(super) fn nested(mut self, prefix: &str) -> Self {
        self.loc = self.loc.replacen("body", &format!("body.{prefix}"), 1);
        self
    }

    /// `value` is not a `str`.
    fn not_a_string(field: &str, value: &Value) -> Self {
        Self::type_error(
            field,
            "string_type",
            "Input should be a valid string",
            value,
        )
    }

    /// `value` is not a `list`.
    fn not_a_list(field: &str, value: &Value) -> Self {
        Self::type_error(field, "list_type", "Input should be a valid list", value)
    }

    /// `value` is not of the field's type (`kind`, `msg` as pydantic words them).
    fn type_error(field: &str, kind: &'static str, msg: &str, value: &Value) -> Self {
        Self::about(field, kind, msg.into(), value, None)
    }

    /// An error of `kind` about `value`, the body's `field`.
    fn about(
        field: &str,
        kind: &'static str,
        msg: String,
        value: &Value,
        ctx: Option<String>,
    ) -> Self {
        Self {
            kind,
            loc: format!("body.{field}"),
            msg,
            input: summarize(value),
            ctx,
        }
    }

    /// The dict as Python's `str()` prints it, cut like `_format_error`.
    fn render(&self) -> String {
        let mut out = format!(
            "{{'type': {}, 'loc': {}, 'msg': {}, 'input': {}",
            py_str(self.kind),
            py_str(&self.loc),
            py_str(&self.msg),
            py_str(&self.input)
        );
        if let Some(ctx) = &self.ctx {
            out.push_str(", 'ctx': ");
            out.push_str(ctx);
        }
        out.push('}');
        if out.chars().count() > MAX_ERROR_CHARS {
            out = out.chars().take(MAX_ERROR_CHARS).collect::<String>() + "...[truncated]";
        }
        out
    }
}

/// The 400 vLLM answers for `errors` (at least one).
pub(super) fn validation_error(errors: &[FieldError]) -> ApiError {
    let count = errors.len();
    let label = if count == 1 { "error" } else { "errors" };
    let mut message = format!("{count} validation {label}:\n");
    for e in errors.iter().take(MAX_REPORTED_ERRORS) {
        message.push_str("  ");
        message.push_str(&e.render());
        message.push('\n');
    }
    if count > MAX_REPORTED_ERRORS {
        let more = count - MAX_REPORTED_ERRORS;
        message.push_str(&format!("  ...and {more} more {label}\n"));
    }
    let mut err = ApiError::new(StatusCode::BAD_REQUEST, message.trim_end()).kind("Bad Request");
    err.param = errors.first().map(|e| e.loc.clone());
    err.framework = true;
    err
}

/// The body as a JSON object, or the validation error FastAPI answers for it.
pub(super) fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        // No body at all: the body parameter itself is missing.
        return Err(validation_error(&[FieldError {
            kind: "missing",
            loc: "body".into(),
            msg: "Field required".into(),
            input: "None".into(),
            ctx: None,
        }]));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(validation_error(&[FieldError {
            kind: "model_attributes_type",
            loc: "body".into(),
            msg: "Input should be a valid dictionary or object to extract fields from".into(),
            input: summarize(&other),
            ctx: None,
        }])),
        Err(e) => Err(validation_error(&[FieldError {
            kind: "json_invalid",
            loc: format!("body.{}", byte_offset(body, e.line(), e.column())),
            msg: "JSON decode error".into(),
            input: "<dict of 0 items>".into(),
            ctx: Some("{'error': 'Expecting value'}".into()),
        }])),
    }
}

/// The offset of 1-based `line`, `column` in `text` (where Python's decoder reports `pos`).
fn byte_offset(text: &[u8], line: usize, column: usize) -> usize {
    let line_start: usize = text
        .split(|b| *b == b'\n')
        .take(line.saturating_sub(1))
        .map(|l| l.len() + 1)
        .sum();
    (line_start + column.saturating_sub(1)).min(text.len())
}

/// Checks that `fields` are present (pydantic reports every missing field, in model order).
pub(super) fn require(body: &Map<String, Value>, fields: &[&str]) -> Vec<FieldError> {
    fields
        .iter()
        .filter(|f| !body.contains_key(**f))
        .map(|f| FieldError::missing(f, body))
        .collect()
}

/// A `str` field: `None` when absent or null is allowed by the caller's check.
pub(super) fn string_field<'a>(
    body: &'a Map<String, Value>,
    field: &str,
) -> Result<Option<&'a str>, FieldError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(FieldError::not_a_string(field, v)),
    }
}

/// A `list` field.
pub(super) fn list_field<'a>(
    body: &'a Map<String, Value>,
    field: &str,
) -> Result<Option<&'a Vec<Value>>, FieldError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => Ok(Some(items)),
        Some(v) => Err(FieldError::not_a_list(field, v)),
    }
}

/// An `int` field, read in pydantic's lax mode: an integral float or a numeric string is
/// accepted.
pub(super) fn int_field(body: &Map<String, Value>, field: &str) -> Result<Option<i64>, FieldError> {
    let v = match body.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let err = |kind, msg: &str| FieldError::type_error(field, kind, msg, v);
    match v {
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.2e18 => Ok(Some(f as i64)),
            _ => Err(err(
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
            )),
        },
        Value::Bool(b) => Ok(Some(i64::from(*b))),
        Value::String(s) => s.trim().parse::<i64>().map(Some).map_err(|_| {
            err(
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
            )
        }),
        _ => Err(err("int_type", "Input should be a valid integer")),
    }
}

/// A `bool` field in pydantic's lax mode (`0`/`1`, and strings such as `"true"`, `"no"`);
/// `None` when absent or null (the caller picks the default).
pub(super) fn bool_field(
    body: &Map<String, Value>,
    field: &str,
) -> Result<Option<bool>, FieldError> {
    let v = match body.get(field) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let parsed = match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    };
    match (parsed, v) {
        (Some(b), _) => Ok(Some(b)),
        (None, Value::String(_) | Value::Number(_)) => Err(FieldError::type_error(
            field,
            "bool_parsing",
            "Input should be a valid boolean, unable to interpret input",
            v,
        )),
        (None, _) => Err(FieldError::type_error(
            field,
            "bool_type",
            "Input should be a valid boolean",
            v,
        )),
    }
}

/// The two errors pydantic reports for a `str | list[...]` field given neither.
pub(super) fn str_or_list_errors(field: &str, value: &Value) -> Vec<FieldError> {
    vec![
        FieldError::not_a_string(field, value),
        FieldError::not_a_list(field, value),
    ]
}

/// `_summarize_error_input`: strings cut, containers described, scalars as Python prints them.
fn summarize(v: &Value) -> String {
    match v {
        Value::String(s) if s.chars().count() > MAX_INPUT_CHARS => {
            s.chars().take(MAX_INPUT_CHARS).collect::<String>() + "...[truncated]"
        }
        Value::String(s) => s.clone(),
        Value::Array(items) => format!("<list of {} items>", items.len()),
        Value::Object(map) => format!("<dict of {} items>", map.len()),
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => n.to_string(),
    }
}

/// A string as Python's `repr()` writes it (the router's writer, so both agree).
fn py_str(s: &str) -> String {
    vllm_wire::agent_chat::python_repr(&Value::from(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::tests::obj;
    use serde_json::json;

    #[test]
    fn a_missing_field_reads_as_fastapi_and_vllm_render_it() {
        let body = obj(json!({"model": "m", "messages": [], "stream": true}));
        let err = validation_error(&require(&body, &["model", "messages", "max_tokens"]));
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.error_type(), "Bad Request");
        assert_eq!(err.param.as_deref(), Some("body.max_tokens"));
        assert!(err.framework);
        assert_eq!(
            err.message,
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', \
             'msg': 'Field required', 'input': '<dict of 3 items>'}"
        );
    }

    #[test]
    fn several_errors_are_counted_and_a_value_error_carries_its_ctx() {
        let e = FieldError::value_error("max_tokens", "max_tokens must be positive", &json!(0));
        let err = validation_error(&[e.clone(), e]);
        assert!(
            err.message
                .starts_with("2 validation errors:\n  {'type': 'value_error'")
        );
        assert!(err.message.contains(
            "'msg': 'Value error, max_tokens must be positive', 'input': '0', \
             'ctx': {'error': ValueError('max_tokens must be positive')}}"
        ));
    }

    #[test]
    fn lax_integers_and_python_reprs() {
        let body = obj(json!({"a": 5.0, "b": "7", "c": 1.5, "d": "x", "e": []}));
        assert_eq!(int_field(&body, "a"), Ok(Some(5)));
        assert_eq!(int_field(&body, "b"), Ok(Some(7)));
        assert_eq!(int_field(&body, "c").unwrap_err().kind, "int_from_float");
        assert_eq!(int_field(&body, "d").unwrap_err().kind, "int_parsing");
        assert_eq!(int_field(&body, "e").unwrap_err().kind, "int_type");
        assert_eq!(int_field(&body, "zz"), Ok(None));
        assert_eq!(py_str("it's"), "\"it's\"");
        assert_eq!(py_str("a'\"b\n"), "'a\\'\"b\\n'");
    }

    #[test]
    fn bodies_that_are_no_object() {
        let e = json_object(b"[1, 2]").unwrap_err();
        assert!(
            e.message.contains("'input': '<list of 2 items>'"),
            "{}",
            e.message
        );
        let e = json_object(b"{\"a\": ").unwrap_err();
        assert!(
            e.message.contains("'type': 'json_invalid'"),
            "{}",
            e.message
        );
        assert!(e.param.as_deref().unwrap().starts_with("body."));
        let e = json_object(b"").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
    }
}
