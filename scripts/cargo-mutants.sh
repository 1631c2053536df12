#!/usr/bin/env bash
# Mutation score of kvx-proto's protocol files (admission, slots, the receiver, the sender,
# the proxy; not `testing/` or the explorer's canonical encodings, `canon.rs`, `canon` and `canon_*`)
# under kvx-proto's own tests, with the
# cargo-mutants tool (installed here at a pinned version if it is missing). The wire tests
# are left out: the wire is not mutated, and they read the golden vectors beside the
# checkout, which cargo-mutants' copy of the tree does not have.
# Usage: scripts/cargo-mutants.sh [cargo-mutants arguments]
#   e.g. scripts/cargo-mutants.sh --shard 0/8 --sharding round-robin   (every 8th mutant)
#        scripts/cargo-mutants.sh --list         (the mutants, without running them)
# Results: target/mutants/mutants.out/ (or $KVX_MUTANTS_OUT/mutants.out/): {caught,missed,timeout,unviable}.txt.
# The score and the survivors' reasons are kept in docs/evidence.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=27.1.0
if ! cargo mutants --version 2>/dev/null | grep -qx "cargo-mutants $VERSION"; then
    cargo install --locked cargo-mutants --version "$VERSION"
fi
mkdir -p "${KVX_MUTANTS_OUT:-target/mutants}"
# The explorer and the property tests dominate the run: optimised, without debug info, they
# take seconds where the default test profile takes a minute, at a few seconds more of build.
export CARGO_PROFILE_DEV_OPT_LEVEL=2 CARGO_PROFILE_DEV_DEBUG=0
# Every kvx-proto test target but the wire's (see above).
tests=(--lib)
for file in crates/kvx-proto/tests/*.rs; do
    name=$(basename "$file" .rs)
    [[ $name == wire_* ]] || tests+=(--test "$name")
done
exec cargo mutants --package kvx-proto \
    --file 'crates/kvx-proto/src/admission.rs' \
    --file 'crates/kvx-proto/src/slots.rs' \
    --file 'crates/kvx-proto/src/proxy/*.rs' \
    --file 'crates/kvx-proto/src/receiver/**' \
    --file 'crates/kvx-proto/src/sender/**' \
    --exclude canon.rs \
    --exclude-re '::canon(_|\b)' \
    --output "${KVX_MUTANTS_OUT:-target/mutants}" \
    "$@" \
    -- "${tests[@]}"
