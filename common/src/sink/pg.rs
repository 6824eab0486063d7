//! The PostgreSQL result sink: its tables (created with [`ddl`] when absent,
//! an existing one checked column by column), batched writes that a
//! redelivered batch cannot duplicate (`ON CONFLICT (record_id) DO NOTHING`),
//! and the reads reconciliation needs.
//!
//! The worker's sink service moves outcomes here from each partition's sink
//! stream and acknowledges them only after the transaction committed; see
//! docs/sink.md.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;
use serde_json::value::RawValue;
use tokio_postgres::Client;
use tokio_postgres::types::Json;

use super::{Durable, FailureRow, Holdings, ResultRow, ResultSink, RevisionRow, SinkBatch, SinkEntry, SinkError};
use super::{Unacked, with_revisions};
use crate::ids::RecordIds;
use crate::ledger::PaidCall;
use crate::manifest::Manifest;
use crate::secret::Scrubber;
use crate::spec::{FieldType, JobSpec};
use crate::task::ResultRecord;

impl SinkError {
    fn of(e: &tokio_postgres::Error, scrub: &Scrubber) -> SinkError {
        let text = scrub.scrub(&error_text(e));
        match e.code().map(|c| c.code()) {
            // 28: invalid authorization; 42501: insufficient privilege; 3D000: no such database.
            Some(c) if c.starts_with("28") || c == "42501" || c == "3D000" => SinkError::Refused(text),
            // 23: integrity constraint violation; 22: data exception; 21: cardinality.
            Some(c) if c.starts_with("23") || c.starts_with("22") || c.starts_with("21") => SinkError::Rejected(text),
            Some(c) if c.starts_with("42") => SinkError::Schema(text),
            _ => SinkError::Unreachable(text),
        }
    }
}

/// The database's own message when it sent one, else the client's.
fn error_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            text
        }
    }
}

/// The columns of the results table batchfleet writes, and their types as
/// `information_schema.columns.data_type` names them.
const RESULT_COLUMNS: &[(&str, &str)] = &[
    ("record_id", "text"),
    ("job", "text"),
    ("business_key", "text"),
    ("versions", "jsonb"),
    ("output", "jsonb"),
    ("attempts", "integer"),
    ("calls", "integer"),
    ("prompt_tokens", "bigint"),
    ("cached_tokens", "bigint"),
    ("completion_tokens", "bigint"),
    ("cost_usd", "double precision"),
    ("model", "text"),
    ("response_id", "text"),
    ("human", "boolean"),
    ("reviewer", "text"),
    ("committed_at", "timestamp with time zone"),
    ("usage", "jsonb"),
    ("repairs", "jsonb"),
    ("history", "jsonb"),
    ("worker", "text"),
    ("input", "jsonb"),
];

const JOB_COLUMNS: &[(&str, &str)] = &[
    ("job", "text"),
    ("expected_records", "bigint"),
    ("datasets", "jsonb"),
    ("versions", "jsonb"),
    ("spec_sha256", "text"),
    ("created_at", "timestamp with time zone"),
    ("updated_at", "timestamp with time zone"),
];

const REVISION_COLUMNS: &[(&str, &str)] = &[
    ("record_id", "text"),
    ("revision", "integer"),
    ("job", "text"),
    ("previous", "jsonb"),
    ("output", "jsonb"),
    ("reviewer", "text"),
    ("note", "text"),
    ("revised_at", "timestamp with time zone"),
];

const LEDGER_COLUMNS: &[(&str, &str)] = &[
    ("call_key", "text"),
    ("job", "text"),
    ("record_id", "text"),
    ("call_number", "integer"),
    ("attempt", "integer"),
    ("delivery", "integer"),
    ("worker", "text"),
    ("cause", "text"),
    ("fate", "text"),
    ("prompt_tokens", "bigint"),
    ("cached_tokens", "bigint"),
    ("completion_tokens", "bigint"),
    ("estimated", "boolean"),
    ("prices", "text"),
    ("cost_nusd", "bigint"),
    ("at", "timestamp with time zone"),
    ("tier", "text"),
    ("model", "text"),
];

const RAW_COLUMNS: &[(&str, &str)] = &[
    ("sha256", "text"),
    ("job", "text"),
    ("body", "bytea"),
    ("kept_at", "timestamp with time zone"),
];

const FAILURE_COLUMNS: &[(&str, &str)] = &[
    ("record_id", "text"),
    ("job", "text"),
    ("business_key", "text"),
    ("state", "text"),
    ("reason", "text"),
    ("errors", "jsonb"),
    ("at", "timestamp with time zone"),
    ("resolved_at", "timestamp with time zone"),
];

