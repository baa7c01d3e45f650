//! The Redis store URLs: one server (`redis://`, `rediss://` over TLS), a master named by
//! Sentinel (`redis+sentinel://`), or a Cluster (`redis+cluster://`), each with its `rediss+`
//! TLS form.

/// Where the records live, as the URL says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://HOST:PORT[/DB]` or `rediss://…` (TLS).
    Server { url: String },
    /// `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]`
    /// (`rediss+sentinel://` for TLS to the master and the sentinels).
    Sentinel {
        sentinels: Vec<(String, u16)>,
        master: String,
        db: i64,
        userinfo: String,
        tls: bool,
    },
    /// `redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]` (`rediss+cluster://` for TLS):
    /// any of the cluster's nodes; the rest are discovered.
    Cluster { nodes: Vec<String>, tls: bool },
}

const SENTINEL_FORM: &str = "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]";
const CLUSTER_FORM: &str = "redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]";

impl RedisTarget {
    /// A URL of one of the Redis schemes; the error says what was expected.
    pub fn parse(url: &str) -> Result<Option<RedisTarget>, String> {
        let (scheme, rest) = match url.split_once("://") {
            Some(parts) => parts,
            None => return Ok(None),
        };
        match scheme {
            "redis" | "rediss" => {
                redis::Client::open(url).map_err(|e| {
                    format!("`{url}` is not a Redis URL ({e}): expected {scheme}://[USER:PASSWORD@]HOST:PORT[/DB]")
                })?;
                Ok(Some(RedisTarget::Server {
                    url: url.to_string(),
                }))
            }
            "redis+sentinel" | "rediss+sentinel" => {
                let (userinfo, rest) = split_userinfo(rest);
                let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
                let sentinels = host_list(url, hosts, SENTINEL_FORM)?;
                let mut parts = path.split('/').filter(|p| !p.is_empty());
                let master = parts
                    .next()
                    .ok_or_else(|| format!("`{url}` names no master: expected {SENTINEL_FORM}"))?
                    .to_string();
                let db = match parts.next() {
                    Some(db) => db.parse().map_err(|_| {
                        format!(
                            "`{url}`: database `{db}` is not a number: expected {SENTINEL_FORM}"
                        )
                    })?,
                    None => 0,
                };
                if parts.next().is_some() {
                    return Err(format!(
                        "`{url}` has more path than MASTER/DB: expected {SENTINEL_FORM}"
                    ));
                }
                Ok(Some(RedisTarget::Sentinel {
                    sentinels,
                    master,
                    db,
                    userinfo: userinfo.to_string(),
                    tls: scheme == "rediss+sentinel",
                }))
            }
            "redis+cluster" | "rediss+cluster" => {
                let (userinfo, rest) = split_userinfo(rest);
                let hosts = rest.strip_suffix('/').unwrap_or(rest);
                if hosts.contains('/') {
                    return Err(format!(
                        "`{url}`: a cluster has only database 0, so no path: expected {CLUSTER_FORM}"
                    ));
                }
                let tls = scheme == "rediss+cluster";
                let node_scheme = if tls { "rediss" } else { "redis" };
                let nodes = host_list(url, hosts, CLUSTER_FORM)?
                    .into_iter()
                    .map(|(h, p)| format!("{node_scheme}://{userinfo}{h}:{p}"))
                    .collect();
                Ok(Some(RedisTarget::Cluster { nodes, tls }))
            }
            _ => Ok(None),
        }
    }
}

/// `user:pass@` (with its `@`) and the rest.
fn split_userinfo(rest: &str) -> (&str, &str) {
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    }
}

fn host_list(url: &str, hosts: &str, form: &str) -> Result<Vec<(String, u16)>, String> {
    let list: Result<Vec<_>, String> = hosts
        .split(',')
        .map(|h| {
            let (host, port) = h
                .rsplit_once(':')
                .ok_or_else(|| format!("`{url}`: `{h}` has no port: expected {form}"))?;
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("`{url}`: `{port}` is not a port: expected {form}"))?;
            if host.is_empty() {
                return Err(format!("`{url}`: `{h}` has no host: expected {form}"));
            }
            Ok((host.to_string(), port))
        })
        .collect();
    let list = list?;
    if list.is_empty() {
        return Err(format!("`{url}` names no host: expected {form}"));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_and_cluster_urls_parse_and_typos_say_what_was_expected() {
        assert_eq!(
            RedisTarget::parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2"),
            Ok(Some(RedisTarget::Sentinel {
                sentinels: vec![("10.0.0.1".into(), 26379), ("10.0.0.2".into(), 26380)],
                master: "mymaster".into(),
                db: 2,
                userinfo: ":pw@".into(),
                tls: false,
            }))
        );
        assert_eq!(
            RedisTarget::parse("rediss+cluster://a:7000,b:7001/"),
            Ok(Some(RedisTarget::Cluster {
                nodes: vec!["rediss://a:7000".into(), "rediss://b:7001".into()],
                tls: true,
            }))
        );
        for (bad, says) in [
            ("redis+sentinel://h:26379", "names no master"),
            ("redis+sentinel://h/m", "has no port"),
            ("redis+sentinel://h:x/m", "is not a port"),
            ("redis+sentinel://h:1/m/zero", "is not a number"),
            ("redis+cluster://h:7000/1", "no path"),
            ("redis://h:port", "expected redis://"),
        ] {
            let e = RedisTarget::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!(RedisTarget::parse("memcached://h:1"), Ok(None));
    }
}
