//! PostgreSQL as the store, for real: a server of the test's own (Debian's package) shared by
//! two proxies, crashed, stopped, paused, a connection killed in the middle of a settle, a
//! role without rights, the sweeper. Every test asserts on the provider's effects and on
//! what clients got.

use std::time::{Duration, Instant};

use crate::common::client::{post, send, Reply};
use crate::common::pay::{post_in_background, post_until_ok, until_effects};
use crate::common::provider::{Behavior, FakeProvider};
use crate::common::proxy::{config, route, Proxy, StoreFixture};
use crate::common::records::record;
use crate::common::Backend;
use idemproxy::idempotency::record::State;
use idemproxy::store::{self, Expiry};

const WAIT: &str = "on_in_flight = \"wait\"\nwait_timeout = \"5s\"\nlease = \"2s\"";

fn assert_unavailable(r: &Reply) {
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-idemproxy-error"), Some("store-unavailable"));
}

/// Two proxies on one database: a retry on the other replays, concurrent duplicates split
/// across both execute once, and a wait-mode duplicate on one is woken by the other's settle
/// (LISTEN/NOTIFY), also after the database restarted under the listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_on_one_database_execute_once_and_wake_each_other() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Postgres);
    let text = config(&store.url(), &route("pay", provider.port(), WAIT));
    let (a, b) = (Proxy::start(&text), Proxy::start(&text));

    let first = post(a.addr, "/pay/v1/charges", Some("shared-1"), "{}").await;
    let second = post(b.addr, "/pay/v1/charges", Some("shared-1"), "{}").await;
    assert_eq!(
        (second.replayed(), &second.body),
        (Some("true"), &first.body)
    );

    let mut tasks = Vec::new();
    for i in 0..20 {
        let addr = if i % 2 == 0 { a.addr } else { b.addr };
        tasks.push(tokio::spawn(async move {
            let h = [
                ("content-type", "application/json"),
                ("idempotency-key", "shared-2"),
                ("x-fake-delay-ms", "200"),
            ];
            send(addr, "POST", "/pay/v1/charges", &h, "{}").await
        }));
    }
    for t in tasks {
        let r = t.await.expect("task").expect("reply");
        assert_eq!(
            r.status,
            200,
            "wait mode answers every duplicate: {}",
            r.text()
        );
    }
    assert_eq!(
        provider.effects(),
        2,
        "one effect per key across both proxies"
    );

    for round in 0..2 {
        if round == 1 {
            // The LISTEN connections die with the database and must come back by themselves.
            store.postgres().restart();
            post_until_ok(a.addr, "probe-a", &[503]).await;
            post_until_ok(b.addr, "probe-b", &[503]).await;
            tokio::time::sleep(Duration::from_millis(1_000)).await;
        }
        let key = format!("woken-{round}");
        provider.then([Behavior::Slow(Duration::from_millis(1_000))]);
        let started = Instant::now();
        let first = post_in_background(&a, "/pay/v1/charges", &key);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dup = post_in_background(&b, "/pay/v1/charges", &key);
        let first = first.await.expect("task").expect("reply");
        let first_done = started.elapsed();
        let dup = dup.await.expect("task").expect("reply");
        let lag = started.elapsed() - first_done;
        assert_eq!((dup.status, dup.replayed()), (200, Some("true")));
        assert_eq!(dup.body, first.body);
        assert!(
            lag < Duration::from_millis(800),
            "round {round}: woken {lag:?} late"
        );
        eprintln!("wait mode across proxies (LISTEN/NOTIFY, round {round}): answered {lag:?} after the first");
    }
    assert_eq!(
        provider.effects(),
        6,
        "shared-1, shared-2, woken-0, probes, woken-1"
    );
}