/// The DDL of a results table and its companions: failures
/// (`<table>_failures`), jobs, revisions, the cost ledger (`<table>_ledger`)
/// and the raw responses (`<table>_raw`, see [`super::raw`]).
pub fn ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\n\
         \x20   record_id         text PRIMARY KEY,\n\
         \x20   job               text NOT NULL,\n\
         \x20   business_key      text NOT NULL,\n\
         \x20   versions          jsonb NOT NULL,\n\
         \x20   output            jsonb NOT NULL,\n\
         \x20   attempts          integer NOT NULL,\n\
         \x20   calls             integer NOT NULL,\n\
         \x20   prompt_tokens     bigint,\n\
         \x20   cached_tokens     bigint,\n\
         \x20   completion_tokens bigint,\n\
         \x20   cost_usd          double precision,\n\
         \x20   model             text NOT NULL,\n\
         \x20   response_id       text,\n\
         \x20   human             boolean NOT NULL,\n\
         \x20   reviewer          text,\n\
         \x20   committed_at      timestamptz NOT NULL,\n\
         \x20   usage             jsonb,           -- the call that produced the output\n\
         \x20   repairs           jsonb NOT NULL,\n\
         \x20   history           jsonb NOT NULL,  -- every call and action, as in Redis before\n\
         \x20   worker            text,\n\
         \x20   input             jsonb,           -- the record's input, as enqueued\n\
         \x20   written_at        timestamptz NOT NULL DEFAULT now()\n\
         );\n\
         CREATE INDEX IF NOT EXISTS {index}_job ON {table} (job);\n\
         CREATE TABLE IF NOT EXISTS {table}_failures (\n\
         \x20   record_id    text PRIMARY KEY,\n\
         \x20   job          text NOT NULL,\n\
         \x20   business_key text NOT NULL,\n\
         \x20   state        text NOT NULL,  -- review | dropped | cancelled | rejected\n\
         \x20   reason       text NOT NULL,\n\
         \x20   errors       jsonb NOT NULL,\n\
         \x20   at           timestamptz NOT NULL,\n\
         \x20   resolved_at  timestamptz     -- set when the record became done\n\
         );\n\
         CREATE TABLE IF NOT EXISTS {table}_jobs (\n\
         \x20   job              text PRIMARY KEY,\n\
         \x20   expected_records bigint NOT NULL,  -- each ends in results or failures\n\
         \x20   datasets         jsonb NOT NULL,   -- path, sha256, bytes, lines of each pass\n\
         \x20   versions         jsonb NOT NULL,\n\
         \x20   spec_sha256      text NOT NULL,\n\
         \x20   created_at       timestamptz NOT NULL,\n\
         \x20   updated_at       timestamptz NOT NULL\n\
         );\n\
         CREATE TABLE IF NOT EXISTS {table}_revisions (\n\
         \x20   record_id  text NOT NULL,\n\
         \x20   revision   integer NOT NULL,  -- 1 for a result's first edit\n\
         \x20   job        text NOT NULL,\n\
         \x20   previous   jsonb NOT NULL,    -- the output it replaced, kept\n\
         \x20   output     jsonb NOT NULL,    -- the output it set (the results row holds the latest)\n\
         \x20   reviewer   text NOT NULL,\n\
         \x20   note       text,\n\
         \x20   revised_at timestamptz NOT NULL,\n\
         \x20   PRIMARY KEY (record_id, revision)\n\
         );\n\
         CREATE TABLE IF NOT EXISTS {table}_ledger (\n\
         \x20   call_key          text PRIMARY KEY,  -- record id, call number, nonce\n\
         \x20   job               text NOT NULL,\n\
         \x20   record_id         text NOT NULL,\n\
         \x20   call_number       integer NOT NULL,  -- the record's calls so far, this one included\n\
         \x20   attempt           integer NOT NULL,\n\
         \x20   delivery          integer NOT NULL,\n\
         \x20   worker            text NOT NULL,\n\
         \x20   cause             text NOT NULL,     -- first | transient_retry | validation_retry | human | check\n\
         \x20   fate              text NOT NULL,     -- settled | abandoned | lost (no result)\n\
         \x20   prompt_tokens     bigint NOT NULL,\n\
         \x20   cached_tokens     bigint NOT NULL,\n\
         \x20   completion_tokens bigint NOT NULL,\n\
         \x20   estimated         boolean NOT NULL,  -- no usage reported (timed out, cut off...): estimated\n\
         \x20   prices            text NOT NULL,     -- the version of the prices it was costed at\n\
         \x20   cost_nusd         bigint NOT NULL,   -- nano-USD: sum(cost_nusd) / 1e9 is USD, exactly\n\
         \x20   at                timestamptz NOT NULL,\n\
         \x20   tier              text NOT NULL DEFAULT 'standard',  -- its route: standard, flex, batch, a fallback's name\n\
         \x20   model             text NOT NULL DEFAULT ''           -- the model it was sent to ('': the job's own)\n\
         );\n\
         CREATE INDEX IF NOT EXISTS {index}_ledger_job ON {table}_ledger (job);\n\
         CREATE TABLE IF NOT EXISTS {table}_raw (\n\
         \x20   sha256  text PRIMARY KEY,  -- of body: the audit trail's address of a provider's response\n\
         \x20   job     text NOT NULL,     -- the job that first kept it\n\
         \x20   body    bytea NOT NULL,    -- as received (a secret it echoed replaced)\n\
         \x20   kept_at timestamptz NOT NULL DEFAULT now()\n\
         );\n",
        index = table.replace('.', "_"),
    )
}

/// A top-level output field as a typed column of the results table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypedColumn {
    pub column: String,
    pub field: String,
    pub kind: FieldType,
}

impl TypedColumn {
    /// Its type in the DDL, and as `information_schema.columns` names it.
    pub fn sql_type(&self) -> &'static str {
        match self.kind {
            FieldType::String => "text",
            FieldType::Integer => "bigint",
            FieldType::Number => "double precision",
            FieldType::Boolean => "boolean",
            FieldType::Array | FieldType::Object => "jsonb",
        }
    }

    /// Its value taken from the output, a jsonb expression (the validator
    /// made sure of the type; an absent or null field is NULL).
    fn value_sql(&self, output: &str) -> String {
        let f = self.field.replace('\'', "''");
        match self.kind {
            FieldType::String => format!("({output}->>'{f}')"),
            // Through numeric: `3.0` and `1e3` are integers to the validator.
            FieldType::Integer => format!("({output}->>'{f}')::numeric::bigint"),
            FieldType::Number => format!("({output}->>'{f}')::float8"),
            FieldType::Boolean => format!("({output}->>'{f}')::boolean"),
            FieldType::Array | FieldType::Object => format!("NULLIF({output}->'{f}', 'null'::jsonb)"),
        }
    }
}

/// The typed columns of a job's results table (none unless `sink.typed_columns`).
pub fn typed_columns(spec: &JobSpec) -> Vec<TypedColumn> {
    if !spec.sink.typed_columns {
        return Vec::new();
    }
    spec.output
        .fields
        .iter()
        .map(|(name, f)| TypedColumn {
            column: crate::spec::column_name(name),
            field: name.clone(),
            kind: f.kind,
        })
        .collect()
}

/// The DDL of a results table's typed columns (added to a table batchfleet creates).
pub fn typed_ddl(table: &str, typed: &[TypedColumn]) -> String {
    typed
        .iter()
        .map(|t| {
            format!(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {} {};\n",
                t.column,
                t.sql_type()
            )
        })
        .collect()
}

/// A sink's tables inside one transaction: the statements of [`PgSink::write`].
struct Tables<'a> {
    tx: &'a tokio_postgres::Transaction<'a>,
    results: &'a str,
    failures: &'a str,
    ledger: &'a str,
    typed: &'a [TypedColumn],
}

