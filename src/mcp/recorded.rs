//! Tool calls priced from an operation recorded earlier: most money-moving tools carry no
//! amount (`create_payment_link(price, quantity)`), but the call that created what they name
//! did (`create_price(product, unit_amount, currency)`). A tool's `records` rule says what its
//! successful result made (the object's kind and id, its amount and currency); a tool's
//! `price_from` rule says which recorded object a call names and what multiplies its amount.
//! This module reads both from the call's arguments and its JSON-RPC result; `proxy::recorded`
//! keeps and finds the records.

use serde_json::Value;

/// Longest object id kept or looked up (Stripe's are ~30 bytes).
const MAX_ID_LEN: usize = 255;

/// Where a rule's value is: `{args.PATH}` (the call's arguments) or `{result.PATH}` (the
/// object the call's result holds), PATH dotted (`{result.recurring.interval}`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    text: String,
    from: Source,
    path: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Args,
    Result,
}

impl Field {
    fn parse(text: &str, result_allowed: bool) -> Result<Field, String> {
        let inner = text
            .trim()
            .strip_prefix('{')
            .and_then(|t| t.strip_suffix('}'))
            .ok_or_else(|| format!("`{text}` is not one field like \"{{args.price}}\""))?;
        let (from, path) = if let Some(p) = inner.strip_prefix("args.") {
            (Source::Args, p)
        } else if let Some(p) = inner.strip_prefix("result.") {
            (Source::Result, p)
        } else {
            return Err(format!(
                "`{text}` names neither {{args.NAME}} (the call's arguments) nor {{result.NAME}} (the object its result holds)"
            ));
        };
        if from == Source::Result && !result_allowed {
            return Err(format!(
                "`{text}` reads the result, which a call priced before it runs does not have yet: name an argument ({{args.NAME}})"
            ));
        }
        let path: Vec<String> = path.split('.').map(str::to_string).collect();
        if path
            .iter()
            .any(|p| p.is_empty() || p.contains(['{', '}', '|']))
        {
            return Err(format!(
                "`{text}`: a field is a dotted path of names, without filters"
            ));
        }
        Ok(Field {
            text: text.trim().to_string(),
            from,
            path,
        })
    }

