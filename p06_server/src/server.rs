//! Starting and stopping: bind first (so `/health` can say "loading"), load
//! the model on a blocking thread, serve, and on SIGTERM/SIGINT drain:
//! refuse new requests, let in-flight ones finish until a deadline, then
//! cancel what is left and exit.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::engine::{Engine, EngineError, EngineLoad, EngineRequest, EngineStream};
use tokio::net::TcpListener;

pub use crate::load::{resolve_model, served_name};
use crate::routes::{router, AppState};

/// The options every serving binary shares (p06's, p07's, ...): what to
/// serve, where, and how to stop. Each binary flattens it into its own.
#[derive(Clone, Debug, clap::Args)]
pub struct ListenArgs {
    /// `smollm2` (fetched on first run), a .gguf file or an HF Llama directory.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The name clients pass as `model` (default: SmolLM2-135M-Instruct or the file stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Larger request bodies get 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_s: u64,
}

impl ListenArgs {
    /// The served model name.
    pub fn name(&self) -> String {
        self.served_model_name
            .clone()
            .unwrap_or_else(|| served_name(&self.model))
    }

    /// Bind, and print `listening on http://ADDR (model NAME)` (tests read it).
    pub async fn bind(&self) -> anyhow::Result<TcpListener> {
        use anyhow::Context;
        let listener = TcpListener::bind((self.host.as_str(), self.port))
            .await
            .with_context(|| format!("binding {}:{}", self.host, self.port))?;
        println!(
            "listening on http://{} (model {})",
            listener.local_addr()?,
            self.name()
        );
        let _ = std::io::Write::flush(&mut std::io::stdout());
        Ok(listener)
    }

    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_s)
    }
}

/// An engine that is still loading: `/health` and requests answer 503 until
/// [`LoadingEngine::set`] installs the real one.
#[derive(Debug)]
pub struct LoadingEngine {
    name: String,
    inner: OnceLock<Arc<dyn Engine>>,
}

impl LoadingEngine {
    pub fn new(name: &str) -> LoadingEngine {
        LoadingEngine {
            name: name.to_string(),
            inner: OnceLock::new(),
        }
    }

    pub fn set(&self, engine: Arc<dyn Engine>) {
        let _ = self.inner.set(engine);
    }
}

impl Engine for LoadingEngine {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn context_length(&self) -> Option<usize> {
        self.inner.get().and_then(|e| e.context_length())
    }

    fn load(&self) -> EngineLoad {
        self.inner.get().map(|e| e.load()).unwrap_or_default()
    }

    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        match self.inner.get() {
            Some(e) => e.submit(request),
            None => Err(EngineError::Unavailable("the model is loading".into())),
        }
    }

    fn submit_choices(&self, request: EngineRequest) -> Result<Vec<EngineStream>, EngineError> {
        match self.inner.get() {
            Some(e) => e.submit_choices(request),
            None => Err(EngineError::Unavailable("the model is loading".into())),
        }
    }

    fn abort_all(&self) {
        if let Some(e) = self.inner.get() {
            e.abort_all();
        }
    }

    fn extra_metrics(&self, out: &mut String) {
        if let Some(e) = self.inner.get() {
            e.extra_metrics(out);
        }
    }
}

/// SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Serve until `shutdown` resolves, then drain: new requests get 503,
/// in-flight ones have `grace` to finish before they are cancelled (their
/// streams end with finish_reason `abort`). Returns when every connection
/// is closed.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let app = router(state.clone());
    let drain = async move {
        shutdown.await;
        state.draining.store(true, Ordering::SeqCst);
        let engine = state.engine.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            engine.abort_all();
        });
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(drain)
        .await
}

/// Serve until SIGTERM/SIGINT, then drain for `grace` (the binaries' main loop).
pub async fn run_until_signal(
    listener: TcpListener,
    state: AppState,
    grace: Duration,
) -> std::io::Result<()> {
    let shutdown = async move {
        shutdown_signal().await;
        println!("shutting down: draining for up to {} s", grace.as_secs());
        let _ = std::io::Write::flush(&mut std::io::stdout());
        // Connections that still will not close (a client that stopped
        // reading) do not hold the process past the deadline.
        tokio::spawn(async move {
            tokio::time::sleep(grace.saturating_add(Duration::from_secs(5))).await;
            eprintln!("shutdown deadline passed with connections open; exiting");
            std::process::exit(0);
        });
    };
    serve(listener, state, shutdown, grace).await?;
    println!("stopped");
    Ok(())
}

