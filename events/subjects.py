"""The NATS subject map: where each message travels. Part of the wire contract.

<prefix>.in.<handoff_id>               inputs: StartHandoff, facts, ActionOutcome (JetStream)
<prefix>.engine.<engine_id>.actions    actions for the engine that executes them
<prefix>.done.<handoff_id>             Complete, for the frontend waiting on the handoff (the
                                       worker's completion stream keeps the last one)
<prefix>.rejected.<handoff_id>         Rejection of an input (`unknown` if undecodable; the
                                       worker's rejection stream keeps the last one)
$KV.<PREFIX>_LEASES.<engine_id>        the engine's lease (`events.leases`; a KV bucket)

A tier of workers stores its inputs partitioned, and logs each partition on its own subject:

<prefix>.inp.<partition>.<handoff_id>  an input as the input stream's subject transform stores it
                                       (`{{partition(P,1)}}` of the handoff id)
<prefix>.log.<partition>               the partition's replicated log, compare-and-set appended

The tier's streams are named after its input stream (`KVHANDOFF_IN` by default): its
completions in `<input less _IN>_DONE`, its partition logs in `<input less _IN>_LOG`; and its
rejections after its completion stream, `<done less _DONE>_REJECTED`, since a frontend, which
knows the completion stream, reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from kvhandoff.events.messages import Action, Role

DEFAULT_STREAM = "KVHANDOFF_IN"


def tier_stream(input_stream: str, role: str) -> str:
    """The name of a stream of the tier whose input stream is `input_stream`, unless its flag
    names another: `<input stream less _IN>_<role>`. Tiers on one account are told apart by
    their input streams (and subject prefixes), so naming the others after it lets a second
    tier run with only `--subject-prefix` and `--stream` given, while the default tier keeps
    the names it always had (`KVHANDOFF_LOG`, `KVHANDOFF_DONE`)."""
    return f"{input_stream.removesuffix('_IN')}_{role}"


def done_stream_of(input_stream: str) -> str:
    """The tier's completion stream, which a frontend reads (`--done-stream`'s default)."""
    return tier_stream(input_stream, "DONE")


def rejections_stream_of(done_stream: str) -> str:
    """The tier's rejection stream: named after its completion stream (`KVHANDOFF_REJECTED`
    beside `KVHANDOFF_DONE`), which is all a frontend is told."""
    return f"{done_stream.removesuffix('_DONE')}_REJECTED"


def log_stream_of(input_stream: str) -> str:
    """The tier's stream of replicated partition logs (`--log-stream`'s default)."""
    return tier_stream(input_stream, "LOG")


DEFAULT_DONE_STREAM = done_stream_of(DEFAULT_STREAM)


def partition_transform(prefix: str, partitions: int) -> tuple[str, str]:
    """The input stream's subject transform, source and destination: `<prefix>.in.<id>` is
    stored as `<prefix>.inp.<p>.<id>`, p the FNV-1a of the id modulo `partitions`."""
    return f"{prefix}.in.*", f"{prefix}.inp.{{{{partition({partitions},1)}}}}.{{{{wildcard(1)}}}}"


def partition_prefix(prefix: str, partition: int) -> str:
    """What the stream's transform puts before the handoff id of one partition's inputs."""
    return f"{prefix}.inp.{partition}."


def partition_subject(prefix: str, partition: int) -> str:
    """The subjects of one partition's inputs, as the stream's transform stores them."""
    return f"{partition_prefix(prefix, partition)}*"


def partition_log_subject(prefix: str, partition: int) -> str:
    """The subject of one partition's log, appended with compare-and-set."""
    return f"{prefix}.log.{partition}"


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "kvhandoff"

    @property
    def inputs(self) -> str:
        """The wildcard the input stream captures."""
        return f"{self.prefix}.in.>"

    @property
    def all_done(self) -> str:
        return f"{self.prefix}.done.>"

    @property
    def completions(self) -> str:
        """The wildcard the completion stream captures: one token, the handoff id."""
        return f"{self.prefix}.done.*"

    @property
    def all_rejected(self) -> str:
        return f"{self.prefix}.rejected.>"

    @property
    def rejections(self) -> str:
        """The wildcard the rejection stream captures: one token, the handoff id."""
        return f"{self.prefix}.rejected.*"

    @property
    def lease_bucket(self) -> str:
        """The KV bucket of the engines' leases (`events.leases`), named after the prefix as
        the tier's streams are: `KVHANDOFF_LEASES` for `kvhandoff`."""
        return f"{self.prefix.upper().replace('.', '_')}_LEASES"

    @property
    def engines_report(self) -> str:
        return f"{self.prefix}.engines.report"

    def input(self, handoff_id: UUID | str) -> str:
        """The handoff's input subject; `handoff_id` as a UUID or as its text (cheaper)."""
        return f"{self.prefix}.in.{handoff_id}"

    def input_handoff(self, subject: str) -> UUID | None:
        """The handoff id an input subject names, or None if it names none."""
        head = f"{self.prefix}.in."
        if not subject.startswith(head):
            return None
        try:
            return UUID(subject[len(head) :])
        except ValueError:
            return None

    def engine(self, engine_id: str) -> str:
        return f"{self.prefix}.engine.{engine_id}.actions"

    def action(self, action: Action, source: str, destination: str) -> str:
        """Where `action` goes: to the engine that executes it (the handoff's source or
        destination), or, for `Complete`, to the frontend."""
        match action.executor:
            case Role.SOURCE:
                return self.engine(source)
            case Role.DESTINATION:
                return self.engine(destination)
            case Role.FRONTEND:
                return self.done(action.handoff_id)

    def done(self, handoff_id: UUID) -> str:
        return f"{self.prefix}.done.{handoff_id}"

    def rejected(self, handoff_id: UUID | None) -> str:
        return f"{self.prefix}.rejected.{handoff_id or 'unknown'}"
