//! OpenTelemetry traces: a record's enqueue and its attempts form one trace.
//!
//! Tracing is off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Off, [`Traces`] holds nothing
//! and every span is an empty value: no exporter, no thread, no allocation per
//! record, nothing logged. On, spans leave by OTLP over HTTP/protobuf in
//! batches from a background thread; the standard `OTEL_*` variables apply
//! (service name, resource attributes, headers, timeout, `OTEL_TRACES_SAMPLER`).
//!
//! The producer stores the W3C `traceparent` of each record's enqueue span in
//! its task (field `tp`); a worker's attempt span is a child of it.

use std::time::Duration;

pub use opentelemetry::trace::SpanKind;
use opentelemetry::trace::{
    SpanContext, SpanId, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

/// The environment variables that turn tracing on.
pub const ENDPOINT_VARS: [&str; 2] = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"];

/// The process's tracer, or nothing when tracing is off. Cheap to clone.
#[derive(Clone, Default)]
pub struct Traces {
    inner: Option<(SdkTracerProvider, SdkTracer)>,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traces").field("enabled", &self.enabled()).finish()
    }
}

impl Traces {
    /// Tracing off.
    pub fn off() -> Self {
        Self::default()
    }

    /// Tracing as the environment asks: off when no endpoint is set (or
    /// `OTEL_SDK_DISABLED=true`); an error names a setting this build cannot honour.
    pub fn from_env(service: &'static str) -> Result<Self, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || !ENDPOINT_VARS.iter().any(|k| var(k).is_some())
        {
            return Ok(Self::off());
        }
        for k in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
            if let Some(p) = var(k)
                && p != "http/protobuf"
            {
                return Err(format!(
                    "{k}={p}: this build exports traces by OTLP over HTTP/protobuf only \
                     (point the endpoint at the collector's HTTP port, usually 4318)"
                ));
            }
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()
            .map_err(|e| format!("OTLP trace exporter: {e}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(service).build())
            .build();
        let tracer = provider.tracer("batchfleet");
        Ok(Self {
            inner: Some((provider, tracer)),
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Starts a span: a child of `traceparent` when one is given and valid,
    /// else the root of a new trace.
    pub fn start(&self, name: &'static str, kind: SpanKind, traceparent: Option<&str>) -> Span {
        let Some((_, tracer)) = &self.inner else {
            return Span::none();
        };
        let parent = match traceparent.and_then(parse_traceparent) {
            Some(sc) => Context::new().with_remote_span_context(sc),
            None => Context::new(),
        };
        let span = tracer
            .span_builder(name)
            .with_kind(kind)
            .start_with_context(tracer, &parent);
        Span {
            inner: Some((tracer.clone(), parent.with_span(span))),
        }
    }

    /// Sends what is buffered and stops the exporter (at most `timeout`).
    pub fn shutdown(&self, timeout: Duration) {
        if let Some((provider, _)) = &self.inner {
            let _ = provider.shutdown_with_timeout(timeout);
        }
    }
}

/// One span (or nothing, when tracing is off). Ended on [`Span::end`] or drop.
#[derive(Default)]
pub struct Span {
    inner: Option<(SdkTracer, Context)>,
}

impl Span {
    pub fn none() -> Self {
        Self::default()
    }

    /// True when this span is recorded (tracing on): guards costly attributes.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// A child span of this one.
    pub fn child(&self, name: &'static str, kind: SpanKind) -> Span {
        let Some((tracer, cx)) = &self.inner else {
            return Span::none();
        };
        let span = tracer.span_builder(name).with_kind(kind).start_with_context(tracer, cx);
        Span {
            inner: Some((tracer.clone(), cx.with_span(span))),
        }
    }

    /// The W3C `traceparent` of this span, to carry to another process.
    pub fn traceparent(&self) -> Option<String> {
        let (_, cx) = self.inner.as_ref()?;
        let span = cx.span();
        let sc = span.span_context();
        sc.is_valid().then(|| format_traceparent(sc))
    }

    pub fn set(&self, key: &'static str, value: impl Into<Value>) {
        if let Some((_, cx)) = &self.inner {
            cx.span().set_attribute(KeyValue::new(key, value));
        }
    }

    /// Marks the span failed with a short description (never secrets: callers
    /// pass error causes and codes, not provider bodies or headers).
    pub fn fail(&self, description: impl Into<String>) {
        if let Some((_, cx)) = &self.inner {
            cx.span().set_status(Status::error(description.into()));
        }
    }

    pub fn end(self) {
        drop(self)
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((_, cx)) = &self.inner {
            cx.span().end();
        }
    }
}

/// `00-<trace id>-<span id>-<flags>`.
pub fn format_traceparent(sc: &SpanContext) -> String {
    format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8())
}

/// Parses a version-00 W3C `traceparent`; None for anything malformed or all-zero.
pub fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let mut parts = s.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let sc = SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, TraceState::default());
    sc.is_valid().then_some(sc)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn traceparent_round_trips() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(s).unwrap();
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(format_traceparent(&sc), s);
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "garbage",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn off_means_empty_spans() {
        let t = Traces::off();
        assert!(!t.enabled());
        let span = t.start(
            "attempt",
            SpanKind::Consumer,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        assert!(span.traceparent().is_none());
        let child = span.child("model_call", SpanKind::Client);
        child.set("k", 1_i64);
        assert!(child.traceparent().is_none());
    }
}