/// A crash of the database (immediate shutdown) with a call in flight, then a clean stop:
/// requests fail closed (503, nothing forwarded) within the store timeout, the route that
/// opted into `fail_open` forwards, and once the database is back the in-flight call's
/// receipt replays: committed rows survived the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashed_and_stopped_fails_closed_and_recovers() {
    let provider = FakeProvider::start().await;
    let mut store = StoreFixture::new(Backend::Postgres);
    let routes = route("pay", provider.port(), "lease = \"1s\"")
        + &route("open", provider.port(), "fail_open = true");
    let proxy = Proxy::start(&config(&store.url(), &routes));
    let done = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("before"),
        r#"{"amount":42}"#,
    )
    .await;
    assert_eq!(done.status, 200);

    provider.then([Behavior::EffectThenSlow(Duration::from_millis(1_500))]);
    let in_flight = post_in_background(&proxy, "/pay/v1/charges", "a");
    until_effects(&provider, 2).await;
    store.postgres().crash();
    for _ in 0..3 {
        let started = Instant::now();
        let r = post(proxy.addr, "/pay/v1/charges", Some("b"), r#"{"amount":42}"#).await;
        assert_unavailable(&r);
        assert!(
            started.elapsed() < Duration::from_millis(1_500),
            "took {:?}",
            started.elapsed()
        );
    }
    let open = post(proxy.addr, "/open/v1/x", Some("k"), "{}").await;
    assert_eq!(open.status, 200, "{}", open.text());
    assert_eq!(
        open.header("x-idemproxy-warning"),
        Some("unprotected: store unavailable")
    );
    let a = in_flight.await.expect("task").expect("reply");
    assert_eq!((a.status, a.replayed()), (200, Some("false")));
    assert_eq!(provider.effects(), 3, "before, a, and the fail_open call");

    store.postgres().start_again();
    let restarted = Instant::now();
    let replay = post_until_ok(proxy.addr, "a", &[409, 503]).await;
    eprintln!(
        "postgres crash: receipt replayed {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &a.body));
    let before = post(
        proxy.addr,
        "/pay/v1/charges",
        Some("before"),
        r#"{"amount":42}"#,
    )
    .await;
    assert_eq!(
        (before.replayed(), &before.body),
        (Some("true"), &done.body),
        "survived the crash"
    );

    // A clean stop: the same, and the proxy's pool reconnects by itself.
    store.postgres().stop();
    assert_unavailable(&post(proxy.addr, "/pay/v1/charges", Some("c"), "{}").await);
    store.postgres().start_again();
    let c = post_until_ok(proxy.addr, "c", &[503]).await;
    assert_eq!(c.replayed(), Some("false"));
    assert_eq!(provider.effects(), 4, "c once; b never went through");
}

/// A database that accepts connections and never answers (SIGSTOP): every request gets its
/// 503 within the store timeout; after SIGCONT the call in flight settles and `c`, whose
/// claims were never answered, executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_paused_never_hangs_requests() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Postgres);
    let proxy = Proxy::start(&config(
        &store.url(),
        &route("pay", provider.port(), "lease = \"1s\""),
    ));
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("warm"), "{}")
            .await
            .status,
        200
    );
    provider.then([Behavior::EffectThenSlow(Duration::from_millis(1_000))]);
    let in_flight = post_in_background(&proxy, "/pay/v1/charges", "a");
    until_effects(&provider, 2).await;
    store.postgres.as_ref().expect("postgres").pause();

    let mut worst = Duration::ZERO;
    for _ in 0..4 {
        let started = Instant::now();
        let r = post(proxy.addr, "/pay/v1/charges", Some("c"), r#"{"amount":42}"#).await;
        worst = worst.max(started.elapsed());
        assert_unavailable(&r);
    }
    assert!(
        worst < Duration::from_millis(900),
        "a request took {worst:?}"
    );
    let a = in_flight.await.expect("task").expect("reply");
    assert_eq!((a.status, a.replayed()), (200, Some("false")));
    eprintln!("postgres SIGSTOP: worst 503 latency {worst:?} (op_timeout 500ms)");

    store.postgres.as_ref().expect("postgres").resume();
    let replay = post_until_ok(proxy.addr, "a", &[409, 503]).await;
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &a.body));
    let c = post_until_ok(proxy.addr, "c", &[409, 503]).await;
    assert_eq!(c.replayed(), Some("false"));
    assert_eq!(provider.effects(), 3, "warm, a and c once each");
}

