//! The worker's one decision: after an attempt, exactly one of commit, retry,
//! review, drop or halt. Pure: the random draw for jitter is an argument.

use serde::{Deserialize, Serialize};

use crate::spec::{Jitter, RetryPolicy};
use crate::validate::{ErrorCode, FieldError};

/// What one attempt came to, classified by the provider client and validator.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Output passed validation.
    Valid,
    /// Output failed validation; these errors go back to the model.
    Invalid(Vec<FieldError>),
    /// Timeout, refused or reset connection, 5xx, 408/409/425, empty or
    /// broken body: the world's fault, never the record's (not an attempt).
    Transient { cause: String, retry_after_ms: Option<u64> },
    /// 429 `rate_limit_exceeded`: not the record's fault, never its last chance.
    RateLimited { retry_after_ms: Option<u64> },
    /// `finish_reason = length`: the output was cut off.
    Truncated,
    /// `finish_reason = content_filter`, or a refusal.
    Refused { cause: String },
    /// A 4xx the record cannot recover from (400, 404, 422...).
    Permanent { cause: String },
    /// 401/403, `insufficient_quota`: the whole fleet must stop.
    FleetHalt { cause: String },
    /// The record cannot be sent (template field missing, too large).
    InputError { reason: String },
    /// The task was delivered more often than allowed: every worker that
    /// took it died or hung on it, so no worker takes it again.
    Poison { deliveries: u32 },
    /// A non-retryable provider error that may be about the job, not the
    /// record (the provider never answered validly yet): the record waits,
    /// without using an attempt, while the circuit breaker counts.
    Suspect { cause: String },
    /// The server refused the structured-output form sent (`auto` mode
    /// falls back to the next form): retried at once, not an attempt.
    FormRefused,
    /// The next request would be byte-identical to one the record already
    /// got an answer for: not sent (it would buy the same answer again).
    NoNewAttempt,
    /// The record's next call could pass its own spend cap (`[budget]`
    /// `max_tokens_per_record`, `max_cost_per_record`): not sent.
    OverBudget { why: String },
}

impl Outcome {
    /// The world's failure (transient, or a 429): never the record's.
    pub fn is_world_failure(&self) -> bool {
        matches!(self, Outcome::Transient { .. } | Outcome::RateLimited { .. })
    }

    /// Whether the call uses up one of the record's attempts: only an
    /// answer about the record does (not the world's failures, a halt, a
    /// suspect error or a refused structured-output form).
    pub fn is_attempt(&self) -> bool {
        !(self.is_world_failure()
            || matches!(
                self,
                Outcome::FleetHalt { .. } | Outcome::Suspect { .. } | Outcome::FormRefused
            ))
    }
}

/// The decision, applied by one atomic script each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Commit,
    Retry {
        delay_ms: u64,
        cause: String,
        /// Validation errors to show the model next time (never transport errors).
        feedback: Option<Vec<FieldError>>,
    },
    Review {
        reason: String,
    },
    Drop {
        reason: String,
    },
    Halt {
        reason: String,
    },
}

/// The least a record waits after a suspect (maybe systematic) error.
pub const SUSPECT_WAIT_MS: u64 = 1000;

/// The provider as the fleet knows it when an attempt is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderState {
    /// It answers (others' calls, at least). `failing_ms`: how long this
    /// record's own calls have failed transiently in a row, this one included.
    Up { failing_ms: u64 },
    /// Taken for down fleet-wide: a record that failed transiently waits in
    /// the queue, without a delay of its own, for the probe's answer (the
    /// job halts once the outage outlasts its budget).
    Down,
}

/// Where a record stands when its attempt is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// The attempt, 1-based (this call counted when it is one).
    pub attempt: u32,
    /// Every call for the record, failed and rate-limited ones included.
    pub calls: u32,
    pub provider: ProviderState,
}

impl Standing {
    /// A record whose provider answers, its calls not failing.
    pub fn new(attempt: u32, calls: u32) -> Standing {
        Standing {
            attempt,
            calls,
            provider: ProviderState::Up { failing_ms: 0 },
        }
    }
}