impl Tables<'_> {
    /// The failures (a record already in the results table is never a
    /// failure again; a newer failure replaces an older one).
    async fn insert_failures(&self, job: &str, failures: &[FailureRow]) -> Result<(), tokio_postgres::Error> {
        let col = |f: fn(&FailureRow) -> String| failures.iter().map(f).collect::<Vec<String>>();
        let errors: Vec<Value> = failures.iter().map(|f| f.errors.clone()).collect();
        self.tx.execute(
            &format!(
                "INSERT INTO {f} (record_id, job, business_key, state, reason, errors, at) \
                 SELECT u.a, $1, u.c, u.d, u.e, u.f, u.g::timestamptz \
                 FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[], $7::text[]) AS u(a, c, d, e, f, g) \
                 WHERE NOT EXISTS (SELECT 1 FROM {r} r WHERE r.record_id = u.a) \
                 ON CONFLICT (record_id) DO UPDATE SET state = EXCLUDED.state, reason = EXCLUDED.reason, \
                 errors = EXCLUDED.errors, at = EXCLUDED.at, resolved_at = NULL \
                 WHERE EXCLUDED.at >= {f}.at",
                f = self.failures,
                r = self.results
            ),
            &[
                &job,
                &col(|f| f.record_id.clone()),
                &col(|f| f.business_key.clone()),
                &col(|f| f.state.clone()),
                &col(|f| f.reason.clone()),
                &errors,
                &col(|f| f.at.clone()),
            ],
        )
        .await?;
        Ok(())
    }

    /// The results (`ON CONFLICT (record_id) DO NOTHING`: a redelivered
    /// batch adds nothing), then the failures they resolve. Returns the
    /// rows that were new.
    async fn insert_results(&self, job: &str, results: &[ResultRow]) -> Result<u64, tokio_postgres::Error> {
        let ids: Vec<&str> = results.iter().map(|r| r.record_id.as_str()).collect();
        let keys: Vec<&str> = results.iter().map(|r| r.business_key.as_str()).collect();
        let versions: Vec<Json<&RawValue>> = results.iter().map(|r| Json(&*r.versions)).collect();
        let outputs: Vec<Json<&RawValue>> = results.iter().map(|r| Json(&*r.output)).collect();
        let attempts: Vec<i32> = results.iter().map(|r| r.attempts).collect();
        let calls: Vec<i32> = results.iter().map(|r| r.calls).collect();
        let prompt: Vec<Option<i64>> = results.iter().map(|r| r.prompt_tokens).collect();
        let cached: Vec<Option<i64>> = results.iter().map(|r| r.cached_tokens).collect();
        let completion: Vec<Option<i64>> = results.iter().map(|r| r.completion_tokens).collect();
        let cost: Vec<Option<f64>> = results.iter().map(|r| r.cost_usd).collect();
        let model: Vec<&str> = results.iter().map(|r| r.model.as_str()).collect();
        let response: Vec<Option<&str>> = results.iter().map(|r| r.response_id.as_deref()).collect();
        let human: Vec<bool> = results.iter().map(|r| r.human).collect();
        let reviewer: Vec<Option<&str>> = results.iter().map(|r| r.reviewer.as_deref()).collect();
        let at: Vec<&str> = results.iter().map(|r| r.committed_at.as_str()).collect();
        let usage: Vec<Option<Json<&RawValue>>> = results.iter().map(|r| r.usage.as_deref().map(Json)).collect();
        let repairs: Vec<Json<&RawValue>> = results.iter().map(|r| Json(&*r.repairs)).collect();
        let history: Vec<Json<&RawValue>> = results.iter().map(|r| Json(&*r.history)).collect();
        let worker: Vec<Option<&str>> = results.iter().map(|r| r.worker.as_deref()).collect();
        let input: Vec<Option<Json<&RawValue>>> = results.iter().map(|r| r.input.as_deref().map(Json)).collect();
        let typed_names: String = self.typed.iter().map(|t| format!(", {}", t.column)).collect();
        let typed_values: String = self.typed.iter().map(|t| format!(", {}", t.value_sql("u.e"))).collect();
        let written = self
            .tx
            .execute(
                &format!(
                    "INSERT INTO {r} (record_id, job, business_key, versions, output, attempts, calls, \
                     prompt_tokens, cached_tokens, completion_tokens, cost_usd, model, response_id, human, \
                     reviewer, committed_at, usage, repairs, history, worker, input{typed_names}) \
                     SELECT u.a, $1, u.c, u.d, u.e, u.f, u.g, u.h, u.i, u.j, u.k, u.l, u.m, u.n, u.o, u.p::timestamptz, \
                     u.q, u.r, u.s, u.t, u.v{typed_values} \
                     FROM UNNEST($2::text[], $3::text[], $4::jsonb[], $5::jsonb[], $6::int4[], $7::int4[], \
                     $8::int8[], $9::int8[], $10::int8[], $11::float8[], $12::text[], $13::text[], $14::bool[], \
                     $15::text[], $16::text[], $17::jsonb[], $18::jsonb[], $19::jsonb[], $20::text[], $21::jsonb[]) \
                     AS u(a, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, v) \
                     ON CONFLICT (record_id) DO NOTHING",
                    r = self.results
                ),
                &[
                    &job,
                    &ids,
                    &keys,
                    &versions,
                    &outputs,
                    &attempts,
                    &calls,
                    &prompt,
                    &cached,
                    &completion,
                    &cost,
                    &model,
                    &response,
                    &human,
                    &reviewer,
                    &at,
                    &usage,
                    &repairs,
                    &history,
                    &worker,
                    &input,
                ],
            )
            .await?;
        self.tx
            .execute(
                &format!(
                    "UPDATE {f} SET resolved_at = now() WHERE record_id = ANY($1) AND resolved_at IS NULL",
                    f = self.failures
                ),
                &[&ids],
            )
            .await?;
        Ok(written)
    }

    /// The paid calls into the ledger table (`ON CONFLICT (call_key) DO NOTHING`).
    async fn insert_paid(&self, job: &str, paid: &[PaidCall]) -> Result<(), tokio_postgres::Error> {
        let int = |f: fn(&PaidCall) -> u64| -> Vec<i64> {
            paid.iter().map(|c| i64::try_from(f(c)).unwrap_or(i64::MAX)).collect()
        };
        let small = |f: fn(&PaidCall) -> u32| -> Vec<i32> {
            paid.iter().map(|c| i32::try_from(f(c)).unwrap_or(i32::MAX)).collect()
        };
        let keys: Vec<String> = paid.iter().map(PaidCall::key).collect();
        let rids: Vec<&str> = paid.iter().map(|c| c.rid.as_str()).collect();
        let workers: Vec<&str> = paid.iter().map(|c| c.worker.as_str()).collect();
        let causes: Vec<&str> = paid.iter().map(|c| c.cause.name()).collect();
        let fates: Vec<&str> = paid.iter().map(|c| c.fate.name()).collect();
        let estimated: Vec<bool> = paid.iter().map(|c| c.usage.estimated).collect();
        let prices: Vec<&str> = paid.iter().map(|c| c.prices.as_str()).collect();
        let tiers: Vec<&str> = paid.iter().map(|c| c.tier.as_str()).collect();
        let models: Vec<&str> = paid.iter().map(|c| c.model.as_str()).collect();
        self.tx.execute(
            &format!(
                "INSERT INTO {l} (call_key, job, record_id, call_number, attempt, delivery, worker, cause, fate, \
                 prompt_tokens, cached_tokens, completion_tokens, estimated, prices, cost_nusd, at, tier, model) \
                 SELECT u.a, $1, u.b, u.c, u.d, u.e, u.f, u.g, u.h, u.i, u.j, u.k, u.l, u.m, u.n, \
                 to_timestamp(u.o / 1000.0), u.p, u.q \
                 FROM UNNEST($2::text[], $3::text[], $4::int4[], $5::int4[], $6::int4[], $7::text[], $8::text[], \
                 $9::text[], $10::int8[], $11::int8[], $12::int8[], $13::bool[], $14::text[], $15::int8[], $16::int8[], $17::text[], $18::text[]) \
                 AS u(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q) \
                 ON CONFLICT (call_key) DO NOTHING",
                l = self.ledger
            ),
            &[
                &job,
                &keys,
                &rids,
                &small(|c| c.call),
                &small(|c| c.attempt),
                &small(|c| c.delivery),
                &workers,
                &causes,
                &fates,
                &int(|c| c.usage.prompt),
                &int(|c| c.usage.cached),
                &int(|c| c.usage.completion),
                &estimated,
                &prices,
                &int(|c| c.cost_nusd),
                &int(|c| c.at_ms),
                &tiers,
                &models,
            ],
        )
        .await
        ?;
        Ok(())
    }
}