/// The proxy's connection is killed (`pg_terminate_backend`) while its settle waits on a row
/// lock another session holds: the settle fails, is retried on a fresh connection, and the
/// receipt lands once. Retries meanwhile are held, never executed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_mid_settle_settles_once() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Postgres);
    let pg = store.postgres.as_ref().expect("postgres");
    let proxy = Proxy::start(&config(
        &store.url(),
        &route("pay", provider.port(), "lease = \"2s\""),
    ));
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("warm"), "{}")
            .await
            .status,
        200
    );

    provider.then([Behavior::EffectThenSlow(Duration::from_millis(1_000))]);
    let in_flight = post_in_background(&proxy, "/pay/v1/charges", "a");
    until_effects(&provider, 2).await;
    // Another session locks the claim's row until we say so: the settle's UPDATE waits on it.
    let url = store.url();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("connect");
            tokio::spawn(conn);
            client
                .batch_execute(
                    "BEGIN; SELECT 1 FROM idemproxy_records WHERE scope LIKE '%' FOR UPDATE",
                )
                .await
                .expect("lock the rows");
            locked_tx.send(()).expect("signal");
            let _ = tokio::task::spawn_blocking(move || release_rx.recv()).await;
            client.batch_execute("COMMIT").await.expect("release");
        });
    });
    locked_rx.recv().expect("locked");

    // Wait for the settle to block on the lock, then kill the connection it runs on.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let killed = pg.psql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'idemproxy' AND wait_event_type = 'Lock'",
        );
        if killed != "0" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the settle never waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = in_flight.await.expect("task").expect("reply");
    assert_eq!(
        (a.status, a.replayed()),
        (200, Some("false")),
        "the client still gets the real answer"
    );
    // While the row is locked the settle cannot land: a retry is held or refused, never executed.
    let held = post(proxy.addr, "/pay/v1/charges", Some("a"), r#"{"amount":42}"#).await;
    assert!(
        matches!(held.status, 409 | 503),
        "{}: {}",
        held.status,
        held.text()
    );
    release_tx.send(()).expect("release");
    holder.join().expect("lock holder");

    let replay = post_until_ok(proxy.addr, "a", &[409, 503]).await;
    assert_eq!((replay.replayed(), &replay.body), (Some("true"), &a.body));
    assert_eq!(provider.effects(), 2, "warm and a, once each");
}

/// Expired rows go, in batches, while claims go on: a backlog larger than one batch is
/// deleted within a few sweeps, live rows stay, and no claim waits for the sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_swept_in_batches_while_claims_go_on() {
    let store = StoreFixture::new(Backend::Postgres);
    let pg = store.postgres.as_ref().expect("postgres");
    let mut cfg = store.store_config();
    cfg.sweep_interval = idemproxy::config::Dur(Duration::from_millis(300));
    let s = store::open(&cfg, None, Default::default())
        .await
        .expect("open")
        .claims;
    s.ping().await.expect("schema in place");
    // 5000 rows already expired (more than two sweep batches), written directly.
    pg.psql(
        "INSERT INTO idemproxy_records (scope, state, token, value, expires_at)
         SELECT 'idem:t:old' || i, 'P', 'x', '\\x00', 1 FROM generate_series(1, 5000) i",
    );
    let hour = Expiry::After(Duration::from_secs(3600));
    s.insert_if_absent("idem:t:live", &record(State::Pending), hour)
        .await
        .expect("insert");
    let mut slowest = Duration::ZERO;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    loop {
        i += 1;
        let started = Instant::now();
        s.insert_if_absent(&format!("idem:t:busy{i}"), &record(State::Pending), hour)
            .await
            .expect("insert");
        slowest = slowest.max(started.elapsed());
        if pg.psql("SELECT count(*) FROM idemproxy_records WHERE scope LIKE 'idem:t:old%'") == "0" {
            break;
        }
        assert!(Instant::now() < deadline, "the backlog was never swept");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(s.get("idem:t:live").await.expect("get").is_some());
    assert!(
        slowest < Duration::from_millis(400),
        "a claim waited {slowest:?} during sweeps"
    );
    eprintln!("postgres sweep: 5000 expired rows gone after {i} claims; slowest claim {slowest:?}");
}

