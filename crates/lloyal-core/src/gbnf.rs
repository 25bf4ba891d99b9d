//! GBNF (llama.cpp's grammar format) translated to llguidance's Lark syntax.
//!
//! Supported: rules (`name ::= ...`, continued after `|` or inside
//! parentheses), `root` as the start rule, string literals, character
//! classes (`[a-z]`, `[^"\\]`), `.`, grouping, alternation, the postfix
//! operators `*` `+` `?` `{m}` `{m,}` `{m,n}` `{,n}`, escapes `\n \r \t \\
//! \" \[ \] \- \xHH \uHHHH \UHHHHHHHH`, and `#` comments. Anything else
//! (token references `<...>`, `!` negation, undefined rules, a missing
//! `root`) is an error, so a grammar is never applied half-understood.
//!
//! Rule names are re-spelled so that every GBNF name (which may contain
//! upper case) becomes a distinct lower-case Lark rule.

use std::collections::BTreeSet;
use std::fmt::Write;

/// How deep parentheses may nest: llguidance's own Lark limit, checked here
/// first (the translator recurses on them).
pub const MAX_NESTING: usize = 30;

/// Translate GBNF text to a Lark grammar for llguidance, or say what is
/// wrong (with a line number).
pub fn gbnf_to_lark(gbnf: &str) -> Result<String, String> {
    let mut parser = Parser {
        src: gbnf.as_bytes(),
        pos: 0,
        line: 1,
        defined: BTreeSet::new(),
        used: BTreeSet::new(),
        depth: 0,
    };
    let mut rules = Vec::new();
    loop {
        parser.skip_space(true);
        if parser.at_end() {
            break;
        }
        rules.push(parser.rule()?);
    }
    if !parser.defined.contains("root") {
        return Err("the grammar has no `root` rule".to_owned());
    }
    if let Some(missing) = parser.used.difference(&parser.defined).next() {
        return Err(format!("rule `{missing}` is used but never defined"));
    }
    let mut lark = format!("start: {}\n", lark_name("root"));
    for (name, body) in rules {
        let _ = writeln!(lark, "{}: {}", lark_name(&name), body);
    }
    Ok(lark)
}

/// `g_` + the name with `_` doubled and each upper-case letter spelled
/// `_` + its lower case: distinct GBNF names stay distinct.
fn lark_name(name: &str) -> String {
    let mut out = String::from("g_");
    for c in name.chars() {
        match c {
            '_' => out.push_str("__"),
            'A'..='Z' => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            _ => out.push(c),
        }
    }
    out
}

struct Parser<'a> {
    src: &'a [u8],
    pos: usize,
    line: usize,
    defined: BTreeSet<String>,
    used: BTreeSet<String>,
    /// Parentheses open around the current position.
    depth: usize,
}

