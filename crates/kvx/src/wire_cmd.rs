//! `kvx wire decode|encode`: LMCache wire messages as JSON, for debugging captures.

use std::io::{Read, Write};
use std::process::ExitCode;

use anyhow::{bail, Context};
use kvx_proto::wire::{self, Message};

use crate::cli::WireCommand;

pub fn run(cmd: WireCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        WireCommand::Decode { hex, file } => {
            let input = read_input(file.as_deref())?;
            let bytes = if hex { parse_hex(&input)? } else { input };
            let msg = wire::decode(&bytes).context("not a valid LMCache/kvx message")?;
            println!("{}", serde_json::to_string_pretty(&msg)?);
        }
        WireCommand::Encode { hex, file } => {
            let input = read_input(file.as_deref())?;
            let text = std::str::from_utf8(&input).context("JSON input must be UTF-8")?;
            let msg: Message = serde_json::from_str(text).context(
                "not a message: expected a JSON object with \"type\" (AllocRequest, AllocResponse, \
                 ProxyNotif, CancelNotif or FailNotif) and that message's fields",
            )?;
            let bytes = wire::encode(&msg);
            let mut out = std::io::stdout().lock();
            if hex {
                writeln!(out, "{}", hex::encode(&bytes))?;
            } else {
                out.write_all(&bytes)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn read_input(file: Option<&std::path::Path>) -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    match file {
        Some(path) => {
            buf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => {
            std::io::stdin()
                .read_to_end(&mut buf)
                .context("reading stdin")?;
        }
    }
    Ok(buf)
}

fn parse_hex(input: &[u8]) -> anyhow::Result<Vec<u8>> {
    let text: String = std::str::from_utf8(input)
        .context("hex input must be text")?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    if text.is_empty() {
        bail!("no hex digits on input");
    }
    hex::decode(&text).context("not valid hex")
}
