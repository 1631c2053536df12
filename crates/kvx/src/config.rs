//! The TOML file of `kvx receiver|sender|proxy --config FILE`: a table per role whose keys are
//! that role's long flags in snake_case. Each key is given to the command line as its flag,
//! unless the command line gives that flag itself: a flag wins over the file and the file
//! over the default, and a value from the file goes through the same parser and range check
//! as the flag, with the same message. A key that is no flag of the role is an error naming
//! the known ones. Ports are laid out as LMCache lays them out: one alloc port and one fabric
//! port per TP rank.
//!
//! ```toml
//! [receiver]
//! host = "127.0.0.1"
//! alloc_ports = [8400, 8401]   # one per TP rank (LMCache: pd_peer_alloc_port)
//! fabric_ports = [8300, 8301]  # one per TP rank (LMCache: pd_peer_init_port)
//! buffer_chunks = 64
//! chunk_bytes = 1048576
//! metrics = "127.0.0.1:9400"
//! unconsumed_ttl_s = 300
//!
//! [proxy]
//! host = "127.0.0.1"
//! port = 8500
//! tp_ranks = 2
//! ```

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::parser::ValueSource;
use clap::CommandFactory;

use crate::cli::Cli;

/// The roles a file may hold a table for.
const ROLES: &[&str] = &["receiver", "sender", "proxy"];

/// Flags a file cannot set: the file itself, and what only makes sense per invocation.
const NOT_IN_FILE: &[&str] = &["config", "help", "version"];