/// A connected sink: its client and table names.
pub struct PgSink {
    client: Client,
    results: String,
    failures: String,
    jobs: String,
    revisions: String,
    ledger: String,
    raw: String,
    typed: Vec<TypedColumn>,
    scrub: Scrubber,
    /// Stored batches not acknowledged in Redis yet, by partition.
    unacked: HashMap<u32, Unacked>,
}

impl PgSink {
    /// Connects (TLS when the URL's `sslmode` asks for it or the server
    /// offers it) to the job's sink, then creates the tables when absent or
    /// checks them.
    pub async fn connect(url: &str, spec: &JobSpec) -> Result<PgSink, SinkError> {
        Self::connect_table(url, spec.sink.table(), typed_columns(spec)).await
    }

    /// [`PgSink::connect`] to a table with these typed columns.
    pub async fn connect_table(url: &str, table: &str, typed: Vec<TypedColumn>) -> Result<PgSink, SinkError> {
        let sink = Self::open(url, table, typed).await?;
        sink.prepare().await?;
        Ok(sink)
    }

    /// A connection for the raw responses of `table` alone: `<table>_raw`
    /// created when absent, nothing else touched (the sink writer creates
    /// and checks the others, with their typed columns).
    pub async fn connect_raw(url: &str, table: &str) -> Result<PgSink, SinkError> {
        let sink = Self::open(url, table, Vec::new()).await?;
        let ddl = ddl(table);
        let create = ddl
            .split(";\n")
            .find(|stmt| stmt.contains(&format!("{table}_raw (")))
            .expect("the DDL creates the raw table");
        sink.client.batch_execute(create).await.map_err(|e| sink.err(&e))?;
        Ok(sink)
    }

    /// Connects (TLS when the URL asks for it or the server offers it).
    async fn open(url: &str, table: &str, typed: Vec<TypedColumn>) -> Result<PgSink, SinkError> {
        let scrub = Scrubber::new(db_passwords(url));
        let mut config: tokio_postgres::Config = url.parse().map_err(|e: tokio_postgres::Error| {
            SinkError::Refused(format!("the database URL is invalid: {}", scrub.scrub(&error_text(&e))))
        })?;
        if config.get_connect_timeout().is_none() {
            // A black-holed server must not hold a worker past its drain.
            config.connect_timeout(std::time::Duration::from_secs(10));
        }
        let tls = tls_connector();
        let (client, connection) = config.connect(tls).await.map_err(|e| SinkError::of(&e, &scrub))?;
        tokio::spawn(async move {
            // Ends when the client is dropped or the connection breaks; the
            // next query then fails and the sink reconnects.
            let _ = connection.await;
        });
        let sink = PgSink {
            client,
            results: table.to_owned(),
            failures: format!("{table}_failures"),
            jobs: format!("{table}_jobs"),
            revisions: format!("{table}_revisions"),
            ledger: format!("{table}_ledger"),
            raw: format!("{table}_raw"),
            typed,
            scrub,
            unacked: HashMap::new(),
        };
        Ok(sink)
    }

    /// Keeps a raw response under its sha256 (kept already: nothing changes).
    pub async fn keep_raw(&self, job: &str, sha: &str, body: &[u8]) -> Result<(), SinkError> {
        let sql = format!(
            "INSERT INTO {} (sha256, job, body) VALUES ($1, $2, $3) ON CONFLICT (sha256) DO NOTHING",
            self.raw
        );
        self.client
            .execute(&sql, &[&sha, &job, &body])
            .await
            .map_err(|e| self.err(&e))?;
        Ok(())
    }

