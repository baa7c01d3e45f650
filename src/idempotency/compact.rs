//! A record's compact form, as the embedded store writes it: the 33-byte header unchanged (the
//! fences and the state column read only that), then the JSON body and the receipt's body
//! bytes deflated together.
//!
//! Most of a record on disk was its JSON: field names, hex digests, and the response body in
//! base64 (4/3 of its size, and base64 hides the body's repetitions from a compressor). The
//! body is taken out of the JSON and deflated as the bytes it is.
//!
//! After the header: [`MARK`], the JSON's length and the receipt body's length (u32, little
//! endian), then one raw deflate stream of the JSON (the receipt's `body` left empty) followed
//! by the body. A plain record's JSON always starts with `{`, so the byte after the header
//! tells the two forms apart, and `Record::decode` (here, for every store) reads both.

use bytes::Bytes;

use super::record::{DecodeError, Record, RecordBody, State, Token, HEADER_LEN};

/// The byte after the header that marks the compact form (never `{`, how JSON starts).
pub(super) const MARK: u8 = 0x01;
/// The mark and the two lengths.
const PREFIX: usize = 1 + 4 + 4;
/// miniz's fastest level: on the soak's ~950-byte records zlib's level 6 and 9 came out
/// within 2 bytes of level 1.
const LEVEL: u8 = 1;
/// Plain records shorter than this are written plain: they are claims without a receipt (the
/// soak's are ~200 bytes), which their settle rewrites a moment later, so deflating them would
/// cost CPU on the claim's path for bytes that do not stay.
const MIN_PLAIN: usize = 512;

impl Record {
    /// The compact form, or the plain one (`encode`) for a short record ([`MIN_PLAIN`]) or
    /// where deflating would not make it smaller.
    pub fn encode_compact(&self) -> Vec<u8> {
        let raw_body = self
            .body
            .receipt
            .as_ref()
            .map(|r| r.body.clone())
            .unwrap_or_default();
        let json = if raw_body.is_empty() {
            serde_json::to_vec(&self.body)
        } else {
            let mut body = self.body.clone();
            if let Some(receipt) = body.receipt.as_mut() {
                receipt.body = Bytes::new();
            }
            serde_json::to_vec(&body)
        };
        // Serializing plain structs of strings and numbers cannot fail, and no record the
        // proxy holds in memory is 4 GiB; either way the plain form is still right.
        let (Ok(mut input), Ok(body_len)) = (json, u32::try_from(raw_body.len())) else {
            return self.encode();
        };
        let Ok(json_len) = u32::try_from(input.len()) else {
            return self.encode();
        };
        // The plain form's size: this JSON with the body's base64 in its empty quotes.
        let plain = HEADER_LEN + input.len() + raw_body.len().div_ceil(3) * 4;
        let deflated = (plain >= MIN_PLAIN).then(|| {
            input.extend_from_slice(&raw_body);
            miniz_oxide::deflate::compress_to_vec(&input, LEVEL)
        });
        let rest = match deflated {
            Some(d) if HEADER_LEN + PREFIX + d.len() < plain => d,
            // Without a receipt body the JSON is the plain form's: not serialized twice.
            None if raw_body.is_empty() => return self.with_header(&[&input]),
            _ => return self.encode(),
        };
        self.with_header(&[
            &[MARK],
            &json_len.to_le_bytes(),
            &body_len.to_le_bytes(),
            &rest,
        ])
    }

    /// The state and token, then `parts`.
    fn with_header(&self, parts: &[&[u8]]) -> Vec<u8> {
        let len = parts.iter().map(|p| p.len()).sum::<usize>();
        let mut out = Vec::with_capacity(HEADER_LEN + len);
        out.push(self.state.code());
        out.extend_from_slice(self.token.as_str().as_bytes());
        parts.iter().for_each(|p| out.extend_from_slice(p));
        out
    }
}

impl Record {
    /// What a store found under a scope (`None`: nothing live), as a record.
    pub fn decode_found(raw: Option<Vec<u8>>) -> Result<Option<Record>, DecodeError> {
        raw.map(|raw| Record::decode(&raw)).transpose()
    }

    /// A record in either stored form: plain JSON after the header, or the compact form.
    pub fn decode(raw: &[u8]) -> Result<Record, DecodeError> {
        if raw.len() < HEADER_LEN {
            return Err(DecodeError(format!(
                "{} bytes is shorter than the header",
                raw.len()
            )));
        }
        let state = State::from_code(raw[0])
            .ok_or_else(|| DecodeError(format!("unknown state byte {:#x}", raw[0])))?;
        let token = std::str::from_utf8(&raw[1..HEADER_LEN])
            .ok()
            .and_then(Token::parse)
            .ok_or_else(|| DecodeError("token is not hex".into()))?;
        let body = match raw.get(HEADER_LEN) {
            Some(&MARK) => decode_body(&raw[HEADER_LEN..])?,
            _ => serde_json::from_slice(&raw[HEADER_LEN..])
                .map_err(|e| DecodeError(e.to_string()))?,
        };
        Ok(Record { state, token, body })
    }
}