impl Parser<'_> {
    fn at_end(&self) -> bool {
        self.pos >= self.src.len()
    }

    fn peek(&self) -> Option<u8> {
        self.src.get(self.pos).copied()
    }

    fn error(&self, what: impl std::fmt::Display) -> String {
        format!("GBNF line {}: {what}", self.line)
    }

    /// Skip blanks and comments; newlines too when `newlines`.
    fn skip_space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' => self.pos += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.pos += 1;
                    }
                }
                b'\r' | b'\n' if newlines => {
                    if c == b'\n' {
                        self.line += 1;
                    }
                    self.pos += 1;
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.error(format!("expected a rule name, found {}", self.found())));
        }
        Ok(String::from_utf8_lossy(&self.src[start..self.pos]).into_owned())
    }

    fn found(&self) -> String {
        match self.peek() {
            None => "the end of the grammar".to_owned(),
            Some(_) => {
                let rest = String::from_utf8_lossy(&self.src[self.pos..]);
                let snippet: String = rest.chars().take(12).collect();
                format!("`{snippet}`")
            }
        }
    }

    fn rule(&mut self) -> Result<(String, String), String> {
        let name = self.name()?;
        self.skip_space(false);
        if !self.src[self.pos..].starts_with(b"::=") {
            return Err(self.error(format!("expected `::=` after `{name}`")));
        }
        self.pos += 3;
        if !self.defined.insert(name.clone()) {
            return Err(self.error(format!("rule `{name}` is defined twice")));
        }
        self.skip_space(true);
        let body = self.alternates(false)?;
        self.skip_space(false);
        match self.peek() {
            None | Some(b'\n' | b'\r') => Ok((name, body)),
            Some(_) => Err(self.error(format!("unexpected {}", self.found()))),
        }
    }

    fn alternates(&mut self, nested: bool) -> Result<String, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some(b'|') {
            self.pos += 1;
            self.skip_space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(&mut self, nested: bool) -> Result<String, String> {
        let mut items: Vec<String> = Vec::new();
        loop {
            let item = match self.peek() {
                Some(b'"') => self.literal()?,
                Some(b'[') => self.char_class()?,
                Some(b'.') => {
                    self.pos += 1;
                    "/(?s:.)/".to_owned()
                }
                Some(b'(') => {
                    if self.depth >= MAX_NESTING {
                        return Err(
                            self.error(format!("parentheses nest more than {MAX_NESTING} deep"))
                        );
                    }
                    self.pos += 1;
                    self.skip_space(true);
                    self.depth += 1;
                    let inner = self.alternates(true);
                    self.depth -= 1;
                    let inner = inner?;
                    self.skip_space(true);
                    if self.peek() != Some(b')') {
                        return Err(self.error(format!("expected `)`, found {}", self.found())));
                    }
                    self.pos += 1;
                    format!("({inner})")
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let save = (self.pos, self.line);
                    let name = self.name()?;
                    // `name ::=` starts the next rule.
                    let mut probe = self.pos;
                    while matches!(self.src.get(probe), Some(b' ' | b'\t')) {
                        probe += 1;
                    }
                    if self.src[probe..].starts_with(b"::=") {
                        (self.pos, self.line) = save;
                        break;
                    }
                    self.used.insert(name.clone());
                    lark_name(&name)
                }
                Some(b'<') => return Err(self.error("token references `<...>` are not supported")),
                Some(b'!') => return Err(self.error("`!` (token negation) is not supported")),
                _ => break,
            };
            self.skip_space(nested);
            let item = self.postfix(item, nested)?;
            items.push(item);
        }
        if items.is_empty() {
            // An empty alternative matches the empty string.
            return Ok("\"\"".to_owned());
        }
        Ok(items.join(" "))
    }

    fn postfix(&mut self, mut item: String, nested: bool) -> Result<String, String> {
        loop {
            match self.peek() {
                Some(op @ (b'*' | b'+' | b'?')) => {
                    self.pos += 1;
                    item = format!("({item}){}", op as char);
                }
                Some(b'{') => {
                    self.pos += 1;
                    let (min, max) = self.repetition()?;
                    item = match max {
                        Some(max) => format!("({item}){{{min},{max}}}"),
                        None => format!("({item}){{{min},}}"),
                    };
                }
                _ => return Ok(item),
            }
            self.skip_space(nested);
        }
    }

    /// `{m}`, `{m,}`, `{m,n}` or `{,n}`, after the `{`.
    fn repetition(&mut self) -> Result<(u32, Option<u32>), String> {
        let number = |p: &mut Self| -> Result<Option<u32>, String> {
            p.skip_space(false);
            let start = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.pos += 1;
            }
            let digits = std::str::from_utf8(&p.src[start..p.pos]).unwrap_or("");
            let n = if digits.is_empty() {
                None
            } else {
                Some(
                    digits
                        .parse()
                        .map_err(|_| p.error("repetition count is too large"))?,
                )
            };
            p.skip_space(false);
            Ok(n)
        };
        let min = number(self)?;
        let (min, max) = if self.peek() == Some(b',') {
            self.pos += 1;
            (min.unwrap_or(0), number(self)?)
        } else {
            let n = min.ok_or_else(|| self.error("expected a number in `{...}`"))?;
            (n, Some(n))
        };
        if self.peek() != Some(b'}') {
            return Err(self.error(format!("expected `}}`, found {}", self.found())));
        }
        self.pos += 1;
        if max.is_some_and(|max| max < min) {
            return Err(self.error(format!("repetition {{{min},..}} has max below min")));
        }
        Ok((min, max))
    }

    /// One character of a literal or class, decoding escapes.
    fn char(&mut self) -> Result<char, String> {
        let rest = std::str::from_utf8(&self.src[self.pos..])
            .map_err(|_| self.error("the grammar is not valid UTF-8"))?;
        let mut chars = rest.chars();
        let c = chars
            .next()
            .ok_or_else(|| self.error("unterminated literal"))?;
        if c == '\n' {
            return Err(self.error("unterminated literal"));
        }
        self.pos += c.len_utf8();
        if c != '\\' {
            return Ok(c);
        }
        let e = chars
            .next()
            .ok_or_else(|| self.error("unterminated escape"))?;
        self.pos += e.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Result<char, String> {
            let digits = p
                .src
                .get(p.pos..p.pos + n)
                .and_then(|d| std::str::from_utf8(d).ok())
                .ok_or_else(|| p.error("truncated escape"))?;
            let value = u32::from_str_radix(digits, 16).map_err(|_| p.error("bad hex escape"))?;
            p.pos += n;
            char::from_u32(value).ok_or_else(|| p.error("escape is not a Unicode scalar"))
        };
        match e {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            '0' => Ok('\0'),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            '\\' | '"' | '[' | ']' | '-' | '^' | '/' => Ok(e),
            other => Err(self.error(format!("unknown escape `\\{other}`"))),
        }
    }

    fn literal(&mut self) -> Result<String, String> {
        self.pos += 1; // opening quote
        let mut text = String::new();
        while self.peek() != Some(b'"') {
            text.push(self.char()?);
        }
        self.pos += 1;
        if text.is_empty() {
            return Ok("\"\"".to_owned());
        }
        serde_json::to_string(&text).map_err(|e| self.error(e))
    }

    fn char_class(&mut self) -> Result<String, String> {
        self.pos += 1; // `[`
        let mut regex = String::from("/[");
        if self.peek() == Some(b'^') {
            self.pos += 1;
            regex.push('^');
        }
        let mut empty = true;
        while self.peek() != Some(b']') {
            let lo = self.char()?;
            push_class_char(&mut regex, lo);
            if self.peek() == Some(b'-') && self.src.get(self.pos + 1) != Some(&b']') {
                self.pos += 1;
                let hi = self.char()?;
                if hi < lo {
                    return Err(self.error(format!("range `{lo}-{hi}` is reversed")));
                }
                regex.push('-');
                push_class_char(&mut regex, hi);
            }
            empty = false;
        }
        self.pos += 1;
        if empty {
            return Err(self.error("empty character class `[]`"));
        }
        regex.push_str("]/");
        Ok(regex)
    }
}

