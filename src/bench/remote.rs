//! `bench routing`'s `<mode>-remote` cells: a NATS server on a free loopback port and, per
//! mode, a `tokenrouter worker` hosting the reference model, all children of the bench, which
//! end with it.

use anyhow::Context;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokenrouter::config::{ClusterConfig, Config, ExecutionMode, Placement};

pub struct Bus {
    nats: Child,
    url: String,
    token: String,
    workers: Vec<Child>,
}

impl Bus {
    /// Starts `nats-server` (Debian's package) on a free loopback port with a fresh token.
    pub fn start() -> anyhow::Result<Self> {
        let program = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .context("`<mode>-remote` needs nats-server (Debian's `nats-server` package)")?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let token = format!("bench-{:016x}", rand::random::<u64>());
        let nats = Command::new(program)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "--auth", &token])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start nats-server")?;
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if started.elapsed() > Duration::from_secs(10) {
                anyhow::bail!("nats-server did not listen on port {port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self {
            nats,
            url: format!("nats://127.0.0.1:{port}"),
            token,
            workers: Vec::new(),
        })
    }

    /// Starts a worker hosting `model` in `mode` and returns `config` with that model placed
    /// on it (each mode on subjects of its own, so the cells' workers do not meet).
    pub fn host(
        &mut self,
        config_path: &Path,
        config: &Config,
        model: &str,
        mode: ExecutionMode,
    ) -> anyhow::Result<Config> {
        let prefix = format!("bench-{}", mode.as_str());
        let worker = Command::new(std::env::current_exe()?)
            .args(["worker", "--model", model, "--nats-url", &self.url])
            .args([
                "--subject-prefix",
                &prefix,
                "--mode",
                mode.as_str(),
                "--config",
            ])
            .arg(config_path)
            .env("TOKENROUTER_NATS_TOKEN", &self.token)
            .stdout(Stdio::null())
            .spawn()
            .context("cannot start tokenrouter worker")?;
        self.workers.push(worker);
        let mut remote = config.clone();
        remote.cluster = Some(ClusterConfig {
            token: Some(self.token.clone()),
            subject_prefix: prefix,
            ..ClusterConfig::at(&self.url)
        });
        let hosted = remote
            .models
            .iter_mut()
            .find(|m| m.name == model)
            .with_context(|| format!("`<mode>-remote` places the reference model `{model}` remote; it is not a configured model"))?;
        hosted.placement = Placement::Remote;
        Ok(remote)
    }
}

impl Drop for Bus {
    fn drop(&mut self) {
        for child in self
            .workers
            .iter_mut()
            .chain(std::iter::once(&mut self.nats))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
