//! JSON in and out of the template engine as Python sees it: objects keep their key order
//! (templates that print `tools` or tool-call arguments print them in the client's order), and
//! `tojson` writes what `json.dumps` writes (`", "` and `": "` between items, non-ASCII as is).

use std::io;

use minijinja::value::{Value, ValueKind};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter, Serializer};

use crate::TokenizeError;

/// The JSON text `raw` (the request's field `field`) as a template value, key order kept.
pub fn parse(raw: &str, field: &str) -> Result<Value, TokenizeError> {
    serde_json::from_str(raw)
        .map_err(|err| TokenizeError::Unsupported(format!("`{field}` is not valid JSON: {err}")))
}

/// A copy of the object `object` with `name` set to `value` (in place when it was there).
pub fn with_field(object: &Value, name: &str, value: Value) -> Value {
    let mut fields: Vec<(Value, Value)> = match object.try_iter() {
        Ok(keys) if object.kind() == ValueKind::Map => keys
            .map(|key| {
                let item = object.get_item(&key).unwrap_or_default();
                (key, item)
            })
            .collect(),
        _ => Vec::new(),
    };
    match fields
        .iter_mut()
        .find(|(key, _)| key.as_str() == Some(name))
    {
        Some(field) => field.1 = value,
        None => fields.push((Value::from(name), value)),
    }
    Value::from_iter(fields)
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub fn dumps(value: &Value, indent: Option<usize>) -> Result<String, serde_json::Error> {
    let mut out = Vec::new();
    match indent {
        Some(width) => {
            let indent = vec![b' '; width];
            let mut serializer =
                Serializer::with_formatter(&mut out, PrettyFormatter::with_indent(&indent));
            value.serialize(&mut serializer)?;
        }
        None => value.serialize(&mut Serializer::with_formatter(&mut out, PythonCompact))?,
    }
    Ok(String::from_utf8(out).expect("serde_json writes UTF-8"))
}

/// Python's default separators: `", "` between items, `": "` after keys.
struct PythonCompact;

/// `", "` before every item but the first.
fn separator<W: ?Sized + io::Write>(w: &mut W, first: bool) -> io::Result<()> {
    match first {
        true => Ok(()),
        false => w.write_all(b", "),
    }
}

impl Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(w, first)
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(w, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_keep_their_order_and_print_as_python_does() {
        let value = parse(r#"{"b": 1, "a": [true, null, "é"], "c": {"z": 1.5}}"#, "x").unwrap();
        assert_eq!(
            dumps(&value, None).unwrap(),
            r#"{"b": 1, "a": [true, null, "é"], "c": {"z": 1.5}}"#
        );
        assert_eq!(
            dumps(&value, Some(2)).unwrap(),
            "{\n  \"b\": 1,\n  \"a\": [\n    true,\n    null,\n    \"é\"\n  ],\n  \"c\": {\n    \"z\": 1.5\n  }\n}"
        );
        let changed = with_field(&value, "a", Value::from(2));
        assert_eq!(
            dumps(&changed, None).unwrap(),
            r#"{"b": 1, "a": 2, "c": {"z": 1.5}}"#
        );
    }
}
