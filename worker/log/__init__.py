"""The local event log: one SQLite file per partition (`schema`, `rows`), its writer (`store`),
the offline reader the log commands share (`reader`) and the JSON documents they print
(`reports`). Nothing here imports nats."""
