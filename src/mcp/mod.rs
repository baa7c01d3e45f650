//! Remote MCP servers (Streamable HTTP): what a route with `protocol = "mcp"` reads in the
//! JSON-RPC messages a client posts. The operation is the tool call — not the HTTP request —
//! so this module says which message is a tool call (`jsonrpc`), who makes it and which
//! operation it is (`identity`), whether it is claimed at all (`protect`), how a server's
//! event stream is read (`sse`), which `Host` and `Origin` a route answers to (`origin`), where a call whose stream closed early waits for the result a
//! resumed GET carries (`resume`), how a kept result answers a re-run (`replay`), and what a
//! call's result made that prices later calls (`recorded`). It knows
//! no route, store or claim: `proxy::mcp` runs the stages.

pub mod identity;
pub mod jsonrpc;
pub mod origin;
pub mod protect;
pub mod recorded;
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
    /// How long a person may take to answer what a call asks (`[routes.mcp] answer_timeout`).
    pub answer_timeout: Duration,
    /// Per tool: text that marks an `isError` result as "nothing happened" (lowercase; matched
    /// as a substring of the result's text, ASCII case-insensitive).
    pub release_errors: BTreeMap<String, Vec<String>>,
    /// Per tool: what its successful result made, kept for pricing later calls.
    pub records: BTreeMap<String, recorded::Records>,
    /// Per tool: the recorded object a call is priced from.
    pub price_from: BTreeMap<String, recorded::PriceFrom>,
    /// `refusals = "result"`: a tool call's spend refusal is answered as a tool result with
    /// `isError: true` instead of a JSON-RPC error.
    pub refusals_as_results: bool,
    /// Host and Origin names the route answers to besides its server's and loopback ones.
    pub allowed: origin::Allowed,
}

/// `[routes.mcp] answer_timeout` unless set.
pub const DEFAULT_ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

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
            answer_timeout: DEFAULT_ANSWER_TIMEOUT,
            release_errors: BTreeMap::new(),
            records: BTreeMap::new(),
            price_from: BTreeMap::new(),
            refusals_as_results: false,
            allowed: origin::Allowed::default(),
        })
    }
}
