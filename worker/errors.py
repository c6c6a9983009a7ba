"""The worker's exceptions, rooted at one class. Driver errors (nats, sqlite) are translated into
these at exactly one seam per adapter, with `raise ... from exc`: sqlite's in `worker.log.store`
(the writer) and `worker.log.reader` (the offline reader), nats-py's in `worker.bus` (its modules,
each at its call). What the core raises (`events.errors`) passes through the worker as it is.

    WorkerError
    ├── ConfigError        a setting or a command's argument that cannot work, reported at start
    ├── StoreError         the event log could not be read or written
    │   ├── StoreCorrupt   a log file, a row of it or an export that this build cannot read
    │   ├── StoreConflict  a second writer appended the same (handoff, sequence)
    │   └── StoreLocked    another worker holds the log's writer lock
    ├── BusError           NATS / JetStream failed
    │   ├── BusRefused     NATS refused our credentials or TLS: retrying cannot help
    │   ├── PinMismatch    another client holds the pin of a consumer's priority group
    │   ├── Fenced         a compare-and-set append found that another writer appended first
    │   └── StreamMismatch a stream the worker opens is another's: other subjects or settings
    │       └── PartitionsMismatch  the input stream was made for other partitions, or a
    │                               worker of an earlier version
    ├── LogDiverges        this build's coordinator does not re-derive an open handoff's log
    ├── NewerLogVersion    a partition's replicated log holds an entry a newer build wrote
    ├── PhaseError         a partition owner's phase was moved in a way its table forbids: a bug
    ├── ChildError         a process we started (`worker.harness.child`) did not come up
    ├── NatsServerError    the embedded nats-server did not start
    └── ContainerError     a test container did not start (worker.harness.containers)

Who handles what apart: `kvhandoff run` exits 2 on `ConfigError`, `StoreLocked`, `BusRefused`,
`StreamMismatch` (`PartitionsMismatch` included), `LogDiverges` and `NewerLogVersion` (retrying
cannot help), 1 on any other `StoreError` or `BusError` it cannot serve through. Once running, a
partition whose commit or append failed is handed back and claimed again at the next round
(worker.tier.membership), its handoffs rebuilt from the log, unless it failed with `LogDiverges`
or `NewerLogVersion`, which stop the worker; a handoff whose row or record is
`StoreCorrupt` or `LogCorrupt` is quarantined, not the whole load. The offline commands print any
`WorkerError` or `events.errors.HandoffError` as one line, exit 2.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Root of every error the worker raises."""


class ConfigError(WorkerError):
    """Configuration or a command's arguments that cannot work; the message says which setting
    or argument, and why."""


class StoreError(WorkerError):
    """The event log could not be read or written."""


class StoreCorrupt(StoreError):
    """The log holds what this build cannot read around its records: a file that is not a log
    of a layout it reads, a `handoffs` row with a bad column, an export that is not one or is
    of a newer format. (A record that does not decode is the core's `LogCorrupt`.) The message
    names the file or the handoff."""


class StoreConflict(StoreError):
    """An append collided with an existing (handoff, sequence): another writer is active."""


class StoreLocked(StoreError):
    """Another worker holds the event log's writer lock; the message names it."""


class BusError(WorkerError):
    """The message bus could not be reached or refused an operation."""


class BusRefused(BusError):
    """NATS refused the connection for good (authentication or TLS); the message says which
    setting to check."""


class LogDiverges(WorkerError):
    """Recovery replayed an open handoff and this build's coordinator issued other actions
    than the log holds: the build, not the log, is the likely culprit, so the worker refuses
    to start instead of acting differently from what it logged."""


class NewerLogVersion(WorkerError):
    """A partition's replicated log holds an entry that a newer build wrote and this one cannot
    read: of a later log version, of a kind or with a handoff state this build does not know
    (see "Reading rule" in worker.tier.entries). Owning the partition would mean acting on a
    history this build does not understand, so the worker stops instead, handing the rest of
    its share over, for an upgraded worker to take it. The message names the partition, the
    entry and the versions."""


class PhaseError(WorkerError):
    """A partition owner was told of an event that its phase table has no move for
    (`worker.tier.phase.MOVES`): a bug in the owner. The message names the partition, the phase
    and the event; the phase is left as it was."""


class PinMismatch(BusError):
    """A pull for a consumer's priority group was refused (status 423): another client holds
    the group's pin. Whoever acted for that group must stop; the message names the consumer."""


class Fenced(BusError):
    """A compare-and-set append to a partition's log was refused (JetStream err_code 10071 or
    10164, wrong last sequence): another writer appended to that subject since we last did. Whoever
    appended it owns the partition now; this process must stop acting for it at once (no
    publish, no ack). The message names the subject and the sequence we expected."""


class StreamMismatch(BusError):
    """A stream the worker opens (its input, completion or log stream) exists with other
    subjects or an incompatible retention, or cannot be created because another stream
    captures its subjects: another tier's, most likely. Retrying cannot help, so the worker
    refuses to start (exit 2). The message names the stream, what it captures, and the flag
    to set."""


class PartitionsMismatch(StreamMismatch):
    """The input stream exists with another partition count, or for another kind of worker
    (single or tier), than this worker was started with; both are fixed when the stream is
    created, so the worker refuses to start (exit 2). The message names the stream and both
    counts and kinds."""


class ChildError(WorkerError):
    """A child process (`kvhandoff run`, the mock engines) exited or was not ready in time; the
    message names it and where its output went."""


class NatsServerError(WorkerError):
    """The embedded nats-server could not be found or did not start."""
