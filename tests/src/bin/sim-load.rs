//! sim-load: the benchmarks' baseline. Sends N chat requests at concurrency C
//! to an OpenAI-compatible endpoint with the same HTTP client stack as the
//! worker (reqwest), no Redis and no validation, and prints requests/s.
//!
//! usage: sim-load BASE_URL N C

use std::sync::Arc;
use std::time::Instant;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, base, n, c] = args.as_slice() else {
        anyhow::bail!("usage: sim-load BASE_URL N C");
    };
    let (n, c): (usize, usize) = (n.parse()?, c.parse()?);
    let client = reqwest::Client::builder().pool_max_idle_per_host(c).build()?;
    let url = format!("{}/chat/completions", base.trim_end_matches('/'));
    let schema = common::validate::json_schema(&common::spec::JobSpec::parse(
        include_str!("../../../examples/job.toml"),
        "examples/job.toml",
    )?);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (client, url, next, schema) = (client.clone(), url.clone(), next.clone(), schema.clone());
        tasks.push(tokio::spawn(async move {
            let mut ok = 0usize;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let i = next.load(std::sync::atomic::Ordering::Relaxed);
                let body = serde_json::json!({
                    "model": "m",
                    "messages": [{"role": "system", "content": "classify"}, {"role": "user", "content": format!("Task type: classify\nMessage:\nmessage {i}")}],
                    "max_tokens": 200,
                    "response_format": schema,
                });
                if let Ok(r) = client.post(&url).bearer_auth("sk-bench").json(&body).send().await
                    && r.status().is_success()
                    && r.bytes().await.is_ok()
                {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut ok = 0;
    for t in tasks {
        ok += t.await?;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{{\"requests\": {n}, \"ok\": {ok}, \"seconds\": {secs:.3}, \"per_sec\": {:.1}}}",
        ok as f64 / secs
    );
    Ok(())
}
