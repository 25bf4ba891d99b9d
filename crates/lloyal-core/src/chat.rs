//! Chat templates: real Jinja rendering (minijinja) of the template stored
//! in the GGUF, or of a named built-in one. Hugging Face templates call
//! Python string methods (`.strip()`, `.startswith()` ...), which minijinja's
//! Python-compatibility layer provides.

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};

use crate::error::{Error, Result};
use crate::model::Model;

/// Built-in templates for models whose GGUF carries none (base models such
/// as Gemma 3 270M), by name.
pub const BUILTIN_TEMPLATES: &[(&str, &str)] = &[
    (
        "chatml",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    (
        "gemma",
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}\
         {% if m.role == 'system' %}{% set ns.system = ns.system + m.content + '\n\n' %}\
         {% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n\
         {{ (ns.system + m.content) if m.role == 'user' else m.content }}<end_of_turn>\n\
         {% if m.role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}\
         {% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n\
         {{ m.content | trim }}<|eot_id|>{% endfor %}\
         {% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    (
        "phi3",
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ),
];

/// Markers that end a turn in common templates; those that are single
/// tokens of the model and appear in the template become stop tokens.
const END_OF_TURN_MARKERS: &[&str] = &[
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|end|>",
    "<|endoftext|>",
    "</s>",
];

/// A rendered prompt and the tokens that end the assistant's turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPrompt {
    pub prompt: String,
    pub stop_tokens: Vec<i32>,
    /// Where the template came from: `"model"`, a built-in name, or `"custom"`.
    pub template_source: String,
}

/// Resolve `template`: `None` means the model's own; a built-in name; or
/// Jinja source. Returns (source text, where it came from).
pub fn resolve_template<'a>(
    model: &'a Model,
    template: Option<&'a str>,
) -> Result<(&'a str, String)> {
    match template {
        None => model
            .chat_template()
            .map(|t| (t, "model".to_owned()))
            .ok_or_else(|| {
                let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect();
                Error::Template(format!(
                    "this model's GGUF has no chat template (it may be a base model); pass \
                     template= with Jinja source or one of the built-in names {names:?}"
                ))
            }),
        Some(name_or_source) => Ok(BUILTIN_TEMPLATES
            .iter()
            .find(|(n, _)| *n == name_or_source)
            .map(|(n, src)| (*src, (*n).to_owned()))
            .unwrap_or((name_or_source, "custom".to_owned()))),
    }
}

/// Limits on what a template may cost. Chat templates come from model files
/// and from users, so each is bounded; crossing one is a `ChatTemplateError`.
pub mod limits {
    /// Largest template source accepted (Hugging Face's are under 20 KiB).
    pub const MAX_SOURCE_BYTES: usize = 1 << 20;
    /// Most lexical tokens in one `{{ }}` or `{% %}` tag. Long operator or
    /// attribute chains (`a.b.b.b...`) build an expression tree as deep as
    /// the chain, which minijinja compiles and frees recursively; the
    /// longest tag of a real chat template has a few dozen tokens.
    pub const MAX_TAG_TOKENS: usize = 2_000;
    /// What one render may spend (minijinja's fuel): an instruction costs
    /// one, and a byte of every string it builds 1/64 (minijinja checks a
    /// concatenation's size against what is left before it allocates). So
    /// a render runs at most 4,000,000 instructions or builds at most
    /// 256 MiB of strings in all, which bounds a string doubled in a loop
    /// to about 128 MiB. A 100-message conversation through a large
    /// Hugging Face template takes about 100,000 instructions; the largest
    /// prompt (64 MiB) a quarter of the bytes.
    pub const FUEL: u64 = 4_000_000;
    /// Largest rendered prompt, in bytes.
    pub const MAX_OUTPUT_BYTES: usize = 64 << 20;
    /// Wall-clock limit of one parse and render.
    pub const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
    /// Stack of the thread templates are parsed and rendered on.
    pub(crate) const STACK_BYTES: usize = 64 << 20;
}

/// Refuse sources whose size or tag length could exhaust the stack or the
/// memory before minijinja's own limits apply.
fn check_source(source: &str) -> Result<()> {
    if source.len() > limits::MAX_SOURCE_BYTES {
        return Err(Error::Template(format!(
            "the template is {} bytes; at most {} are accepted",
            source.len(),
            limits::MAX_SOURCE_BYTES
        )));
    }
    let longest = longest_tag(source);
    if longest > limits::MAX_TAG_TOKENS {
        return Err(Error::Template(format!(
            "a {{{{ }}}} or {{% %}} tag holds {longest} tokens; at most {} are accepted",
            limits::MAX_TAG_TOKENS
        )));
    }
    Ok(())
}

/// The most lexical tokens (names, numbers and string literals count one,
/// each other character one) in any one tag of `source`.
pub(crate) fn longest_tag(source: &str) -> usize {
    let bytes = source.as_bytes();
    let (mut i, mut longest) = (0, 0);
    while i + 1 < bytes.len() {
        let open = (bytes[i], bytes[i + 1]);
        let close = match open {
            (b'{', b'{') => b'}',
            (b'{', b'%') => b'%',
            (b'{', b'#') => {
                // A comment: skip to its end.
                i = source[i + 2..]
                    .find("#}")
                    .map_or(bytes.len(), |at| i + 2 + at + 2);
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        };
        i += 2;
        let mut tokens = 0;
        while i < bytes.len() {
            let c = bytes[i];
            if c == close && bytes.get(i + 1) == Some(&b'}') {
                i += 2;
                break;
            }
            if c.is_ascii_whitespace() {
                i += 1;
                continue;
            }
            tokens += 1;
            if c == b'"' || c == b'\'' {
                i += 1;
                while i < bytes.len() && bytes[i] != c {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            } else if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 {
                while i < bytes.len()
                    && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] >= 0x80)
                {
                    i += 1;
                }
            } else {
                i += 1;
            }
        }
        longest = longest.max(tokens);
    }
    longest
}

/// Run `f` (a parse or render) on a thread of its own, with a large stack,
/// and wait at most [`limits::TIMEOUT`] for it. Fuel bounds the work, so a
/// render that times out still ends soon after; its result is dropped.
fn bounded<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    crate::isolate::on_thread(
        "template",
        limits::STACK_BYTES,
        Some(limits::TIMEOUT),
        Error::Template,
        f,
    )
}

/// Render output that refuses to grow past `limit` bytes.
struct CappedOutput {
    text: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(limits::FUEL));
    // Hugging Face renders chat templates with these two flags on.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime_now(&fmt)
    });
    env
}

