"""kvhandoff's pure core: the wire vocabulary, the handoff coordinator, its log records and replay.

Imports only the standard library and msgspec, so that engines written against it, and the
offline log tools, never pull in the bus or the database drivers.
"""
