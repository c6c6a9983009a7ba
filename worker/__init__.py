"""kvhandoff's IO shell: configuration, the SQLite event log, the NATS bus, the service that
ties them to the pure core, timers, the mock engines, the load generator and the CLI."""