/// Enough of `strftime` for the date lines that templates print.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil-from-days (Howard Hinnant), proleptic Gregorian calendar.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
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
    let month_name = MONTHS[(month - 1) as usize];
    fmt.replace("%Y", &year.to_string())
        .replace("%m", &format!("{month:02}"))
        .replace("%d", &format!("{day:02}"))
        .replace("%B", month_name)
        .replace("%b", &month_name[..3])
}

/// Whether `source` parses as a Jinja template (within [`limits`]).
pub fn validate_template(source: &str) -> bool {
    if check_source(source).is_err() {
        return false;
    }
    let source = source.to_owned();
    bounded(move || {
        environment()
            .template_from_str(&source)
            .map(|_| ())
            .map_err(|e| Error::Template(e.to_string()))
    })
    .is_ok()
}

/// Render `source` with `messages` (JSON array of message objects) and any
/// extra variables (JSON object, may be `null`).
pub fn render(
    model: &Model,
    source: &str,
    messages_json: &str,
    add_generation_prompt: bool,
    extra_json: Option<&str>,
) -> Result<String> {
    let messages: serde_json::Value = serde_json::from_str(messages_json)
        .map_err(|e| Error::InvalidArgument(format!("messages are not valid JSON: {e}")))?;
    if !messages.is_array() {
        return Err(Error::InvalidArgument(
            "messages must be a list of dicts".into(),
        ));
    }
    let mut vars = match extra_json {
        Some(extra) => match serde_json::from_str(extra) {
            Ok(serde_json::Value::Object(map)) => map,
            Ok(serde_json::Value::Null) => serde_json::Map::new(),
            _ => {
                return Err(Error::InvalidArgument(
                    "template variables must be a JSON object".into(),
                ))
            }
        },
        None => serde_json::Map::new(),
    };
    let special_text = |t: Option<i32>| {
        t.and_then(|t| model.token_bytes(t, true).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    vars.entry("bos_token")
        .or_insert_with(|| special_text(model.bos_token()).into());
    vars.entry("eos_token")
        .or_insert_with(|| special_text(Some(model.eog_token())).into());
    vars.insert("messages".into(), messages);
    vars.insert("add_generation_prompt".into(), add_generation_prompt.into());
    check_source(source)?;
    let source = source.to_owned();
    bounded(move || {
        let env = environment();
        let template = env
            .template_from_str(&source)
            .map_err(|e| Error::Template(format!("template does not parse: {e:#}")))?;
        let mut out = CappedOutput {
            text: Vec::new(),
            limit: limits::MAX_OUTPUT_BYTES,
            overflowed: false,
        };
        let ctx = Value::from(minijinja::value::Serde(&vars));
        let rendered = template.render_captured_to(ctx, &mut out).map(drop);
        match rendered {
            Ok(()) => Ok(String::from_utf8_lossy(&out.text).into_owned()),
            Err(_) if out.overflowed => Err(Error::Template(format!(
                "the rendered prompt would exceed {} bytes",
                limits::MAX_OUTPUT_BYTES
            ))),
            Err(e) => Err(Error::Template(format!("template failed to render: {e:#}"))),
        }
    })
}

/// Render a conversation and collect the tokens that end the turn.
pub fn format_chat(
    model: &Model,
    template: Option<&str>,
    messages_json: &str,
    add_generation_prompt: bool,
    extra_json: Option<&str>,
) -> Result<ChatPrompt> {
    let (source, origin) = resolve_template(model, template)?;
    let prompt = render(
        model,
        source,
        messages_json,
        add_generation_prompt,
        extra_json,
    )?;
    let mut stop_tokens = vec![model.eog_token()];
    for marker in END_OF_TURN_MARKERS {
        if source.contains(marker) {
            if let Some(t) = model.single_token(marker) {
                if !stop_tokens.contains(&t) {
                    stop_tokens.push(t);
                }
            }
        }
    }
    stop_tokens.retain(|&t| t >= 0);
    Ok(ChatPrompt {
        prompt,
        stop_tokens,
        template_source: origin,
    })
}

/// The tokens a template writes after an assistant message (e.g. ChatML's
/// `<|im_end|>\n`): what to append to close a generated turn before adding
/// the next user message to a live sequence. Falls back to the EOG token.
pub fn turn_separator(model: &Model, template: Option<&str>) -> Result<Vec<i32>> {
    const SENTINEL: &str = "LLOYALSENTINEL";
    let fallback = vec![model.eog_token()];
    let Ok((source, _)) = resolve_template(model, template) else {
        return Ok(fallback);
    };
    let messages = serde_json::json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": SENTINEL},
    ])
    .to_string();
    let Ok(rendered) = render(model, source, &messages, false, None) else {
        return Ok(fallback);
    };
    let Some(at) = rendered.rfind(SENTINEL) else {
        return Ok(fallback);
    };
    let tail = &rendered[at + SENTINEL.len()..];
    let tokens = model.tokenize(tail, Some(false), true)?;
    Ok(if tokens.is_empty() { fallback } else { tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_templates_parse() {
        for (name, src) in BUILTIN_TEMPLATES {
            assert!(validate_template(src), "{name} does not parse");
        }
        assert!(!validate_template("{% for %}"));
    }

    #[test]
    fn hostile_templates_are_errors_not_crashes() {
        // Chains that used to overflow the stack in minijinja's compiler.
        for chain in [".b", " + 1", "|e", " ~ 'x'"] {
            let src = format!("{{{{ a{} }}}}", chain.repeat(100_000));
            assert!(!validate_template(&src));
            let e = check_source(&src).unwrap_err();
            assert!(e.to_string().contains("tokens"), "{e}");
        }
        assert!(!validate_template(&format!(
            "{{{{ {}1 }}}}",
            "-".repeat(100_000)
        )));
        assert!(!validate_template(
            &"x".repeat(limits::MAX_SOURCE_BYTES + 1)
        ));
        // Strings, comments and raw text do not count as tag tokens.
        let ok = format!(
            "{}{{# {} #}}{{{{ '{}' }}}}",
            "text ".repeat(10_000),
            "+ ".repeat(10_000),
            "+".repeat(10_000)
        );
        assert_eq!(longest_tag(&ok), 1);
        assert!(validate_template(&ok));
    }

    #[test]
    fn strftime_formats_a_date() {
        let s = strftime_now("%d %B %Y");
        assert!(s.len() >= 10, "{s}");
        assert!(s.chars().last().unwrap().is_ascii_digit());
    }
}