/// Decides after an attempt (see [`Standing`]). `unit` is a uniform draw in
/// [0, 1) for the jitter.
///
/// `max_attempts` counts answers that came back wrong. Transient failures
/// and 429s are the world's: they wait on a time horizon (backoff on the
/// record's calls, capped and jittered, `Retry-After` honoured) and never
/// send a record to review while the job's outage budget lasts.
pub fn decide(at: Standing, outcome: &Outcome, policy: &RetryPolicy, unit: f64) -> Decision {
    let Standing {
        attempt,
        calls,
        provider,
    } = at;
    let attempts_left = attempt < policy.max_attempts;
    let retry = |cause: &str, retry_after_ms: Option<u64>, feedback: Option<Vec<FieldError>>| Decision::Retry {
        delay_ms: backoff_ms(attempt, policy, unit).max(retry_after_ms.unwrap_or(0)),
        cause: cause.to_owned(),
        feedback,
    };
    // Not the record's fault, never its last chance: it waits, longer the
    // more often it was turned away (the backoff follows its calls, not its
    // attempts); while the provider is down, in the queue for the probe.
    let wait = |cause: &str, retry_after_ms: Option<u64>| Decision::Retry {
        delay_ms: match provider {
            ProviderState::Down => 0,
            ProviderState::Up { .. } => backoff_ms(calls, policy, unit).max(retry_after_ms.unwrap_or(0)),
        },
        cause: cause.to_owned(),
        feedback: None,
    };
    match outcome {
        Outcome::Valid => Decision::Commit,
        // A business rule that cannot be evaluated (a field it reads is
        // absent) is the spec's or the record's matter: another paid answer
        // cannot change it.
        Outcome::Invalid(errors) if errors.iter().any(|e| e.code == ErrorCode::RuleUnevaluable) => Decision::Review {
            reason: "rule_unevaluable".into(),
        },
        Outcome::Invalid(errors) if attempts_left => retry("invalid_output", None, Some(errors.clone())),
        Outcome::Invalid(_) => Decision::Review {
            reason: "attempts_exhausted".into(),
        },
        // Only this record's calls fail, and for longer than the job waits
        // out an outage: something about the record, not the world.
        Outcome::Transient { .. } if matches!(provider, ProviderState::Up { failing_ms } if failing_ms > 0 && failing_ms >= policy.outage_budget_ms()) => {
            Decision::Review {
                reason: "transient_exhausted".into(),
            }
        }
        Outcome::Transient { cause, retry_after_ms } => wait(cause, *retry_after_ms),
        Outcome::RateLimited { retry_after_ms } => wait("rate_limited", *retry_after_ms),
        // The retry says why (and shows the cut-off answer): without it the
        // request would be the one already paid for, byte for byte.
        Outcome::Truncated if attempts_left => retry("truncated", None, Some(vec![truncated_feedback()])),
        Outcome::Truncated => Decision::Review {
            reason: "truncated".into(),
        },
        Outcome::Refused { cause } => Decision::Review {
            reason: format!("refused:{cause}"),
        },
        Outcome::Permanent { cause } => Decision::Review {
            reason: format!("provider_error:{cause}"),
        },
        Outcome::FleetHalt { cause } => Decision::Halt { reason: cause.clone() },
        Outcome::InputError { reason } => Decision::Drop { reason: reason.clone() },
        Outcome::Poison { .. } => Decision::Review {
            reason: "poison".into(),
        },
        Outcome::NoNewAttempt => Decision::Review {
            reason: "no_new_attempt".into(),
        },
        Outcome::OverBudget { .. } => Decision::Review {
            reason: "budget".into(),
        },
        Outcome::FormRefused => Decision::Retry {
            delay_ms: 0,
            cause: "response_format_refused".into(),
            feedback: None,
        },
        Outcome::Suspect { cause } => Decision::Retry {
            delay_ms: backoff_ms(attempt, policy, unit).max(SUSPECT_WAIT_MS),
            cause: cause.clone(),
            feedback: None,
        },
    }
}

/// What a retry after a cut-off answer tells the model.
pub fn truncated_feedback() -> FieldError {
    FieldError {
        code: ErrorCode::Truncated,
        field: String::new(),
        message: "the answer was cut off at the output token limit; answer again with one complete JSON object, \
                  every string as short as its field allows"
            .into(),
    }
}