/// Serve `listen`'s model until SIGINT/SIGTERM: bind, start the engine in
/// the background with `start` (given the model's path and the served
/// name; `/health` answers 503 until it returns), drain on a signal.
/// Every serving binary runs this with its own engine.
pub async fn serve_model<F>(listen: &ListenArgs, start: F) -> anyhow::Result<()>
where
    F: FnOnce(&std::path::Path, &str) -> anyhow::Result<Arc<dyn Engine>> + Send + 'static,
{
    let name = listen.name();
    let listener = listen.bind().await?;
    let spec = listen.model.clone();
    let state = load_in_background(&name, listen.max_body_bytes, move |name| {
        let path = resolve_model(&spec)?;
        start(&path, name)
    });
    Ok(run_until_signal(listener, state, listen.grace()).await?)
}

/// Serve at once and load in the background: `/health` and requests answer
/// 503 until `load` (run on a blocking thread, given the served name) returns
/// the engine; a failed load ends the process with its message (the
/// binary's boundary, so any error will do: `anyhow`).
pub fn load_in_background<F>(name: &str, max_body_bytes: usize, load: F) -> AppState
where
    F: FnOnce(&str) -> anyhow::Result<Arc<dyn Engine>> + Send + 'static,
{
    let loading = Arc::new(LoadingEngine::new(name));
    let state = AppState::new(loading.clone(), max_body_bytes);
    state.ready.store(false, Ordering::SeqCst);
    let (ready, name) = (state.clone(), name.to_string());
    tokio::task::spawn_blocking(move || {
        let t0 = std::time::Instant::now();
        // A loader that panics (a bug) must end the process too, not leave
        // a server answering 503 forever.
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(&name)))
            .unwrap_or_else(|p| Err(anyhow::anyhow!(crate::serial::panic_message(p.as_ref()))));
        match loaded {
            Ok(e) => {
                loading.set(e);
                ready.ready.store(true, Ordering::SeqCst);
                println!("ready: model loaded in {:.1} s", t0.elapsed().as_secs_f64());
                let _ = std::io::Write::flush(&mut std::io::stdout());
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        }
    });
    state
}

#[cfg(test)]
mod tests {
    use common::engine::PromptInput;

    use super::*;

    /// Answers every method recognisably.
    #[derive(Debug)]
    struct Fake;

    impl Engine for Fake {
        fn model_name(&self) -> &str {
            "fake"
        }
        fn context_length(&self) -> Option<usize> {
            Some(7)
        }
        fn load(&self) -> EngineLoad {
            EngineLoad {
                running: 1,
                waiting: 2,
                kv_cache_bytes: 3,
            }
        }
        fn submit(&self, _: EngineRequest) -> Result<EngineStream, EngineError> {
            Err(EngineError::Internal("submit".into()))
        }
        fn submit_choices(&self, r: EngineRequest) -> Result<Vec<EngineStream>, EngineError> {
            Err(EngineError::Internal(format!("choices {}", r.n)))
        }
        fn abort_all(&self) {}
        fn extra_metrics(&self, out: &mut String) {
            out.push_str("fake_metric 1\n");
        }
    }

    #[test]
    fn a_loading_engine_forwards_every_method_once_set() {
        let e = LoadingEngine::new("m");
        let req = || EngineRequest {
            n: 3,
            ..EngineRequest::new("x", PromptInput::Text("hi".into()))
        };
        let unavailable = |r: Result<Vec<EngineStream>, EngineError>| {
            matches!(r, Err(EngineError::Unavailable(_)))
        };
        assert!(unavailable(e.submit_choices(req())));
        e.set(Arc::new(Fake));
        assert_eq!(e.context_length(), Some(7));
        assert_eq!(e.load().kv_cache_bytes, 3);
        assert_eq!(
            e.submit(req()).unwrap_err(),
            EngineError::Internal("submit".into())
        );
        assert_eq!(
            e.submit_choices(req()).unwrap_err(),
            EngineError::Internal("choices 3".into())
        );
        let mut out = String::new();
        e.extra_metrics(&mut out);
        assert_eq!(out, "fake_metric 1\n");
    }
}