    fn read<'v>(&self, args: &'v Value, result: Option<&'v Value>) -> Option<&'v Value> {
        let mut cur = match self.from {
            Source::Args => args,
            Source::Result => result?,
        };
        for part in &self.path {
            cur = match cur {
                Value::Object(m) => m.get(part)?,
                Value::Array(a) => a.get(part.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(cur)
    }

    /// The value as text: a string, or a number as written. Anything else, or empty: `None`.
    fn text_of(&self, args: &Value, result: Option<&Value>) -> Option<String> {
        match self.read(args, result)? {
            Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }
}

/// A currency: a code written in the rule (`"usd"`), or a field.
#[derive(Debug, Clone, PartialEq, Eq)]
enum CurrencyFrom {
    Code(String),
    Field(Field),
}

/// `records = { kind, id, amount, currency, unit }` on a tool: what a successful call made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Records {
    pub kind: String,
    id: Field,
    amount: Field,
    currency: CurrencyFrom,
    /// `minor` (integers of cents, Stripe's) or `major`.
    pub unit: String,
}

/// What a successful call made, as its `records` rule read it: not yet money (the route's
/// budget parses it when a later call is priced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedObject {
    pub kind: String,
    pub id: String,
    pub amount: String,
    pub currency: String,
    pub unit: String,
}

/// `price_from = { kind, id, times }` on a tool: a call is priced as the recorded object's
/// amount, times the `times` argument when named (a quantity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceFrom {
    pub kind: String,
    id: Field,
    times: Option<Field>,
}

/// Why a rule cannot be used: (the rule's field, what is wrong).
pub type RuleError = (&'static str, String);

fn kind_of(kind: &str) -> Result<String, RuleError> {
    let ok = !kind.is_empty()
        && kind.len() <= 64
        && kind
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if !ok {
        return Err((
            "kind",
            format!("`{kind}`: name the kind of object in letters, digits, '_', '-' or '.', e.g. \"price\""),
        ));
    }
    Ok(kind.to_string())
}

impl Records {
    pub fn parse(
        kind: &str,
        id: &str,
        amount: &str,
        currency: &str,
        unit: &str,
    ) -> Result<Records, RuleError> {
        let currency = if currency.trim().starts_with('{') {
            CurrencyFrom::Field(Field::parse(currency, true).map_err(|m| ("currency", m))?)
        } else {
            let code = currency.trim();
            if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_alphabetic()) {
                return Err((
                    "currency",
                    format!("`{currency}` is neither a field like \"{{result.currency}}\" nor a currency code like \"usd\""),
                ));
            }
            CurrencyFrom::Code(code.to_ascii_lowercase())
        };
        if unit != "minor" && unit != "major" {
            return Err((
                "unit",
                format!("`{unit}` is not \"minor\" (integers of cents, as Stripe writes unit_amount) or \"major\""),
            ));
        }
        Ok(Records {
            kind: kind_of(kind)?,
            id: Field::parse(id, true).map_err(|m| ("id", m))?,
            amount: Field::parse(amount, true).map_err(|m| ("amount", m))?,
            currency,
            unit: unit.to_string(),
        })
    }

    /// What a call with these arguments made, from its final JSON-RPC message. `None` when the
    /// message is no successful result or lacks a field: nothing is recorded, and a later call
    /// naming the object stays unpriced.
    pub fn read(&self, arguments: &Value, message: &[u8]) -> Option<RecordedObject> {
        let object = result_object(message)?;
        let result = Some(&object);
        let id = self
            .id
            .text_of(arguments, result)
            .filter(|id| id.len() <= MAX_ID_LEN)?;
        let amount = self.amount.text_of(arguments, result)?;
        let currency = match &self.currency {
            CurrencyFrom::Code(c) => c.clone(),
            CurrencyFrom::Field(f) => f.text_of(arguments, result)?,
        };
        Some(RecordedObject {
            kind: self.kind.clone(),
            id,
            amount,
            currency,
            unit: self.unit.clone(),
        })
    }
}

impl PriceFrom {
    pub fn parse(kind: &str, id: &str, times: Option<&str>) -> Result<PriceFrom, RuleError> {
        Ok(PriceFrom {
            kind: kind_of(kind)?,
            id: Field::parse(id, false).map_err(|m| ("id", m))?,
            times: times
                .map(|t| Field::parse(t, false).map_err(|m| ("times", m)))
                .transpose()?,
        })
    }

    /// The id of the object a call names; `None` when the argument is not there.
    pub fn id(&self, arguments: &Value) -> Option<String> {
        self.id
            .text_of(arguments, None)
            .filter(|id| id.len() <= MAX_ID_LEN)
    }