/// A class member for a `/.../` regex: ASCII letters and digits as they
/// are, everything else as `\u{..}` so no character can break the regex.
fn push_class_char(regex: &mut String, c: char) {
    if c.is_ascii_alphanumeric() || c == ' ' {
        regex.push(c);
    } else {
        let _ = write!(regex, "\\u{{{:x}}}", c as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::gbnf_to_lark;

    #[test]
    fn translates_the_common_forms() {
        let lark = gbnf_to_lark(
            "root ::= \"yes\" | \"no\" ws item{2,3}\n\
             item ::= [a-zA-Z_] ( \"-\" | [0-9] )* # comment\n\
             ws ::= [ \\t\\n]?\n",
        )
        .unwrap();
        assert!(lark.starts_with("start: g_root\n"), "{lark}");
        assert!(
            lark.contains("g_root: \"yes\" | \"no\" g_ws (g_item){2,3}"),
            "{lark}"
        );
        assert!(
            lark.contains("g_item: /[a-zA-Z\\u{5f}]/ ((\"-\" | /[0-9]/))*"),
            "{lark}"
        );
    }

    #[test]
    fn continues_rules_after_bar_and_inside_parentheses() {
        let lark =
            gbnf_to_lark("root ::= (\n  \"a\"\n  \"b\"\n) |\n  \"c\"\nx ::= \"d\"\n").unwrap();
        assert!(lark.contains("g_root: (\"a\" \"b\") | \"c\""), "{lark}");
    }

    #[test]
    fn distinct_names_stay_distinct() {
        let lark =
            gbnf_to_lark("root ::= Ab ab a_b\nAb ::= \"1\"\nab ::= \"2\"\na_b ::= \"3\"").unwrap();
        assert!(
            lark.contains("g__ab: \"1\"") && lark.contains("g_ab: \"2\""),
            "{lark}"
        );
        assert!(lark.contains("g_a__b: \"3\""), "{lark}");
    }

    #[test]
    fn rejects_what_it_does_not_understand() {
        for (bad, why) in [
            ("item ::= \"x\"", "no `root`"),
            ("root ::= missing", "never defined"),
            ("root ::= \"x\"\nroot ::= \"y\"", "defined twice"),
            ("root ::= <think>", "not supported"),
            ("root ::= \"unterminated", "unterminated"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= \"a\"{3,1}", "max below min"),
            ("root = \"a\"", "expected `::=`"),
            ("root ::= \"a\" )", "unexpected"),
            ("root ::= \"\\q\"", "unknown escape"),
        ] {
            let err = gbnf_to_lark(bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }
}
