//! `cargo run --release -p kvx-benches --bin fairness [-- --json]`: the buffer's utilization
//! and Jain's index of slot-seconds among senders contending for one receiver, measured in
//! virtual time (`kvx_benches::fairness`), one row per case with its goal and whether it is
//! met. `--json` prints the rows, with every sender's figures, as one JSON document.

use std::process::ExitCode;

use kvx_benches::fairness::{cases, run, Goal, Row, Setup};

fn goal_text(row: &Row) -> String {
    match row.goal {
        Goal::Utilization(min) => format!("util ≥ {min}"),
        Goal::Jain(min) => format!("J ≥ {min}"),
        Goal::HeavyWithinShare => format!("heavy ≤ share {}", row.share_slots),
    }
}

fn main() -> ExitCode {
    let json = std::env::args().skip(1).any(|a| a == "--json");
    let setup = Setup::default();
    let rows: Vec<Row> = cases().iter().map(|c| run(&setup, c)).collect();
    if json {
        let doc = serde_json::json!({ "setup": setup, "rows": rows });
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("rows serialize")
        );
    } else {
        println!(
            "buffer {} slots, requests of {}–{} chunks (2× for the heavy sender), {} in flight \
             per sender, {} per sender; write {} µs/chunk, decode delay {} µs; virtual time",
            setup.buffer_slots,
            setup.chunks.0,
            setup.chunks.1,
            setup.interleave,
            setup.requests,
            setup.write_us,
            setup.decode_delay_us,
        );
        println!(
            "| case | share | window s | util | J | J/w | slot-s split | held while others wait \
             (max, sender 0) | backlogged (min) | goal | met |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &rows {
            let m = &r.measures;
            let split: Vec<String> = r.split.iter().map(|x| format!("{x:.2}")).collect();
            let backlog = m.backlogged.iter().copied().fold(f64::INFINITY, f64::min);
            let peak = if r.case.senders > 1 {
                m.peak_while_others_wait[0].to_string()
            } else {
                "—".into()
            };
            println!(
                "| {} | {} | {:.2} | {:.3} | {:.3} | {:.3} | {} | {} | {:.2} | {} | {} |",
                r.case.name,
                r.share_slots,
                r.window_s,
                m.utilization,
                r.jain,
                r.jain_weighted,
                split.join(" "),
                peak,
                backlog,
                goal_text(r),
                if r.pass { "yes" } else { "**no**" },
            );
        }
    }
    let complete = rows.iter().all(|r| r.delivered == r.planned);
    if complete {
        ExitCode::SUCCESS
    } else {
        eprintln!("some requests were not delivered: the measurement is not of a clean run");
        ExitCode::FAILURE
    }
}
