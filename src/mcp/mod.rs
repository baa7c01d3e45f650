//! Remote MCP servers (Streamable HTTP): what a route with `protocol = "mcp"` reads in the
//! JSON-RPC messages a client posts. The operation is the tool call — not the HTTP request —
//! so this module says which message is a tool call (`jsonrpc`), who makes it and which
//! operation it is (`identity`), whether it is claimed at all (`protect`), how a server's
//! event stream is read (`sse`), where a call whose stream closed early waits for the result a
//! resumed GET carries (`resume`), and how a kept result answers a re-run (`replay`). It knows
//! no route, store or claim: `proxy::mcp` runs the stages.

pub mod identity;
pub mod jsonrpc;
pub mod protect;
pub mod replay;
pub mod resume;
pub mod sse;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::request::template::Template;

/// A route's MCP rules, built from `[routes.mcp]`.
pub struct McpRules {
    /// How long two calls of a tool with the same arguments are one call.
    pub window: Duration,
    pub read_only: BTreeSet<String>,
    pub trust_annotations: bool,
    /// Per-tool key templates, `{args.X}` read as the call's argument `X`.
    pub templates: BTreeMap<String, Template>,
    /// What the route's servers said about their tools.
    pub annotations: protect::Annotations,
    /// Calls waiting for their result on a resumed stream.
    pub resumptions: resume::Resumptions,
    /// `refusals = "result"`: a tool call's spend refusal is answered as a tool result with
    /// `isError: true` instead of a JSON-RPC error.
    pub refusals_as_results: bool,
}

impl McpRules {
    /// `tools`: (tool, key template). The error names the tool whose template is wrong.
    pub fn new(
        window: Duration,
        read_only: Vec<String>,
        trust_annotations: bool,
        tools: Vec<(String, String)>,
    ) -> Result<McpRules, (String, String)> {
        let mut templates = BTreeMap::new();
        for (tool, text) in tools {
            let template = Template::parse(&text.replace("{args.", "{body.params.arguments."))
                .map_err(|e| (tool.clone(), e))?;
            templates.insert(tool, template);
        }
        Ok(McpRules {
            window,
            read_only: read_only.into_iter().collect(),
            trust_annotations,
            templates,
            annotations: protect::Annotations::default(),
            resumptions: resume::Resumptions::default(),
            refusals_as_results: false,
        })
    }
}
