# batchfleet — the commands the README documents.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: demo test chaos console-shots build bench bench-enqueue bench-tracing bench-worker bench-ratelimit bench-litellm bench-scale bench-status bench-sink bench-console bench-batch bench-outage bench-waiting bench-routes bench-queues deps lint clean

## demo: build, then enqueue the example dataset into a throwaway Redis and print the job
## (MODE=batch: the same job through the provider's Batch API, at batch prices)
demo:
	@scripts/ensure-deps.sh demo
	$(CARGO) build --release --workspace --bins
	MODE=$(MODE) scripts/demo.sh

## test: every test (unit, and integration against real redis-server processes), with
## cargo-nextest (each test its own process, many at once: .config/nextest.toml), else cargo test.
## One build of every target first: the binaries the tests start and the tests share one feature set.
test: deps
	$(CARGO) build --workspace --all-targets
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
	  $(CARGO) nextest run --workspace; \
	else \
	  echo "cargo-nextest is not installed: running cargo test (one test binary at a time, slower)"; \
	  $(CARGO) test --workspace --no-fail-fast; \
	fi

## chaos: the chaos run at full size (20,000 records; `make test` runs 2,000); summary in .bench/chaos-summary.json
chaos: deps
	$(CARGO) build --workspace --bins
	mkdir -p .bench
	CHAOS_RECORDS=$${CHAOS_RECORDS:-20000} CHAOS_CONCURRENCY=$${CHAOS_CONCURRENCY:-24} \
	CHAOS_SUMMARY=$(CURDIR)/.bench/chaos-summary.json \
	$(CARGO) test -p batchfleet-tests --test chaos -- --nocapture

## console-shots: a PNG of each console page in .bench/console/ (UPDATE_DOCS=1: also docs/console/, which docs/console.md shows)
console-shots: deps
	$(CARGO) build --workspace --bins
	CONSOLE_SHOTS=$(CURDIR)/.bench/console $(CARGO) test -p batchfleet-tests --test console console_shots -- --ignored --nocapture
	if [ -n "$${UPDATE_DOCS:-}" ]; then mkdir -p docs/console && cp .bench/console/*.png docs/console/; fi

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## bench: every benchmark; figures go to BENCHMARKS.md by hand
bench: bench-enqueue bench-worker bench-ratelimit bench-litellm bench-scale bench-status bench-tracing bench-sink bench-console bench-batch bench-outage bench-waiting bench-routes bench-queues

## bench-enqueue: 1,000,000 records vs a raw redis-cli --pipe baseline in the same run
bench-enqueue: deps
	$(CARGO) build --release --workspace --bins
	scripts/bench-enqueue.sh

## deps: what the tests need (`scripts/ensure-deps.sh test`, and Helm's tools); `make demo` installs only its own
deps:
	@scripts/ensure-deps.sh test
	@scripts/ensure-chart-tools.sh

clean:
	$(CARGO) clean
	rm -rf .demo .bench

## bench-tracing: producer enqueue with tracing off vs on (OTLP receiver on 127.0.0.1), same run
bench-tracing: deps
	$(CARGO) build --release --workspace --bins
	scripts/bench-tracing.sh

## bench-worker: records/s per worker vs raw HTTP at zero latency; in-flight and RSS at 1 s latency
bench-worker: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-worker.py

## bench-ratelimit: utilization of the provider's limit and 429 rate for 1/4/8 workers (told, tokens-bound, untold), and per model call the Redis CPU, commands and round trips beside an idle and a PING-a-call redis-server (RUNS=told|untold, RPM, SECONDS_PER_RUN)
bench-ratelimit: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-ratelimit.py

## bench-litellm: the limit's use per calendar minute behind a proxy that says "retry after 60" (LiteLLM), told and untold
bench-litellm: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-litellm.py

## bench-scale: one job end to end (enqueue, 2 workers, files sink, status) at N records (default 1,000,000): Redis peak and end, rates, RSS; one JSON line
bench-scale: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-scale.py

## bench-status: producer status (full reconciliation) on 1,000,000 records vs their enqueue in the same run
bench-status: deps
	$(CARGO) build --release --workspace --bins
	scripts/bench-status.sh

## bench-console: the console's pages on a 1,000,000-record job and a 100,000-entry review queue, against a static answer of the same server
bench-console: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-console.py

## bench-batch: the same job online and in provider batch mode: paid cost per done record, HTTP calls per 10,000 records
bench-batch: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-batch.py

## bench-outage: a 20 s provider outage mid-job: records/s before and after, time from its return to the first record done
bench-outage: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-outage.py

## bench-waiting: Redis commands/s per worker of an idle fleet and of one waiting out a provider outage, young and an hour old
bench-waiting: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-waiting.py

## bench-queues: one worker's records/s, Redis CPU, commands and round trips a record, and its own CPU, against BullMQ's no-op worker on the same Redis, alternating, beside a floor (the same data stored by native commands, no script) (npm installs BullMQ under .bench/)
bench-queues: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-queues.py

## bench-routes: the same job all standard vs routed by the planner (flex refusing 40% in bursts, a deadline), and with the primary down (a fallback)
bench-routes: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-routes.py

## bench-sink: rows/s into PostgreSQL vs a raw COPY of the same rows, Redis bytes per queued and finished record
bench-sink: deps
	$(CARGO) build --release --workspace --bins
	python3 scripts/bench-sink.py