/// A role that may not create the tables gets a start-up error that says what to grant;
/// once the tables exist (created by an owner) and it has DML rights, it runs.
/// `check-config` accepts the same URL: it checks the URL, not the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_rights_is_told_what_to_grant() {
    let provider = FakeProvider::start().await;
    let store = StoreFixture::new(Backend::Postgres);
    let pg = store.postgres.as_ref().expect("postgres");
    pg.psql("CREATE ROLE limited LOGIN");
    let text = config(&pg.url_as("limited"), &route("pay", provider.port(), ""));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemproxy.toml");
    std::fs::write(&path, &text).expect("write config");
    let run = |cmd: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args([cmd, "--config"])
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .expect("run idemproxy")
    };
    assert!(
        run("check-config").status.success(),
        "check-config accepts the URL"
    );
    let out = run("serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "serve started without rights");
    assert!(err.contains("GRANT CREATE ON SCHEMA public"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // The owner creates the schema (a first run as a privileged role), then grants DML.
    let owner = Proxy::start(&config(&store.url(), &route("pay", provider.port(), "")));
    drop(owner);
    pg.psql("GRANT SELECT, INSERT, UPDATE, DELETE ON idemproxy_records TO limited; GRANT SELECT ON idemproxy_schema TO limited");
    let proxy = Proxy::start(&text);
    assert_eq!(
        post(proxy.addr, "/pay/v1/charges", Some("k"), "{}")
            .await
            .status,
        200
    );
    // A schema newer than this build knows is refused with a clear message.
    pg.psql("UPDATE idemproxy_schema SET version = 99");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["serve", "--config"])
        .arg(&path)
        .current_dir(dir.path())
        .output()
        .expect("run idemproxy");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("newer than this build"),
        "{err}"
    );
}

/// `check-config` and `serve` run the same URL parser: a typo in any store URL is refused by
/// both, naming the field and the forms expected; a good URL of each kind passes the check.
#[test]
fn store_url_typos_name_the_field_and_what_was_expected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemproxy.toml");
    let run = |cmd: &str, url: &str| {
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.1:0\"\n[store]\nurl = \"{url}\"\nop_timeout = \"500ms\"\n\n{}", route("pay", 1, "")),
        )
        .expect("write config");
        std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args([cmd, "--config"])
            .arg(&path)
            .current_dir(dir.path())
            .output()
            .expect("run idemproxy")
    };
    for (url, says) in [
        (
            "postgress://idem@db/claims",
            "expected sqlite://PATH, postgres://",
        ),
        ("postgres://idem@db/claims?sslmode=verify", "verify-full"),
        ("postgres://db:5432/claims", "names no user"),
        ("redis+sentinal://h:26379/m", "expected sqlite://PATH"),
        ("redis+sentinel://h:26379", "names no master"),
        ("redis+cluster://h:70000", "is not a port"),
        ("rediss://h:port/0", "expected rediss://"),
    ] {
        for cmd in ["check-config", "serve"] {
            let out = run(cmd, url);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} accepted {url}");
            assert!(
                err.contains("store.url") && err.contains(says),
                "{cmd} {url}: {err}"
            );
        }
    }
    // A CA with the default sslmode (prefer) verifies nothing: refused at start, saying why.
    let pki = crate::common::pki::TestPki::new("pg-prefer-ca");
    let ca = pki.ca_path();
    for (url, with_ca) in [
        ("postgres://idem@db/claims", true),
        ("postgres://idem@db/claims?sslmode=prefer", true),
        ("postgres://idem@db/claims?sslmode=disable", true),
        (
            "postgres://idem@db/claims?sslrootcert=%2Fetc%2Fca.pem",
            false,
        ),
    ] {
        let lines = if with_ca {
            format!("tls_ca = \"{}\"\n", ca.display())
        } else {
            String::new()
        };
        std::fs::write(
            &path,
            format!("[server]\nlisten = \"127.0.0.1:0\"\n[store]\nurl = \"{url}\"\n{lines}op_timeout = \"500ms\"\n\n{}", route("pay", 1, "")),
        )
        .expect("write config");
        for cmd in ["check-config", "serve"] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
                .args([cmd, "--config"])
                .arg(&path)
                .current_dir(dir.path())
                .output()
                .expect("run idemproxy");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} accepted a CA with {url}");
            assert!(
                err.contains("store.tls_ca") && err.contains("verify-full"),
                "{cmd} {url}: {err}"
            );
        }
    }
    for url in [
        "postgres://idem@db.internal:5432/claims?sslmode=verify-full",
        "rediss://cache.internal:6380/0",
        "redis+sentinel://a:26379,b:26379/mymaster/1",
        "redis+cluster://a:7000,b:7000",
    ] {
        let out = run("check-config", url);
        assert!(
            out.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
