"""kvhandoff: prefill -> decode KV-cache ownership handoffs for disaggregated LLM serving.

Everything installs under this one import name, so that it clashes with nothing a downstream
project has. In the repository the code lives in the top-level folders, which this package
links to:

- `kvhandoff.events`: the pure core (ids, wire messages, log records, codec, coordinator,
  replay). Imports only the standard library and msgspec.
- `kvhandoff.worker`: the IO shell (configuration, the event log, the one NATS module, the
  service, the mock engines, the log tools, the CLI, `kvhandoff.worker.harness.containers`).
- `kvhandoff.client`: the engine and frontend clients.
"""
