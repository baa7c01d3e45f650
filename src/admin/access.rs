//! Who may do what on the admin listener: named tokens with a role each. A token is only
//! ever kept as its SHA-256 and compared in constant time; the name is what decisions are
//! recorded under.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{Config, ConfigError, Environment};
use crate::spend::money::{Currency, Money, Unit};

/// What a token may do. Each role may do everything the ones before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Looks: lists, key lookups, overview, spend.
    Viewer,
    /// Also approves and denies parked payments.
    Approver,
    /// Also resolves held (UNKNOWN) outcomes, reloads the config, freezes spend.
    Operator,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "viewer" => Some(Role::Viewer),
            "approver" => Some(Role::Approver),
            "operator" => Some(Role::Operator),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Approver => "approver",
            Role::Operator => "operator",
        }
    }
}

/// Who is asking, once their token (or session) checked out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
    /// The single unnamed token (`admin.token_env` / `admin.token_sha256`): everyone who has
    /// it is "admin", so API decisions made with it say who decides in the request.
    pub shared: bool,
    /// First bytes of the token's hash, hex: a session remembers which token it came from,
    /// so rotating or removing the token ends its sessions.
    pub token_tag: String,
}

impl Principal {
    /// How a decision by this principal reads, given the `by` its request wrote: a named
    /// token is its name, with what it said beside it (`ana (as ana@example.com)`); the
    /// shared token is what it said, and `None` when it said nothing. The name itself is
    /// recorded apart from this ([`Principal::name`]) and is what four eyes compares.
    pub fn saying(&self, by: Option<&str>) -> Option<String> {
        let by = by.map(str::trim).filter(|b| !b.is_empty());
        match (by, self.shared) {
            (Some(by), true) => Some(by.to_string()),
            (None, true) => None,
            (Some(by), false) if by != self.name => Some(format!("{} (as {by})", self.name)),
            (_, false) => Some(self.name.clone()),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    role: Role,
    hash: [u8; 32],
    shared: bool,
}

/// Every token the admin listener accepts.
#[derive(Debug, Clone, Default)]
pub struct Access {
    entries: Vec<Entry>,
    /// `four_eyes_above`: approvals above any of these need a second, different approver.
    four_eyes: Vec<Money>,
}

/// The name of the single unnamed token.
pub const SHARED_NAME: &str = "admin";

impl Access {
    pub fn from_config(config: &Config) -> Result<Access, ConfigError> {
        let admin = &config.admin;
        let mut entries = Vec::new();
        let shared = match &admin.token_sha256 {
            Some(h) => Some(parse_hash(h).ok_or_else(|| {
                config.invalid("admin.token_sha256", "must be 64 hex digits (a SHA-256)")
            })?),
            None => env_hash(&config.env, &admin.token_env),
        };
        if let Some(hash) = shared {
            entries.push(Entry {
                name: SHARED_NAME.into(),
                role: Role::Operator,
                hash,
                shared: true,
            });
        }
        for (i, t) in admin.tokens.iter().enumerate() {
            let field = |f: &str| format!("admin.tokens[{i}].{f}");
            if t.name.is_empty()
                || t.name.len() > 64
                || !t
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.@".contains(c))
            {
                return Err(config.invalid(
                    field("name"),
                    "must be 1-64 letters, digits, `-`, `_`, `.` or `@`",
                ));
            }
            if t.name == SHARED_NAME && shared.is_some() || entries.iter().any(|e| e.name == t.name)
            {
                return Err(config.invalid(field("name"), format!("`{}` is used twice", t.name)));
            }
            let role = Role::parse(&t.role).ok_or_else(|| {
                config.invalid(field("role"), "must be viewer, approver or operator")
            })?;
            let hash = match (&t.sha256, &t.env) {
                (Some(h), None) => parse_hash(h).ok_or_else(|| {
                    config.invalid(field("sha256"), "must be 64 hex digits (a SHA-256)")
                })?,
                (None, Some(var)) => match env_hash(&config.env, var) {
                    Some(hash) => hash,
                    None => {
                        tracing::warn!(token = %t.name, variable = %var, "admin token variable is unset or empty: that token cannot log in");
                        continue;
                    }
                },
                _ => return Err(config.invalid(field("sha256"), "give sha256 or env (not both)")),
            };
            entries.push(Entry {
                name: t.name.clone(),
                role,
                hash,
                shared: false,
            });
        }
        let four_eyes = admin
            .four_eyes_above
            .iter()
            .enumerate()
            .map(|(i, text)| {
                parse_money(text)
                    .map_err(|m| config.invalid(format!("admin.four_eyes_above[{i}]"), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !four_eyes.is_empty() {
            let approvers = admin
                .tokens
                .iter()
                .filter(|t| Role::parse(&t.role).is_some_and(|r| r >= Role::Approver))
                .count();
            if approvers < 2 {
                return Err(config.invalid(
                    "admin.four_eyes_above",
                    format!("asks two different approvers above it, and [[admin.tokens]] names {approvers} token(s) with role approver or operator: name at least two (the shared admin token cannot tell people apart, so it is never one of the two)"),
                ));
            }
        }
        Ok(Access { entries, four_eyes })
    }

    /// Whether any token is accepted at all.
    pub fn enabled(&self) -> bool {
        !self.entries.is_empty()
    }

    /// Whether some token may approve parked payments.
    pub fn can_approve(&self) -> bool {
        self.entries.iter().any(|e| e.role >= Role::Approver)
    }

    /// The holder of `token`, compared against every known hash in constant time.
    pub fn check(&self, token: &str) -> Option<Principal> {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for e in &self.entries {
            if e.hash.ct_eq(&hash).unwrap_u8() == 1 {
                found = Some(e);
            }
        }
        found.map(principal)
    }

    /// The token named `name` as it is now, for a session that names it: `None` when it
    /// was removed, its role changed or it was rotated (its tag differs).
    pub fn current(&self, name: &str, role: Role, tag: &str) -> Option<Principal> {
        self.entries
            .iter()
            .find(|e| e.name == name)
            .map(principal)
            .filter(|p| p.role == role && p.token_tag == tag)
    }

    /// Whether approving `amount` (as the request asked it, `"600.00 USD"`) needs a second
    /// approver. Unreadable amounts, and currencies the list does not name, do.
    pub fn needs_two(&self, amount: &str) -> bool {
        if self.four_eyes.is_empty() {
            return false;
        }
        let Ok(asked) = parse_money(amount) else {
            return true;
        };
        match self.four_eyes.iter().find(|m| m.currency == asked.currency) {
            Some(limit) => asked.minor > limit.minor,
            None => true,
        }
    }
}

fn principal(e: &Entry) -> Principal {
    Principal {
        name: e.name.clone(),
        role: e.role,
        shared: e.shared,
        token_tag: hex::encode(&e.hash[..8]),
    }
}

fn parse_hash(h: &str) -> Option<[u8; 32]> {
    hex::decode(h.trim())
        .ok()
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
}

fn env_hash(env: &Environment, var: &str) -> Option<[u8; 32]> {
    env.var(var)
        .filter(|t| !t.is_empty())
        .map(|t| Sha256::digest(t.as_bytes()).into())
}

/// `"1000.00 USD"`: an amount in major units and its currency.
fn parse_money(text: &str) -> Result<Money, String> {
    let (value, code) = text.trim().rsplit_once(' ').ok_or_else(|| {
        format!("`{text}` must be an amount and a currency, e.g. \"1000.00 USD\"")
    })?;
    let currency =
        Currency::parse(code.trim()).map_err(|e| format!("`{text}`: the currency {e}"))?;
    Money::parse(value.trim(), Unit::Major, currency).map_err(|e| format!("`{text}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn access(extra: &str) -> Result<Access, ConfigError> {
        let config = Config::parse(
            &format!("[admin]\ntoken_env = \"IDEMPROXY_TEST_UNSET_TOKEN\"\n{extra}"),
            Path::new("t.toml"),
        )
        .expect("config");
        Access::from_config(&config)
    }

    fn sha(t: &str) -> String {
        hex::encode(Sha256::digest(t.as_bytes()))
    }

    #[test]
    fn named_tokens_have_their_roles_and_nothing_else_gets_in() {
        let a = access(&format!(
            "[[admin.tokens]]\nname = \"ana\"\nrole = \"approver\"\nsha256 = \"{}\"\n[[admin.tokens]]\nname = \"vic\"\nrole = \"viewer\"\nsha256 = \"{}\"\n",
            sha("ana-secret"),
            sha("vic-secret")
        ))
        .expect("valid");
        let ana = a.check("ana-secret").expect("ana");
        assert_eq!((ana.name.as_str(), ana.role), ("ana", Role::Approver));
        assert_eq!(a.check("vic-secret").map(|p| p.role), Some(Role::Viewer));
        assert!(a.check("ana-secret ").is_none());
        assert!(a.check("").is_none());
        assert!(a.current("ana", Role::Approver, &ana.token_tag).is_some());
        assert!(a.current("ana", Role::Operator, &ana.token_tag).is_none());
        assert!(a.current("ana", Role::Approver, "0000").is_none());
    }

    #[test]
    fn config_errors_name_the_field() {
        let bad_role = access(&format!(
            "[[admin.tokens]]\nname = \"ana\"\nrole = \"root\"\nsha256 = \"{}\"\n",
            sha("x")
        ))
        .expect_err("role");
        assert!(
            bad_role.to_string().contains("admin.tokens[0].role"),
            "{bad_role}"
        );
        let bad_name =
            access("[[admin.tokens]]\nname = \"<b>\"\nrole = \"viewer\"\nsha256 = \"00\"\n")
                .expect_err("name");
        assert!(
            bad_name.to_string().contains("admin.tokens[0].name"),
            "{bad_name}"
        );
        let bad_money = access("four_eyes_above = [\"lots\"]\n").expect_err("money");
        assert!(
            bad_money.to_string().contains("admin.four_eyes_above[0]"),
            "{bad_money}"
        );
    }

    fn approvers(n: usize) -> String {
        (0..n)
            .map(|i| {
                format!(
                    "[[admin.tokens]]\nname = \"ap{i}\"\nrole = \"approver\"\nsha256 = \"{}\"\n",
                    sha(&format!("secret-{i}"))
                )
            })
            .collect()
    }

    #[test]
    fn four_eyes_above_a_threshold_and_for_unlisted_currencies() {
        let a = access(&format!(
            "four_eyes_above = [\"1000.00 USD\"]\n{}",
            approvers(2)
        ))
        .expect("valid");
        assert!(!a.needs_two("1000.00 USD"));
        assert!(a.needs_two("1000.01 USD"));
        assert!(a.needs_two("5.00 EUR"), "a currency the list does not name");
        assert!(!access("").expect("valid").needs_two("99999.00 USD"));
    }

    #[test]
    fn four_eyes_needs_two_named_approvers() {
        for n in [0, 1] {
            let e = access(&format!(
                "four_eyes_above = [\"1000.00 USD\"]\n{}",
                approvers(n)
            ))
            .expect_err("fewer than two approvers");
            let text = e.to_string();
            assert!(
                text.starts_with("t.toml: admin.four_eyes_above:") && text.contains("at least two"),
                "{text}"
            );
        }
        // A viewer is not an approver; an operator is.
        let viewer = format!(
            "four_eyes_above = [\"1000.00 USD\"]\n{}[[admin.tokens]]\nname = \"vic\"\nrole = \"viewer\"\nsha256 = \"{}\"\n",
            approvers(1),
            sha("vic")
        );
        assert!(access(&viewer).is_err());
        let operator = viewer.replace("\"viewer\"", "\"operator\"");
        assert!(access(&operator).is_ok());
    }

    #[test]
    fn a_principal_says_who_it_is_beside_what_its_request_wrote() {
        let a = access(&approvers(1)).expect("valid");
        let ana = a.check("secret-0").expect("ap0");
        assert_eq!(ana.saying(None).as_deref(), Some("ap0"));
        assert_eq!(ana.saying(Some(" ap0 ")).as_deref(), Some("ap0"));
        assert_eq!(ana.saying(Some("bob")).as_deref(), Some("ap0 (as bob)"));
        let shared = Principal {
            name: SHARED_NAME.into(),
            role: Role::Operator,
            shared: true,
            token_tag: String::new(),
        };
        assert_eq!(shared.saying(Some("oscar")).as_deref(), Some("oscar"));
        assert_eq!(shared.saying(Some("  ")), None);
    }
}