/// `argv` with the `--config` file's table for the subcommand added as flags (those the
/// command line does not give). `argv` unchanged when it names no file, or does not parse
/// (clap then reports why, as usual).
pub fn command_line(argv: Vec<OsString>) -> anyhow::Result<Vec<OsString>> {
    let command = Cli::command();
    let Ok(matches) = command.clone().try_get_matches_from(&argv) else {
        return Ok(argv);
    };
    let Some((role, sub)) = matches.subcommand() else {
        return Ok(argv);
    };
    if !ROLES.contains(&role) {
        return Ok(argv);
    }
    let Some(path) = sub.get_one::<PathBuf>("config") else {
        return Ok(argv);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let doc: toml::Table = toml::from_str(&text)
        .with_context(|| format!("{}: not a valid kvx config", path.display()))?;
    let unknown: Vec<&String> = doc
        .keys()
        .filter(|k| !ROLES.contains(&k.as_str()))
        .collect();
    if !unknown.is_empty() {
        bail!(
            "{}: unknown table(s) {unknown:?}: a kvx config has [receiver], [sender] and [proxy]",
            path.display()
        );
    }
    let Some(table) = doc.get(role) else {
        return Ok(argv);
    };
    let table = table
        .as_table()
        .with_context(|| format!("{}: [{role}] is not a table", path.display()))?;
    let sub_command = command
        .find_subcommand(role)
        .expect("the subcommand just parsed");
    let settable: Vec<String> = sub_command
        .get_arguments()
        .filter(|a| a.get_long().is_some() && !NOT_IN_FILE.contains(&a.get_id().as_str()))
        .map(|a| a.get_id().to_string())
        .collect();
    let mut out = argv;
    for (key, value) in table {
        if !settable.contains(key) {
            let mut known = settable.clone();
            known.sort_unstable();
            bail!(
                "{}: [{role}] {key}: not a setting of kvx {role} (known: {})",
                path.display(),
                known.join(", ")
            );
        }
        if sub.value_source(key) == Some(ValueSource::CommandLine) {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        let text = |v: &toml::Value| -> anyhow::Result<String> {
            Ok(match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => bail!(
                    "{}: [{role}] {key}: {other} is not a value kvx reads here",
                    path.display()
                ),
            })
        };
        match value {
            toml::Value::Array(items) => {
                let parts = items.iter().map(text).collect::<anyhow::Result<Vec<_>>>()?;
                out.push(format!("{flag}={}", parts.join(",")).into());
            }
            toml::Value::Boolean(b) if is_switch(sub_command, key) => {
                if *b {
                    out.push(flag.into());
                }
            }
            v => out.push(format!("{flag}={}", text(v)?).into()),
        }
    }
    Ok(out)
}

/// Whether `id` is a flag that takes no value (present or absent).
fn is_switch(command: &clap::Command, id: &str) -> bool {
    command
        .get_arguments()
        .find(|a| a.get_id() == id)
        .is_some_and(|a| matches!(a.get_action(), clap::ArgAction::SetTrue))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn with_file(args: &[&str], toml: &str) -> anyhow::Result<Cli> {
        let path = std::env::temp_dir().join(format!(
            "kvx-config-test-{}-{}.toml",
            std::process::id(),
            toml.len()
        ));
        std::fs::write(&path, toml).expect("write");
        let mut argv: Vec<OsString> = args.iter().map(OsString::from).collect();
        argv.extend(["--config".into(), path.clone().into()]);
        let out = command_line(argv);
        let _ = std::fs::remove_file(&path);
        Ok(Cli::try_parse_from(out?)?)
    }

    #[test]
    fn file_values_are_flags_and_the_command_line_wins() {
        let cli = with_file(
            &["kvx", "receiver", "--buffer-chunks", "8"],
            "[receiver]\nbuffer_chunks = 32\nalloc_ports = [9400, 9401]\nfabric_ports = [9300, 9301]\n\
             unconsumed_ttl_s = 12.5\nno_verify = true\n[proxy]\nport = 1\n",
        )
        .expect("valid");
        let crate::cli::Command::Receiver(r) = cli.command else {
            panic!("a receiver")
        };
        assert_eq!(r.buffer_chunks, Some(8), "the flag wins");
        assert_eq!(r.alloc_ports, Some(vec![9400, 9401]));
        assert_eq!(r.protocol.unconsumed_ttl_s, 12.5);
        assert!(r.no_verify);
    }

    /// The row of docs/operations.md's settings table for each flag of `role` that a file can
    /// set, from the flag itself: its default is clap's, or for a flag whose default comes
    /// from elsewhere (an LMCache file) the `[default: …]` of its help, which states the
    /// core's; its meaning is its help without that.
    fn settings_rows(role: &str) -> Vec<String> {
        let command = Cli::command();
        let sub = command.find_subcommand(role).expect("a role");
        let mut rows = Vec::new();
        for arg in sub.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let id = arg.get_id().as_str();
            if NOT_IN_FILE.contains(&id) {
                continue;
            }
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            let (mut meaning, stated) = match help.split_once(" [default: ") {
                Some((before, rest)) => {
                    let (stated, after) = rest.split_once(']').expect("a closed [default: …]");
                    (format!("{before}{after}"), Some(stated.to_owned()))
                }
                None => (help.clone(), None),
            };
            if meaning.ends_with('.') {
                meaning.pop();
            }
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let default = if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
                "—".to_owned()
            } else if !defaults.is_empty() {
                defaults.join(",")
            } else {
                stated.unwrap_or_else(|| "—".to_owned())
            };
            rows.push(format!("| `--{long}` | `{id}` | {default} | {meaning} |"));
        }
        rows
    }

    /// docs/operations.md's table of each role's settings is what the flags say, row for row
    /// (defaults from the core's `Default`, through `knobs`). On a mismatch the test prints
    /// the table to paste.
    #[test]
    fn the_operations_settings_tables_are_the_flags() {
        let docs = include_str!("../../../docs/operations.md");
        let mut wrong = Vec::new();
        for role in ROLES {
            let heading = format!("**`kvx {role}`**");
            let (_, after) = docs
                .split_once(&heading)
                .unwrap_or_else(|| panic!("docs/operations.md has no {heading}"));
            let documented: Vec<&str> = after
                .lines()
                .skip_while(|l| !l.starts_with("| `--"))
                .take_while(|l| l.starts_with('|'))
                .collect();
            let expected = settings_rows(role);
            if documented != expected {
                wrong.push(format!(
                    "{heading}\n\n| flag | TOML key | default | meaning |\n|---|---|---|---|\n{}",
                    expected.join("\n")
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "docs/operations.md's settings tables differ from the flags; they should read:\n\n{}",
            wrong.join("\n\n")
        );
    }

    #[test]
    fn bad_keys_and_values_are_refused_naming_them() {
        for (toml, names) in [
            ("[receiver]\nbufer_chunks = 3\n", "bufer_chunks"),
            ("[reciever]\nbuffer_chunks = 3\n", "reciever"),
            ("[receiver]\nbuffer_chunks = 0\n", "--buffer-chunks"),
            ("[receiver]\nunconsumed_ttl_s = -1\n", "--unconsumed-ttl-s"),
            ("[receiver]\nconfig = \"x\"\n", "config"),
        ] {
            let err = with_file(&["kvx", "receiver"], toml).expect_err(toml);
            assert!(format!("{err:#}").contains(names), "{toml}: {err:#}");
        }
    }
}
