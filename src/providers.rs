//! Built-in provider profiles: how a provider takes an idempotency key, and whether it
//! deduplicates on it. A route's own fields override the profile.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    pub name: &'static str,
    /// The provider deduplicates requests carrying the same key.
    pub honours_key: bool,
    /// Header the key is passed down in; `None` when the provider takes none.
    pub forward_key_header: Option<&'static str>,
}

const PROFILES: &[Profile] = &[
    Profile {
        name: "stripe",
        honours_key: true,
        forward_key_header: Some("Idempotency-Key"),
    },
    Profile {
        name: "adyen",
        honours_key: true,
        forward_key_header: Some("Idempotency-Key"),
    },
    Profile {
        name: "paypal",
        honours_key: true,
        forward_key_header: Some("PayPal-Request-Id"),
    },
    Profile {
        name: "checkout",
        honours_key: true,
        forward_key_header: Some("Cko-Idempotency-Key"),
    },
    Profile {
        name: "gocardless",
        honours_key: true,
        forward_key_header: Some("Idempotency-Key"),
    },
    Profile {
        name: "resend",
        honours_key: true,
        forward_key_header: Some("Idempotency-Key"),
    },
    // No provider-side deduplication: the proxy's claim is the only protection.
    Profile {
        name: "sendgrid",
        honours_key: false,
        forward_key_header: None,
    },
    Profile {
        name: "postmark",
        honours_key: false,
        forward_key_header: None,
    },
    Profile {
        name: "mailgun",
        honours_key: false,
        forward_key_header: None,
    },
    Profile {
        name: "ses",
        honours_key: false,
        forward_key_header: None,
    },
    Profile {
        name: "twilio",
        honours_key: false,
        forward_key_header: None,
    },
];

pub fn lookup(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

pub fn names() -> Vec<&'static str> {
    PROFILES.iter().map(|p| p.name).collect()
}
