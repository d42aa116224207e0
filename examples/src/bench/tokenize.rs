//! Tokenization in process (`pd_tokenize`, what pd-proxy's precise_prefix runs per request):
//! the time to tokenize a 2,048-token completion prompt, and a chat of the same length rendered
//! with the model's template first, with a model's tokenizer (`--tokenizer DIR`) or the sims'
//! one token per byte.

use std::path::Path;
use std::time::{Duration, Instant};

use pd_tokenize::{ChatRequest, Tokenizer};
use serde_json::json;

use super::output::Output;

/// One prompt tokenized.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TokenizeRow {
    /// The tokenizer.
    pub tokenizer: String,
    /// Completion or chat.
    pub prompt: String,
    /// Its tokens.
    pub tokens: usize,
    /// Median over 2,000 runs, µs.
    pub median_us: f64,
    /// Per 1,000 tokens, µs.
    pub us_per_1000_tokens: f64,
}

/// Text of about `tokens` tokens for `tokenizer`: English words, grown until it has them.
fn text_of(tokenizer: &Tokenizer, tokens: usize) -> Result<String, String> {
    const WORDS: &str =
        "the prefill engine computes the key and value cache of every prompt token \
        while the decode engine generates one token at a time from the cache it pulled ";
    let mut text = String::new();
    while tokenizer
        .encode(&text, true)
        .map_err(|e| e.to_string())?
        .len()
        < tokens
    {
        text.push_str(WORDS);
    }
    while tokenizer
        .encode(&text, true)
        .map_err(|e| e.to_string())?
        .len()
        > tokens
    {
        text.pop();
    }
    Ok(text)
}

fn median(mut run: impl FnMut() -> Result<usize, String>) -> Result<(usize, Duration), String> {
    let mut times = Vec::with_capacity(2000);
    let mut tokens = 0;
    for _ in 0..2000 {
        let started = Instant::now();
        tokens = std::hint::black_box(run()?);
        times.push(started.elapsed());
    }
    times.sort();
    Ok((tokens, times[times.len() / 2]))
}

/// A 2,048-token completion and a chat of about as many, tokenized by the tokenizer in `dir`
/// (named `name`).
pub fn measure(name: &str, dir: &Path) -> Result<Vec<TokenizeRow>, String> {
    let tokenizer = Tokenizer::from_dir(dir).map_err(|e| e.to_string())?;
    let text = text_of(&tokenizer, 2048)?;
    let messages = json!([{"role": "system", "content": &text[..text.len() / 2]},
                          {"role": "user", "content": &text[text.len() / 2..]}])
    .to_string();
    let completion =
        median(|| (tokenizer.encode(&text, true).map(|ids| ids.len())).map_err(|e| e.to_string()))?;
    let chat = median(|| {
        let ids = tokenizer.encode_chat(&ChatRequest::new(&messages));
        ids.map(|ids| ids.len()).map_err(|e| e.to_string())
    })?;
    let row = |prompt: &str, (tokens, took): (usize, Duration)| TokenizeRow {
        tokenizer: name.to_owned(),
        prompt: prompt.to_owned(),
        tokens,
        median_us: took.as_secs_f64() * 1e6,
        us_per_1000_tokens: took.as_secs_f64() * 1e9 / tokens.max(1) as f64,
    };
    Ok(vec![
        row("completion", completion),
        row("chat (template rendered)", chat),
    ])
}

/// The section: the sims' tokenizer (written under `work_dir`) and the model's in `model`, if
/// given.
pub fn section(out: &mut Output, work_dir: &Path, model: Option<&Path>) -> Result<(), String> {
    let bytes = work_dir.join("byte-level-tokenizer");
    std::fs::create_dir_all(&bytes)
        .and_then(|()| pd_tokenize::byte_level::write(&bytes))
        .map_err(|e| format!("{}: {e}", bytes.display()))?;
    let mut rows = measure("one token per byte (the sims')", &bytes)?;
    if let Some(model) = model {
        rows.extend(measure(&model.display().to_string(), model)?);
    }
    out.text("\n");
    out.section("tokenize", &table(&rows), &rows, vec![])
}

/// The rows as a Markdown table.
pub fn table(rows: &[TokenizeRow]) -> String {
    let mut out = String::from(
        "| tokenizer | prompt | tokens | median µs | µs per 1,000 tokens |\n|---|---|---|---|---|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} |\n",
            r.tokenizer, r.prompt, r.tokens, r.median_us, r.us_per_1000_tokens
        ));
    }
    out
}
