//! One string read out of a JSON document at a dotted path (`payment.id`), without building
//! the document: the id of an object an answer created is all the counted-object marker
//! needs, and a `serde_json::Value` of the whole answer was a third of the marker's CPU.
//!
//! It must read exactly what `serde_json::from_slice::<Value>` and `Value::get` would: the
//! same document accepted (every value is parsed through `deserialize_any`, as `Value` parses
//! it, never skipped unchecked), and of a key given twice the last one, as `Value`'s map keeps
//! it. `tests::agrees_with_value` holds it to that.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error, MapAccess, SeqAccess, Visitor};

/// The string at `at` in `body`, borrowed where it has no escapes. `None` if the body is not
/// one JSON document, or nothing is there, or what is there is not a string.
pub fn string_at<'b>(body: &'b [u8], at: &str) -> Option<Cow<'b, str>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = Walk { rest: Some(at) }.deserialize(&mut de).ok()?;
    de.end().ok()?;
    found
}

/// Looks for the path `rest` (the leaf itself when `None`) in one value.
struct Walk<'p> {
    rest: Option<&'p str>,
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = Option<Cow<'de, str>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = Option<Cow<'de, str>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E: Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(self.rest.is_none().then_some(Cow::Borrowed(v)))
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.rest.is_none().then(|| Cow::Owned(v.to_owned())))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let Some(rest) = self.rest else {
            skip_map(&mut map)?;
            return Ok(None);
        };
        let (part, deeper) = match rest.split_once('.') {
            Some((part, deeper)) => (part, Some(deeper)),
            None => (rest, None),
        };
        let mut found = None;
        while let Some(is_part) = map.next_key_seed(KeyIs(part))? {
            if is_part {
                // A key given twice: the last one counts, as in `Value`.
                found = map.next_value_seed(Walk { rest: deeper })?;
            } else {
                map.next_value::<Skip>()?;
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(None)
    }

    fn visit_bool<E: Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E: Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E: Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Whether a map's key is `.0`, compared where it lies.
struct KeyIs<'p>(&'p str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl Visitor<'_> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

/// A value read through and dropped: parsed as `Value` would parse it (so a document `Value`
/// refuses is refused here too), nothing kept.
struct Skip;

impl<'de> serde::Deserialize<'de> for Skip {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Skip, D::Error> {
        d.deserialize_any(Skip)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = Skip;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: Error>(self, _: bool) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_i64<E: Error>(self, _: i64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_u64<E: Error>(self, _: u64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_f64<E: Error>(self, _: f64) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_str<E: Error>(self, _: &str) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_unit<E: Error>(self) -> Result<Skip, E> {
        Ok(Skip)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(Skip)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
        skip_map(&mut map)?;
        Ok(Skip)
    }
}

fn skip_map<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    while map.next_entry::<Skip, Skip>()?.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the `Value` parse this replaces read.
    fn by_value(body: &[u8], at: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let mut cur = &v;
        for part in at.split('.') {
            cur = cur.get(part)?;
        }
        cur.as_str().map(String::from)
    }

    #[test]
    fn agrees_with_value() {
        let bodies: &[&[u8]] = &[
            br#"{"id":"ch_1","object":"charge","amount":2000,"outcome":{"type":"authorized"}}"#,
            br#"{"payment":{"id":"p_9"},"id":"top"}"#,
            br#"{"payment":{"id":"p\"9\u00e9\n"}}"#,
            br#"{"id":"first","id":"last"}"#,
            br#"{"payment":{"id":"a"},"payment":{"other":1}}"#,
            br#"{"payment":{"other":1},"payment":{"id":"b"}}"#,
            br#"{"id":7}"#,
            br#"{"id":null}"#,
            br#"{"id":["x"]}"#,
            br#"{"id":{"id":"x"}}"#,
            br#"{"id":""}"#,
            br#"["id","x"]"#,
            br#""id""#,
            br#"{"": {"": "empty keys"}}"#,
            br#"{"a.b":"dotted key","a":{"b":"nested"}}"#,
            br#"{"id":"x"} "#,
            br#"{"id":"x"} trailing"#,
            br#"{"id":"x","n":1e400}"#,
            br#"{"id":"x","n":-1.5e-3,"t":true,"f":false,"z":null,"l":[1,[2,{"q":"r"}]]}"#,
            br#"{"id":"x","bad":"\ud800"}"#,
            br#"{"id":"x","bad":"\uZZZZ"}"#,
            b"{\"id\":\"x\",\"raw\":\"\xff\"}",
            b"{\"id\":\"\xc3\xa9t\xc3\xa9\"}",
            br#"{"id":"x",}"#,
            br#"{"id":"x""#,
            b"",
            b"not json",
            br#"{"\u0069d":"escaped key"}"#,
        ];
        for body in bodies {
            for at in ["id", "payment.id", "", ".", "a.b", "a", "l", "payment..id"] {
                let ours = string_at(body, at).map(Cow::into_owned);
                assert_eq!(
                    ours,
                    by_value(body, at),
                    "{at:?} in {}",
                    String::from_utf8_lossy(body)
                );
            }
        }
    }

    #[test]
    fn a_string_without_escapes_is_borrowed() {
        let body = br#"{"payment":{"id":"p_9"}}"#;
        assert!(matches!(
            string_at(body, "payment.id"),
            Some(Cow::Borrowed("p_9"))
        ));
    }

    #[test]
    fn nesting_past_the_parsers_limit_is_refused_as_value_refuses_it() {
        let deep = format!(r#"{{"id":"x","n":{}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert_eq!(string_at(deep.as_bytes(), "id"), None);
        assert_eq!(by_value(deep.as_bytes(), "id"), None);
    }
}