/// Exponential delay before the attempt after `attempt`, capped, with jitter:
/// full jitter draws uniformly from [0, capped exponential].
pub fn backoff_ms(attempt: u32, policy: &RetryPolicy, unit: f64) -> u64 {
    let exp = policy
        .base_delay_ms
        .saturating_mul(1u64 << attempt.saturating_sub(1).min(40))
        .min(policy.max_delay_ms);
    match policy.jitter {
        Jitter::Full => (exp as f64 * unit.clamp(0.0, 1.0)).round() as u64,
        Jitter::None => exp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::{ErrorCode, FieldError};

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            base_delay_ms: 1000,
            max_delay_ms: 5000,
            jitter: Jitter::None,
            temperatures: vec![],
            outage_budget_secs: Some(600),
        }
    }

    fn invalid() -> Outcome {
        Outcome::Invalid(vec![FieldError {
            code: ErrorCode::Enum,
            field: "label".into(),
            message: "x".into(),
        }])
    }

    #[test]
    fn valid_output_commits_on_any_attempt() {
        assert_eq!(
            decide(Standing::new(1, 1), &Outcome::Valid, &policy(), 0.5),
            Decision::Commit
        );
        assert_eq!(
            decide(Standing::new(3, 9), &Outcome::Valid, &policy(), 0.5),
            Decision::Commit
        );
    }

    #[test]
    fn invalid_output_retries_with_feedback_then_goes_to_review() {
        match decide(Standing::new(1, 1), &invalid(), &policy(), 0.5) {
            Decision::Retry {
                feedback: Some(f),
                delay_ms: 1000,
                cause,
            } => {
                assert_eq!(f[0].field, "label");
                assert_eq!(cause, "invalid_output");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decide(Standing::new(3, 3), &invalid(), &policy(), 0.5),
            Decision::Review {
                reason: "attempts_exhausted".into()
            }
        );
    }

    #[test]
    fn transport_errors_wait_on_the_record_s_calls_and_honour_retry_after() {
        let t = Outcome::Transient {
            cause: "timeout".into(),
            retry_after_ms: Some(4200),
        };
        assert_eq!(
            decide(Standing::new(1, 1), &t, &policy(), 0.5),
            Decision::Retry {
                delay_ms: 4200,
                cause: "timeout".into(),
                feedback: None
            }
        );
        let t = Outcome::Transient {
            cause: "http_503".into(),
            retry_after_ms: None,
        };
        let delay = |attempt, calls| match decide(Standing::new(attempt, calls), &t, &policy(), 1.0) {
            Decision::Retry { delay_ms, feedback, .. } => {
                assert_eq!(feedback, None, "never fed back to the model");
                delay_ms
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(delay(1, 2), 2000, "the backoff follows the record's calls");
        assert_eq!(delay(1, 500), 5000, "capped");
        // Past max_attempts: a transient failure is not an answer that came back wrong.
        assert_eq!(delay(3, 3), 4000);
        assert_eq!(delay(9, 9), 5000);
    }

    #[test]
    fn transient_failures_review_a_record_only_after_the_outage_budget_and_never_while_the_provider_is_down() {
        let t = Outcome::Transient {
            cause: "connect".into(),
            retry_after_ms: Some(900),
        };
        let at = |failing_ms| Standing {
            provider: ProviderState::Up { failing_ms },
            ..Standing::new(1, 40)
        };
        assert!(matches!(
            decide(at(599_999), &t, &policy(), 0.5),
            Decision::Retry { .. }
        ));
        assert_eq!(
            decide(at(600_000), &t, &policy(), 0.5),
            Decision::Review {
                reason: "transient_exhausted".into()
            },
            "only this record's calls failed for the whole budget"
        );
        let down = Standing {
            provider: ProviderState::Down,
            ..Standing::new(1, 40)
        };
        assert_eq!(
            decide(down, &t, &policy(), 0.5),
            Decision::Retry {
                delay_ms: 0,
                cause: "connect".into(),
                feedback: None
            },
            "while the provider is down the record waits in the queue for the probe"
        );
        let r = Outcome::RateLimited { retry_after_ms: None };
        assert!(matches!(
            decide(at(u64::MAX), &r, &policy(), 0.5),
            Decision::Retry { .. }
        ));
    }

    #[test]
    fn a_429_never_sends_a_record_to_review_and_waits_longer_the_more_it_was_throttled() {
        let r = Outcome::RateLimited {
            retry_after_ms: Some(100),
        };
        let delay = |calls| match decide(Standing::new(3, calls), &r, &policy(), 1.0) {
            Decision::Retry { delay_ms, .. } => delay_ms,
            other => panic!("{other:?}"),
        };
        assert_eq!(delay(1), 1000, "the base delay");
        assert_eq!(delay(2), 2000);
        assert_eq!(delay(500), 5000, "capped");
        let short = RetryPolicy {
            base_delay_ms: 10,
            ..policy()
        };
        match decide(Standing::new(1, 1), &r, &short, 0.0) {
            Decision::Retry { delay_ms, .. } => assert_eq!(delay_ms, 100, "Retry-After is the minimum"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn truncation_retries_then_reviews_refusals_review_at_once() {
        assert!(matches!(
            decide(Standing::new(1, 1), &Outcome::Truncated, &policy(), 0.5),
            Decision::Retry { feedback: Some(f), .. } if f[0].code == ErrorCode::Truncated
        ));
        assert_eq!(
            decide(Standing::new(3, 3), &Outcome::Truncated, &policy(), 0.5),
            Decision::Review {
                reason: "truncated".into()
            }
        );
        let refused = Outcome::Refused {
            cause: "content_filter".into(),
        };
        assert_eq!(
            decide(Standing::new(1, 1), &refused, &policy(), 0.5),
            Decision::Review {
                reason: "refused:content_filter".into()
            }
        );
    }

    #[test]
    fn a_request_the_record_already_got_an_answer_for_is_not_sent() {
        assert_eq!(
            decide(Standing::new(2, 2), &Outcome::NoNewAttempt, &policy(), 0.5),
            Decision::Review {
                reason: "no_new_attempt".into()
            }
        );
        let schedule = RetryPolicy {
            temperatures: vec![0.0, 0.5],
            ..policy()
        };
        assert_eq!(
            (
                schedule.temperature(1),
                schedule.temperature(2),
                schedule.temperature(9)
            ),
            (Some(0.0), Some(0.5), Some(0.5))
        );
        assert_eq!(policy().temperature(1), None);
    }

    #[test]
    fn a_rule_that_cannot_be_evaluated_reviews_at_once_and_a_broken_one_retries() {
        let with = |code| {
            Outcome::Invalid(vec![FieldError {
                code,
                field: "same_task".into(),
                message: "rule".into(),
            }])
        };
        assert_eq!(
            decide(Standing::new(1, 1), &with(ErrorCode::RuleUnevaluable), &policy(), 0.5),
            Decision::Review {
                reason: "rule_unevaluable".into()
            }
        );
        assert!(matches!(
            decide(Standing::new(1, 1), &with(ErrorCode::Rule), &policy(), 0.5),
            Decision::Retry { .. }
        ));
    }

    #[test]
    fn a_poison_task_goes_to_review_whatever_its_attempts() {
        for attempt in [1, 3, 9] {
            assert_eq!(
                decide(
                    Standing::new(attempt, 1),
                    &Outcome::Poison { deliveries: 6 },
                    &policy(),
                    0.5
                ),
                Decision::Review {
                    reason: "poison".into()
                }
            );
        }
    }

    #[test]
    fn input_errors_drop_and_fleet_faults_halt() {
        let d = decide(
            Standing::new(1, 1),
            &Outcome::InputError {
                reason: "template_missing:text".into(),
            },
            &policy(),
            0.5,
        );
        assert_eq!(
            d,
            Decision::Drop {
                reason: "template_missing:text".into()
            }
        );
        let h = decide(
            Standing::new(1, 1),
            &Outcome::FleetHalt {
                cause: "http_401".into(),
            },
            &policy(),
            0.5,
        );
        assert_eq!(
            h,
            Decision::Halt {
                reason: "http_401".into()
            }
        );
    }

    #[test]
    fn backoff_is_exponential_capped_and_fully_jittered() {
        let mut p = policy();
        assert_eq!(
            [1, 2, 3, 4, 60].map(|a| backoff_ms(a, &p, 0.0)),
            [1000, 2000, 4000, 5000, 5000]
        );
        p.jitter = Jitter::Full;
        assert_eq!(backoff_ms(3, &p, 0.0), 0);
        assert_eq!(backoff_ms(3, &p, 0.5), 2000);
        assert_eq!(backoff_ms(3, &p, 1.0), 4000);
    }
}