/// The body of a compact record; `rest` is everything after the header, [`MARK`] first.
pub(super) fn decode_body(rest: &[u8]) -> Result<RecordBody, DecodeError> {
    let corrupt = |what: &str| DecodeError(format!("compact record: {what}"));
    let length = |at: usize| {
        rest.get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(|b| u32::from_le_bytes(b) as usize)
            .ok_or_else(|| corrupt("shorter than its lengths"))
    };
    let (json_len, body_len) = (length(1)?, length(5)?);
    let total = json_len
        .checked_add(body_len)
        .ok_or_else(|| corrupt("lengths overflow"))?;
    // The stated lengths bound what inflating may allocate: a damaged stream cannot grow
    // past them.
    let inflated = miniz_oxide::inflate::decompress_to_vec_with_limit(&rest[PREFIX..], total)
        .map_err(|e| corrupt(&format!("cannot inflate: {e}")))?;
    if inflated.len() != total {
        return Err(corrupt("inflated to another length than stated"));
    }
    let inflated = Bytes::from(inflated);
    let mut body: RecordBody =
        serde_json::from_slice(&inflated[..json_len]).map_err(|e| DecodeError(e.to_string()))?;
    match body.receipt.as_mut() {
        Some(receipt) => receipt.body = inflated.slice(json_len..),
        None if body_len == 0 => {}
        None => return Err(corrupt("body bytes without a receipt")),
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::record::{Receipt, SealedReceipt, State, TOKEN_LEN};

    /// A settled record as the soak writes them: a Stripe-like charge of ~400 bytes.
    fn committed() -> Record {
        let mut r = Record::for_test(State::Committed);
        r.body.fingerprint =
            "821dcdf0aec00bc213aebfb9742ebd246081a6fad24b33c5250c6a5a5a2ed046".into();
        r.body.passed_down_sha256 =
            Some("61f575b5edca0977c4628a7e5e16aaed4a8fcb8f03090bed588446a199f88554".into());
        r.body.receipt = Some(Receipt {
            status: 200,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("date".into(), "Wed, 02 Dec 2026 05:18:40 GMT".into()),
            ],
            body: Bytes::from_static(
                br#"{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":2000,"amount_captured":2000,"balance_transaction":"txn_3MmlLrLkdIwHu7ix0uke3Ezy","captured":true,"created":1679090539,"currency":"usd","livemode":false,"paid":true,"status":"succeeded","outcome":{"network_status":"approved_by_network","risk_level":"normal","type":"authorized"}}"#,
            ),
        });
        r
    }

    #[test]
    fn a_compact_record_decodes_to_the_same_record_and_keeps_its_header() {
        let r = committed();
        let plain = r.encode();
        let compact = r.encode_compact();
        assert_eq!(compact[HEADER_LEN], MARK);
        // The fences and the state column read only the header: it is the plain one.
        assert_eq!(compact[..HEADER_LEN], plain[..HEADER_LEN]);
        assert!(
            compact.len() * 10 < plain.len() * 7,
            "{} bytes compact against {} plain",
            compact.len(),
            plain.len()
        );
        assert_eq!(Record::decode(&compact).expect("decodes"), r);
        assert!(r.fence().admits_encoded(&compact));
    }

    #[test]
    fn every_byte_of_a_body_survives_and_records_without_one_too() {
        let mut r = committed();
        let odd: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
        r.body.receipt.as_mut().expect("receipt").body = Bytes::from(odd);
        let compact = r.encode_compact();
        assert_eq!(compact[HEADER_LEN], MARK);
        assert_eq!(Record::decode(&compact).expect("decodes"), r);

        let mut held = committed();
        held.state = State::Unknown;
        held.body.receipt = None;
        held.body.note = Some("the upstream call timed out; ".repeat(20));
        let compact = held.encode_compact();
        assert_eq!(compact[HEADER_LEN], MARK);
        assert_eq!(Record::decode(&compact).expect("decodes"), held);
    }

    /// A short claim is written plain; a sealed receipt, random bytes in base64, is never made
    /// larger and reads back.
    #[test]
    fn what_does_not_shrink_stays_plain() {
        let short = Record::for_test(State::Pending);
        assert_eq!(short.encode_compact(), short.encode());

        let mut sealed = committed();
        sealed.body.receipt = None;
        sealed.body.fingerprint = String::new();
        sealed.body.passed_down_sha256 = None;
        let random: Vec<u8> = (0..600).map(|_| rand::random::<u8>()).collect();
        sealed.body.sealed_receipt = Some(Box::new(SealedReceipt {
            cipher: crate::idempotency::record::Cipher::Aes256Gcm,
            data: Bytes::from(random),
        }));
        let out = sealed.encode_compact();
        assert!(out.len() <= sealed.encode().len());
        assert_eq!(Record::decode(&out).expect("decodes"), sealed);
    }

    #[test]
    fn damaged_compact_records_are_errors_not_panics() {
        let good = committed().encode_compact();
        let header = &good[..HEADER_LEN];
        let with = |rest: &[u8]| [header, rest].concat();
        // Cut anywhere: inside the lengths, inside the stream.
        for cut in HEADER_LEN + 1..good.len() {
            assert!(Record::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        // Lengths that disagree with the stream, or overflow.
        let stream = &good[HEADER_LEN + PREFIX..];
        for (json, body) in [(1u32, 0u32), (0, 0), (u32::MAX, u32::MAX), (10, 5000)] {
            let rest = [
                &[MARK][..],
                &json.to_le_bytes(),
                &body.to_le_bytes(),
                stream,
            ]
            .concat();
            assert!(Record::decode(&with(&rest)).is_err(), "{json}/{body}");
        }
        // Not a deflate stream at all.
        assert!(Record::decode(&with(&[MARK, 3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff])).is_err());
        assert_eq!(header.len(), 1 + TOKEN_LEN);
    }
}
