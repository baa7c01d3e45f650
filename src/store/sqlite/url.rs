//! `sqlite://PATH`: the file the store keeps, created with its directory when missing.

/// The file a `sqlite://` URL names; `None` for another scheme. The error says what to write.
pub fn parse(url: &str) -> Result<Option<String>, String> {
    let Some(path) = url.strip_prefix("sqlite://") else {
        return Ok(None);
    };
    if path.is_empty() {
        return Err(format!(
            "`{url}` names no file: write sqlite://data/idemproxy.db"
        ));
    }
    Ok(Some(path.to_string()))
}