    /// The raw response kept under `sha`.
    pub async fn raw(&self, sha: &str) -> Result<Option<Vec<u8>>, SinkError> {
        let sql = format!("SELECT body FROM {} WHERE sha256 = $1", self.raw);
        let row = self.client.query_opt(&sql, &[&sha]).await.map_err(|e| self.err(&e))?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Whether the connection is gone (the sink must reconnect).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    fn err(&self, e: &tokio_postgres::Error) -> SinkError {
        SinkError::of(e, &self.scrub)
    }

    /// Creates the tables when absent; checks an existing one's columns.
    async fn prepare(&self) -> Result<(), SinkError> {
        for (table, columns) in [
            (&self.results, RESULT_COLUMNS),
            (&self.failures, FAILURE_COLUMNS),
            (&self.jobs, JOB_COLUMNS),
            (&self.revisions, REVISION_COLUMNS),
            (&self.ledger, LEDGER_COLUMNS),
            (&self.raw, RAW_COLUMNS),
        ] {
            let mut found = self.columns(table).await?;
            if *table == self.ledger && !found.is_empty() && !found.contains_key("tier") {
                // A ledger of a version before routes: each call's route and
                // model added (its rows were standard calls to the job's model).
                let alter = format!(
                    "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS tier text NOT NULL DEFAULT 'standard', \
                     ADD COLUMN IF NOT EXISTS model text NOT NULL DEFAULT ''"
                );
                self.client.batch_execute(&alter).await.map_err(|e| self.err(&e))?;
                found = self.columns(table).await?;
            }
            if found.is_empty() {
                let mut sql = ddl(&self.results);
                if *table == self.results {
                    sql.push_str(&typed_ddl(&self.results, &self.typed));
                }
                self.client.batch_execute(&sql).await.map_err(|e| self.err(&e))?;
                continue;
            }
            if *table == self.results {
                for t in &self.typed {
                    match found.get(&t.column) {
                        None => {
                            return Err(SinkError::Schema(format!(
                                "table {table} has no column `{}` ({}) for output field `{}` (sink.typed_columns): \
                                 add it (ALTER TABLE {table} ADD COLUMN {} {})",
                                t.column,
                                t.sql_type(),
                                t.field,
                                t.column,
                                t.sql_type()
                            )));
                        }
                        Some(ty) if ty != t.sql_type() => {
                            return Err(SinkError::Schema(format!(
                                "table {table}: column `{}` is {ty}, output field `{}` is written as {}",
                                t.column,
                                t.field,
                                t.sql_type()
                            )));
                        }
                        Some(_) => {}
                    }
                }
            }
            for (name, ty) in columns {
                match found.get(*name) {
                    None => {
                        return Err(SinkError::Schema(format!(
                            "table {table} has no column `{name}` ({ty}): add it, or point sink.table at a new table (batchfleet creates it; see the DDL in docs/sink.md)"
                        )));
                    }
                    Some(t) if t != ty && !(*ty == "integer" && t == "bigint") => {
                        return Err(SinkError::Schema(format!(
                            "table {table}: column `{name}` is {t}, batchfleet writes {ty}"
                        )));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// An existing table's columns and their types (empty when it is absent).
    async fn columns(&self, table: &str) -> Result<BTreeMap<String, String>, SinkError> {
        let (schema, name) = match table.split_once('.') {
            Some((s, n)) => (Some(s), n),
            None => (None, table),
        };
        let rows = self
            .client
            .query(
                "SELECT column_name::text, data_type::text FROM information_schema.columns \
                 WHERE table_name = $1 AND table_schema = COALESCE($2, current_schema())",
                &[&name, &schema],
            )
            .await
            .map_err(|e| self.err(&e))?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Writes one batch in one transaction: the failures (a record already
    /// in the results table is never a failure again), then the results
    /// (`ON CONFLICT (record_id) DO NOTHING`: a redelivered batch adds
    /// nothing), then marks the failures those results resolve, and the
    /// paid calls into the ledger table (`ON CONFLICT (call_key) DO
    /// NOTHING`). Returns the result rows that were new.
    pub async fn write(
        &mut self,
        job: &str,
        partition: u32,
        results: &[ResultRow],
        failures: &[FailureRow],
        paid: &[PaidCall],
    ) -> Result<u64, SinkError> {
        let scrub = self.scrub.clone();
        let err = |e: tokio_postgres::Error| SinkError::of(&e, &scrub);
        let tx = self.client.transaction().await.map_err(err)?;
        // One writer of a job's partition at a time (a record is in one
        // partition): a failure row is then never written from a state older
        // than a result another writer just committed.
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('batchfleet sink ' || $1::text || ':' || $2::text))",
            &[&job, &partition.to_string()],
        )
        .await
        .map_err(err)?;
        let tables = Tables {
            tx: &tx,
            results: &self.results,
            failures: &self.failures,
            ledger: &self.ledger,
            typed: &self.typed,
        };
        if !failures.is_empty() {
            tables.insert_failures(job, failures).await.map_err(err)?;
        }
        let mut written = 0;
        if !results.is_empty() {
            written = tables.insert_results(job, results).await.map_err(err)?;
        }
        if !paid.is_empty() {
            tables.insert_paid(job, paid).await.map_err(err)?;
        }
        tx.commit().await.map_err(err)?;
        Ok(written)
    }

    /// After a batch was rejected: writes it again one row to a
    /// transaction, so the rows the database accepts are written and those
    /// it refuses are found. A refused result is kept in the failures table
    /// as `rejected`, with the database's message, so it is never silently
    /// dropped (and `status --require-complete` lists it as missing from the
    /// table). Returns the new result rows and the refused records with
    /// their messages.
    /// The paid calls go in one transaction of their own: a ledger row the
    /// database refuses is an error (the batch is retried; the calls wait
    /// in Redis), never a silent gap in what was spent.
    pub async fn write_each(
        &mut self,
        job: &str,
        partition: u32,
        results: &[ResultRow],
        failures: &[FailureRow],
        paid: &[PaidCall],
    ) -> Result<(u64, Vec<(String, String)>), SinkError> {
        match self.write(job, partition, &[], &[], paid).await {
            Err(SinkError::Rejected(m)) => {
                return Err(SinkError::Rejected(format!(
                    "the cost ledger's rows (table {}): {m}",
                    self.ledger
                )));
            }
            other => other?,
        };
        let mut written = 0;
        let mut refused = Vec::new();
        for f in failures {
            match self.write(job, partition, &[], std::slice::from_ref(f), &[]).await {
                Ok(_) => {}
                Err(SinkError::Rejected(m)) => {
                    self.keep_refused(job, partition, &f.record_id, "", &m).await?;
                    refused.push((f.record_id.clone(), m));
                }
                Err(e) => return Err(e),
            }
        }
        for r in results {
            match self.write(job, partition, std::slice::from_ref(r), &[], &[]).await {
                Ok(n) => written += n,
                Err(SinkError::Rejected(m)) => {
                    self.keep_refused(job, partition, &r.record_id, &r.business_key, &m)
                        .await?;
                    refused.push((r.record_id.clone(), m));
                }
                Err(e) => return Err(e),
            }
        }
        Ok((written, refused))
    }

    /// Keeps a refused outcome in the failures table as `rejected`, with the
    /// database's message (at most 500 bytes); if even that row is refused,
    /// a bare one (the id and a fixed reason). Only a database that refuses
    /// both is an error here (the batch is then retried).
    async fn keep_refused(
        &mut self,
        job: &str,
        partition: u32,
        rid: &str,
        key: &str,
        message: &str,
    ) -> Result<(), SinkError> {
        let mut cut = message.len().min(500);
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        let row = |key: &str, reason: &str| FailureRow {
            business_key: key.to_owned(),
            ..FailureRow::of_state(rid, "rejected", reason)
        };
        match self.write(job, partition, &[], &[row(key, &message[..cut])], &[]).await {
            Err(SinkError::Rejected(_)) => self
                .write(
                    job,
                    partition,
                    &[],
                    &[row("", "the database refused this outcome and its message")],
                    &[],
                )
                .await
                .map(|_| ()),
            other => other.map(|_| ()),
        }
    }

    /// The job's row in the jobs table, from its manifest: what the job
    /// expects, so reconciliation can run from SQL alone.
    pub async fn write_job(&self, m: &Manifest) -> Result<(), SinkError> {
        let datasets = serde_json::to_value(&m.datasets).unwrap_or(Value::Array(vec![]));
        let versions = serde_json::to_value(&m.versions).unwrap_or(Value::Null);
        let expected = i64::try_from(m.expected_records).unwrap_or(i64::MAX);
        self.client
            .execute(
                &format!(
                    "INSERT INTO {j} (job, expected_records, datasets, versions, spec_sha256, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $5, $6::text::timestamptz, $7::text::timestamptz) \
                     ON CONFLICT (job) DO UPDATE SET expected_records = EXCLUDED.expected_records, \
                     datasets = EXCLUDED.datasets, versions = EXCLUDED.versions, spec_sha256 = EXCLUDED.spec_sha256, \
                     updated_at = EXCLUDED.updated_at WHERE EXCLUDED.updated_at >= {j}.updated_at",
                    j = self.jobs
                ),
                &[
                    &m.job,
                    &expected,
                    &datasets,
                    &versions,
                    &m.spec_sha256,
                    &m.created_at,
                    &m.updated_at,
                ],
            )
            .await
            .map_err(|e| self.err(&e))?;
        Ok(())
    }

    /// Every record id of the job in the results table; read
    /// 50,000 at a time in the primary key's order (a million rows at once
    /// would be held as rows first).
    pub async fn result_ids(&self, job: &str) -> Result<RecordIds, SinkError> {
        self.result_ids_by(job, 50_000).await
    }

    /// [`result_ids`](Self::result_ids), `page` rows a query.
    pub async fn result_ids_by(&self, job: &str, page: i64) -> Result<RecordIds, SinkError> {
        let sql = format!(
            "SELECT record_id FROM {} WHERE job = $1 AND record_id > $2 ORDER BY record_id LIMIT $3",
            self.results
        );
        let mut ids = RecordIds::default();
        let mut after = String::new();
        loop {
            let rows = self
                .client
                .query(&sql, &[&job, &after, &page])
                .await
                .map_err(|e| self.err(&e))?;
            for r in &rows {
                ids.push(r.get(0));
            }
            match rows.last() {
                Some(last) if rows.len() as i64 == page => after = last.get(0),
                _ => break,
            }
        }
        Ok(ids)
    }

    /// Every result of the job in the results table, as it was committed,
    /// streamed (one row at a time in memory).
    pub async fn results(&self, job: &str, mut f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
        use futures_util::StreamExt;
        let revisions = self.revisions(job).await?;
        let rows = self
            .client
            .query_raw(&self.select_results("job = $1"), [job])
            .await
            .map_err(|e| self.err(&e))?;
        let mut rows = std::pin::pin!(rows);
        let mut n = 0;
        while let Some(row) = rows.next().await {
            let row = row.map_err(|e| self.err(&e))?;
            let r = result_of_row(&row).map_err(|e| SinkError::Schema(format!("table {}: {e}", self.results)))?;
            f(match revisions.get(&r.record_id) {
                Some(v) => with_revisions(r, v),
                None => r,
            });
            n += 1;
        }
        Ok(n)
    }

    /// The results table's rows as [`result_of_row`] reads them, `WHERE filter`.
    fn select_results(&self, filter: &str) -> String {
        format!(
            "SELECT record_id, business_key, output, attempts, calls, response_id, repairs, usage, history, \
             model, versions, human, reviewer, worker, input, \
             to_char(committed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
             FROM {} WHERE {filter}",
            self.results
        )
    }

    /// The job's result of one record as it is now (its revisions applied),
    /// if the table has it.
    pub async fn result(&self, job: &str, rid: &str) -> Result<Option<ResultRecord>, SinkError> {
        let row = self
            .client
            .query_opt(&self.select_results("job = $1 AND record_id = $2"), &[&job, &rid])
            .await
            .map_err(|e| self.err(&e))?;
        let Some(row) = row else { return Ok(None) };
        let mut r = result_of_row(&row).map_err(|e| SinkError::Schema(format!("table {}: {e}", self.results)))?;
        if let Some(v) = self.revisions(job).await?.remove(rid) {
            r = with_revisions(r, &v);
        }
        Ok(Some(r))
    }

    /// A person's edit of a written result, in one transaction: the row
    /// locked, the output it replaces kept as the next revision in
    /// `<table>_revisions`, then the row's output, human flag, reviewer and
    /// history set. Returns the revision number, or None when the job has
    /// no row for the record.
    pub async fn revise(
        &mut self,
        job: &str,
        rid: &str,
        output: &Value,
        reviewer: &str,
        note: Option<&str>,
    ) -> Result<Option<i32>, SinkError> {
        let scrub = self.scrub.clone();
        let err = |e: tokio_postgres::Error| SinkError::of(&e, &scrub);
        let tx = self.client.transaction().await.map_err(err)?;
        let Some(row) = tx
            .query_opt(
                &format!(
                    "SELECT output FROM {} WHERE record_id = $1 AND job = $2 FOR UPDATE",
                    self.results
                ),
                &[&rid, &job],
            )
            .await
            .map_err(err)?
        else {
            return Ok(None);
        };
        let previous: Value = row.get(0);
        let revision: i32 = tx
            .query_one(
                &format!(
                    "SELECT (COALESCE(max(revision), 0) + 1)::int4 FROM {} WHERE record_id = $1",
                    self.revisions
                ),
                &[&rid],
            )
            .await
            .map_err(err)?
            .get(0);
        tx.execute(
            &format!(
                "INSERT INTO {} (record_id, revision, job, previous, output, reviewer, note, revised_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, now())",
                self.revisions
            ),
            &[&rid, &revision, &job, &previous, output, &reviewer, &note],
        )
        .await
        .map_err(err)?;
        let mut action = crate::task::Action::new("revise", reviewer);
        action.note = note.map(str::to_owned);
        let action = serde_json::to_value([action]).unwrap_or(Value::Array(vec![]));
        let typed: String = self
            .typed
            .iter()
            .map(|t| format!(", {} = {}", t.column, t.value_sql("$2::jsonb")))
            .collect();
        tx.execute(
            &format!(
                "UPDATE {} SET output = $2, human = true, reviewer = $3, history = history || $4{typed} WHERE record_id = $1",
                self.results
            ),
            &[&rid, output, &reviewer, &action],
        )
        .await
        .map_err(err)?;
        tx.commit().await.map_err(err)?;
        Ok(Some(revision))
    }

    /// The output of the job's row of a record, as it is now (its latest revision's).
    pub async fn output(&self, job: &str, rid: &str) -> Result<Option<Value>, SinkError> {
        let row = self
            .client
            .query_opt(
                &format!("SELECT output FROM {} WHERE record_id = $1 AND job = $2", self.results),
                &[&rid, &job],
            )
            .await
            .map_err(|e| self.err(&e))?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Every revision of the job's results, by record, oldest first.
    pub async fn revisions(&self, job: &str) -> Result<std::collections::HashMap<String, Vec<RevisionRow>>, SinkError> {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT record_id, revision, previous, output, reviewer, note, \
                     to_char(revised_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
                     FROM {} WHERE job = $1 ORDER BY record_id, revision",
                    self.revisions
                ),
                &[&job],
            )
            .await
            .map_err(|e| self.err(&e))?;
        let mut out: std::collections::HashMap<String, Vec<RevisionRow>> = std::collections::HashMap::new();
        for r in rows {
            let row = RevisionRow {
                record_id: r.get(0),
                revision: r.get(1),
                job: job.to_owned(),
                previous: r.get(2),
                output: r.get(3),
                reviewer: r.get(4),
                note: r.get(5),
                revised_at: r.get(6),
            };
            out.entry(row.record_id.clone()).or_default().push(row);
        }
        Ok(out)
    }

    /// The job's rows in the ledger table (each paid call once: its key is
    /// the primary key).
    pub async fn ledger_rows(&self, job: &str) -> Result<u64, SinkError> {
        let row = self
            .client
            .query_one(&format!("SELECT count(*) FROM {} WHERE job = $1", self.ledger), &[&job])
            .await
            .map_err(|e| self.err(&e))?;
        Ok(row.get::<_, i64>(0).max(0) as u64)
    }

    /// Every paid call of the job in the ledger table, streamed.
    pub async fn ledger(&self, job: &str, mut f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
        use futures_util::StreamExt;
        let rows = self
            .client
            .query_raw(
                &format!(
                    "SELECT call_key, attempt, delivery, worker, cause, fate, prompt_tokens, cached_tokens, \
                     completion_tokens, estimated, prices, cost_nusd, (extract(epoch FROM at) * 1000)::int8, \
                     tier, model FROM {} WHERE job = $1",
                    self.ledger
                ),
                [job],
            )
            .await
            .map_err(|e| self.err(&e))?;
        let mut rows = std::pin::pin!(rows);
        let mut n = 0;
        while let Some(row) = rows.next().await {
            let row = row.map_err(|e| self.err(&e))?;
            let key: String = row.get(0);
            let encoded = serde_json::json!([
                row.get::<_, i32>(1),
                row.get::<_, i32>(2),
                row.get::<_, String>(3),
                row.get::<_, String>(4),
                row.get::<_, String>(5),
                row.get::<_, i64>(6),
                row.get::<_, i64>(7),
                row.get::<_, i64>(8),
                u8::from(row.get::<_, bool>(9)),
                row.get::<_, String>(10),
                row.get::<_, i64>(11),
                row.get::<_, i64>(12),
                row.get::<_, String>(13),
                row.get::<_, String>(14),
            ]);
            f(PaidCall::decode(&key, &encoded.to_string())
                .map_err(|e| SinkError::Schema(format!("table {}: {e}", self.ledger)))?);
            n += 1;
        }
        Ok(n)
    }

    /// Open failures of the job by state (`review`, `dropped`, `cancelled`).
    pub async fn open_failures(&self, job: &str) -> Result<BTreeMap<String, u64>, SinkError> {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT state, count(*) FROM {} WHERE job = $1 AND resolved_at IS NULL GROUP BY state",
                    self.failures
                ),
                &[&job],
            )
            .await
            .map_err(|e| self.err(&e))?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1).max(0) as u64))
            .collect())
    }
}

