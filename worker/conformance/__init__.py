"""Holding an engine to the wire contract (`docs/contract.md`): `kvhandoff engine-check`."""
