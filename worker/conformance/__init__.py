"""Holding implementations to their contracts: an engine to the wire contract
(`docs/contract.md`, `engine_check`: `kvhandoff engine-check`), and the coordinator to the
reference conformance vectors (`vectors`, which reads them for `events.conformance`:
`kvhandoff conformance`)."""