impl ResultSink for PgSink {
    type Target = String;

    async fn open(url: &String, _job: &str, spec: &JobSpec) -> Result<PgSink, SinkError> {
        PgSink::connect(url, spec).await
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn is_closed(&self) -> bool {
        PgSink::is_closed(self)
    }

    /// One transaction; a batch the database rejects is written again a
    /// row at a time, so only the rows it refuses are left out.
    async fn store(
        &mut self,
        job: &str,
        p: u32,
        entries: &[SinkEntry],
        batch: &SinkBatch,
    ) -> Result<Vec<(String, String)>, SinkError> {
        let (results, failures, paid) = (&batch.results, &batch.failures, &batch.paid);
        let (written, refused) = match self.write(job, p, results, failures, paid).await {
            Ok(n) => (n, Vec::new()),
            Err(SinkError::Rejected(_)) => self.write_each(job, p, results, failures, paid).await?,
            Err(e) => return Err(e),
        };
        self.unacked
            .entry(p)
            .or_default()
            .add(entries, batch, &refused, written);
        Ok(refused)
    }

    fn durable(&self, p: u32) -> Option<Durable<'_>> {
        self.unacked.get(&p).map(Unacked::durable)
    }

    fn acknowledged(&mut self, p: u32) -> Result<(), SinkError> {
        self.unacked.remove(&p);
        Ok(())
    }

