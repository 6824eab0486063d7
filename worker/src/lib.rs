//! The `worker`: claims tasks, calls the model, validates, decides, commits.
//!
//! - [`run`]: configuration, start-up checks, the services and the shutdown order.
//! - [`fleet`]: what the services share (permits, tracker, flags); starting a task.
//! - [`slot`]: a task's concurrency slot, given back once its outcome goes to be stored.
//! - [`service`]: a loop as a cancellable service around a `run_once` body.
//! - [`claim`], [`reclaim`], [`promote`], [`watch`]: the services (claim new
//!   tasks; take over dead workers' tasks; promote due retries; read halt and
//!   cancel flags).
//! - [`config`]: the worker's configuration, refusals and run summary.
//! - [`job`]: what the worker holds per job ([`job::JobCtx`]) and how a task ends.
//! - [`calls`]: the model calls in flight, as the ledger would record them.
//! - [`clock`]: Unix milliseconds.
//! - [`attempt`]: what an attempt leaves (reservation, audit trail, event, stored outcome);
//! - [`process`]: one task from delivery to its single atomic outcome;
//!   [`check`]: the cross-check's step (a second model's answer compared).
//! - [`queue`]: the pipeline's one door to what the fleet shares about a job
//!   (Redis in a fleet, memory in in-process tests).
//! - [`budget`]: spend control: the job's cap shared in Redis, a record's own caps.
//! - [`breaker`]: halts a job on systematic provider errors (a wrong key or model).
//! - [`outage`]: a provider failing every call: one probe at a time, a halt past the budget.
//! - [`plan`]: a job with tiers or a fallback: which tier and which provider each call takes
//!   before its deadline; [`replan`]: the service that re-plans it from the fleet's counts.
//! - [`form`]: structured-output negotiation (`auto`: the first form a server accepts).
//! - [`provider`]: the OpenAI-compatible client (HTTP, request forms, classification).
//! - [`judge`]: what an answer comes to for the record ([`judge::Reply`]: validated).
//! - [`limiter`]: fleet-wide rate limits shared in Redis; header parsing.
//! - [`scaler`]: the always-on component that serves the work left to the
//!   autoscaler and promotes due retries while no worker runs (`scaler` binary).
//! - [`telemetry`]: metric declarations; [`http`]: `/metrics`, `/healthz`, `/readyz`.

pub mod attempt;
pub mod batch_api;
pub mod batcher;
pub mod breaker;
pub mod budget;
pub mod calls;
pub mod check;
pub mod claim;
pub mod clock;
pub mod config;
pub mod drift;
pub mod entry;
pub mod fleet;
pub mod form;
pub mod heartbeat;
pub mod http;
pub mod job;
pub mod judge;
pub mod limiter;
pub mod outage;
pub mod plan;
pub mod process;
pub mod promote;
pub mod provider;
pub mod queue;
pub mod reclaim;
pub mod replan;
pub mod run;
pub mod scaler;
pub mod service;
pub mod sink;
pub mod slot;
pub mod telemetry;
pub mod wake;
pub mod watch;
