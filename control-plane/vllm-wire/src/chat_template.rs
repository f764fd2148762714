//! Chat templates rendered like transformers' `apply_chat_template`, which vLLM calls for every
//! chat request: the control plane must render the same prompt text as the engine to tokenise
//! it the same way (precise routing), and vllm-sim renders it in the engine's place.
//!
//! The environment: `trim_blocks` and `lstrip_blocks` on, `raise_exception(msg)` and
//! `strftime_now(fmt)` available, Python string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`, ...) and `tojson` work, dicts keep insertion order. The caller
//! builds the context (`messages`, `add_generation_prompt`, `bos_token`, ...) and passes the
//! time `strftime_now` prints, so rendering reads no clock.

use serde::Serialize;

/// The name the one template is registered under.
const NAME: &str = "chat_template";

/// Why a template could not be compiled or rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The source is not a valid template: a configuration problem, found at load time.
    #[error("invalid chat template: {0}")]
    Invalid(String),
    /// Rendering failed, e.g. the template's `raise_exception` rejected the conversation: a
    /// problem of the request, not of the template.
    #[error("{0}")]
    Render(String),
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (a Hugging Face `chat_template`).
    pub fn new(source: &str) -> Result<Self, TemplateError> {
        let mut env = minijinja::Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| TemplateError::Invalid(format!("syntax: {e}")))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, _> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| TemplateError::Invalid(format!("{e:#}")))?;
        Ok(Self { env })
    }

    /// Renders the template with `context` (any serialisable map: `messages`,
    /// `add_generation_prompt`, `bos_token`, `tools`, ...); `strftime_now` prints the UTC time
    /// `now_unix_s` unless the context defines a variable of that name.
    pub fn render<S: Serialize>(
        &self,
        context: &S,
        now_unix_s: u64,
    ) -> Result<String, TemplateError> {
        let render_error = |e: minijinja::Error| {
            let mut msg = e.to_string();
            if let Some(d) = e.detail() {
                msg = format!("{msg}: {d}");
            }
            TemplateError::Render(msg)
        };
        let template = self.env.get_template(NAME).map_err(render_error)?;
        let strftime_now =
            minijinja::Value::from_function(move |fmt: String| strftime(&fmt, now_unix_s));
        // Of merged maps the later one wins a lookup: the caller's variables shadow
        // `strftime_now`, as they would a Jinja global.
        let ctx = minijinja::value::merge_maps([
            minijinja::context! { strftime_now },
            minijinja::Value::from(minijinja::value::Serde(context)),
        ]);
        template.render(ctx).map_err(render_error)
    }
}

