//! The command line: parse, load, report errors with context, run.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use idemproxy::config::Config;
use idemproxy::reload::Reloader;
use idemproxy::tls::init::InitOptions;

// mimalloc: fewer cycles per allocation than glibc malloc on the request path (see bench/).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "idemproxy",
    version,
    about = "Makes agent tools' side effects happen once"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, default_value = "config/idemproxy.toml")]
        config: PathBuf,
    },
    /// Try it locally, from any directory: stand-in providers on this machine (one that
    /// counts what it does, one shaped like Stripe's API) and the proxy in front of them;
    /// prints the commands to run. Each run starts with an empty store.
    Demo {
        /// The demo's config (default: config/examples/local.toml, built in).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Load and validate a config file, then exit.
    CheckConfig {
        #[arg(long, default_value = "config/idemproxy.toml")]
        config: PathBuf,
    },
    /// Inspect and resolve claims through the admin API.
    Keys(Box<idemproxy::admin::cli::KeysArgs>),
    /// Payments parked by spend control: list them, approve or deny one.
    Approvals(Box<idemproxy::admin::cli::ApprovalsArgs>),
    /// Stop every capped operation of a tenant, a run or a route at once (until unfrozen).
    Freeze(Box<idemproxy::admin::cli::FreezeArgs>),
    /// Lift a freeze.
    Unfreeze(Box<idemproxy::admin::cli::FreezeArgs>),
    /// List the freezes in effect.
    Freezes(Box<idemproxy::admin::cli::AdminTarget>),
    /// Exit 0 when the admin listener answers /healthz (for container health checks).
    Healthcheck {
        #[arg(long, default_value = "http://127.0.0.1:9090/healthz")]
        url: String,
    },
    /// Print the worker setup (environment, files to mount) that makes provider SDKs as
    /// shipped go through the proxy, for every runtime; writes the files into <dir>/worker/.
    Env(Box<idemproxy::worker::EnvArgs>),
    /// The CA that signs the certificates of intercepted HTTPS hosts.
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create the CA (ca.pem, ca.key with mode 0600, ca-bundle.pem) and print the settings
    /// the proxy and its workers need.
    Init {
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
        /// Replace an existing CA (workers must then trust the new one).
        #[arg(long)]
        force: bool,
        /// The proxy as workers reach it (printed as HTTPS_PROXY).
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        proxy_url: String,
        /// Where workers see --dir (a read-only volume mount); default: --dir itself.
        #[arg(long)]
        worker_dir: Option<PathBuf>,
        /// PEM bundle of trusted roots combined with the CA into ca-bundle.pem (default: the
        /// system bundle, e.g. /etc/ssl/certs/ca-certificates.crt).
        #[arg(long)]
        system_bundle: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _log_guard = match init_logging() {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("idemproxy: cannot start the log writer thread: {e}");
            return ExitCode::from(1);
        }
    };
    let result = match cli.command {
        Command::Serve { config } => run_serve(config, None),
        Command::Demo { config } => run_demo(config),
        Command::CheckConfig { config } => check_config(config),
        Command::Keys(args) => run_client(async move {
            println!("{}", idemproxy::admin::cli::run(*args).await?);
            Ok(())
        }),
        Command::Approvals(args) => run_client(async move {
            println!("{}", idemproxy::admin::cli::run_approvals(*args).await?);
            Ok(())
        }),
        Command::Freeze(args) => run_client(async move {
            println!("{}", idemproxy::admin::cli::run_freeze(*args, true).await?);
            Ok(())
        }),
        Command::Unfreeze(args) => run_client(async move {
            println!("{}", idemproxy::admin::cli::run_freeze(*args, false).await?);
            Ok(())
        }),
        Command::Freezes(target) => run_client(async move {
            println!("{}", idemproxy::admin::cli::list_freezes(*target).await?);
            Ok(())
        }),
        Command::Healthcheck { url } => run_client(async move {
            idemproxy::admin::cli::healthcheck(&url).await?;
            Ok(())
        }),
        Command::Env(args) => idemproxy::worker::run(&args)
            .map(|text| print!("{text}"))
            .map_err(Into::into),
        Command::Ca {
            command:
                CaCommand::Init {
                    dir,
                    force,
                    proxy_url,
                    worker_dir,
                    system_bundle,
                },
        } => ca_init(InitOptions {
            dir,
            force,
            proxy_url,
            worker_dir,
            system_bundle,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemproxy: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Logs go to stderr from a background thread, so a request never waits on a log write.
/// Lines are never dropped (back-pressure instead); the guard writes what is left at exit.
/// The thread writes whatever lines have queued up in one write and sleeps when there are
/// none (`log_writer`); colours only on a terminal.
fn init_logging() -> std::io::Result<idemproxy::log_writer::LogGuard> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("IDEMPROXY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = std::env::var("IDEMPROXY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let (writer, guard) = idemproxy::log_writer::spawn(std::io::stderr())?;
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    if json {
        builder.json().init();
    } else if ansi {
        builder.init();
    } else {
        // The same bytes as `builder.init()` writes; each protected request's line costs a
        // fraction of its fields' formatting (`proxy::log_line`).
        builder
            .fmt_fields(idemproxy::proxy::log_line::LineFields)
            .init();
        idemproxy::proxy::log_line::write_lines_whole();
    }
    Ok(guard)
}

fn check_config(path: PathBuf) -> anyhow::Result<()> {
    let config = Config::load(&path)?;
    // Exactly what `serve` builds before it opens the store.
    idemproxy::app::Parts::check(&config)?;
    for warning in config
        .warnings()
        .into_iter()
        .chain(idemproxy::admin::warnings(&config))
    {
        eprintln!("{}: warning: {warning}", path.display());
    }
    println!("{}: OK ({} routes)", path.display(), config.routes.len());
    println!("{}", idemproxy::proxy::egress_policy::summary(&config));
    Ok(())
}

fn ca_init(opts: InitOptions) -> anyhow::Result<()> {
    let written = idemproxy::tls::init::init(&opts)?;
    print!("{}", idemproxy::tls::init::instructions(&written, &opts));
    Ok(())
}

/// A fresh run of the demo's config: the CA if the config names one that does not exist yet,
/// then the proxy as `serve` runs it, with the stand-ins started once it listens. The run's
/// store goes when the demo ends.
fn run_demo(config: Option<PathBuf>) -> anyhow::Result<()> {
    let (text, source) = match config {
        Some(path) => (
            std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?,
            path,
        ),
        None => (
            idemproxy::demo::BUILT_IN.to_string(),
            PathBuf::from(idemproxy::demo::BUILT_IN_NAME),
        ),
    };
    let cwd = std::env::current_dir().context("no current directory")?;
    let run = idemproxy::demo::Run::prepare(&text, &source, &cwd)?;
    let config = Config::load(&run.config)?;
    let ca = match (&config.tls.ca_cert, &config.tls.ca_key) {
        (Some(cert), Some(key)) => {
            if !cert.exists() {
                ca_init(InitOptions {
                    dir: cert.parent().map(PathBuf::from).unwrap_or_default(),
                    force: false,
                    proxy_url: format!("http://{}", config.server.listen),
                    worker_dir: None,
                    system_bundle: None,
                })?;
            }
            Some((cert.clone(), key.clone()))
        }
        _ => None,
    };
    let shop_host = config
        .routes
        .iter()
        .find(|r| {
            run.stand_ins
                .iter()
                .any(|s| s.route == r.name && matches!(s.kind, idemproxy::demo::Kind::Counter))
        })
        .and_then(|r| r.host.clone());
    let stand_ins = run.stand_ins.clone();
    let config_path = run.config.clone();
    let served = run_serve(
        config_path,
        Some(Box::new(move |proxy| {
            Box::pin(async move {
                let ca = ca.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
                let starting = idemproxy::demo::Run::start_stand_ins(&stand_ins, ca);
                starting.await?;
                print!(
                    "{}",
                    idemproxy::demo::instructions(proxy, &stand_ins, shop_host.as_deref())
                );
                Ok(())
            })
        })),
    );
    drop(run);
    served
}

/// Runs once the proxy listens (the demo starts its stand-ins there).
type OnListening = Box<
    dyn FnOnce(
            std::net::SocketAddr,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>
        + Send,
>;

fn run_serve(path: PathBuf, on_listening: Option<OnListening>) -> anyhow::Result<()> {
    let config = Config::load(&path)?;
    let runtime = idemproxy::serve::runtime(&config).context("cannot start the async runtime")?;
    runtime.block_on(serve_config(path, config, on_listening))
}

async fn serve_config(
    path: PathBuf,
    config: Config,
    on_listening: Option<OnListening>,
) -> anyhow::Result<()> {
    let listening = idemproxy::serve::listen(path, config).await?;
    // Before the listening line: until then SIGHUP would still end the process.
    reload_on_sighup(listening.reloader.clone());
    // Tests and scripts read this line to find the ports when the config asks for port 0.
    match listening.admin {
        Some(admin) => println!(
            "idemproxy listening proxy={} admin={admin}",
            listening.proxy
        ),
        None => println!("idemproxy listening proxy={}", listening.proxy),
    }
    if let Some(hook) = on_listening {
        hook(listening.proxy).await?;
    }
    listening.serve(shutdown_signal()).await;
    Ok(())
}

/// SIGHUP re-reads the config file (see `idemproxy::reload`).
fn reload_on_sighup(reloader: Arc<Reloader>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reload through the admin API (POST /v1/reload)");
                return;
            }
        };
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let reloader = reloader.clone();
                // Reads files and certificates: off the runtime's threads. The outcome is
                // logged and counted there.
                let _ = tokio::task::spawn_blocking(move || reloader.reload_logged("SIGHUP")).await;
            }
        });
    }
    #[cfg(not(unix))]
    drop(reloader);
}

/// Runs a client command (keys, healthcheck) on a small runtime of its own.
fn run_client(work: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(work)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the proxy gracefully");
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