    async fn write_job(&self, manifest: &Manifest) -> Result<(), SinkError> {
        PgSink::write_job(self, manifest).await
    }

    async fn holdings(&self, job: &str) -> Result<Holdings, SinkError> {
        Ok(Holdings {
            result_ids: self.result_ids(job).await?,
            open_failures: self.open_failures(job).await?,
            ledger_calls: self.ledger_rows(job).await?,
            ..Holdings::default()
        })
    }

    async fn results(&self, job: &str, f: impl FnMut(ResultRecord)) -> Result<u64, SinkError> {
        PgSink::results(self, job, f).await
    }

    async fn ledger(&self, job: &str, f: impl FnMut(PaidCall)) -> Result<u64, SinkError> {
        PgSink::ledger(self, job, f).await
    }
}

/// A results table row as the result it was written from.
fn result_of_row(row: &tokio_postgres::Row) -> Result<ResultRecord, tokio_postgres::Error> {
    let json = |v: Option<Value>| v.unwrap_or(Value::Null);
    let output = match row.try_get::<_, Value>(2)? {
        Value::Object(m) => m,
        _ => Default::default(),
    };
    let usage: Option<Value> = row.try_get(7)?;
    Ok(ResultRecord {
        record_id: row.try_get(0)?,
        key: row.try_get(1)?,
        output,
        attempts: u32::try_from(row.try_get::<_, i32>(3)?).unwrap_or(0),
        calls: u32::try_from(row.try_get::<_, i32>(4)?).unwrap_or(0),
        response_id: row.try_get(5)?,
        repairs: serde_json::from_value(json(row.try_get(6)?)).unwrap_or_default(),
        usage: usage.and_then(|u| serde_json::from_value(u).ok()),
        history: serde_json::from_value(json(row.try_get(8)?)).unwrap_or_default(),
        model: row.try_get(9)?,
        versions: serde_json::from_value(row.try_get(10)?).unwrap_or_default(),
        human: row.try_get(11)?,
        reviewer: row.try_get(12)?,
        worker: row.try_get(13)?,
        committed_at: row.try_get(15)?,
        input: row
            .try_get::<_, Option<Value>>(14)?
            .and_then(|v| crate::task::Input::parse(&v.to_string()).ok()),
        revisions: Vec::new(),
    })
}