/// `rendered` cut right after the final message's text `final_text`, as transformers'
/// `apply_chat_template(continue_final_message=True)` cuts it (vLLM's request field of that
/// name): the model continues the message instead of answering it. The cut is after the last
/// occurrence of the text stripped of surrounding whitespace; when the template kept the text
/// and its trailing whitespace, that whitespace stays too. `None` when the template dropped the
/// text (transformers refuses such a request). Checked against transformers by the golden
/// fixtures (`scripts/gen_chat_template_fixtures.py`, `continue_final_message` cases).
pub fn cut_after_final_message(rendered: &str, final_text: &str) -> Option<String> {
    let stripped = final_text.trim();
    let at = rendered.rfind(stripped)?;
    let from_text = final_text.trim_start();
    let end = if rendered[at..].starts_with(from_text) {
        at + from_text.len()
    } else {
        at + stripped.len()
    };
    Some(rendered[..end].to_owned())
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=indent)`, so
/// Python's `", "`/`": "` separators and no HTML escaping (minijinja's built-in, like Jinja's,
/// writes `'`, `<`, `>` and `&` as `\u0027`...: a tool description would not match).
fn tojson(
    value: &minijinja::Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    struct Python;
    impl serde_json::ser::Formatter for Python {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            self.begin_array_value(w, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let indent = match indent {
        Some(n) => Some(n),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        None => serde::Serialize::serialize(
            value,
            &mut serde_json::Serializer::with_formatter(&mut out, Python),
        ),
        Some(n) => {
            let spaces = " ".repeat(n);
            let pretty = serde_json::ser::PrettyFormatter::with_indent(spaces.as_bytes());
            serde::Serialize::serialize(
                value,
                &mut serde_json::Serializer::with_formatter(&mut out, pretty),
            )
        }
    };
    written.map_err(|e| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            "cannot serialize to JSON",
        )
        .with_source(e)
    })?;
    Ok(minijinja::Value::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// A small `strftime` for `strftime_now` (UTC): `%Y %y %m %d %e %j %H %M %S %b %B %a %A %p %%`;
/// other directives pass through as written.
pub fn strftime(fmt: &str, unix_s: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continued_final_message_is_cut_after_its_text() {
        let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhalf<|im_end|>\n";
        assert_eq!(
            cut_after_final_message(rendered, "half").as_deref(),
            Some("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhalf")
        );
        // Trailing spacing the template trimmed is not kept; spacing it kept is.
        assert_eq!(
            cut_after_final_message("A: half.\nB", "half. ").as_deref(),
            Some("A: half.")
        );
        assert_eq!(
            cut_after_final_message("A:   half.  \n<end>", "  half.  \n").as_deref(),
            Some("A:   half.  \n")
        );
        assert_eq!(cut_after_final_message("nothing", "gone"), None);
    }
    use serde_json::json;

    #[test]
    fn configured_like_apply_chat_template() {
        let src = "{{ bos_token }}{% for m in messages %}\n\
                   {% if m['role'] not in ['user', 'assistant'] %}\n\
                   {{ raise_exception('roles must be user or assistant') }}\n\
                   {% endif %}\n\
                   [{{ m['role'] | upper }}] {{ m['content'].strip() }}\n\
                   {% endfor %}\n\
                   {% if add_generation_prompt %}[ASSISTANT]{% endif %}";
        let t = ChatTemplate::new(src).unwrap();
        let ctx = |role: &str| {
            json!({"messages": [{"role": role, "content": "  hi  "}],
                   "add_generation_prompt": true, "bos_token": "<s>"})
        };
        // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation
        // before one; an expression keeps its newline.
        assert_eq!(
            t.render(&ctx("user"), 0).unwrap(),
            "<s>[USER] hi\n[ASSISTANT]"
        );
        let err = t.render(&ctx("tool"), 0).unwrap_err();
        assert!(
            matches!(&err, TemplateError::Render(m) if m.contains("roles must be user")),
            "{err}"
        );
        assert!(matches!(
            ChatTemplate::new("{% for %}"),
            Err(TemplateError::Invalid(_))
        ));
    }

    #[test]
    fn tojson_and_dicts_read_like_python() {
        let t = ChatTemplate::new(
            "{{ messages | tojson }}|{% set d = {'b': 1, 'a': 2} %}{{ d | tojson }}|\
             {% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}",
        )
        .unwrap();
        #[derive(Serialize)]
        struct Message {
            role: &'static str,
            content: &'static str,
        }
        #[derive(Serialize)]
        struct Ctx {
            messages: Vec<Message>,
        }
        let out = t
            .render(
                &Ctx {
                    messages: vec![Message {
                        role: "user",
                        content: "a",
                    }],
                },
                0,
            )
            .unwrap();
        // Python's json.dumps separators, as transformers' tojson; keys in insertion order.
        assert_eq!(
            out,
            r#"[{"role": "user", "content": "a"}]|{"b": 1, "a": 2}|b1a2"#
        );
    }

    #[test]
    fn strftime_now_prints_the_time_it_is_given() {
        let t = ChatTemplate::new("{{ strftime_now('%d %B %Y') }}").unwrap();
        // 2024-02-29 13:05:09 UTC.
        assert_eq!(
            t.render(&json!({}), 1_709_211_909).unwrap(),
            "29 February 2024"
        );
        // A context variable of the same name wins, as over a Jinja global.
        let shadow = ChatTemplate::new("{{ strftime_now }}").unwrap();
        assert_eq!(
            shadow.render(&json!({"strftime_now": "x"}), 0).unwrap(),
            "x"
        );
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%d %b %Y|%Y-%m-%d %H:%M:%S|%A %a %B %j %y %p %%|%q", t),
            "29 Feb 2024|2024-02-29 13:05:09|Thursday Thu February 060 24 PM %|%q"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("trailing %", 0), "trailing %");
    }
}
