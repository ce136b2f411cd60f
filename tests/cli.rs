//! The command-line contract (`docs/cli.md`) for commands that need no downloaded weights.

mod common;

use std::process::Command;

fn tokenrouter(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs a `--json` command that must succeed and returns its report.
fn tokenrouter_json(args: &[&str]) -> serde_json::Value {
    let out = tokenrouter(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn tune_validate_paper_json_reproduces_the_paper_grid() {
    let report = tokenrouter_json(&["tune", "--validate-paper", "--json"]);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 9, "N = 2..4, B_1 = 1..N");
    for row in rows {
        let (got, want) = (
            row["predicted"].as_f64().unwrap(),
            row["paper"].as_f64().unwrap(),
        );
        assert!((got - want).abs() <= 0.1, "{row}");
    }
    let worked = &report["worked_example"];
    assert!(
        (worked["predicted"].as_f64().unwrap() - 1058.56).abs() < 0.1,
        "{worked}"
    );
    assert_eq!(worked["best"][1], 1);
}

#[test]
fn tune_prints_thresholds_for_the_default_config() {
    let report = tokenrouter_json(&["tune", "--json"]);
    let rows = report["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        let n = row["n"].as_u64().unwrap() as usize;
        let thresholds = row["thresholds"].as_array().unwrap();
        let slack: usize = thresholds
            .iter()
            .map(|t| t.as_u64().unwrap() as usize - 1)
            .sum();
        assert!(slack < n, "B* must be deadlock-free: {row}");
        assert!(row["predicted"].as_f64().unwrap() >= row["eager"].as_f64().unwrap() - 1e-9);
    }
}

#[test]
fn bad_input_gets_a_message_naming_the_problem() {
    let out = tokenrouter(&["models", "list", "--config", "/nonexistent.toml"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read config /nonexistent.toml"));

    let out = tokenrouter(&["bench", "routing", "--workload", "marathon"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown workload `marathon`"));

    let out = tokenrouter(&["generate", "--prompt", "hi", "--top-p", "1.5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--top-p"));

    let sim = [
        "bench",
        "engine",
        "--config",
        "config/paper-sim.toml",
        "--cuda-graphs",
    ];
    let out = tokenrouter(&[&sim[..], &["on,off"]].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--cuda-graphs applies to a model on a GPU"),
        "{err}"
    );
    let out = tokenrouter(&[&sim[..], &["maybe"]].concat());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`maybe` is not `on` or `off`"));
}

#[test]
fn bench_routing_on_the_simulated_pair_reports_every_mode_with_predictions_and_plots() {
    let out_dir = tempfile::tempdir().unwrap();
    let rows = tokenrouter_json(&[
        "bench",
        "routing",
        "--config",
        "config/paper-sim.toml",
        "--policy",
        "r2r",
        "--concurrency",
        "2",
        "--requests",
        "4",
        "--max-tokens",
        "6",
        "--workload",
        "agent",
        "--mode",
        "lockstep,async,tokenrouter,llm-only",
        "--json",
        "--out",
        out_dir.path().to_str().unwrap(),
    ]);
    let rows = rows.as_array().unwrap();
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["lockstep", "async", "tokenrouter", "llm-only"]);
    for row in rows {
        assert_eq!(row["completed"], 4, "{row}");
        assert_eq!(
            row["output_tokens"], 24,
            "simulated models never stop early: {row}"
        );
        assert_eq!(row["workload"], "agent");
        let predicted = &row["predicted_tokens_per_s"];
        assert_eq!(predicted.is_null(), row["mode"] == "lockstep", "{row}");
        // 4 requests on 2 clients: a window with both in flight before the drain.
        assert!(
            row["all_in_flight_tokens_per_s"]
                .as_f64()
                .is_some_and(|rate| rate > 0.0),
            "{row}"
        );
        assert_eq!(row["per_model"].as_array().unwrap().len(), 2);
    }
    let llm_only = &rows[3];
    assert_eq!(
        llm_only["token_share"][0],
        serde_json::json!(["large", 1.0])
    );
    assert_eq!(
        llm_only["per_model"][1]["steps"], 0,
        "the small model idles"
    );
    for plot in ["throughput-r2r.svg", "predicted-vs-measured.svg"] {
        let svg = std::fs::read_to_string(out_dir.path().join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("tokens/s"),
            "{plot}"
        );
    }
}

/// `--profile-steps` measures each model's step profile around every cell: a config without
/// profiles then gets a profile-priced prediction, and each model's steps are set beside what
/// the profile prices them at.
#[test]
fn bench_routing_with_profiled_steps_prices_every_routed_cell() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::server::write_tiny_config(dir.path(), 0.5);
    let routing = |extra: &[&str]| {
        let mut args = vec!["bench", "routing", "--config", config.to_str().unwrap()];
        args.extend_from_slice(&["--policy", "r2r", "--mode", "async,llm-only"]);
        args.extend_from_slice(&["--concurrency", "2", "--requests", "4", "--max-tokens", "6"]);
        args.extend_from_slice(&["--workload", "long", "--json"]);
        args.extend_from_slice(extra);
        tokenrouter_json(&args)
    };
    for row in routing(&[]).as_array().unwrap() {
        assert!(
            row["predicted_from_profiles_tokens_per_s"].is_null(),
            "{row}"
        );
        assert!(row["measured_profiles"].is_null(), "{row}");
    }
    for row in routing(&["--profile-steps"]).as_array().unwrap() {
        assert!(
            row["predicted_from_profiles_tokens_per_s"]
                .as_f64()
                .is_some_and(|p| p > 0.0),
            "{row}"
        );
        let measured = row["measured_profiles"].as_array().unwrap();
        assert_eq!(measured.len(), 2, "{row}");
        for (_, profile) in measured.iter().map(|m| (&m[0], &m[1])) {
            assert!(profile["a_ms"].as_f64().unwrap() >= 0.0, "{row}");
            assert!(
                profile["prefill_ms_per_token"].as_f64().unwrap() > 0.0,
                "{row}"
            );
        }
        for model in row["per_model"].as_array().unwrap() {
            if model["steps"] == 0 {
                continue;
            }
            assert!(model["step_ms_mean"].as_f64().unwrap() > 0.0, "{row}");
            assert!(
                model["profile_step_ms_mean"].as_f64().unwrap() > 0.0,
                "{row}"
            );
            let busy = model["busy_share"].as_f64().unwrap();
            assert!(busy > 0.0 && busy <= 1.05, "{row}");
        }
    }
}

/// `bench engine --json` writes the step-latency fit; a config naming it as a model's
/// `step_profile` feeds it to `tune` (no `[tuning] latency_ms`); the concurrent mode reports
/// both models; a file that is not a report is refused with the field named.
#[test]
fn bench_engine_fit_feeds_tune_and_concurrent_mode_reports_both_models() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::server::write_tiny_config(dir.path(), 0.5);
    let config_arg = config.to_str().unwrap();
    let bench = |model: &str, extra: &[&str]| {
        let mut args = vec!["bench", "engine", "--config", config_arg, "--model", model];
        args.extend_from_slice(&["--batch", "1,2", "--steps", "2", "--prefill-tokens", "8"]);
        args.extend_from_slice(extra);
        args.push("--json");
        tokenrouter_json(&args)
    };
    let mut profiles = Vec::new();
    for model in ["large", "small"] {
        let report = bench(model, &[]);
        assert!(report["fit"]["c_ms"].as_f64().unwrap() >= 0.0, "{report}");
        let path = dir.path().join(format!("{model}.json"));
        std::fs::write(&path, report.to_string()).unwrap();
        profiles.push(path);
    }
    let concurrent = bench("large", &["--concurrent-with", "small", "--threads", "1"]);
    let rows = concurrent["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "two models × two batch sizes: {concurrent}");
    assert!(rows.iter().all(|r| r["slowdown"].as_f64().unwrap() > 0.0));
    assert!(rows
        .iter()
        .all(|r| r["alternating_ms_median"].as_f64().unwrap() > 0.0));

    let text = std::fs::read_to_string(&config).unwrap();
    let with_profiles = |large: &std::path::Path| {
        text.replacen(
            "name = \"large\"",
            &format!("name = \"large\"\nstep_profile = {:?}", large),
            1,
        )
        .replacen(
            "name = \"small\"",
            &format!("name = \"small\"\nstep_profile = {:?}", profiles[1]),
            1,
        ) + "\n[tuning]\nrouting = [[0.0, 1.0], [0.25, 0.75]]\ncommits = [[0.0, 1.0], [0.0, 1.0]]\nmax_requests = 3\n"
    };
    let tune_config = dir.path().join("tune.toml");
    std::fs::write(&tune_config, with_profiles(&profiles[0])).unwrap();
    let tuned = tokenrouter_json(&["tune", "--config", tune_config.to_str().unwrap(), "--json"]);
    assert_eq!(tuned["rows"].as_array().unwrap().len(), 3, "{tuned}");

    std::fs::write(&tune_config, with_profiles(&config)).unwrap();
    let out = tokenrouter(&["tune", "--config", tune_config.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("models.large.step_profile"), "{stderr}");
}

/// `bench quality` answers the held-out questions per served name, scores them and plots
/// accuracy against the first model's token share; a bad split is a clear error.
#[test]
fn bench_quality_scores_each_policy_and_model_alone_and_writes_the_plot() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::server::write_tiny_config(dir.path(), 0.5);
    let quality = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "quality",
            "--config",
            config.to_str().unwrap(),
            "--policy",
            "large,small",
            "--sweep",
            "r2r=0.5,2",
            "--questions",
            "5",
            "--max-tokens",
            "4",
        ];
        args.extend_from_slice(extra);
        tokenrouter(&args)
    };
    let out = quality(&["--json", "--out", dir.path().to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let served: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["served"].as_str().unwrap())
        .collect();
    assert_eq!(served, ["large", "small", "r2r@0.5", "r2r@2", "oracle"]);
    // The oracle's answers are the reference model's; only its share differs.
    let (large, oracle) = (&rows[0], &rows[4]);
    assert_eq!(oracle["correct"], large["correct"]);
    assert_eq!(oracle["reference_nll"], large["reference_nll"]);
    assert!(oracle["ms_per_token"].is_null());
    let share = oracle["reference_token_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{oracle}");
    for row in rows.as_array().unwrap() {
        assert_eq!(row["questions"], 5, "{row}");
        assert_eq!(row["answers"].as_array().unwrap().len(), 5, "{row}");
        assert!(row["reference_nll"].as_f64().unwrap() > 0.0, "{row}");
    }
    assert_eq!(rows[0]["reference_token_share"], 1.0);
    assert_eq!(rows[1]["reference_token_share"], 0.0);
    assert!(dir.path().join("accuracy-vs-share.svg").exists());

    let out = quality(&["--split", "validation"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--split takes heldout, train or all"));
}

/// `bench parity` decodes the fixed prompts on the CPU and on `--device`; CPU against CPU must
/// match token for token, and a device this build cannot use is a clear error.
#[test]
fn bench_parity_compares_devices_and_names_a_device_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::server::write_tiny_config(dir.path(), 0.5);
    let config_arg = config.to_str().unwrap();
    let parity = |device: &str| {
        tokenrouter(&[
            "bench", "parity", "--config", config_arg, "--model", "large", "--device", device,
            "--tokens", "6", "--json",
        ])
    };
    let out = parity("cpu");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["all_match"], true, "{report}");
    assert_eq!(report["passed"], true, "{report}");
    assert_eq!(report["forced_agreement"], 1.0, "{report}");
    assert_eq!(report["prompts"].as_array().unwrap().len(), 3, "{report}");
    assert_eq!(report["candidate"], "large@cpu");

    let out = parity("cuda:7");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--features cuda") || stderr.contains("cuda:7"),
        "{stderr}"
    );
    let out = parity("gpu");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("device `gpu`"));
}

/// A config naming an unknown policy kind is refused at start-up with the kind and the known
/// ones named.
#[test]
fn an_unknown_policy_kind_is_named_with_the_known_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::server::write_tiny_config(dir.path(), 0.5);
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("kind = \"r2r\""), "{text}");
    std::fs::write(
        &config,
        text.replacen("kind = \"r2r\"", "kind = \"magic\"", 1),
    )
    .unwrap();
    let out = tokenrouter(&["models", "list", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for name in ["magic", "r2r", "citer", "rstitch", "colm", "me", "single"] {
        assert!(stderr.contains(&format!("`{name}`")), "{name}: {stderr}");
    }
}

/// The binary carries the default config, its step profiles and the fetch script: copied into
/// an empty directory it still finds everything except the model, which it would fetch.
#[test]
fn a_binary_in_an_empty_directory_uses_its_carried_config() {
    // A hard link, not a copy: a copy's write handle, inherited by a process another test forks
    // meanwhile, makes executing it fail with "Text file busy" (ETXTBSY).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let binary = dir.path().join("tokenrouter");
    std::fs::hard_link(env!("CARGO_BIN_EXE_tokenrouter"), &binary).unwrap();
    let out = Command::new(&binary)
        .current_dir(dir.path())
        .args(["models", "list", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("built into the binary"), "{stderr}");
    let models: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(models[0]["name"], "smollm2-135m", "{models}");
    assert_eq!(models[0]["present"], false, "{models}");
    let out = Command::new(&binary)
        .current_dir(dir.path())
        .args(["tune", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the carried step profiles feed tune: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