/// The password of a database URL (`postgres://u:PASSWORD@...` or
/// `password=...` in a key/value string), for the scrubber.
pub fn db_passwords(url: &str) -> Vec<String> {
    let mut found = crate::secret::url_passwords(url);
    for part in url.split_whitespace() {
        if let Some(p) = part.strip_prefix("password=") {
            found.push(p.trim_matches('\'').to_owned());
        }
    }
    if let Ok(c) = url.parse::<tokio_postgres::Config>()
        && let Some(p) = c.get_password()
    {
        found.push(String::from_utf8_lossy(p).into_owned());
    }
    found.retain(|p| !p.is_empty());
    found
}

/// TLS with the system's root certificates (used when `sslmode` is
/// `prefer`, the default, and the server offers it, or `require`).
fn tls_connector() -> tokio_postgres_rustls::MakeRustlsConnect {
    // The system's certificates are read once per process, not per reconnect.
    static CONFIG: std::sync::OnceLock<rustls::ClientConfig> = std::sync::OnceLock::new();
    tokio_postgres_rustls::MakeRustlsConnect::new(CONFIG.get_or_init(tls_config).clone())
}

fn tls_config() -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
        .unwrap_or_else(|_| {
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_of_both_url_forms_are_found() {
        assert!(db_passwords("postgres://bf:s3cr%3At-pw@127.0.0.1:5432/db").contains(&"s3cr:t-pw".to_owned()));
        assert!(db_passwords("host=127.0.0.1 user=bf password=hunter2hunter2").contains(&"hunter2hunter2".to_owned()));
        assert!(db_passwords("postgres://127.0.0.1/db").is_empty());
    }

    #[test]
    fn the_docs_show_the_ddl_as_it_is() {
        let doc = include_str!("../../../docs/sink.md");
        assert!(
            doc.contains(&ddl("results")),
            "docs/sink.md's DDL block differs from sink::ddl(\"results\")"
        );
    }

    #[test]
    fn the_ddl_names_every_column_it_checks() {
        let ddl = ddl("s.results");
        for (name, _) in RESULT_COLUMNS
            .iter()
            .chain(FAILURE_COLUMNS)
            .chain(REVISION_COLUMNS)
            .chain(LEDGER_COLUMNS)
        {
            assert!(ddl.contains(&format!("    {name} ")), "{name}");
        }
        assert!(ddl.contains("CREATE TABLE IF NOT EXISTS s.results_failures"));
        assert!(ddl.contains("CREATE INDEX IF NOT EXISTS s_results_job ON s.results (job)"));
    }
}
