//! Static assets (`web/static/`), embedded in the binary and served under
//! `/console/static/`. Pages link them with `?v=` and the file's digest, so
//! they may be cached for a year.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

#[derive(rust_embed::Embed)]
#[folder = "web/static/"]
struct Assets;

/// The first 16 hex digits of an asset's SHA-256 (`?v=` in links).
pub fn version(path: &str) -> String {
    Assets::get(path)
        .map(|f| hex::encode(f.metadata.sha256_hash()))
        .and_then(|h| h.get(..16).map(str::to_string))
        .unwrap_or_default()
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, e)| e) {
        Some("css") => "text/css; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("woff2") => "font/woff2",
        _ => "application/octet-stream",
    }
}

pub async fn serve(Path(path): Path<String>) -> Response {
    let Some(f) = Assets::get(&path) else {
        return (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "not found",
        )
            .into_response();
    };
    let etag = format!("\"{}\"", hex::encode(f.metadata.sha256_hash()));
    let mut r = (
        [
            (header::CONTENT_TYPE, content_type(&path)),
            (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
        ],
        f.data.into_owned(),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&etag) {
        r.headers_mut().insert(header::ETAG, v);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stylesheet_is_embedded() {
        assert!(Assets::get("console.css").is_some());
        assert_eq!(version("console.css").len(), 16);
        assert_eq!(content_type("console.css"), "text/css; charset=utf-8");
        assert_eq!(content_type("x"), "application/octet-stream");
        // The one script (progressive enhancement: the copy buttons).
        assert!(Assets::get("console.js").is_some());
        assert_eq!(version("console.js").len(), 16);
        assert_eq!(content_type("console.js"), "text/javascript; charset=utf-8");
    }
}