    /// What the recorded amount is multiplied by: `Ok(None)` when the rule names nothing,
    /// an error naming the field when it names an argument the call lacks.
    pub fn times(&self, arguments: &Value) -> Result<Option<String>, String> {
        let Some(f) = &self.times else {
            return Ok(None);
        };
        f.text_of(arguments, None)
            .map(Some)
            .ok_or_else(|| format!("{} is missing", f.text))
    }
}

/// The object a tool call's result holds: its `structuredContent`, else its first text
/// content read as a JSON object (servers that return the API's JSON as text, as Stripe's
/// toolkit does). `None` for an error, an `isError` result, or a result holding no object.
pub fn result_object(message: &[u8]) -> Option<Value> {
    let message: Value = serde_json::from_slice(message).ok()?;
    let result = message.get("result")?;
    if result.get("isError").and_then(Value::as_bool) == Some(true) {
        return None;
    }
    if let Some(structured @ Value::Object(_)) = result.get("structuredContent") {
        return Some(structured.clone());
    }
    let text = result
        .get("content")?
        .as_array()?
        .iter()
        .find(|c| c.get("type").and_then(Value::as_str) == Some("text"))?
        .get("text")?
        .as_str()?;
    match serde_json::from_str::<Value>(text).ok()? {
        object @ Value::Object(_) => Some(object),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn price_rule() -> Records {
        Records::parse(
            "price",
            "{result.id}",
            "{result.unit_amount}",
            "{result.currency}",
            "minor",
        )
        .expect("rule")
    }

    fn answer(result: Value) -> Vec<u8> {
        json!({"jsonrpc": "2.0", "id": 3, "result": result})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn a_result_is_read_from_structured_content_or_its_text() {
        let args = json!({"product": "prod_1", "unit_amount": 1500, "currency": "usd"});
        let object = json!({"id": "price_1", "unit_amount": 1500, "currency": "usd"});
        let want = Some(RecordedObject {
            kind: "price".into(),
            id: "price_1".into(),
            amount: "1500".into(),
            currency: "usd".into(),
            unit: "minor".into(),
        });
        let structured = answer(json!({"content": [], "structuredContent": object}));
        assert_eq!(price_rule().read(&args, &structured), want);
        let text = answer(json!({"content": [{"type": "text", "text": object.to_string()}]}));
        assert_eq!(price_rule().read(&args, &text), want);
        // An error result, a JSON-RPC error, or a result without the id records nothing.
        let failed = answer(json!({"isError": true, "structuredContent": object}));
        assert_eq!(price_rule().read(&args, &failed), None);
        let error = json!({"jsonrpc": "2.0", "id": 3, "error": {"code": -1, "message": "x"}});
        assert_eq!(price_rule().read(&args, error.to_string().as_bytes()), None);
        let no_id = answer(json!({"structuredContent": {"unit_amount": 1500}}));
        assert_eq!(price_rule().read(&args, &no_id), None);
    }

    #[test]
    fn arguments_and_fixed_currencies_are_read_too() {
        let rule = Records::parse("item", "{args.invoice}", "{result.amount}", "usd", "minor")
            .expect("rule");
        let got = rule.read(
            &json!({"invoice": "in_1"}),
            &answer(json!({"structuredContent": {"amount": 700}})),
        );
        assert_eq!(
            got.map(|r| (r.id, r.currency)),
            Some(("in_1".into(), "usd".into()))
        );
    }

    #[test]
    fn a_price_from_rule_reads_the_id_and_the_multiplier_from_arguments() {
        let rule =
            PriceFrom::parse("price", "{args.price}", Some("{args.quantity}")).expect("rule");
        let args = json!({"price": "price_1", "quantity": 3});
        assert_eq!(rule.id(&args), Some("price_1".into()));
        assert_eq!(rule.times(&args), Ok(Some("3".into())));
        let bare = json!({"price": "price_1"});
        assert_eq!(rule.times(&bare), Err("{args.quantity} is missing".into()));
        assert_eq!(rule.id(&json!({"quantity": 3})), None);
    }

    #[test]
    fn rules_name_the_field_that_is_wrong() {
        let bad = |r: Result<PriceFrom, RuleError>| r.err().map(|(f, _)| f);
        assert_eq!(
            bad(PriceFrom::parse("price", "{result.id}", None)),
            Some("id")
        );
        assert_eq!(
            bad(PriceFrom::parse("price", "args.price", None)),
            Some("id")
        );
        assert_eq!(
            bad(PriceFrom::parse("a price", "{args.price}", None)),
            Some("kind")
        );
        assert_eq!(
            bad(PriceFrom::parse(
                "price",
                "{args.price}",
                Some("{args.q|trim}")
            )),
            Some("times")
        );
        let records = |currency: &str, unit: &str| {
            Records::parse(
                "price",
                "{result.id}",
                "{result.unit_amount}",
                currency,
                unit,
            )
            .err()
            .map(|(f, _)| f)
        };
        assert_eq!(records("dollars", "minor"), Some("currency"));
        assert_eq!(records("usd", "cents"), Some("unit"));
        assert_eq!(records("{body.currency}", "minor"), Some("currency"));
        assert_eq!(records("{result.currency}", "major"), None);
    }
}
